"""Read a megatron module's own description of its shards into ``vps.shards`` records.

``module.sharded_state_dict()`` (megatron's distributed-checkpointing contract) returns, per local
tensor, a ``ShardedTensor`` (key, global shape and offset, local shape, stack axes), or a
``ShardedTensorFactory`` whose ``build()`` cuts a parameter into such tensors, each a view of it
(megatron's SwiGLU ``linear_fc1``). Each is matched back to the parameter it describes (by object
identity, through the chain of views for a chunk), with the chunk's element offset in it.

What the description says besides parameters is reported, not dropped: floating tensors that are
not parameters (a persistent buffer such as a router's ``expert_bias``: training state a switch
would have to move), parameters nothing describes, and descriptions this project cannot read
(``flattened_range``).

Works on storage-free (meta) modules as on live ones: offsets come from strides, never from data.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

from lightning_dynatrain.compat.torch_internals import view_base
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.shards import ModuleDescription, ParamRecord, ShardRecord


def _leaves(tree: Any) -> Iterator[Any]:
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _leaves(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _leaves(value)
    else:
        yield tree


def describe_module(module: torch.nn.Module, *, layout: ParallelConfig, rank: int,
                    dp_cp_group: Any) -> ModuleDescription:
    """What ``module`` (this rank's shard at ``layout``) says it holds.

    ``dp_cp_group``: the data-and-context-parallel group megatron's replica ids are computed over
    (the module's own; any group of the right size for a probe).
    """
    params = list(module.named_parameters())
    name_of = {id(p): n for n, p in params}
    by_id = {id(p): p for _, p in params}
    records: list[ShardRecord] = []
    buffers: list[str] = []
    unsupported: list[str] = []
    seen: set[str] = set()
    sharded = module.sharded_state_dict(metadata={"dp_cp_group": dp_cp_group})
    for leaf in _leaves(sharded):
        if isinstance(leaf, ShardedObject) or leaf is None:
            continue
        if isinstance(leaf, ShardedTensorFactory):
            name = name_of.get(id(leaf.data))
            if name is None:
                _other_state(leaf.key, leaf.data, buffers)
                continue
            param = leaf.data
            for chunk in _leaves(leaf.build()):
                if not isinstance(chunk, ShardedTensor):
                    continue
                if not _is_block_of(chunk.data, param):
                    unsupported.append(f"{leaf.key}: a chunk of {name} is not a contiguous block of it")
                    continue
                records.append(_record(chunk, name, chunk.data.storage_offset() - param.storage_offset()))
            seen.add(name)
        elif isinstance(leaf, ShardedTensor):
            if leaf.flattened_range is not None:
                unsupported.append(f"{leaf.key}: a flattened_range description")
                continue
            param = _viewed_param(leaf.data, by_id)
            if param is None or not _is_block_of(leaf.data, param):
                _other_state(leaf.key, leaf.data, buffers)
                continue
            name = name_of[id(param)]
            records.append(_record(leaf, name, leaf.data.storage_offset() - param.storage_offset()))
            seen.add(name)
    return ModuleDescription(
        layout=layout, rank=rank, records=tuple(records),
        params=tuple(ParamRecord(n, tuple(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in params),
        undescribed=tuple(n for n, _ in params if n not in seen), buffers=tuple(buffers),
        unsupported=tuple(unsupported), vocab_params=_vocab_params(module))


def _vocab_params(module: torch.nn.Module) -> tuple[str, ...]:
    """Parameters along a padded vocabulary: every ``VocabParallelEmbedding``'s, and the output layer
    of megatron's language models (``LanguageModule``: GPT, BERT, T5, hybrid models)."""
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    names = []
    for prefix, sub in module.named_modules():
        dot = f"{prefix}." if prefix else ""
        if isinstance(sub, VocabParallelEmbedding):
            names += [dot + n for n, _ in sub.named_parameters()]
        elif isinstance(sub, LanguageModule) and getattr(sub, "output_layer", None) is not None:
            names += [f"{dot}output_layer.{n}" for n, _ in sub.output_layer.named_parameters()]
    return tuple(names)


def _viewed_param(tensor: Any, by_id: dict[int, torch.Tensor]) -> torch.Tensor | None:
    """The parameter ``tensor`` is, or is a view of (through its chain of bases), else ``None``."""
    while isinstance(tensor, torch.Tensor):
        if id(tensor) in by_id:
            return by_id[id(tensor)]
        tensor = view_base(tensor)
    return None


def _record(tensor: ShardedTensor, param: str, start: int) -> ShardRecord:
    return ShardRecord(key=tensor.key, param=param, global_shape=tuple(tensor.global_shape),
                       global_offset=tuple(tensor.global_offset), local_shape=tuple(tensor.local_shape),
                       stack_axes=tensor.prepend_axis_num, start=start)


def _is_block_of(chunk: torch.Tensor, param: torch.Tensor) -> bool:
    """``chunk`` is a contiguous row-major run of ``param``'s elements."""
    start = chunk.storage_offset() - param.storage_offset()
    return chunk.is_contiguous() and param.is_contiguous() and 0 <= start and start + chunk.numel() <= param.numel()


def _other_state(key: str, tensor: Any, found: list[str]) -> None:
    """A described tensor that is no parameter: floating state is reported (``buffers``)."""
    if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
        found.append(key)


__all__ = ["describe_module"]
