"""Layout-independent weight initialisation for a megatron ``GPTModel``.

Megatron's CPU initialisation draws each full ("master") weight from the global CPU RNG in
construction order and keeps this rank's shard. The draws therefore depend on the layout: a
pipeline stage > 0 starts its first layer where stage 0 starts its embedding, an EP rank's first
local expert gets the values of expert 0, and a different vocab padding shifts every later draw.
None of that is wrong for training, but then "the same model at two layouts" is not the same
model, and a switch cannot be checked against a static run.

Here every weight of two or more dims is redrawn from a generator seeded by ``(seed, logical
name)``; the logical name uses the global layer index and the global expert index, and the tied
output layer of the last stage uses the embedding's name. The full logical tensor is drawn and
this rank's part is cut from it the way megatron cuts it:

- ``partition_dim`` chunk ``tp_rank`` of ``tp`` (``etp`` and the expert-TP rank for experts),
  honouring ``partition_stride``: a gated ``linear_fc1`` has stride 2, so its local rows are
  ``[gate[r]; up[r]]`` (logically ``[2, ffn, in]`` split on ``ffn``);
- the embedding / output layer has ``vocab_size`` real rows drawn under the tensor's name and the
  padding rows drawn under ``name#pad``, so the real rows do not depend on the padded size.

One-dimensional parameters (biases, norm weights) keep megatron's constant init (zeros / ones).
The std is megatron's: ``init_method_std``, divided by ``sqrt(2 * layers)`` for the output
projections (``linear_proj``, ``linear_fc2``).
"""

from __future__ import annotations

import hashlib
import math
import re
from typing import TYPE_CHECKING

import torch
from megatron.core.process_groups_config import ProcessGroupCollection

from lightning_dynatrain.vps.layout import ParallelConfig

if TYPE_CHECKING:
    from lightning_dynatrain.megatron.gpt import GPTShape

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
_SCALED = ("linear_proj.weight", "linear_fc2.weight")


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest, "little") >> 1)


def logical_name(model: torch.nn.Module, name: str, *, ep_rank: int, num_local_experts: int,
                 tied_embeddings: bool) -> str:
    """The layout-free name of a local parameter: global layer and expert indices.

    Example: ``decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight`` on pp stage 1 of 2
    (4 layers) and ep rank 1 of 2 (4 experts) is ``decoder.layers.2.mlp.experts.3.linear_fc1.weight``.
    """
    if tied_embeddings and name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    match = _LAYER.match(name)
    if match is None:
        return name
    local = int(match.group(1))
    global_layer = model.decoder.layers[local].layer_number - 1
    name = f"decoder.layers.{global_layer}." + name[match.end():]
    expert = _EXPERT.search(name)
    if expert is not None:
        global_expert = ep_rank * num_local_experts + int(expert.group(1))
        name = name[: expert.start()] + f".mlp.experts.{global_expert}." + name[expert.end():]
    return name


def _draw(shape: tuple[int, ...], std: float, seed: int, name: str) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=_generator(seed, name))


def _master(name: str, full_shape: tuple[int, ...], std: float, seed: int, vocab_size: int) -> torch.Tensor:
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        real = _draw((vocab_size, *full_shape[1:]), std, seed, name)
        pad = _draw((full_shape[0] - vocab_size, *full_shape[1:]), std, seed, name + "#pad")
        return torch.cat([real, pad], dim=0)
    return _draw(full_shape, std, seed, name)


def _shard(master: torch.Tensor, dim: int, rank: int, size: int, stride: int) -> torch.Tensor:
    """This rank's part of ``master``, as ``tensor_parallel.layers._initialize_affine_weight_cpu``
    cuts it: ``stride * size`` equal chunks along ``dim``, rank ``r`` keeps chunks ``r, r + size, ...``
    (stride 2 is a gated ``linear_fc1``: local rows ``[gate_r; up_r]``)."""
    chunks = master.chunk(stride * size, dim=dim)
    return torch.cat(chunks[rank::size], dim=dim)


@torch.no_grad()
def init_layout_independent(
    model: torch.nn.Module,
    shape: "GPTShape",
    layout: ParallelConfig,
    *,
    seed: int,
    pg_collection: ProcessGroupCollection,
) -> None:
    """Redraw every weight (ndim >= 2) of ``model`` from ``(seed, logical name)``; see module doc."""
    ep_rank = pg_collection.ep.rank() if shape.is_moe else 0
    num_local_experts = shape.num_experts // layout.ep if shape.is_moe else 0
    std = shape.init_method_std
    scaled_std = std / math.sqrt(2.0 * shape.layers)
    for local_name, param in model.named_parameters():
        if param.dim() < 2:
            continue
        name = logical_name(model, local_name, ep_rank=ep_rank, num_local_experts=num_local_experts,
                            tied_embeddings=shape.tied_embeddings)
        is_expert = ".mlp.experts." in name
        group = pg_collection.expt_tp if is_expert else pg_collection.tp
        tp_size, tp_rank = (group.size(), group.rank()) if group is not None else (1, 0)
        split = getattr(param, "tensor_model_parallel", False) and tp_size > 1
        dim = getattr(param, "partition_dim", 0) if split else 0
        full = list(param.shape)
        full[dim] *= tp_size if split else 1
        std_here = scaled_std if name.endswith(_SCALED) else std
        master = _master(name, tuple(full), std_here, seed, shape.vocab_size)
        local = _shard(master, dim, tp_rank, tp_size, getattr(param, "partition_stride", 1)) if split else master
        param.copy_(local.to(param.dtype))


__all__ = ["init_layout_independent", "logical_name"]
