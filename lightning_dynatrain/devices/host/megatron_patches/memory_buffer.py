"""Patch A: megatron's scratch buffer, on CPU."""

from __future__ import annotations

import torch


def patch_global_memory_buffer() -> None:
    """A: ``megatron/core/utils.py::GlobalMemoryBuffer.get_tensor`` allocates its scratch buffer on
    ``torch.cuda.current_device()``; allocate it on CPU instead (needed even outside the mode, e.g.
    by ``dot_product_attention`` and the sequence-parallel gathers)."""
    import megatron.core.utils as mutils

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        required_len = 1
        for size in tensor_shape:
            required_len *= size
        buffer = self.buffer.get((name, dtype))
        if buffer is None or buffer.numel() < required_len:
            buffer = torch.empty(required_len, dtype=dtype, device="cpu", requires_grad=False)
            self.buffer[(name, dtype)] = buffer
        return buffer[0:required_len].view(*tensor_shape)

    mutils.GlobalMemoryBuffer.get_tensor = get_tensor


__all__ = ["patch_global_memory_buffer"]
