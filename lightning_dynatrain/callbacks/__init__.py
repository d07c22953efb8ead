"""Callbacks that ask ``DynaTrainStrategy`` to switch layouts: ``ScheduledReconfig`` (step -> layout)."""

from lightning_dynatrain.callbacks.scheduled import ScheduledReconfig, ScheduleError, parse_schedule, validate_schedule

__all__ = ["ScheduleError", "ScheduledReconfig", "parse_schedule", "validate_schedule"]
