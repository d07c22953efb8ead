"""How far one rank got through an optimizer step: what a recovery reads after a collective failed.

A member that dies mid-step leaves the survivors at different points of it: some failed in
forward/backward or in the gradient all-reduce (their state is the last step's), some had already
passed megatron's ``optimizer.step()`` (their state is this step's). ``stepped`` says which; the
recovery then takes every box from survivors at one step only (``elastic/driver/recovery.py``), so the
step is in the new world's state everywhere or nowhere.

``StepFault`` is a test hook: ``DYNATRAIN_STEP_FAULT=<rank>:<step>:<phase>`` kills this process
(SIGKILL, no goodbye) when rank ``rank`` reaches ``phase`` (``forward_backward``: the micro-batches
ran, the gradients are not reduced yet; ``optimizer``: megatron's step returned, the loss not yet
reduced) of the step that ends at global step ``step``.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

STEP_FAULT_ENV = "DYNATRAIN_STEP_FAULT"
PHASES = ("forward_backward", "optimizer")


@dataclass(frozen=True)
class StepFault:
    """Kill rank ``rank`` at ``phase`` of the step that ends at global step ``step`` (test hook)."""

    rank: int
    step: int
    phase: str

    @classmethod
    def from_environment(cls) -> "StepFault | None":
        value = os.environ.get(STEP_FAULT_ENV)
        if not value:
            return None
        rank, step, phase = value.split(":")
        if phase not in PHASES:
            raise ValueError(f"{STEP_FAULT_ENV}={value!r}: the phase must be one of {PHASES}")
        return cls(int(rank), int(step), phase)


@dataclass
class StepProgress:
    """One rank's progress through the optimizer step that ends at global step ``step``."""

    step: int
    rank: int
    fault: StepFault | None = None
    stepped: bool = False
    """megatron's ``optimizer.step()`` returned: this rank's state is the step's result."""
    loss: float | None = None
    """The step's global mean loss, once reduced."""
    before_update: Callable[[], None] | None = None
    """Called once the gradients are computed, before the update (an in-memory snapshot's copy of
    the state must be complete by then)."""

    def reached(self, phase: str) -> None:
        if phase == "optimizer":
            self.stepped = True
        elif phase == "forward_backward" and self.before_update is not None:
            self.before_update()
        fault = self.fault
        if fault is not None and (fault.rank, fault.step, fault.phase) == (self.rank, self.step, phase):
            os.kill(os.getpid(), signal.SIGKILL)


__all__ = ["PHASES", "STEP_FAULT_ENV", "StepFault", "StepProgress"]
