"""How far one rank got through an optimizer step: what a recovery reads after a collective failed.

A member that dies mid-step leaves the survivors at different points of it: some failed in
forward/backward or in the gradient all-reduce (their state is the last step's), some had already
passed megatron's ``optimizer.step()`` (their state is this step's). ``stepped`` says which; the
recovery then takes every box from survivors at one step only (``elastic/driver/recovery.py``), so the
step is in the new world's state everywhere or nowhere.

A step can also stop early: ``stop_if_lost`` (the elastic driver's) raises ``MemberLostError`` once
this process's watchdog has read the store's record of a member that died; ``checked_at_layers``
calls it as each transformer layer starts its forward and its backward, so a survivor leaves the
step in flight at the next layer instead of computing on until a collective with the dead fails.

``StepFault`` is a test hook: ``DYNATRAIN_STEP_FAULT=<rank>:<step>:<phase>`` kills this process
(SIGKILL, no goodbye) when rank ``rank`` reaches ``phase`` (``forward_backward``: the micro-batches
ran, the gradients are not reduced yet; ``optimizer``: megatron's step returned, the loss not yet
reduced) of the step that ends at global step ``step``.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

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
    stop_if_lost: Callable[[], None] | None = None
    """Raises when the step must stop now (a member died): called at every layer of the step's
    forward and backward (``checked_at_layers``)."""

    def reached(self, phase: str) -> None:
        if phase == "optimizer":
            self.stepped = True
        elif phase == "forward_backward" and self.before_update is not None:
            self.before_update()
        fault = self.fault
        if fault is not None and (fault.rank, fault.step, fault.phase) == (self.rank, self.step, phase):
            os.kill(os.getpid(), signal.SIGKILL)


@contextmanager
def checked_at_layers(chunks: Sequence[torch.nn.Module], check: Callable[[], None] | None) -> Iterator[None]:
    """Call ``check`` as each of ``chunks``' megatron transformer layers starts its forward (a forward
    pre-hook) and its backward (a hook on the gradient of its output), while the block runs; what
    ``check`` raises leaves the step from there. A chunk without transformer layers is checked as
    a whole. ``None``: nothing is checked. The hooks go on exit."""
    if check is None:
        yield
        return
    from megatron.core.transformer.transformer_layer import TransformerLayer

    def before_forward(module: torch.nn.Module, args: object) -> None:
        check()

    def before_backward(grad: torch.Tensor) -> None:
        check()

    def after_forward(module: torch.nn.Module, args: object, output: object) -> None:
        tensor = output[0] if isinstance(output, tuple) and output else output
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
            tensor.register_hook(before_backward)

    handles = []
    for chunk in chunks:
        for layer in [m for m in chunk.modules() if isinstance(m, TransformerLayer)] or [chunk]:
            handles += [layer.register_forward_pre_hook(before_forward), layer.register_forward_hook(after_forward)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


__all__ = ["PHASES", "STEP_FAULT_ENV", "StepFault", "StepProgress", "checked_at_layers"]
