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

from collections.abc import Sequence

import torch
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.optimizer import ChainedOptimizer, MegatronOptimizer

from lightning_dynatrain.transition.adoption import owns_storage
from lightning_dynatrain.megatron.model_chunks import chunk_list
from lightning_dynatrain.megatron.state import MegatronState
from lightning_dynatrain.transition.local_state import RegionIndex, StoreKey
from lightning_dynatrain.megatron.optimizer import optimizer_state_views
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.mapping import rank_regions
from lightning_dynatrain.vps.names import local_parameters
from lightning_dynatrain.vps.spec import ModelSpec, Precision, StateKind


def precision_of(model: torch.nn.Module, optimizer: "MegatronOptimizer | OptimizerConfig | None" = None) -> Precision:
    """``bf16`` when the model's params are bf16 (with fp32 main params; megatron keeps some, the
    norms, in fp32 even then), else ``fp32``; ``+sgd`` when ``optimizer`` (megatron's optimizer or
    its config; ``None``: Adam) is SGD."""
    bf16 = any(p.dtype == torch.bfloat16 for p in model.parameters())
    return Precision.of_state(params="bf16" if bf16 else "fp32", optimizer=_optimizer_name(optimizer))


def _optimizer_name(optimizer: "MegatronOptimizer | OptimizerConfig | None") -> str:
    if optimizer is None:
        return "adam"
    if isinstance(optimizer, OptimizerConfig):
        return optimizer.optimizer
    return "sgd" if any(isinstance(inner, torch.optim.SGD) for inner in _inner_optimizers(optimizer)) else "adam"


def _inner_optimizers(optimizer: MegatronOptimizer) -> list[torch.optim.Optimizer]:
    subs = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    return [sub.optimizer for sub in subs if getattr(sub, "optimizer", None) is not None]


def materialize_optimizer_state(optimizer: MegatronOptimizer, step: int, *, zero: bool = True) -> None:
    """Give every parameter its optimizer state (Adam: moments and ``step``; SGD: momentum) so a new
    optimizer can be filled.

    A freshly built torch optimizer creates its state lazily at the first step; the switch writes the
    moved state into it before that, so it must exist (and have the right shapes) first.
    ``zero=False`` leaves it uninitialised (``torch.empty_like``: no page is touched): for a switch,
    whose plan writes every element of it.
    """
    new = torch.zeros_like if zero else torch.empty_like
    for inner in _inner_optimizers(optimizer):
        sgd = isinstance(inner, torch.optim.SGD)
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                if sgd:
                    if state.get("momentum_buffer") is None:
                        state["momentum_buffer"] = new(p, memory_format=torch.preserve_format)
                    continue
                if "exp_avg" not in state:
                    state["exp_avg"] = new(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = new(p, memory_format=torch.preserve_format)
                state["step"] = torch.tensor(float(step))


def adam_step(optimizer: MegatronOptimizer) -> int | None:
    """Adam's step count (the same for every parameter), or ``None`` before the first step (and
    for SGD, which keeps none)."""
    for inner in _inner_optimizers(optimizer):
        for state in inner.state.values():
            if "step" in state:
                return int(state["step"])
    return None


def set_adam_step(optimizer: MegatronOptimizer, step: int) -> None:
    for inner in _inner_optimizers(optimizer):
        for state in inner.state.values():
            state["step"] = torch.tensor(float(step))


def _local_views(ddp_model: "torch.nn.Module | Sequence[torch.nn.Module]", optimizer: MegatronOptimizer,
                 spec: ModelSpec, layout: ParallelConfig, rank: int):
    """The local tensors of ``rank`` at ``layout`` (the store's keys), and for those megatron has a
    parameter of: ``key -> (the parameter's state view, state kind)``."""
    views = optimizer_state_views(ddp_model, optimizer)
    precision = precision_of(chunk_list(ddp_model)[0].module, optimizer)
    wanted = set(RegionIndex(rank_regions(spec, layout, rank, precision)).local_tensors())
    found = {}
    for name, local in local_parameters(spec, layout, rank).items():
        for kind in StateKind:
            key = (local.tensor, kind, local.stack)
            if key in wanted:
                found[key] = (views[name], kind)
    return wanted, found


def megatron_store(
    ddp_model: "torch.nn.Module | Sequence[torch.nn.Module]",
    optimizer: MegatronOptimizer,
    spec: ModelSpec,
    layout: ParallelConfig,
    rank: int,
) -> dict[StoreKey, torch.Tensor]:
    """Every local tensor of this rank's training state, keyed as the engine keys it (live views).
    ``ddp_model``: megatron's DDP, or one per model chunk (``MegatronState.chunks``).

    Raises:
        KeyError: the model does not have the parameters the VPS says ``rank`` holds at ``layout``
            (a model built for another layout or shape).
    """
    return _store(*_local_views(ddp_model, optimizer, spec, layout, rank), layout, rank)


def _store(wanted: set[StoreKey], found: dict, layout: ParallelConfig, rank: int) -> dict[StoreKey, torch.Tensor]:
    store: dict[StoreKey, torch.Tensor] = {}
    for key, (view, kind) in found.items():
        tensor = _tensor_of(view, kind)
        if tensor is None:
            raise KeyError(f"{view.name}: no {kind.value} on rank {rank}; call materialize_optimizer_state first")
        store[key] = tensor.detach()
    missing = wanted - set(store)
    if missing:
        raise KeyError(f"rank {rank}: the model lacks {len(missing)} local tensors of layout {layout}, "
                       f"e.g. {sorted(missing, key=str)[:3]}")
    return store


def _tensor_of(view, kind: StateKind) -> torch.Tensor | None:
    if kind is StateKind.PARAM:
        return view.param.data
    if kind is StateKind.MAIN_PARAM:
        return view.main_param
    return view.state.get(kind.value) if view.state is not None else None


def param_store(model: torch.nn.Module, spec: ModelSpec, layout: ParallelConfig,
                rank: int) -> dict[StoreKey, torch.Tensor]:
    """This rank's parameters alone, keyed as the engine keys them (live ``.data`` views): for a
    model without megatron DDP or an optimizer (a checkpoint's parameters are loaded before they
    are built, and for ``validate``, which builds neither).

    Raises:
        KeyError: the model lacks a parameter the VPS says ``rank`` holds at ``layout``.
    """
    params = dict(model.named_parameters())
    store: dict[StoreKey, torch.Tensor] = {}
    for name, local in local_parameters(spec, layout, rank).items():
        if name not in params:
            raise KeyError(f"rank {rank}: the model has no parameter {name!r} of layout {layout}")
        store[(local.tensor, StateKind.PARAM, local.stack)] = params[name].data
    return store


class MegatronTarget:
    """A megatron model and optimizer built for a switch (without init), as the memory policy's
    ``Destination``: its local tensors, and which of them can be pointed at another tensor.

    A parameter, or an fp32 main param, takes another tensor as its ``.data`` when it owns its
    storage (zero0: megatron maps params into DDP's flat buffer only under the distributed
    optimizer, and a view into that buffer cannot be rebound); an Adam moment is replaced in the
    optimizer's state dict. Anything else declines (``can_rebind``) and the engine writes into it.
    The model's tensors are matched to the engine's keys once, here.
    """

    def __init__(self, state: MegatronState, spec: ModelSpec, rank: int) -> None:
        wanted, found = _local_views(state.chunks, state.optimizer, spec, state.layout, rank)
        self.store = _store(wanted, found, state.layout, rank)
        self._targets = found
        self._rebindable: dict[StoreKey, bool] = {}  # decided on the model as built, before any rebinding

    def tensor(self, key: StoreKey) -> torch.Tensor | None:
        return self.store.get(key)

    def can_rebind(self, key: StoreKey) -> bool:
        found = self._rebindable.get(key)
        if found is None:
            view, kind = self._targets[key]
            if _tensor_of(view, kind) is None:
                found = False
            elif kind.is_optimizer_state:
                found = True
            else:  # not a view into megatron's flat buffer (distributed optimizer)
                found = owns_storage((view.param if kind is StateKind.PARAM else view.main_param).data)
            self._rebindable[key] = found
        return found

    def rebind(self, key: StoreKey, tensor: torch.Tensor) -> bool:
        if not self.can_rebind(key):
            return False
        view, kind = self._targets[key]
        current = _tensor_of(view, kind)
        if current.numel() != tensor.numel() or current.dtype != tensor.dtype:
            return False
        if kind.is_optimizer_state:
            view.state[kind.value] = tensor.view(current.shape)
        else:
            owner = view.param if kind is StateKind.PARAM else view.main_param
            owner.data = tensor.view(current.shape)
        self.store[key] = tensor
        return True


__all__ = ["MegatronTarget", "adam_step", "materialize_optimizer_state", "megatron_store", "param_store", "precision_of",
           "set_adam_step"]
