"""A batch sampler that yields whole GLOBAL batches, so a layout switch needs no dataloader rebuild.

Every rank iterates the same sampler and gets the same ``G`` indices for optimizer step ``k``; the
strategy cuts this rank's data-parallel share out of the collated batch at train time, by the
*current* layout's dp rank and size. The sequence of global batches is therefore the same at every
layout, and the data position is always ``step * G`` samples: nothing in the data pipeline knows
the layout, so Lightning's one-batch prefetch can run across a switch.

Step ``k`` reads the sample positions ``[k*G, (k+1)*G)`` of an endless stream; position ``p`` is
sample ``p mod N`` of the dataset (``N`` samples), or, with ``shuffle``, entry ``p mod N`` of a
permutation seeded by ``(seed, p // N)`` (a fresh order per pass over the data).

Example, ``N = 10``, ``G = 4``, no shuffle::

    step 0: [0, 1, 2, 3]    step 1: [4, 5, 6, 7]    step 2: [8, 9, 0, 1]    ...

A Lightning epoch is ``len(sampler) = max(1, N // G)`` steps; ``__iter__`` yields from the next
step up to the end of the current epoch, so a run resumed mid-epoch finishes that epoch with the
right batches (``set_step(global_step)`` or ``load_state_dict``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields the ``global_batch_size`` dataset indices of each optimizer step, identical on every rank.

    Args:
        data: the dataset (or its length).
        global_batch_size: samples per optimizer step, summed over data-parallel ranks (``G``).
        shuffle: visit the samples in a seeded random order, a new one per pass over the data.
        seed: seed of those orders; must be the same on every rank.

    Raises:
        ValueError: an empty dataset or a non-positive batch size.

    Example::

        sampler = GlobalBatchSampler(dataset, global_batch_size=16, shuffle=True, seed=0)
        loader = DataLoader(dataset, batch_sampler=sampler)   # [16, ...] batches on every rank
    """

    def __init__(self, data: Sized | int, *, global_batch_size: int, shuffle: bool = False, seed: int = 0) -> None:
        self.num_samples = data if isinstance(data, int) else len(data)
        if self.num_samples < 1:
            raise ValueError("GlobalBatchSampler needs a non-empty dataset")
        if not isinstance(global_batch_size, int) or global_batch_size < 1:
            raise ValueError(f"global_batch_size={global_batch_size!r} must be a positive integer")
        self.global_batch_size = global_batch_size
        self.shuffle = shuffle
        self.seed = seed
        self._next_step = 0
        self._order: tuple[int, torch.Tensor] | None = None  # (pass, permutation) cache

    # ------------------------------------------------------------------ positions
    @property
    def steps_per_epoch(self) -> int:
        return max(1, self.num_samples // self.global_batch_size)

    def indices(self, step: int) -> list[int]:
        """The dataset indices of optimizer step ``step`` (pure: does not move the sampler)."""
        start = step * self.global_batch_size
        return [self._index(p) for p in range(start, start + self.global_batch_size)]

    def _index(self, position: int) -> int:
        data_pass, offset = divmod(position, self.num_samples)
        if not self.shuffle:
            return offset
        if self._order is None or self._order[0] != data_pass:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + data_pass)
            self._order = (data_pass, torch.randperm(self.num_samples, generator=g))
        return int(self._order[1][offset])

    # ---------------------------------------------------------- Sampler protocol
    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[list[int]]:
        epoch_end = (self._next_step // self.steps_per_epoch + 1) * self.steps_per_epoch
        while self._next_step < epoch_end:
            step = self._next_step
            self._next_step += 1  # counts what was *handed out*, prefetch included
            yield self.indices(step)

    def set_step(self, step: int) -> None:
        """Make the next batch handed out the one of optimizer step ``step`` (e.g. ``trainer.global_step``)."""
        if step < 0:
            raise ValueError(f"step={step} must be >= 0")
        self._next_step = step

    @property
    def next_step(self) -> int:
        return self._next_step

    # ----------------------------------------------------------------- resume
    def state_dict(self) -> dict[str, Any]:
        """``next_step`` counts batches handed out, which runs one ahead of the optimizer under
        Lightning's prefetch; the strategy therefore re-aligns the sampler to ``trainer.global_step``
        at the start of training, and this state is for loops without that."""
        return {"next_step": self._next_step, "global_batch_size": self.global_batch_size,
                "num_samples": self.num_samples, "shuffle": self.shuffle, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("global_batch_size", "num_samples", "shuffle", "seed"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"cannot resume GlobalBatchSampler: saved {key}={state[key]!r}, now {getattr(self, key)!r}. "
                    "HINT: resume with the same dataset, global batch size, shuffle and seed"
                )
        self.set_step(int(state["next_step"]))


class EvalBatchSampler(GlobalBatchSampler):
    """The global batches of a dataset in order, from the first on every pass (validation).

    A validation that reads only some batches (``limit_val_batches``, a loop that stops early)
    would leave a ``GlobalBatchSampler`` part-way, and the next validation would start there: two
    validations would score different data. This one has no position: every ``iter`` starts at
    step 0 and ends with the pass (``max(1, N // G)`` batches).

    >>> [batch for batch in EvalBatchSampler(6, global_batch_size=2)]
    [[0, 1], [2, 3], [4, 5]]
    """

    def __init__(self, data: Sized | int, *, global_batch_size: int) -> None:
        super().__init__(data, global_batch_size=global_batch_size, shuffle=False)

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.steps_per_epoch):
            yield self.indices(step)


def dp_share_bounds(global_batch_size: int, dp_rank: int, dp_size: int) -> tuple[int, int]:
    """Rows ``[start, end)`` of a global batch that data-parallel rank ``dp_rank`` of ``dp_size`` trains on.

    >>> dp_share_bounds(16, 1, 4)
    (4, 8)
    """
    if global_batch_size % dp_size:
        raise ValueError(f"global batch {global_batch_size} does not split over {dp_size} data-parallel ranks")
    per_rank = global_batch_size // dp_size
    return dp_rank * per_rank, (dp_rank + 1) * per_rank


def global_batch_samplers(loaders: Any) -> Iterator[GlobalBatchSampler]:
    """Every ``GlobalBatchSampler`` in a dataloader or a (nested) collection of them."""
    if isinstance(loaders, DataLoader):
        if isinstance(loaders.batch_sampler, GlobalBatchSampler):
            yield loaders.batch_sampler
    elif isinstance(loaders, Mapping):
        for value in loaders.values():
            yield from global_batch_samplers(value)
    elif isinstance(loaders, (list, tuple)):
        for value in loaders:
            yield from global_batch_samplers(value)


__all__ = ["EvalBatchSampler", "GlobalBatchSampler", "dp_share_bounds", "global_batch_samplers"]
