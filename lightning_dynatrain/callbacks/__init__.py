"""Callbacks for ``DynaTrainStrategy``: ``ScheduledReconfig`` (step -> layout), ``LayoutProgressBar``
(layout and last switch in the progress bar), ``RunRecorder`` (a run's metrics, switches and pictures)."""

from lightning_dynatrain.callbacks.progress import LayoutProgressBar
from lightning_dynatrain.callbacks.run_record import RunRecorder
from lightning_dynatrain.callbacks.scheduled import ScheduledReconfig, ScheduleError, parse_schedule, validate_schedule

__all__ = ["LayoutProgressBar", "RunRecorder", "ScheduleError", "ScheduledReconfig", "parse_schedule",
           "validate_schedule"]
