"""Patch C: CUDA turned into CPU for the megatron calls run inside ``megatron_on_cpu``."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")


def _as_cpu(device: Any) -> Any:
    """Map a CUDA device spec (``"cuda"``, ``"cuda:1"``, ``torch.device("cuda")``, an index) to CPU."""
    if isinstance(device, torch.device):
        return _CPU if device.type == "cuda" else device
    if isinstance(device, str):
        return _CPU if device.startswith("cuda") else device
    if isinstance(device, int) and not isinstance(device, bool):
        return _CPU
    return device


class CudaAsCpuMode(TorchFunctionMode):
    """C: answers megatron's CUDA-only calls on CPU tensors.

    - factory calls with ``device="cuda"``, ``device=torch.cuda.current_device()`` (an int) ->
      CPU (``pipeline_parallel/schedules.py`` ``torch.zeros(..., device="cuda")``,
      ``p2p_communication.py``, ``distributed/param_and_grad_buffer.py`` buffers,
      ``tensor_parallel/mappings.py`` gathers);
    - ``Tensor.cuda()`` -> the tensor (``language_module.py::setup_embeddings_and_output_layer``),
      ``Tensor.to("cuda")`` -> CPU, ``pin_memory()`` -> the tensor, ``record_stream`` -> no-op;
    - ``Tensor.type()`` -> ``"torch.cuda.FloatTensor"`` etc., because
      ``optimizer/optimizer.py`` and ``optimizer/distrib_optimizer.py`` accept only those names;
    - ``torch.autograd.backward`` / ``Tensor.backward`` keep the mode active in the backward pass
      (see ``_backward``).

    ``inner``: another mode's handler, run on each call after the rewrite instead of a second
    dispatch through the mode stack (``megatron_on_cpu(inner=...)``).
    """

    def __init__(self, inner: TorchFunctionMode | None = None) -> None:
        super().__init__()
        self._inner = inner

    def _call(self, func, types, args, kwargs):
        if self._inner is not None:
            return self._inner.__torch_function__(func, types, args, kwargs)
        return func(*args, **kwargs)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.autograd.backward:
            return self._backward(*args, **kwargs)
        if func is torch.Tensor.backward:
            return self._backward(*_tensor_backward_args(*args, **kwargs))
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.record_stream:
            return None
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if "device" in kwargs:
            kwargs["device"] = _as_cpu(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1 and isinstance(args[1], (str, torch.device, int)):
            args = (args[0], _as_cpu(args[1]), *args[2:])
        return self._call(func, types, args, kwargs)

    def _backward(self, tensors, grad_tensors=None, retain_graph=None, create_graph=False,
                  grad_variables=None, inputs=None) -> None:
        """``torch.autograd.backward`` with this mode active inside the autograd engine.

        A mode is popped while its handler runs, so forwarding ``backward`` as-is would run every
        backward function without the mode, and megatron's backward passes allocate on
        ``torch.cuda.current_device()`` (``tensor_parallel/mappings.py`` ``_AllToAll``,
        ``_gather_along_first_dim``, ...). So the body of ``torch.autograd.backward`` (torch 2.13)
        runs here with the mode pushed again, calling the engine directly as megatron's own
        ``pipeline_parallel/schedules.py::custom_backward`` does.
        """
        from lightning_dynatrain.compat.torch_internals import run_backward

        if grad_variables is not None:
            grad_tensors = grad_variables
        tensors = (tensors,) if torch.is_tensor(tensors) else tuple(tensors)
        inputs = () if inputs is None else ((inputs,) if torch.is_tensor(inputs) else tuple(inputs))
        with self:
            run_backward(tensors, grad_tensors, retain_graph=retain_graph, create_graph=create_graph, inputs=inputs)


def _tensor_backward_args(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):
    """``Tensor.backward``'s arguments as ``torch.autograd.backward``'s."""
    return self, gradient, retain_graph, create_graph, None, inputs


class _NoopEvent:
    """Stands in for ``torch.cuda.Event`` (work on CPU is synchronous)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: Any) -> float:
        return 0.0


class _NoopStream:
    """Stands in for ``torch.cuda.Stream`` (``moe/token_dispatcher.py`` D2H stream, DDP streams)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _NoopEvent:
        return event if event is not None else _NoopEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_DEFAULT_STREAM = _NoopStream()
_CUDA_STANDINS: dict[str, Any] = {
    "Stream": _NoopStream,
    "Event": _NoopEvent,
    "synchronize": lambda device=None: None,
    "current_device": lambda: 0,
    "empty_cache": lambda: None,
    "current_stream": lambda device=None: _DEFAULT_STREAM,
    "default_stream": lambda device=None: _DEFAULT_STREAM,
    "stream": lambda stream=None: contextlib.nullcontext(),
}

_local = threading.local()
_swap_lock = threading.Lock()
_swap_depth = 0
_saved_cuda_attrs: dict[str, Any] = {}


def swap_cuda_attrs(enter: bool) -> None:
    """Install (first entry, any thread) or restore (last exit) the ``torch.cuda`` stand-ins."""
    global _swap_depth
    with _swap_lock:
        if enter:
            if _swap_depth == 0:
                for name, standin in _CUDA_STANDINS.items():
                    _saved_cuda_attrs[name] = getattr(torch.cuda, name)
                    setattr(torch.cuda, name, standin)
            _swap_depth += 1
        else:
            _swap_depth -= 1
            if _swap_depth == 0:
                for name, original in _saved_cuda_attrs.items():
                    setattr(torch.cuda, name, original)
                _saved_cuda_attrs.clear()


__all__ = ["CudaAsCpuMode", "swap_cuda_attrs"]
