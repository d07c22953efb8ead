"""Running megatron-core 0.16.1 on CPU with gloo: the one adapter for every CUDA assumption.

Megatron-core assumes a CUDA device in a handful of places (scratch buffers, the RNG tracker,
``device="cuda"`` allocations in the schedules, ``torch.cuda.Stream`` in the MoE dispatcher, ...).
On a machine without CUDA this package answers each of them. When CUDA is available only patch D
(below) is applied: on GPUs megatron otherwise runs unpatched. The host's device kind enters it
(``devices.host.HostKind.megatron_context``); an accelerator's kind never imports it.

Two parts, with different lifetimes:

* :func:`apply_cpu_patches` replaces a few megatron functions and classes (patches A, B, D, E, F).
  It is idempotent and process-wide, because the patched objects are megatron internals that only
  megatron calls.
* :func:`megatron_on_cpu` is a context manager that additionally turns "CUDA" into "CPU" for the
  code run inside it (patch C): a ``TorchFunctionMode`` that rewrites CUDA devices to CPU, plus no-op
  ``torch.cuda.Stream/Event/synchronize/current_device/empty_cache``. It is entered only around
  megatron calls (model build, a training step, DDP and optimizer construction, process-group
  set-up), so Lightning and user code keep seeing an honest CPU-only torch. It is re-entrant.

Example::

    with megatron_on_cpu():
        model = GPTModel(...)          # model building calls Tensor.cuda() on the tied embedding

One module per patched subsystem: ``memory_buffer`` (A), ``rng`` (B), ``cuda_mode`` (C), ``moe``
(E, F). Patch D (``devices/norm_patch.py``) is not a CUDA assumption but megatron's Apex-free norm
refusing sequence parallelism: every device kind applies it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

from lightning_dynatrain.devices.host.megatron_patches.cuda_mode import CudaAsCpuMode, swap_cuda_attrs
from lightning_dynatrain.devices.host.megatron_patches.memory_buffer import patch_global_memory_buffer
from lightning_dynatrain.devices.host.megatron_patches.moe import patch_moe, patch_uneven_all_gather
from lightning_dynatrain.devices.host.megatron_patches.rng import patch_rng_tracker
from lightning_dynatrain.devices.norm_patch import patch_torch_norm

_PATCH_LOCK = threading.Lock()
_PATCHED = False
_local = threading.local()


def cuda_is_used() -> bool:
    """True when megatron should run on CUDA, i.e. unpatched. Decided by the CUDA runtime alone."""
    return torch.cuda.is_available()


def apply_cpu_patches() -> bool:
    """Patch megatron-core for CPU (A, B, D, E, F; D on every device); idempotent, thread-safe.

    Returns:
        True when the CPU patches are in place; False when CUDA is used (only D is applied).
    """
    global _PATCHED
    if not _PATCHED:
        with _PATCH_LOCK:
            if not _PATCHED:
                patch_torch_norm()
                if not cuda_is_used():
                    patch_global_memory_buffer()
                    patch_rng_tracker()
                    patch_uneven_all_gather()
                    patch_moe()
                _PATCHED = True
    return not cuda_is_used()


@contextlib.contextmanager
def megatron_on_cpu(inner: TorchFunctionMode | None = None) -> Iterator[None]:
    """Run the enclosed megatron calls on CPU (patches A-F); a no-op when CUDA is used.

    Re-entrant: nested entries cost one counter increment. The ``TorchFunctionMode`` is per thread;
    the ``torch.cuda`` stand-ins are process-wide while any thread is inside.

    ``inner``: a ``TorchFunctionMode`` the enclosed calls should also run under, seeing CPU devices
    (``hot_switch`` builds DDP's buffers under ``devices.host.carve_buffers.CarveBuffers``). On CPU, at the
    outermost entry, the adapter's mode calls its handler directly after the rewrite: every torch
    call, a tensor's attribute reads included, then pays one mode's dispatch instead of two (megatron's
    DDP and optimizer construction makes thousands). Nested, it runs inside an adapter mode of its
    own; with CUDA, it is entered as it is.
    """
    if not apply_cpu_patches():
        with inner if inner is not None else contextlib.nullcontext():
            yield
        return
    depth = getattr(_local, "depth", 0)
    if depth:
        _local.depth = depth + 1
        try:
            with CudaAsCpuMode(inner) if inner is not None else contextlib.nullcontext():
                yield
        finally:
            _local.depth = depth
        return
    swap_cuda_attrs(True)
    _local.depth = 1
    try:
        with CudaAsCpuMode(inner):
            yield
    finally:
        _local.depth = 0
        swap_cuda_attrs(False)


__all__ = ["apply_cpu_patches", "cuda_is_used", "megatron_on_cpu"]
