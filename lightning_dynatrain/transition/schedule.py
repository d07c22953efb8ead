"""The XOR pairwise schedule: in step ``s`` rank ``i`` talks only to rank ``i ^ s``, both directions.

Every pair of ranks ``(i, j)`` meets in exactly one step, ``s = i ^ j``, and each rank has at most one
partner per step, so a step is a perfect matching: no rank waits on a rank that waits on a third,
and no cycle of waits can form. For a world that is not a power of two, partners ``>= world`` are
skipped (those ranks idle in that step). Pairs with nothing to exchange skip the step too; both
sides know it, because rank ``i``'s sends to ``j`` are rank ``j``'s receives from ``i``.

Example, world 3 (next power of two 4), rank 1: step 1 meets rank 0, step 2 meets rank 3 (absent,
skipped), step 3 meets rank 2::

    >>> [(s.index, s.peer) for s in xor_schedule(1, 3)]
    [(1, 0), (3, 2)]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple


class Step(NamedTuple):
    """One step of the schedule for one rank: the step number and the partner rank."""

    index: int
    peer: int


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def xor_schedule(rank: int, world: int) -> tuple[Step, ...]:
    """All steps of ``rank`` in a world of ``world`` ranks, in the order they run."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world} ranks")
    return tuple(Step(s, rank ^ s) for s in range(1, next_pow2(world)) if rank ^ s < world)


def active_steps(rank: int, world: int, has_traffic: Callable[[int], bool]) -> tuple[Step, ...]:
    """The steps of ``rank`` whose partner exchanges at least one box with it (either direction).

    ``has_traffic(peer)`` must be symmetric across the two ranks (true on ``i`` for ``j`` iff true on
    ``j`` for ``i``); a plan's ``sends_to(peer) or recvs_from(peer)`` is.
    """
    return tuple(step for step in xor_schedule(rank, world) if has_traffic(step.peer))


__all__ = ["Step", "active_steps", "next_pow2", "xor_schedule"]
