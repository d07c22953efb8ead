"""Tensor-parallel tags on the weights of a model built without initialisation.

Megatron sets ``tensor_model_parallel``, ``partition_dim`` and ``partition_stride`` on a parallel
layer's weight inside its weight initialiser, so ``perform_initialization=False`` (a model a switch
fills) leaves them unset, and then ``clip_grad_norm`` counts the TP-split weights of tp ranks > 0 as
duplicates and leaves them out of the gradient norm (a silently different clipping factor). This
tags them as the initialiser would have, by layer class.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def tag_tensor_parallel_weights(model: torch.nn.Module, stride_of: Callable[[str], int] = lambda name: 1) -> None:
    """Tag every untagged parallel weight of ``model``: a ``ColumnParallelLinear``'s on dim 0 with
    ``stride_of(module name)`` (2 for a gated ``linear_fc1``: megatron's mlp.py), a
    ``RowParallelLinear``'s on dim 1, a ``VocabParallelEmbedding``'s on dim 0."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or hasattr(weight, "tensor_model_parallel"):
            continue
        if isinstance(module, ColumnParallelLinear):
            set_tensor_model_parallel_attributes(weight, True, 0, stride_of(name))
        elif isinstance(module, RowParallelLinear):
            set_tensor_model_parallel_attributes(weight, True, 1, 1)
        elif isinstance(module, VocabParallelEmbedding):
            set_tensor_model_parallel_attributes(weight, True, 0, 1)


__all__ = ["tag_tensor_parallel_weights"]
