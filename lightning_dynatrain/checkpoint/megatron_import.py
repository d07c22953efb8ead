"""Starting from a checkpoint megatron-core's ``dist_checkpointing`` wrote (the format Megatron-LM and NeMo write).

Such a checkpoint holds the model under megatron's own keys (``decoder.layers.mlp.linear_fc1.weight``
with a global layer axis, ``embedding.word_embeddings.weight``, ...) and, in the distributed
optimizer's ``fully_reshardable`` format, each parameter's fp32 main copy and Adam moments under
``optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>``, with the same global shape and
sharding as the parameter; Adam's step and the param groups are in its common (non-sharded) part.
(The non-distributed optimizers write the main copy as ``optimizer.state.fp32_param.<key>``, and an
fp32 one none: the parameter is its own main copy. Both are read too.)

``load_megatron_checkpoint`` reads it into a model, DDP and optimizer built at the *current*
layout, any layout, zero1 or not:

- the model: megatron's own ``model.sharded_state_dict()`` and ``dist_checkpointing.load``, as a
  plain megatron load does (at virtual pipeline stages, of each model chunk: each describes its
  layers at their global place, so any pipeline split reads any other);
- the optimizer: not through ``DistributedOptimizer.sharded_state_dict``. Megatron 0.16.1 loads
  this format only into a distributed optimizer (into a non-distributed one:
  ``KeyError: 'pre_wd_mult'``), and only after two fixes on a CPU without Apex/Transformer Engine
  (MEGATRON_ON_CPU.md, patch G). Instead each parameter's three fp32 tensors are requested at the
  parameter's own local (TP/PP/EP) shape and offsets, the keys and replica ids built the way
  ``sharded_param_state_fully_reshardable`` builds them, and then cut to what this rank's optimizer
  holds (its zero1 range of the flattened parameter, or all of it). Like megatron's own load of
  this format, every rank holds its TP/PP-local share of the whole optimizer state for a moment.

Example (every rank; ``state`` built at any layout)::

    step = load_megatron_checkpoint("/ckpt/iter_0001000", model=state.model, state=state)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_dynatrain.checkpoint.identity import CheckpointError, CheckpointMismatchError
from lightning_dynatrain.devices import device_kind
from lightning_dynatrain.megatron.model_chunks import chunk_list

if TYPE_CHECKING:
    from lightning_dynatrain.megatron.state import MegatronState

#: How the model's sharded state dict is asked for (it decides the keys of gated MLPs' halves). A
#: fresh copy per call: megatron adds the current data-parallel group to the dict it is given.
_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
_MOMENTS = ("exp_avg", "exp_avg_sq")
_READABLE = ("fully_reshardable", "fully_sharded_model_space", None)


class SavedTensor(NamedTuple):
    """A tensor of the checkpoint, as its metadata states it."""

    global_shape: tuple[int, ...]
    dtype: torch.dtype


def _check_is_megatron(path: str) -> dict[str, SavedTensor]:
    """Each tensor the checkpoint holds, by key, from the metadata of the ``torch_dist`` format megatron
    writes (torch's own reader). Not megatron's ``load_tensors_metadata``: it rebuilds each entry with
    ``torch.empty(**properties)``, which fails where torch's tensor properties hold a field
    ``torch.empty`` does not take (``strides``: megatron-core 0.19.2 with torch 2.15)."""
    if not dist_checkpointing.check_is_distributed_checkpoint(path):
        raise CheckpointError(f"{path} is not a megatron dist_checkpointing checkpoint (no metadata.json)",
                              hint="pass the directory dist_checkpointing.save wrote (one iteration's directory)")
    metadata = FileSystemReader(path).read_metadata()
    return {key: SavedTensor(tuple(meta.size), meta.properties.dtype)
            for key, meta in metadata.state_dict_metadata.items() if isinstance(meta, TensorStorageMetadata)}


def _param_entries(model: torch.nn.Module, sharded: dict) -> dict[str, ShardedTensor | ShardedTensorFactory]:
    """Parameter name -> its entry in ``model.sharded_state_dict()``."""
    names = {id(p): name for name, p in model.named_parameters()}
    out = {}
    for entry in nested_values(sharded):
        if isinstance(entry, (ShardedTensor, ShardedTensorFactory)) and id(entry.data) in names:
            out[names[id(entry.data)]] = entry
    return out


def _check_model(entries: dict, saved: dict, path: str) -> None:
    differ = []
    for entry in entries.values():
        found = saved.get(entry.key)
        if found is None:
            differ.append(f"{entry.key} missing")
        elif isinstance(entry, ShardedTensor) and (tuple(found.global_shape) != tuple(entry.global_shape)
                                                   or found.dtype != entry.dtype):
            differ.append(f"{entry.key}: {tuple(found.global_shape)} {found.dtype} in the checkpoint, "
                          f"{tuple(entry.global_shape)} {entry.dtype} here")
    if differ:
        raise CheckpointMismatchError(
            f"megatron checkpoint {path} does not hold this model: {'; '.join(differ[:3])}"
            + (f" (+{len(differ) - 3} more)" if len(differ) > 3 else ""),
            hint="build the same GPTShape and precision the checkpoint was trained with; megatron pads the "
                 "vocabulary per tp, so start at a tp whose padded vocabulary is the checkpoint's")


def _main_prefix(entries: dict, saved: dict) -> str | None:
    key = next(iter(entries.values())).key
    for prefix in ("param", "fp32_param"):
        if f"optimizer.state.{prefix}.{key}" in saved:
            return prefix
    return None


def _optimizer_common(path: str) -> tuple[float, list[dict]]:
    """Adam's step and the param groups from the checkpoint's common part: the distributed optimizer
    keeps the step in each param group, the others as the state's ``common_step``."""
    groups: list[dict] = []
    sharding: list[Any] = []
    common_steps: list[float] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("param_groups"), list):
                groups.extend(node["param_groups"])
            if isinstance(node.get("state"), dict) and "common_step" in node["state"]:
                common_steps.append(float(node["state"]["common_step"]))
            if "param_state_sharding_type" in node:
                sharding.append(node["param_state_sharding_type"])
            for value in node.values():
                walk(value)

    walk(dist_checkpointing.load_common_state_dict(path).get("optimizer", {}))
    bad = [s for s in sharding if s not in _READABLE]
    if bad:
        raise CheckpointError(f"megatron checkpoint {path} holds its distributed optimizer in the {bad[0]!r} format",
                              hint="save it with metadata={'distrib_optim_sharding_type': 'fully_reshardable'}; "
                                   "that format reshards to any layout")
    steps = ({g.get("step") for g in groups} | set(common_steps)) - {None}
    if len(steps) != 1:
        raise CheckpointError(f"megatron checkpoint {path} has no single Adam step in its param groups ({steps})",
                              hint="load it without the optimizer (a model-only start) or save it with megatron's "
                                   "Adam optimizer")
    settings = [{"wd_mult": g.get("wd_mult", g.get("pre_wd_mult")), "lr_mult": g.get("lr_mult", g.get("pre_lr_mult")),
                 "is_decoupled_lr": g.get("is_decoupled_lr", False), "lr": g["lr"], "weight_decay": g["weight_decay"]}
                for g in groups]
    return float(steps.pop()), settings


def _state_request(entry: ShardedTensor | ShardedTensorFactory, key: str) -> ShardedTensor | ShardedTensorFactory:
    """``entry`` asked for another tensor of the checkpoint (an optimizer state), into fp32 scratch."""
    scratch = torch.empty(entry.data.shape, dtype=torch.float32, device=entry.data.device)
    fields = dict(key=key, data=scratch)
    if isinstance(entry, ShardedTensor):
        fields["dtype"] = torch.float32
    request = dataclasses.replace(entry, **fields)
    if isinstance(request, ShardedTensor):
        request.validate_metadata_integrity()
    return request


def _fill_optimizer(state: "MegatronState", loaded: dict[str, dict[str, torch.Tensor]]) -> None:
    """Copy each parameter's full local tensors into what this rank's optimizer holds of them."""
    from lightning_dynatrain.megatron.optimizer import optimizer_state_views

    for name, view in optimizer_state_views(state.chunks, state.optimizer).items():
        if view.state is None or view.shard_range is None or name not in loaded:
            continue
        start, end = view.shard_range
        full = loaded[name]
        targets = {"exp_avg": view.exp_avg, "exp_avg_sq": view.exp_avg_sq, "main": view.main_param}
        for what, target in targets.items():
            if target is not None and what in full:
                target.copy_(full[what].reshape(-1)[start:end].view(target.shape))


def load_megatron_checkpoint(path: str | Path, *, model: torch.nn.Module, state: "MegatronState | None") -> int | None:
    """Fill ``model`` (and ``state``'s optimizer, when given) from megatron checkpoint ``path``; collective.

    Returns:
        Adam's step the optimizer continues from, or ``None`` when only the model was loaded.

    Raises:
        CheckpointError: ``path`` is no megatron checkpoint, or its optimizer state is in a format
            this reader does not take (``dp_reshardable``), or has no Adam step.
        CheckpointMismatchError: it holds another model (keys, shapes or dtypes differ).
    """
    from lightning_dynatrain.megatron.optimizer import set_group_settings
    from lightning_dynatrain.megatron.state_bridge import materialize_optimizer_state

    path = str(path)
    saved = _check_is_megatron(path)
    kind = device_kind(next(model.parameters()).device)
    with kind.megatron_context():
        sharded = model.sharded_state_dict(metadata=dict(_METADATA))
    entries = _param_entries(model, sharded)
    _check_model(entries, saved, path)
    request: dict[str, Any] = {"model": sharded}
    step = None
    if state is not None:
        step, settings = _optimizer_common(path)
        main = _main_prefix(entries, saved)
        kinds = {"main": main, **{m: m for m in _MOMENTS}} if main else {m: m for m in _MOMENTS}
        request["optimizer"] = {name: {what: _state_request(entry, f"optimizer.state.{prefix}.{entry.key}")
                                       for what, prefix in kinds.items()} for name, entry in entries.items()}
    with kind.megatron_context():
        loaded = dist_checkpointing.load(request, path)
    chunks = chunk_list(model)
    for index, chunk in enumerate(chunks):  # model chunks: each described under its index
        chunk.load_state_dict(loaded["model"][str(index)] if len(chunks) > 1 else loaded["model"])
    if state is not None:
        materialize_optimizer_state(state.optimizer, int(step))
        set_group_settings(state.optimizer, settings)
        _fill_optimizer(state, loaded["optimizer"])
    return None if step is None else int(step)


__all__ = ["load_megatron_checkpoint"]
