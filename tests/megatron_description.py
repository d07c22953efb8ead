"""The full training state read through megatron-core's own description: the oracle of every "bit for bit".

On each rank, megatron describes its shard itself: the model's ``sharded_state_dict()`` and the
optimizer's ``sharded_state_dict`` in megatron's layout-independent ``fully_reshardable`` form (the
distributed optimizer's state gathered into model space), their factories applied
(``apply_factories``). Each ``ShardedTensor`` says its key, the global shape, where its local data
sits in it (``global_offset``, with ``prepend_axis_num`` leading axes of size one, e.g. a layer's),
and whether this rank holds the main replica. ``describe`` (every rank, collective over the
data-parallel groups) returns those pieces as plain data; ``assemble`` (one process) places them into
whole tensors keyed by megatron's keys, requiring every element to be held by a main
replica (a tied weight's second main copy, megatron's output layer on the embedding's stage, must
hold the same bits) and every other replica to hold the same bits. Nothing of lightning-dynatrain's mapping
(specs, boxes, regions, the store of local tensors) is used, so a mistake there cannot hide here:
a state switched wrongly reads differently however the library describes it.

Example (a switch of a user's model)::

    before = assemble(run_distributed(describe_job, 4, ...))     # each rank: describe(strategy.megatron)
    after = assemble(...)
    assert differences(before, after) == []
"""

from __future__ import annotations

import re
from types import MappingProxyType
from typing import Any

import numpy as np

#: how the distributed optimizer describes its state: in model space, whatever the layout (read-only:
#: megatron adds the data-parallel group it reads to the dict it is given, so each call gets a copy)
METADATA = MappingProxyType({"distrib_optim_sharding_type": "fully_reshardable"})
_BITS = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def describe(state: Any) -> dict:
    """This rank's pieces of the whole state, as megatron describes them (see the module docstring).

    ``state``: a ``MegatronState`` (its ``chunks`` and ``optimizer``: with virtual pipeline stages
    each chunk's description, under ``model0``, ``model1``, ... as Megatron-LM saves them).
    Collective: megatron gathers the distributed optimizer's shards over each data-parallel group.
    Returns ``{"pieces": [...], "steps": [...], "groups": [...]}``: each piece ``(key, global_shape,
    global_offset, prepend_axes, main, bits, dtype)`` with the local data's bits (an integer view: bf16
    and NaN compare exactly); the optimizer's step and param groups' settings (``optimizer_settings``).
    """
    from megatron.core.dist_checkpointing.mapping import apply_factories

    from lightning_dynatrain.devices import device_kind

    for sub in getattr(state.optimizer, "chained_optimizers", [state.optimizer]):
        if getattr(sub, "data_parallel_group_gloo", "") is None:  # its gather runs over this group; on CPU
            sub.data_parallel_group_gloo = sub.data_parallel_group  # the DP group is a gloo group already
    chunks = [ddp.module for ddp in state.chunks]
    with device_kind(next(chunks[0].parameters()).device).megatron_context():
        if len(chunks) == 1:
            model = chunks[0].sharded_state_dict(metadata=dict(METADATA))
        else:  # virtual pipeline stages: each chunk describes its own layers, as Megatron-LM saves them
            model = {f"model{i}": chunk.sharded_state_dict(metadata=dict(METADATA)) for i, chunk in enumerate(chunks)}
        optimizer = _optimizer_description(state.optimizer, model)
        described = {"model": model, "optimizer": optimizer}
        apply_factories(described)
    return {"pieces": _pieces(described), **optimizer_settings(dict(_plain_values(optimizer)))}


def describe_model(model: Any) -> dict:
    """``describe`` of a bare model shard (no DDP, no optimizer: a rollout's model): its parameters
    as megatron describes them (``model.sharded_state_dict()``), ``{"pieces": [...]}``. Collective
    only where the model's description is."""
    from megatron.core.dist_checkpointing.mapping import apply_factories

    from lightning_dynatrain.devices import device_kind

    with device_kind(next(model.parameters()).device).megatron_context():
        described = {"model": model.sharded_state_dict(metadata=dict(METADATA))}
        apply_factories(described)
    return {"pieces": _pieces(described)}


def _pieces(described: dict) -> list[tuple]:
    """Every ``ShardedTensor`` with data in ``described``, as plain data (see ``describe``)."""
    import torch
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    pieces = []
    for value in nested_values(described):
        if not isinstance(value, ShardedTensor) or value.data is None:
            continue
        if value.flattened_range is not None:
            raise AssertionError(f"{value.key}: a flattened range; describe reads fully_reshardable states only")
        data = value.data.detach().cpu().clone()  # (a numpy view of a live storage would pin its size)
        bits = data.view(torch.int16 if data.element_size() == 2 else {1: torch.uint8, 4: torch.int32,
                                                                         8: torch.int64}[data.element_size()])
        main = all(r == 0 for r in (value.replica_id if isinstance(value.replica_id, tuple) else (value.replica_id,)))
        pieces.append((value.key, tuple(value.global_shape), tuple(value.global_offset), value.prepend_axis_num,
                       main, bits.numpy().copy(), str(data.dtype)))
    return pieces


def _optimizer_description(optimizer: Any, model: dict) -> dict:
    """megatron's ``optimizer.sharded_state_dict(model)``, but for a 16-bit optimizer whose model
    also holds fp32 parameters (norms a local spec builds as torch modules):
    ``Float16OptimizerWithFloat16Params.sharded_state_dict`` numbers the optimizer's parameters as if
    every one were 16-bit (``chain(float16_groups)``), so the fp32 ones match no model parameter
    (``ValueError: Param id .. does not match any model sharded param``). For that optimizer the same
    description is built with megatron's own pieces, numbered the way torch numbers them (each param
    group's ``params``, a 16-bit parameter's fp32 main copy standing in its place, as megatron's
    ``fp32_from_float16_groups`` pairs them with ``float16_groups``)."""
    from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding

    subs = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    if not any(_holds_fp32_beside_float16(sub) for sub in subs):
        return optimizer.sharded_state_dict(model, is_loading=False, metadata=dict(METADATA))
    described = []
    for i, sub in enumerate(subs):
        one = (_mixed_float16_description(sub, model) if _holds_fp32_beside_float16(sub)
               else sub.sharded_state_dict(model, is_loading=False, metadata=dict(METADATA)))
        if len(subs) > 1:  # as ChainedOptimizer.sharded_state_dict names several optimizers' tensors
            add_prefix_for_sharding(one, f"chained_{i}.")
        described.append(one)
    return described[0] if len(described) == 1 else dict(enumerate(described))


def _holds_fp32_beside_float16(sub: Any) -> bool:
    return hasattr(sub, "float16_groups") and any(getattr(sub, "fp32_from_fp32_groups", ()))


def _mixed_float16_description(sub: Any, model: dict) -> dict:
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        make_sharded_optimizer_tensor,
        optim_state_to_sharding_state,
    )

    model_param_of_main = {id(main): param for params, mains in zip(sub.float16_groups, sub.fp32_from_float16_groups)
                           for param, main in zip(params, mains)}
    optimized = [p for group in sub.optimizer.param_groups for p in group["params"]]
    by_id = get_param_id_to_sharded_param_map(model, [model_param_of_main.get(id(p), p) for p in optimized])
    state = sub.optimizer.state_dict()
    mains = [make_sharded_optimizer_tensor(by_id[i], p, prefix="optimizer.state.fp32_param")
             for i, p in enumerate(optimized) if id(p) in model_param_of_main]
    steps = {float(entry["step"]) for entry in state["state"].values() if "step" in entry}
    assert len(steps) <= 1, f"the parameters' Adam steps differ: {sorted(steps)}"
    optim_state_to_sharding_state(state, by_id, exclude_keys="step")  # drops each parameter's step
    if steps:  # as megatron keeps it: one step for all parameters
        state["state"]["common_step"] = steps.pop()
    return {"optimizer": state, "fp32_from_fp16_params": mains}


def optimizer_settings(values: dict[str, Any]) -> dict:
    """The optimizer description's plain values, the same whatever the layout and optimizer class:
    ``{"steps": [...], "groups": [...]}``: Adam's step (megatron keeps one for all parameters,
    ``common_step``, or in each param group of the distributed optimizer's description; none for
    SGD) and each param group's settings (learning rate, weight decay, ...), sorted."""
    steps, groups = set(), {}
    for path, value in values.items():
        parts = path.split(".")
        if parts[-1] in ("step", "common_step"):
            steps.add(value)
        elif "param_groups" in parts:
            at = parts.index("param_groups")
            groups.setdefault(tuple(parts[:at + 2]), []).append((parts[-1], value))
    return {"steps": sorted(steps), "groups": sorted(tuple(sorted(group)) for group in groups.values())}


def _plain_values(value: Any, path: str = "optimizer") -> list[tuple[str, Any]]:
    """The optimizer description's values that are not tensors, keyed by their path in it."""
    import torch

    if isinstance(value, dict):
        return [pair for key, item in sorted(value.items(), key=lambda kv: str(kv[0]))
                for pair in _plain_values(item, f"{path}.{key}")]
    if isinstance(value, (list, tuple)) and not path.endswith(".params"):
        return [pair for i, item in enumerate(value) for pair in _plain_values(item, f"{path}.{i}")]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return [(path, value.item())]
    if isinstance(value, (int, float, bool, str)):
        return [(path, value)]
    return []


def assemble(per_rank: list[dict]) -> dict[str, np.ndarray]:
    """Whole tensors (their bits) keyed by megatron's keys, from every rank's ``describe``.

    Raises:
        AssertionError: an element held by no main replica, a replica that differs from the main
            one, or a key described with two global shapes or dtypes (each named).
    """
    whole: dict[str, tuple[np.ndarray, np.ndarray, str]] = {}
    others = []
    for rank, described in enumerate(per_rank):
        for key, shape, offset, prepend, main, bits, dtype in described["pieces"]:
            if key not in whole:
                whole[key] = (np.zeros(shape, bits.dtype), np.zeros(shape, np.int8), dtype)
            array, held, known_dtype = whole[key]
            assert array.shape == tuple(shape) and known_dtype == dtype, \
                f"{key}: rank {rank} describes {shape} {dtype}, another rank {array.shape} {known_dtype}"
            where = _window(shape, offset, prepend, bits.shape)
            if main and not held[where].any():
                array[where] = bits.reshape(array[where].shape)
                held[where] = 1
            else:  # another replica, or a second main one of a tied weight (e.g. the output layer's
                others.append((rank, key, where, bits))  # copy of the embedding on one stage): the same bits
    for key, (array, held, _) in whole.items():
        assert held.all(), f"{key}: {int((held == 0).sum())} of {held.size} elements held by no main replica"
    for rank, key, where, bits in others:
        array = whole[key][0]
        assert np.array_equal(array[where], bits.reshape(array[where].shape)), f"{key}: rank {rank}'s replica differs"
    return _main_copies_named_alike({key: (array, dtype) for key, (array, _, dtype) in whole.items()})


#: a main (fp32) copy of a parameter, as each of megatron's optimizers names it
_MAIN_COPY = re.compile(r"((?:chained_\d+\.)?optimizer\.state\.)(?:param|fp32_param)\.(.+)")


def _main_copies_named_alike(whole: dict[str, tuple[np.ndarray, str]]) -> dict[str, np.ndarray]:
    """Whole tensors with each parameter's main copy under one name, whichever optimizer holds it.

    megatron names it per optimizer class: the 16-bit optimizer ``optimizer.state.fp32_param.<key>``
    (a 16-bit parameter's copy; an fp32 parameter is its own), the distributed one
    ``optimizer.state.param.<key>`` (every parameter's, fp32 ones included), the fp32 optimizer
    none. A switch between ZeRO-1 and plain data parallelism changes the class, so the same state
    reads under other names: here a 16-bit parameter's copy is ``fp32_param``, and an fp32
    parameter's copy must hold the parameter's bits and is then dropped.

    Raises:
        AssertionError: an fp32 parameter's main copy differs from it.
    """
    out = {}
    for key, (array, dtype) in whole.items():
        main = _MAIN_COPY.fullmatch(key)
        if main is None:
            out[key] = array
            continue
        prefix, name = main.groups()
        if name in whole and whole[name][1] == dtype:
            assert np.array_equal(array, whole[name][0]), f"{key}: the main copy differs from the fp32 parameter {name}"
        else:
            out[f"{prefix}fp32_param.{name}"] = array
    return out


def _window(shape: tuple, offset: tuple, prepend: int, local: tuple) -> tuple[slice, ...]:
    """The part of the global tensor a piece holds: its ``prepend`` leading axes of size one, the rest
    of its local shape, from ``offset``."""
    sizes = (1,) * prepend + tuple(local)
    assert len(sizes) == len(shape) == len(offset), (shape, offset, prepend, local)
    return tuple(slice(o, o + n) for o, n in zip(offset, sizes))


def differences(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> list[str]:
    """What differs between two assembled states (empty: the same keys, shapes and bits)."""
    out = [f"{key} is described on one side only" for key in sorted(set(a) ^ set(b))]
    for key in sorted(set(a) & set(b)):
        if a[key].shape != b[key].shape:
            out.append(f"{key}: shape {a[key].shape} against {b[key].shape}")
        elif not np.array_equal(a[key], b[key]):
            out.append(f"{key}: {int((a[key] != b[key]).sum())} of {a[key].size} elements differ")
    return out


__all__ = ["METADATA", "assemble", "describe", "describe_model", "differences", "optimizer_settings"]
