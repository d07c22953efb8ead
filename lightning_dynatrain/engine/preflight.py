"""Checks every rank runs before a switch moves a byte, and the one all-reduce that agrees on them.

A rank alone cannot tell whether the switch can run: a peer may hold a row too big for the budget,
or state that does not match its regions, and a rank that went ahead would wait forever on a peer
that stopped. So each rank checks what it can see locally, then one small all-reduce (MAX) over the
group agrees on

- the smallest staging budget the switch needs (the largest row any rank sends),
- whether any rank found a problem,
- the dtype of every state kind (derived from the source tensors; a rank that holds none of a kind,
  e.g. a rank joining the world, learns it from the others; two ranks that disagree are an error).

Every rank then raises the same error, or none does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_dynatrain.engine.comm import GroupComm
from lightning_dynatrain.engine.errors import EngineInternalError, StateStoreError, SwitchAbortedError
from lightning_dynatrain.engine.staging import check_budget, smallest_unit_bytes
from lightning_dynatrain.engine.store import RegionIndex, StoreKey, box_pieces, check_local
from lightning_dynatrain.vps.plan import RankPlan
from lightning_dynatrain.vps.spec import StateKind

#: dtypes state may have; the position (plus one) is the code the all-reduce carries.
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)
KINDS = tuple(StateKind)
_CEIL = len(DTYPES) + 1


@dataclass(frozen=True, slots=True)
class Agreement:
    """What every rank agreed on: the dtype of each state kind and the budget the switch needs."""

    dtypes: Mapping[StateKind, torch.dtype]
    needed_budget: int


def local_findings(plan: RankPlan, comm: GroupComm, world: int, store: Mapping[StoreKey, torch.Tensor],
                   src: RegionIndex, dst: RegionIndex) -> tuple[Exception | None, dict[StateKind, torch.dtype], int, str]:
    """This rank's problem (if any), the dtypes of its source state, and its largest row sent.

    Returns ``(error, dtypes, largest_row_bytes, what)`` where ``what`` names that row's tensor.
    """
    dtypes: dict[StateKind, torch.dtype] = {}
    try:
        if plan.rank != comm.rank:
            raise StateStoreError(f"the plan of rank {plan.rank} was handed to group rank {comm.rank}",
                                  hint="give each process plan_rank(..., rank=its rank in the switch's group)")
        if comm.size < world:
            raise StateStoreError(f"the switch {plan.src}->{plan.dst} spans {world} ranks but the group has {comm.size}",
                                  hint="run the switch on a group that holds both the old and the new world")
        for key, tensor in store.items():
            if tensor.dtype not in DTYPES:
                raise StateStoreError(f"{key[0]}:{key[1].value} stack {key[2]} has dtype {tensor.dtype}",
                                      hint=f"the engine moves {', '.join(map(str, DTYPES))}")
            known = dtypes.setdefault(key[1], tensor.dtype)
            if known != tensor.dtype:
                raise StateStoreError(f"state kind {key[1].value} is both {known} and {tensor.dtype} on rank {comm.rank}",
                                      hint="keep one dtype per state kind (e.g. bf16 params, fp32 moments)")
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
            row = smallest_unit_bytes(t.box, dtypes[t.kind].itemsize)
            if row > largest:
                largest, what = row, f" of {t.tensor}:{t.kind.value}"
        return None, dtypes, largest, what
    except (StateStoreError, EngineInternalError) as err:
        return err, dtypes, 0, ""


def agree(comm: GroupComm, error: Exception | None, dtypes: Mapping[StateKind, torch.dtype], largest_row: int) -> Agreement:
    """One all-reduce MAX over the group; see the module docstring. Collective: every rank calls it."""
    codes = [DTYPES.index(dtypes[k]) + 1 if k in dtypes else 0 for k in KINDS]
    inverse = [_CEIL - c if c else 0 for c in codes]
    vector = torch.tensor([largest_row, 1 if error else 0, *codes, *inverse], dtype=torch.int64, device=comm.device)
    dist.all_reduce(vector, op=dist.ReduceOp.MAX, group=comm.group)
    values = vector.tolist()
    needed, failed = values[0], values[1]
    high = values[2:2 + len(KINDS)]
    low = [_CEIL - v if v else 0 for v in values[2 + len(KINDS):]]
    if error is not None:
        raise error
    if failed:
        raise SwitchAbortedError(
            f"rank {comm.rank}: another rank found a problem before the switch started; nothing was moved",
            hint="read the error of the rank that reports StateStoreError or EngineInternalError",
        )
    agreed: dict[StateKind, torch.dtype] = {}
    for kind, hi, lo in zip(KINDS, high, low):
        if hi and hi != lo:
            raise SwitchAbortedError(
                f"ranks disagree on the dtype of {kind.value}: {DTYPES[lo - 1]} and {DTYPES[hi - 1]}",
                hint="build the source state with the same precision on every rank",
            )
        if hi:
            agreed[kind] = DTYPES[hi - 1]
    return Agreement(agreed, needed)


def preflight(plan: RankPlan, comm: GroupComm, world: int, store: Mapping[StoreKey, torch.Tensor],
              src: RegionIndex, dst: RegionIndex, budget: int) -> Agreement:
    """Check locally, agree over the group, and raise the same error on every rank if the switch cannot run."""
    error, dtypes, largest, what = local_findings(plan, comm, world, store, src, dst)
    agreement = agree(comm, error, dtypes, largest)
    check_budget(budget, agreement.needed_budget, what=what if largest == agreement.needed_budget else "")
    return agreement


__all__ = ["Agreement", "DTYPES", "agree", "local_findings", "preflight"]
