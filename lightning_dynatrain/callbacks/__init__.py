"""Callbacks that change what ``DynaTrainStrategy`` trains on: ``ScheduledReconfig`` (step -> layout)
and ``OnNodeChange`` (processes join and leave; the layout follows the world)."""

from lightning_dynatrain.callbacks.node_change import OnNodeChange
from lightning_dynatrain.callbacks.scheduled import ScheduledReconfig, ScheduleError, parse_schedule, validate_schedule

__all__ = ["OnNodeChange", "ScheduleError", "ScheduledReconfig", "parse_schedule", "validate_schedule"]
