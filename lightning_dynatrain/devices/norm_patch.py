"""Patch D: megatron's torch-norm fallback (no Apex, no Transformer Engine) with sequence parallelism.

Not about CUDA: megatron-core 0.16.1 refuses sequence parallelism in this fallback on any device,
so every device kind applies it (``devices``: the host's ``megatron_on_cpu`` and the accelerator's
``megatron_context``). Where Apex is installed megatron never builds this class.
"""

from __future__ import annotations

import torch


def _wrapped_torch_norm_new(
    cls,
    config,
    hidden_size: int,
    eps: float = 1e-5,
    persist_layer_norm: bool = False,
    zero_centered_gamma: bool = False,
    normalization: str = "LayerNorm",
):
    """D: ``megatron/core/transformer/torch_norm.py::WrappedTorchNorm.__new__`` asserts
    ``not config.sequence_parallel``. Allow it, and tag the norm's parameters
    ``sequence_parallel=True`` as Apex's ``FusedLayerNorm`` does, so that
    ``distributed/finalize_model_grads.py::_allreduce_non_tensor_model_parallel_grads`` sums their
    gradients over the TP group (each TP rank saw only its slice of the sequence)."""
    from megatron.core.transformer import torch_norm

    if config.layernorm_zero_centered_gamma or config.persist_layer_norm:
        raise ValueError("zero_centered_gamma / persist_layer_norm need Apex or Transformer Engine")
    if config.memory_efficient_layer_norm:
        raise ValueError("memory_efficient_layer_norm needs Apex or Transformer Engine")
    if config.normalization == "LayerNorm":
        norm = torch.nn.LayerNorm(normalized_shape=hidden_size, eps=eps)
    elif config.normalization == "RMSNorm":
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
    elif config.normalization == "L2Norm":
        norm = torch_norm.L2Norm(hidden_size=hidden_size, eps=eps)
    else:
        raise ValueError(f"unsupported normalization {config.normalization!r}")
    for param in norm.parameters():
        param.sequence_parallel = config.sequence_parallel
    return norm


def patch_torch_norm() -> None:
    """Apply patch D (see ``_wrapped_torch_norm_new``); idempotent: a patched class is left as it is."""
    from megatron.core.transformer import torch_norm

    if torch_norm.WrappedTorchNorm.__new__ is not _wrapped_torch_norm_new:
        torch_norm.WrappedTorchNorm.__new__ = _wrapped_torch_norm_new


__all__ = ["patch_torch_norm"]
