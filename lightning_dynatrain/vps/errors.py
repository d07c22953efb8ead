"""Typed errors of the Virtual Parameter Space. Each names the rule broken and how to fix it."""

from __future__ import annotations


class DynaTrainError(ValueError):
    """Base class of the project's user-facing errors; ``hint`` says what to change."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(f"{message}. HINT: {hint}" if hint else message)


class LayoutError(DynaTrainError):
    """A layout string is malformed, or a layout does not fit a model or a world size."""


class ModelSpecError(DynaTrainError):
    """A model description is inconsistent, or an unknown model name was asked for."""


class PlanError(DynaTrainError):
    """A switch cannot be planned between two layouts (e.g. different models)."""


class StateLostError(PlanError):
    """Part of the training state was held only by processes that died: no survivor can source it.

    ``lost``: the boxes that went (``vps.lost_state.LostBox``), ``ranks``: the dead source ranks."""

    def __init__(self, message: str, *, hint: str | None = None, lost: tuple = (), ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message, hint=hint)
        self.lost, self.ranks = lost, ranks
