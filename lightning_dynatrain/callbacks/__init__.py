"""Callbacks for ``DynaTrainStrategy``: ``ScheduledReconfig`` (step -> layout), ``OnNodeChange`` (processes
join and leave; the layout follows the world), ``LayoutProgressBar`` (layout and last switch in the progress
bar), ``RunRecorder`` (a run's metrics, switches and pictures)."""

from lightning_dynatrain.callbacks.node_change import OnNodeChange
from lightning_dynatrain.callbacks.progress import LayoutProgressBar
from lightning_dynatrain.callbacks.run_record import RunRecorder
from lightning_dynatrain.callbacks.scheduled import ScheduledReconfig
from lightning_dynatrain.runtime.switch_schedule import ScheduleError, parse_schedule, validate_schedule

__all__ = ["LayoutProgressBar", "OnNodeChange", "RunRecorder", "ScheduleError", "ScheduledReconfig",
           "parse_schedule", "validate_schedule"]
