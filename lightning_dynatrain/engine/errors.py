"""Typed errors of the state transition engine.

User mistakes (a budget too small, a state store that does not match its regions, an allocator that
hands back the wrong tensor) raise a ``DynaTrainError`` subclass with a HINT. A plan that contradicts
its own regions is a bug in the planner or the mapping, not in the caller's input: it raises
``EngineInternalError``.
"""

from __future__ import annotations

from lightning_dynatrain.vps.errors import DynaTrainError


class StagingBudgetError(DynaTrainError):
    """The staging budget is malformed, or too small for the smallest unit the engine moves."""


class StateStoreError(DynaTrainError):
    """A local state tensor is missing or does not match its region (size, dtype, layout)."""


class SwitchAbortedError(DynaTrainError):
    """Another rank found a problem before anything moved; every rank stops with this error."""


class EngineInternalError(RuntimeError):
    """A plan and the regions it was computed from disagree: a bug, please report it."""


def mark_refused(err: BaseException) -> BaseException:
    """Mark ``err`` as raised before the switch moved or freed anything, on every rank: the old
    state is whole and training can go on at the old layout. Returns ``err``."""
    err.switch_refused = True  # type: ignore[attr-defined]
    return err


def was_refused(err: BaseException) -> bool:
    """Whether ``err`` refused a switch before anything moved (``mark_refused``)."""
    return bool(getattr(err, "switch_refused", False))


__all__ = ["EngineInternalError", "StagingBudgetError", "StateStoreError", "SwitchAbortedError", "mark_refused",
           "was_refused"]
