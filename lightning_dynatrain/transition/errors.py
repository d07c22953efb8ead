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


class SwitchFailedError(DynaTrainError):
    """A rank died or stalled during a switch, or one of its waits ran past the switch's deadline:
    every surviving rank raises it, naming the rank that went missing and the phase.

    Attributes:
        rank: the rank that stopped answering (its heartbeat stopped), or ``None`` when every rank
            was still alive (a wait ran past the deadline, or a peer's collective failed).
        phase: the switch's phase on the rank that went missing (its last heartbeat), else this rank's.
        lost_state: the training state of this step is gone (old storage freed as it was moved, or a
            rank holding a part of it is gone): resume from ``resume_from``. ``False``: the old state
            is whole on every rank and training can go on at the old layout.
        resume_from: the last checkpoint of the run, if the caller knows one.
        freed: a surviving rank freed some of its old state (``lost_state`` also counts the parts the
            missing ranks held, which replicas on survivors may still hold: ``elastic/driver/recovery.py``).
        missing: every rank that stopped answering (``rank`` is the first), in the switch's group.
    """

    def __init__(self, message: str, *, hint: str, rank: int | None, phase: str, lost_state: bool,
                 resume_from: str | None, freed: bool | None = None, missing: tuple[int, ...] = ()) -> None:
        super().__init__(message, hint=hint)
        self.rank, self.phase, self.lost_state, self.resume_from = rank, phase, lost_state, resume_from
        self.freed = lost_state if freed is None else freed
        self.missing = missing or ((rank,) if rank is not None else ())


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


def mark_freed(err: BaseException) -> BaseException:
    """Mark ``err`` as raised after this rank's training state was freed in part and not put back
    (a rollout phase without ``keep_weights`` whose refill failed): the state of this step is whole
    nowhere but in an in-memory snapshot. Returns ``err``."""
    err.state_freed = True  # type: ignore[attr-defined]
    return err


def freed_state(err: BaseException | None) -> bool:
    """Whether this rank's training state was freed in part when ``err`` was raised: a switch that
    failed after freeing old state (``SwitchFailedError.freed``), or ``mark_freed``."""
    return bool(getattr(err, "state_freed", False)) or (isinstance(err, SwitchFailedError) and err.freed)


__all__ = ["EngineInternalError", "StagingBudgetError", "StateStoreError", "SwitchAbortedError", "SwitchFailedError",
           "freed_state", "mark_freed", "mark_refused", "was_refused"]
