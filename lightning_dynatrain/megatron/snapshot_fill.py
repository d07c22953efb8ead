"""The boxes a recovery switch left as holes, written from the keepers' snapshot copies.

A recovery from a snapshot (``elastic/driver/snapshots.py``) first switches every survivor's own
state of step ``S`` to the new layout with ``Members.holes``: a box that only the dead held becomes
a zero fill. Its copy of step ``S`` sits on a keeper (``megatron.snapshot``);
``vps.snapshot_plan.fill_plan`` says, purely, which piece of each such box goes from which keeper
to which process of the new world (the new layout's cells cut each box), and ``fill_from_kept``
runs it: one batch of point-to-point sends and receives, then the writes into the new state's
local tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from lightning_dynatrain.transition.local_state import RegionIndex, StoreKey, box_pieces, box_view, torch_dtype
from lightning_dynatrain.megatron.state import MegatronState
from lightning_dynatrain.megatron.state_bridge import megatron_store
from lightning_dynatrain.vps.box import Box
from lightning_dynatrain.vps.mapping import rank_regions
from lightning_dynatrain.vps.snapshot_plan import FillPiece
from lightning_dynatrain.vps.spec import ModelSpec, Precision, StateKind


def fill_from_kept(state: MegatronState, spec: ModelSpec, precision: Precision, plan: Sequence[FillPiece],
                   kept: Mapping[tuple[str, StateKind, Box], torch.Tensor], rank: int,
                   group: dist.ProcessGroup | None = None) -> int:
    """Run ``plan`` on process ``rank`` of ``group`` (default the world), writing into ``state``
    (at the new layout); the bytes this process received or copied."""
    live = megatron_store(state.chunks, state.optimizer, spec, state.layout, rank)
    regions = RegionIndex(rank_regions(spec, state.layout, rank, precision))
    ops, writes = [], []
    for p in plan:
        if p.keeper == rank:
            data = kept[(p.tensor, p.kind, p.lost)][p.piece.relative_to(p.lost.lo)]
            if p.dest == rank:
                writes.append((p, data))
            else:
                ops.append(dist.P2POp(dist.isend, data.contiguous(), group=group, group_peer=p.dest))
        elif p.dest == rank:
            dtype = torch_dtype(regions.dtype_name(p.tensor, p.kind))
            buffer = torch.empty(p.piece.shape, dtype=dtype, device="cpu")  # host: the copies travel over gloo
            ops.append(dist.P2POp(dist.irecv, buffer, group=group, group_peer=p.keeper))
            writes.append((p, buffer))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for p, data in writes:
        _write(live, regions, p, data)
    return sum(d.nbytes for _, d in writes)


def _write(live: Mapping[StoreKey, torch.Tensor], regions: RegionIndex, p: FillPiece, data: torch.Tensor) -> None:
    """``data`` (shaped as ``p.piece``) into the local tensors holding it."""
    region = regions.find(p.tensor, p.kind, p.piece)
    for key, sub in box_pieces(p.tensor, p.kind, region, p.piece):
        target = box_view(live[key], region, sub)
        target.copy_(data[sub.relative_to(p.piece.lo)].reshape(target.shape))


__all__ = ["fill_from_kept"]
