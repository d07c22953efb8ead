"""Megatron DDP + optimizer for one layout, and views of the optimizer state.

``build_ddp_and_optimizer`` wraps a ``GPTModel`` the way Megatron-LM trains it: contiguous
param-and-grad buffers (``DistributedDataParallel``), ``get_megatron_optimizer`` with Adam, and
megatron's distributed optimizer (ZeRO-1: optimizer state sharded over the data-parallel group) when
the layout says ``zero1``. ``optimizer_state_views`` exposes, per parameter, the tensors that hold its
state on this rank and where they sit in megatron's flat buffer: what the switch engine reads and
writes (a step through megatron's pipeline schedules: ``megatron.train_step``).

Example (2 ranks, ``dp2-tp1-pp1-zero1``)::

    pgs = initialize_for_layout(layout, seed=0)
    model = build_gpt_model(shape, layout, seed=0)
    ddp, opt = build_ddp_and_optimizer(model, layout, lr=1e-3, weight_decay=0.1)
    loss = run_train_step(ddp, opt, {"tokens": x, "labels": y}, layout, num_microbatches=2)  # train_step.py
    views = optimizer_state_views(ddp, opt)   # views["output_layer.weight"].shard_range == (0, 2048)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import (
    ChainedOptimizer,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    MegatronOptimizer,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from torch.overrides import TorchFunctionMode

from lightning_dynatrain.compat.megatron_internals import shard_range
from lightning_dynatrain.compat.megatron_versions import ddp_layout_kwargs
from lightning_dynatrain.devices import device_kind
from lightning_dynatrain.megatron.model_chunks import chunk_list
from lightning_dynatrain.megatron.parallel_state_adapter import current_process_groups
from lightning_dynatrain.vps.layout import ParallelConfig


def build_ddp_and_optimizer(
    model: torch.nn.Module,
    layout: ParallelConfig,
    *,
    config: OptimizerConfig | None = None,
    lr: float | None = None,
    weight_decay: float = 0.0,
    adam_beta1: float = 0.9,
    adam_beta2: float = 0.999,
    adam_eps: float = 1e-8,
    clip_grad: float = 0.0,
    pg_collection: ProcessGroupCollection | None = None,
    torch_function_mode: TorchFunctionMode | None = None,
) -> tuple[DistributedDataParallel, MegatronOptimizer]:
    """Wrap ``model`` in megatron DDP and build its optimizer for ``layout``.

    ``config``: megatron's ``OptimizerConfig`` (any of its Adam or SGD fields); without it, an Adam
    config from ``lr``, ``weight_decay``, ``adam_*`` and ``clip_grad``. The layout and the model
    decide the rest (``optimizer_config_at``): the distributed optimizer under ``zero1``, bf16 with
    fp32 main params when the model's params are bf16, no loss scaling. DDP: grads reduced in fp32,
    no overlap (one bucket per buffer, except megatron's own split of a shared embedding). Weight
    decay skips biases and 1-D params (megatron's default overrides); Adam is megatron's ``adam``
    (decoupled weight decay, i.e. ``torch.optim.AdamW`` without Apex/TE).
    ``torch_function_mode``: a mode both are built under (``hot_switch`` passes ``CarveBuffers``);
    it runs inside the megatron context of the model's device kind (``megatron_context(inner=...)``:
    on CPU, inside the adapter's mode).

    Returns:
        ``(ddp_model, optimizer)``; the optimizer is megatron's ``ChainedOptimizer`` (one for the
        dense params, one more for expert params when expert params are not all-reduced, ep > 1).

    Raises:
        TypeError: ``model`` is model chunks (virtual pipeline stages): use ``build_ddp_chunks_and_optimizer``.
    """
    if config is None:
        if lr is None:
            raise ValueError("build_ddp_and_optimizer needs an OptimizerConfig or lr=")
        config = adam_config(lr=lr, weight_decay=weight_decay, adam_beta1=adam_beta1, adam_beta2=adam_beta2,
                             adam_eps=adam_eps, clip_grad=clip_grad)
    if len(chunk_list(model)) != 1:
        raise TypeError("build_ddp_and_optimizer wraps one module; model chunks (virtual pipeline stages) "
                        "are wrapped by build_ddp_chunks_and_optimizer")
    (ddp_model,), optimizer = build_ddp_chunks_and_optimizer(model, layout, config=config,
                                                             pg_collection=pg_collection,
                                                             torch_function_mode=torch_function_mode)
    return ddp_model, optimizer


def build_ddp_chunks_and_optimizer(
    model: torch.nn.Module,
    layout: ParallelConfig,
    *,
    config: OptimizerConfig,
    pg_collection: ProcessGroupCollection | None = None,
    torch_function_mode: TorchFunctionMode | None = None,
) -> tuple[tuple[DistributedDataParallel, ...], MegatronOptimizer]:
    """``build_ddp_and_optimizer`` of a rank's model chunks (``model_chunks``): one DDP per chunk (its
    own buffers, as Megatron-LM wraps chunks), one optimizer over all of them. A model of one
    module gives one DDP."""
    pgs = pg_collection if pg_collection is not None else current_process_groups()
    chunks = chunk_list(model)
    opt_config = optimizer_config_at(config, layout, chunks[0].config.params_dtype)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        use_distributed_optimizer=opt_config.use_distributed_optimizer,
        bucket_size=None,
    )
    with device_kind(next(model.parameters()).device).megatron_context(inner=torch_function_mode):
        ddp_chunks = tuple(DistributedDataParallel(config=chunk.config, ddp_config=ddp_config, module=chunk,
                                                   pg_collection=pgs, **ddp_layout_kwargs(chunk, ddp_config, pgs))
                           for chunk in chunks)
        optimizer = get_megatron_optimizer(
            opt_config, list(ddp_chunks), use_gloo_process_groups=False, pg_collection=pgs
        )
    return ddp_chunks, optimizer


def adam_config(*, lr: float, weight_decay: float = 0.0, adam_beta1: float = 0.9, adam_beta2: float = 0.999,
                adam_eps: float = 1e-8, clip_grad: float = 0.0) -> OptimizerConfig:
    """Megatron's Adam ``OptimizerConfig`` from ``build_ddp_and_optimizer``'s keyword arguments
    (their defaults: no weight decay, no clipping)."""
    return OptimizerConfig(optimizer="adam", lr=lr, min_lr=lr, weight_decay=weight_decay, adam_beta1=adam_beta1,
                           adam_beta2=adam_beta2, adam_eps=adam_eps, clip_grad=clip_grad)


#: the optimizers a switch moves the state of (megatron's ``OptimizerConfig.optimizer``)
SUPPORTED_OPTIMIZERS = ("adam", "sgd")


def optimizer_config_at(config: OptimizerConfig, layout: ParallelConfig, params_dtype: torch.dtype) -> OptimizerConfig:
    """``config`` as megatron builds it at ``layout`` for params of ``params_dtype``: the distributed
    optimizer under ``zero1``, megatron's bf16 (fp32 main params) or fp32, no loss scaling.

    Raises:
        ValueError: an optimizer or precision a switch cannot carry, saying what to use.
    """
    if config.optimizer not in SUPPORTED_OPTIMIZERS:
        raise ValueError(f"OptimizerConfig(optimizer={config.optimizer!r}) is not supported. HINT: use "
                         f"{' or '.join(repr(o) for o in SUPPORTED_OPTIMIZERS)}")
    if params_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(
            f"params_dtype {params_dtype} is not supported. HINT: build the model with "
            "params_dtype=torch.float32 (or torch.bfloat16: fp32 main params, no loss scaling)"
        )
    if config.fp16:
        raise ValueError("OptimizerConfig(fp16=True): fp16 with loss scaling is not supported. HINT: train in bf16 "
                         "(Trainer(precision='bf16-mixed')), which the strategy sets in the config itself")
    if config.lr is None:
        raise ValueError("OptimizerConfig(lr=None). HINT: give the (peak) learning rate; a scheduler scales it")
    distributed = layout.zero == 1
    return dataclasses.replace(config, params_dtype=params_dtype, fp16=False, bf16=params_dtype == torch.bfloat16,
                               loss_scale=None, use_distributed_optimizer=distributed)


#: what tells megatron's param groups apart (``_get_param_groups``): the same in every layout, but
#: ``is_expert_parallel``, which is set only where experts are sharded (ep > 1)
_GROUP_KEY = ("wd_mult", "lr_mult", "is_decoupled_lr")
#: what a training loop sets on each group between steps (megatron's ``OptimizerParamScheduler``,
#: ``runtime.steps.set_lr_and_wd``); a freshly built optimizer has the config's values
_GROUP_SETTINGS = ("lr", "weight_decay")


def copy_group_settings(source: MegatronOptimizer, target: MegatronOptimizer) -> None:
    """Give ``target``'s param groups the learning rate and weight decay ``source``'s groups of the
    same kind have now (same multipliers), as after a switch: megatron builds a new optimizer with
    the config's LR and weight decay in every group, where the old one had the scheduled LR and no
    weight decay on biases and norms.

    Raises:
        ValueError: a group of ``target`` has no counterpart in ``source`` (not the same model).
    """
    settings = {tuple(g.get(k) for k in _GROUP_KEY): {k: g[k] for k in _GROUP_SETTINGS} for g in source.param_groups}
    for group in target.param_groups:
        found = settings.get(tuple(group.get(k) for k in _GROUP_KEY))
        if found is None:
            raise ValueError(f"no param group like {({k: group.get(k) for k in _GROUP_KEY})} in the old optimizer; "
                             "HINT: switch between optimizers built for the same model and optimizer settings")
        group.update(found)


def group_settings(optimizer: MegatronOptimizer) -> list[dict]:
    """The learning rate and weight decay of each kind of param group (``_GROUP_KEY``), as plain
    dicts: layout-free (every layout's optimizer has the same kinds), for a checkpoint."""
    out: dict[tuple, dict] = {}
    for group in optimizer.param_groups:
        kind = tuple(group.get(k) for k in _GROUP_KEY)
        out.setdefault(kind, {**dict(zip(_GROUP_KEY, kind)), **{k: group[k] for k in _GROUP_SETTINGS}})
    return list(out.values())


def set_group_settings(optimizer: MegatronOptimizer, settings: list[dict]) -> None:
    """Give each param group of ``optimizer`` the settings ``group_settings`` gave its kind.

    Raises:
        ValueError: a group of ``optimizer`` has a kind ``settings`` lacks (not the same model).
    """
    by_kind = {tuple(s.get(k) for k in _GROUP_KEY): s for s in settings}
    for group in optimizer.param_groups:
        found = by_kind.get(tuple(group.get(k) for k in _GROUP_KEY))
        if found is None:
            raise ValueError(f"no settings for a param group like {({k: group.get(k) for k in _GROUP_KEY})}; "
                             "HINT: load optimizer settings saved for the same model and optimizer")
        group.update({k: found[k] for k in _GROUP_SETTINGS})


# ------------------------------------------------------------------------------------ state views
@dataclass(frozen=True, slots=True)
class BufferInfo:
    """One megatron param-and-grad buffer (``ddp.buffers[i]`` or ``ddp.expert_parallel_buffers[i]``).

    Attributes:
        kind: ``"dense"`` (sharded over dp x cp) or ``"expert"`` (sharded over expert-dp).
        index: position in ``ddp.buffers`` / ``ddp.expert_parallel_buffers``.
        numel: padded size of the flat buffer.
        numel_unpadded: elements that belong to params.
        buckets: ``(start, end)`` of each bucket in the buffer, padded.
        shard_group_size: ranks the distributed optimizer shards each bucket over (1 under zero0).
        shard_rank: this rank's index in that group.
    """

    kind: str
    index: int
    numel: int
    numel_unpadded: int
    buckets: tuple[tuple[int, int], ...]
    shard_group_size: int
    shard_rank: int


@dataclass(frozen=True, slots=True, eq=False)
class ParamStateView:
    """Where one parameter's training state lives on this rank. Tensors are live views.

    Attributes:
        name: name in the unwrapped ``GPTModel.named_parameters()`` (stage-local layer index,
            rank-local expert index).
        param: the model parameter (this rank's TP/EP shard, full local shape).
        main_param: the fp32 master copy when separate from ``param`` (bf16/fp16 training), flat
            over ``shard_range`` under the distributed optimizer; ``None`` for fp32 params, where the
            optimizer updates ``param`` (or its flat shard) directly.
        exp_avg, exp_avg_sq: Adam moments; shape of ``param`` under zero0, flat of length
            ``shard_range[1] - shard_range[0]`` under zero1; ``None`` before the first step, or when
            this rank's shard holds no element of the param.
        step: Adam's step count for this param (``None`` before the first step).
        state: the torch optimizer's state dict for it (where ``exp_avg`` / ``exp_avg_sq`` live), or
            ``None`` before the optimizer has state for it (or when this rank's optimizer does not
            update it).
        shard_range: ``(start, end)`` into ``param.view(-1)`` that this rank's optimizer owns under
            zero1 (``None`` when it owns none of it); ``(0, numel)`` under zero0.
        buffer_range: ``(start, end, bucket_id)`` of the param in the grad buffer
            (megatron's ``param_index_map``).
        buffer: the buffer it lives in.
    """

    name: str
    param: torch.Tensor
    main_param: torch.Tensor | None
    exp_avg: torch.Tensor | None
    exp_avg_sq: torch.Tensor | None
    step: float | None
    state: dict | None
    shard_range: tuple[int, int] | None
    buffer_range: tuple[int, int, int]
    buffer: BufferInfo


def _buffers(ddp_model: DistributedDataParallel) -> dict[torch.nn.Parameter, tuple[BufferInfo, tuple]]:
    where: dict[torch.nn.Parameter, tuple[BufferInfo, tuple]] = {}
    for kind, buffers in (("dense", ddp_model.buffers), ("expert", ddp_model.expert_parallel_buffers)):
        for index, buf in enumerate(buffers):
            distributed = buf.ddp_config.use_distributed_optimizer
            info = BufferInfo(
                kind=kind,
                index=index,
                numel=buf.numel,
                numel_unpadded=buf.numel_unpadded,
                buckets=tuple((b.offset, b.offset + b.grad_data.numel()) for b in buf.buckets),
                shard_group_size=buf.data_parallel_group.size() if distributed else 1,
                shard_rank=buf.data_parallel_group.rank() if distributed else 0,
            )
            for param, rng in buf.param_index_map.items():
                where[param] = (info, tuple(int(x) for x in rng))
    return where


def _model_to_optimizer_param(optimizer: MegatronOptimizer) -> dict:
    """model param -> (inner torch optimizer, the tensor it updates, main param or None, shard range)."""
    out: dict = {}
    subs = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    for sub in subs:
        if isinstance(sub, DistributedOptimizer):
            if sub.is_stub_optimizer:
                continue
            for model_groups, shard_groups, separate in (
                (sub.model_fp32_groups, sub.shard_fp32_groups, False),  # updates a view of the param
                (sub.model_float16_groups, sub.shard_fp32_from_float16_groups, True),  # fp32 main copy
            ):
                for model_group, shard_group in zip(model_groups, shard_groups):
                    for model_param, shard in zip(model_group, shard_group):
                        out[model_param] = (sub.optimizer, shard, shard if separate else None,
                                            shard_range(sub, model_param))
        elif isinstance(sub, Float16OptimizerWithFloat16Params):
            for model_group, main_group in zip(sub.float16_groups, sub.fp32_from_float16_groups):
                for model_param, main in zip(model_group, main_group):
                    out[model_param] = (sub.optimizer, main, main, (0, model_param.numel()))
            for group in sub.fp32_from_fp32_groups:
                for model_param in group:
                    out[model_param] = (sub.optimizer, model_param, None, (0, model_param.numel()))
        elif isinstance(sub, FP32Optimizer):
            if sub.is_stub_optimizer:
                continue
            for group in sub.optimizer.param_groups:
                for model_param in group["params"]:
                    out[model_param] = (sub.optimizer, model_param, None, (0, model_param.numel()))
        else:
            raise TypeError(f"unsupported megatron optimizer {type(sub).__name__}")
    return out


def optimizer_state_views(
    ddp_model: DistributedDataParallel | Sequence[DistributedDataParallel], optimizer: MegatronOptimizer
) -> dict[str, ParamStateView]:
    """Per parameter of the unwrapped model (in ``named_parameters()`` order): its state on this rank.
    Model chunks (a sequence of DDP, virtual pipeline stages) name their parameters as a
    ``ModelChunks`` does: ``"{chunk}.{name}"``; a sequence of one, as its one DDP.

    Under zero1 a parameter whose elements all fall in other ranks' shards has
    ``shard_range=None`` and no moments here. Reads only; touches no process group.
    """
    chunks = chunk_list(ddp_model)
    owned = _model_to_optimizer_param(optimizer)
    views: dict[str, ParamStateView] = {}
    for index, chunk in enumerate(chunks):
        where = _buffers(chunk)
        prefix = f"{index}." if len(chunks) > 1 else ""
        for local_name, param in chunk.module.named_parameters():
            name = prefix + local_name
            buffer, buffer_range = where[param]
            inner, updated, main, shard_range = owned.get(param, (None, None, None, None))
            held = inner.state.get(updated) if inner is not None else None
            state = held if held is not None else {}
            step = state.get("step")
            views[name] = ParamStateView(
                name=name,
                param=param,
                main_param=main,
                exp_avg=state.get("exp_avg"),
                exp_avg_sq=state.get("exp_avg_sq"),
                step=float(step) if step is not None else None,
                state=held,
                shard_range=shard_range,
                buffer_range=buffer_range,
                buffer=buffer,
            )
    return views


__all__ = [
    "BufferInfo",
    "ParamStateView",
    "adam_config",
    "build_ddp_and_optimizer",
    "build_ddp_chunks_and_optimizer",
    "copy_group_settings",
    "group_settings",
    "optimizer_state_views",
    "set_group_settings",
]
