"""The bridge between a megatron model + optimizer and the engine's store of local tensors.

The engine moves boxes between local tensors keyed ``(logical tensor, state kind, global stack)``.
Here those keys are matched with megatron's live tensors: parameters (views into DDP's contiguous
buffer), fp32 main params (bf16 training) and Adam's moments, full local tensors under zero0 and
1-D shards under zero1 (see ``optimizer.optimizer_state_views``). Nothing is copied: writing to a
store entry writes megatron's storage, which is how a freshly built model of the new layout is
filled in place.

Adam's ``step`` is scalar state: identical on every rank, carried whole (``set_adam_step``).
"""

from __future__ import annotations

import torch
from megatron.core.optimizer.optimizer import ChainedOptimizer, MegatronOptimizer

from lightning_dynatrain.engine.store import RegionIndex, StoreKey
from lightning_dynatrain.megatron.optimizer import optimizer_state_views
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.mapping import rank_regions
from lightning_dynatrain.vps.names import local_parameters
from lightning_dynatrain.vps.spec import ModelSpec, Precision, StateKind


def precision_of(model: torch.nn.Module) -> Precision:
    """``bf16`` when the model's params are bf16 (with fp32 main params), else ``fp32``."""
    dtype = next(model.parameters()).dtype
    return Precision.BF16 if dtype == torch.bfloat16 else Precision.FP32


def _inner_optimizers(optimizer: MegatronOptimizer) -> list[torch.optim.Optimizer]:
    subs = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    return [sub.optimizer for sub in subs if getattr(sub, "optimizer", None) is not None]


def materialize_adam_state(optimizer: MegatronOptimizer, step: int) -> None:
    """Give every parameter Adam state (zero moments, ``step``) so a new optimizer can be filled.

    A freshly built torch Adam creates its state lazily at the first step; the switch writes the
    moved moments into it before that, so it must exist (and have the right shapes) first.
    """
    for inner in _inner_optimizers(optimizer):
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] = torch.tensor(float(step))


def adam_step(optimizer: MegatronOptimizer) -> int | None:
    """Adam's step count (the same for every parameter), or ``None`` before the first step."""
    for inner in _inner_optimizers(optimizer):
        for state in inner.state.values():
            if "step" in state:
                return int(state["step"])
    return None


def set_adam_step(optimizer: MegatronOptimizer, step: int) -> None:
    for inner in _inner_optimizers(optimizer):
        for state in inner.state.values():
            state["step"] = torch.tensor(float(step))


def megatron_store(
    ddp_model: torch.nn.Module,
    optimizer: MegatronOptimizer,
    spec: ModelSpec,
    layout: ParallelConfig,
    rank: int,
) -> dict[StoreKey, torch.Tensor]:
    """Every local tensor of this rank's training state, keyed as the engine keys it (live views).

    Raises:
        KeyError: the model does not have the parameters the VPS says ``rank`` holds at ``layout``
            (a model built for another layout or shape).
    """
    precision = precision_of(ddp_model.module)
    views = optimizer_state_views(ddp_model, optimizer)
    wanted = set(RegionIndex(rank_regions(spec, layout, rank, precision)).local_tensors())
    store: dict[StoreKey, torch.Tensor] = {}
    for name, local in local_parameters(spec, layout, rank).items():
        view = views[name]
        candidates = {
            StateKind.PARAM: view.param.data,
            StateKind.MAIN_PARAM: view.main_param,
            StateKind.EXP_AVG: view.exp_avg,
            StateKind.EXP_AVG_SQ: view.exp_avg_sq,
        }
        for kind, tensor in candidates.items():
            key = (local.tensor, kind, local.stack)
            if key in wanted:
                if tensor is None:
                    raise KeyError(f"{name}: no {kind.value} on rank {rank}; call materialize_adam_state first")
                store[key] = tensor.detach()
    missing = wanted - set(store)
    if missing:
        raise KeyError(f"rank {rank}: the model lacks {len(missing)} local tensors of layout {layout}, "
                       f"e.g. {sorted(missing, key=str)[:3]}")
    return store

