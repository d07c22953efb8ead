"""Checks every rank runs before a switch moves a byte, and the one all-reduce that agrees on them.

A rank alone cannot tell whether the switch can run: a peer may hold a row too big for the budget,
or state that does not match its program, and a rank that went ahead would wait forever on a peer
that stopped. So each rank checks what it can see locally (every source tensor its program reads
is there, contiguous, with the elements and the dtype its region says), then one small all-reduce
(MAX) over the group agrees on

- the smallest staging budget the switch needs (the largest row any rank sends or receives),
- whether any rank found a problem.

Every rank then raises the same error, or none does. The dtypes of the state are not agreed: they
come from the regions (``Region.dtype``), which every rank computes from the same model and precision.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from lightning_dynatrain.transition.comm import GroupComm
from lightning_dynatrain.transition.errors import StateStoreError, SwitchAbortedError
from lightning_dynatrain.transition.program import StoreKey, SwitchProgram
from lightning_dynatrain.transition.staging import check_budget


def check_tensor(key: StoreKey, tensor: torch.Tensor, numel: int, dtype: str, *, where: str) -> None:
    """Raise ``StateStoreError`` if ``tensor`` cannot be local tensor ``key`` (``numel`` contiguous
    elements of ``dtype``)."""
    if tensor.numel() != numel or not tensor.is_contiguous() or tensor.dtype != getattr(torch, dtype):
        raise StateStoreError(
            f"{where} {key[0]}:{key[1].value} stack {key[2]} is {tensor.dtype} with {tensor.numel()} elements "
            f"(contiguous={tensor.is_contiguous()}); the switch needs {numel} contiguous {dtype} elements",
            hint="hand the engine the local tensors of the layout and precision its program was compiled for",
        )


def local_problem(program: SwitchProgram, comm: GroupComm, store: Mapping[StoreKey, torch.Tensor]
                  ) -> StateStoreError | None:
    """What is wrong on this rank, if anything (see the module docstring)."""
    try:
        if program.rank != comm.rank:
            raise StateStoreError(f"the program of rank {program.rank} was handed to group rank {comm.rank}",
                                  hint="give each process the program compiled for its rank in the switch's group")
        if comm.size < program.world:
            raise StateStoreError(f"the switch {program.src}->{program.dst} spans {program.world} ranks but the "
                                  f"group has {comm.size}",
                                  hint="run the switch on a group that holds both the old and the new world")
        for key, numel, dtype in program.sources:
            if key not in store:
                raise StateStoreError(f"rank {comm.rank} must send or keep {key[0]}:{key[1].value} stack {key[2]} "
                                      "but holds no such tensor", hint="hand the engine every local tensor of the "
                                      "source layout")
            check_tensor(key, store[key], numel, dtype, where="source")
    except StateStoreError as err:
        return err
    return None


def preflight(program: SwitchProgram, comm: GroupComm, store: Mapping[StoreKey, torch.Tensor]) -> None:
    """Check locally, agree over the group (collective), and raise the same error on every rank if
    the switch cannot run."""
    error = local_problem(program, comm, store)
    vector = torch.tensor([program.needed_budget, 1 if error else 0], dtype=torch.int64, device=comm.device)
    dist.all_reduce(vector, op=dist.ReduceOp.MAX, group=comm.group)
    needed, failed = vector.tolist()
    if error is not None:
        raise error
    if failed:
        raise SwitchAbortedError(
            f"rank {comm.rank}: another rank found a problem before the switch started; nothing was moved",
            hint="read the error of the rank that reports StateStoreError",
        )
    check_budget(program.staging_budget, needed)


__all__ = ["check_tensor", "local_problem", "preflight"]
