"""Which parts of a layout's training state die with a set of its ranks (pure).

The Virtual Parameter Space knows every holder of every box: a box survives when one of its
holders does. Data-parallel replicas hold the parameters (and, without ZeRO, the optimizer's state)
several times over, so a dead rank of a ``dp >= 2`` layout loses nothing of them; a ZeRO-1 shard,
or a tp/pp shard at ``dp1``, has one holder and goes with it.

Example::

    >>> lost_state(spec, ParallelConfig.parse("dp2-tp2"), dead={1}, precision=Precision.BF16)
    ()
    >>> print(lost_state(spec, ParallelConfig.parse("dp2-tp2-zero1"), dead={1}, precision=Precision.BF16)[0])
    decoder.layers.self_attention.linear_proj.weight main_param [1:2, 0:8, 4:8] (held by rank 1)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from lightning_dynatrain.vps.box import Box
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.mapping import held_boxes
from lightning_dynatrain.vps.spec import ModelSpec, Precision, StateKind


@dataclass(frozen=True)
class LostBox:
    """A box of one tensor's state kind that only dead ranks held (``holders``: those ranks)."""

    tensor: str
    kind: StateKind
    box: Box
    holders: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.tensor} {self.kind.value} {self.box} (held by rank{'s' * (len(self.holders) > 1)} " \
               f"{', '.join(map(str, self.holders))})"


def lost_state(spec: ModelSpec, layout: ParallelConfig, dead: Iterable[int],
               precision: Precision = Precision.FP32) -> tuple[LostBox, ...]:
    """Every box of ``layout``'s state whose holders are all in ``dead`` (empty: the survivors hold
    the whole state), in the spec's tensor order."""
    dead = frozenset(dead)
    out = [LostBox(tensor, kind, box, holders) for tensor, kind, box, holders in
           held_boxes(spec, layout, precision, ranks=dead) if dead.issuperset(holders)]
    return tuple(out)


def lost_bytes(spec: ModelSpec, lost: Iterable[LostBox], precision: Precision = Precision.FP32) -> int:
    """The bytes of ``lost``'s boxes."""
    return sum(b.box.numel * spec.itemsize(b.tensor, b.kind, precision) for b in lost)


def describe_lost(spec: ModelSpec, lost: tuple[LostBox, ...], precision: Precision = Precision.FP32) -> tuple[str, str]:
    """``lost`` in words for an error: its count and size ("3 boxes (0.01 MiB)"), and the first three."""
    shown = "; ".join(map(str, lost[:3])) + (f"; and {len(lost) - 3} more" if len(lost) > 3 else "")
    return f"{len(lost)} boxes ({lost_bytes(spec, lost, precision) / 2**20:.2f} MiB)", shown


__all__ = ["LostBox", "describe_lost", "lost_bytes", "lost_state"]
