"""Checks every rank runs before a switch moves a byte, and the one all-reduce that agrees on them.

A rank alone cannot tell whether the switch can run: a peer may hold a row too big for the budget,
or state that does not match its regions, and a rank that went ahead would wait forever on a peer
that stopped. So each rank checks what it can see locally (every source tensor there, with the
size and the dtype its region says), then one small all-reduce (MAX) over the group agrees on

- the smallest staging budget the switch needs (the largest row any rank sends),
- whether any rank found a problem.

Every rank then raises the same error, or none does. The dtypes of the state are not agreed: they
come from the regions (``Region.dtype``), which every rank computes from the same model and precision.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from lightning_dynatrain.engine.comm import GroupComm
from lightning_dynatrain.engine.errors import EngineInternalError, StateStoreError, SwitchAbortedError
from lightning_dynatrain.engine.staging import check_budget, smallest_unit_bytes
from lightning_dynatrain.engine.store import RegionIndex, StoreKey, box_pieces, check_local, torch_dtype
from lightning_dynatrain.vps.plan import RankPlan


def local_findings(plan: RankPlan, comm: GroupComm, world: int, store: Mapping[StoreKey, torch.Tensor],
                   src: RegionIndex, dst: RegionIndex) -> tuple[Exception | None, int, str]:
    """This rank's problem (if any) and its largest row sent.

    Returns ``(error, largest_row_bytes, what)`` where ``what`` names that row's tensor.
    """
    try:
        if plan.rank != comm.rank:
            raise StateStoreError(f"the plan of rank {plan.rank} was handed to group rank {comm.rank}",
                                  hint="give each process plan_rank(..., rank=its rank in the switch's group)")
        if comm.size < world:
            raise StateStoreError(f"the switch {plan.src}->{plan.dst} spans {world} ranks but the group has {comm.size}",
                                  hint="run the switch on a group that holds both the old and the new world")
        for key, tensor in store.items():
            want = src.dtype_name(key[0], key[1])
            if want is not None and tensor.dtype != torch_dtype(want):
                raise StateStoreError(f"{key[0]}:{key[1].value} stack {key[2]} is {tensor.dtype} on rank {comm.rank}; "
                                      f"the model's precision stores it as {want}",
                                      hint="build the source state at the precision the regions were computed for "
                                      "(rank_regions(..., precision))")
        for t in plan.sends + plan.retains:
            region = src.find(t.tensor, t.kind, t.box)
            for key, _ in box_pieces(t.tensor, t.kind, region, t.box):
                if key not in store:
                    raise StateStoreError(f"rank {comm.rank} must send or keep {t} but holds no {key}",
                                          hint="hand the engine every local tensor of the source layout")
                check_local(key, store[key], region, where="source")
        for t in plan.recvs + plan.retains + plan.fills:
            dst.find(t.tensor, t.kind, t.box)
        largest, what = 0, ""
        for t in plan.sends:  # the rows a rank sends travel through both sides' staging buffers
            row = smallest_unit_bytes(t.box, src.find(t.tensor, t.kind, t.box).itemsize)
            if row > largest:
                largest, what = row, f" of {t.tensor}:{t.kind.value}"
        return None, largest, what
    except (StateStoreError, EngineInternalError) as err:
        return err, 0, ""


def agree(comm: GroupComm, error: Exception | None, largest_row: int) -> int:
    """One all-reduce MAX over the group; see the module docstring. Collective: every rank calls it.
    Returns the staging budget the switch needs."""
    vector = torch.tensor([largest_row, 1 if error else 0], dtype=torch.int64, device=comm.device)
    dist.all_reduce(vector, op=dist.ReduceOp.MAX, group=comm.group)
    needed, failed = vector.tolist()
    if error is not None:
        raise error
    if failed:
        raise SwitchAbortedError(
            f"rank {comm.rank}: another rank found a problem before the switch started; nothing was moved",
            hint="read the error of the rank that reports StateStoreError or EngineInternalError",
        )
    return needed


def preflight(plan: RankPlan, comm: GroupComm, world: int, store: Mapping[StoreKey, torch.Tensor],
              src: RegionIndex, dst: RegionIndex, budget: int) -> None:
    """Check locally, agree over the group, and raise the same error on every rank if the switch cannot run."""
    error, largest, what = local_findings(plan, comm, world, store, src, dst)
    needed = agree(comm, error, largest)
    check_budget(budget, needed, what=what if largest == needed else "")


__all__ = ["agree", "local_findings", "preflight"]
