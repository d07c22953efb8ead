"""What one rank does in a switch: the boxes it sends, receives and keeps. Pure data, printable."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from lightning_dynatrain.vps.box import Box
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.spec import ModelSpec, Precision, StateKind


class Transfer(NamedTuple):
    """One box of one state kind of one tensor; ``peer`` is the other rank (self for a retain)."""

    peer: int
    tensor: str
    kind: StateKind
    box: Box

    def __str__(self) -> str:
        return f"{self.tensor}:{self.kind.value}{self.box}@{self.peer}"


@dataclass(frozen=True, slots=True)
class RankPlan:
    """The send, receive and retain lists of one rank for a switch from ``src`` to ``dst``.

    ``fills`` are destination boxes no source rank holds: vocabulary padding rows that only the
    destination layout has (a larger tp pads more). They are the named don't-care region: the
    engine zeroes them rather than leaving uninitialised memory in a tensor Megatron trains.

    Every rank computes every plan from the same inputs, so no coordination is needed: rank ``i``'s
    send list to ``j`` matches rank ``j``'s receive list from ``i`` box for box, in the same order.
    """

    rank: int
    src: ParallelConfig
    dst: ParallelConfig
    sends: tuple[Transfer, ...]
    recvs: tuple[Transfer, ...]
    retains: tuple[Transfer, ...]
    fills: tuple[Transfer, ...] = ()
    group_size: int = 0
    """Processes of the switch's group (``Members.size``); 0: the larger of the two worlds."""
    weights_only: bool = False
    """The params alone move (a rollout's switch); the optimizer's state stays where it is."""

    @property
    def world(self) -> int:
        """Processes of the switch's group (by default the union of both worlds)."""
        return self.group_size or max(self.src.world_size, self.dst.world_size)

    def peers(self) -> tuple[int, ...]:
        return tuple(sorted({t.peer for t in self.sends} | {t.peer for t in self.recvs}))

    def bytes(self, transfers: tuple[Transfer, ...], spec: ModelSpec, precision: Precision) -> int:
        """Bytes of ``transfers`` of ``spec``'s state at ``precision``."""
        return sum(t.box.numel * spec.itemsize(t.tensor, t.kind, precision) for t in transfers)

    def sends_to(self, peer: int) -> tuple[Transfer, ...]:
        return tuple(t for t in self.sends if t.peer == peer)

    def recvs_from(self, peer: int) -> tuple[Transfer, ...]:
        return tuple(t for t in self.recvs if t.peer == peer)

    def __str__(self) -> str:
        def count(ts: tuple[Transfer, ...]) -> str:
            return f"{len(ts)} boxes/{sum(t.box.numel for t in ts)} el"

        return (
            f"rank {self.rank} {self.src}->{self.dst}{' (weights only)' if self.weights_only else ''}:"
            f" send {count(self.sends)} to {sorted({t.peer for t in self.sends})}"
            f" | recv {count(self.recvs)} from {sorted({t.peer for t in self.recvs})}"
            f" | retain {count(self.retains)}"
            + (f" | fill {count(self.fills)}" if self.fills else "")
        )
