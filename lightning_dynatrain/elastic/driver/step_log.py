"""The global batches and learning rates of the steps since the last snapshot, kept for a replay.

With in-memory snapshots (``OnNodeChange(snapshot_every=N)``) a recovery may go back to the
snapshot's step ``S`` and compute steps ``S+1 ..`` again at the survivors' layout. Lightning's loop
has moved past their batches, so each rank keeps them here as the steps run: every rank receives
the global batch (the strategy slices its data-parallel share), so a replay at any layout is the
same computation on the same samples, with the learning rate and weight decay each step ran with
(the schedule's values, whatever changes it later). At most ``N + 1`` steps are kept: a snapshot
drops the steps it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoggedStep:
    """One optimizer step's input: the step it ends at, its global batch, its lr and weight decay, and
    its ``forward_step`` when the step named one (``None``: the model's)."""

    step: int
    batch: Mapping[str, torch.Tensor]
    lr: float
    weight_decay: float
    forward_step: Callable | None = None


class StepLog:
    """The steps after the last snapshot, by the global step each ends at."""

    def __init__(self) -> None:
        self._steps: dict[int, LoggedStep] = {}

    def record(self, step: int, batch: Mapping[str, torch.Tensor], *, lr: float, weight_decay: float,
               forward_step: Callable | None = None) -> None:
        """Keep step ``step``'s input (a copy: the loader may reuse its tensors)."""
        kept = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        self._steps[step] = LoggedStep(step, kept, lr, weight_decay, forward_step)

    def drop_through(self, step: int) -> None:
        """Forget the steps up to ``step`` (a snapshot of ``step`` holds their result)."""
        self._steps = {s: v for s, v in self._steps.items() if s > step}

    def steps(self) -> tuple[int, ...]:
        return tuple(sorted(self._steps))

    def between(self, first: int, last: int) -> list[LoggedStep]:
        """Steps ``first .. last``, in order. Raises ``KeyError`` naming a step not kept."""
        missing = [s for s in range(first, last + 1) if s not in self._steps]
        if missing:
            raise KeyError(f"steps {missing} are not in this rank's step log (it holds {self.steps()})")
        return [self._steps[s] for s in range(first, last + 1)]

    def nbytes(self) -> int:
        return sum(v.nbytes for s in self._steps.values() for v in s.batch.values() if isinstance(v, torch.Tensor))


__all__ = ["LoggedStep", "StepLog"]
