"""Running megatron-core 0.16.1 on CPU with gloo: the one adapter for every CUDA assumption.

Megatron-core assumes a CUDA device in a handful of places (scratch buffers, the RNG tracker,
``device="cuda"`` allocations in the schedules, ``torch.cuda.Stream`` in the MoE dispatcher, ...).
On a machine without CUDA this module answers each of them. Nothing here is applied when CUDA is
available: on GPUs megatron runs unpatched.

Two parts, with different lifetimes:

* :func:`apply_cpu_patches` replaces a few megatron functions and classes (patches A, B, D, E, F
  below). It is idempotent and process-wide, because the patched objects are megatron internals that
  only megatron calls.
* :func:`megatron_on_cpu` is a context manager that additionally turns "CUDA" into "CPU" for the
  code run inside it (patch C): a ``TorchFunctionMode`` that rewrites CUDA devices to CPU, plus no-op
  ``torch.cuda.Stream/Event/synchronize/current_device/empty_cache``. It is entered only around
  megatron calls (model build, a training step, DDP and optimizer construction, process-group
  set-up), so Lightning and user code keep seeing an honest CPU-only torch. It is re-entrant.

Example::

    with megatron_on_cpu():
        model = GPTModel(...)          # model building calls Tensor.cuda() on the tied embedding
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_PATCH_LOCK = threading.Lock()
_PATCHED = False


def cuda_is_used() -> bool:
    """True when megatron should run on CUDA, i.e. unpatched. Decided by the CUDA runtime alone."""
    return torch.cuda.is_available()


# ----------------------------------------------------------------------------------------- patch A
def _patch_global_memory_buffer() -> None:
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
            buffer = torch.empty(required_len, dtype=dtype, device=_CPU, requires_grad=False)
            self.buffer[(name, dtype)] = buffer
        return buffer[0:required_len].view(*tensor_shape)

    mutils.GlobalMemoryBuffer.get_tensor = get_tensor


# ----------------------------------------------------------------------------------------- patch B
def _patch_rng_tracker() -> None:
    """B: ``megatron/core/tensor_parallel/random.py``: ``CudaRNGStatesTracker.add`` seeds the CUDA
    generator, ``fork`` swaps CUDA RNG states through ``_get_cuda_rng_state``/``_set_cuda_rng_state``,
    and ``model_parallel_cuda_manual_seed`` builds the tracker through ``initialize_rng_tracker``.

    The CPU tracker keeps CPU generator states; ``fork(name)`` swaps the global CPU RNG state in and
    out, so dropout inside a tensor-parallel region draws from the per-TP-rank stream as on GPU.
    ``add`` seeds a private generator, so it never disturbs the global CPU RNG (which model building
    relies on). ``model_parallel_cuda_manual_seed`` then works unchanged.
    """
    import megatron.core.tensor_parallel.random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """``CudaRNGStatesTracker`` over CPU generator states (see patch B)."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"cpu rng state {name} already exists")
            generator = torch.Generator(device="cpu")
            generator.manual_seed(seed)
            self.states_[name] = generator.get_state()

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"cpu rng state {name} is not added")
            outer_state = torch.get_rng_state()
            outer_name = self._current_state_name
            if outer_name != "default-rng":
                self.states_[outer_name] = outer_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if outer_name != "default-rng":
                    outer_state = self.states_[outer_name]
                torch.set_rng_state(outer_state)
                self._current_state_name = outer_name

    def initialize_rng_tracker(
        use_te_rng_tracker: bool = False,
        inference_rng_tracker: bool = False,
        use_cudagraphable_rng: bool = False,
        force_reset: bool = False,
    ) -> None:
        if use_te_rng_tracker or use_cudagraphable_rng:
            raise RuntimeError(
                "the Transformer Engine / CUDA-graph RNG trackers need CUDA; on CPU only "
                "megatron's default tracker is available"
            )
        if force_reset or not isinstance(mrandom._CUDA_RNG_STATE_TRACKER, CpuRNGStatesTracker):
            mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker(
                is_inference_rng_tracker=inference_rng_tracker
            )
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    def get_cpu_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
        return torch.get_rng_state()

    def set_cpu_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False):
        torch.set_rng_state(new_state)

    mrandom.CpuRNGStatesTracker = CpuRNGStatesTracker
    mrandom.initialize_rng_tracker = initialize_rng_tracker
    # Used by CheckpointFunction (activation recompute) and _get/_set_all_rng_states.
    mrandom._get_cuda_rng_state = get_cpu_rng_state
    mrandom._set_cuda_rng_state = set_cpu_rng_state
    initialize_rng_tracker(force_reset=True)


# ----------------------------------------------------------------------------------------- patch D
def _patch_torch_norm() -> None:
    """D: ``megatron/core/transformer/torch_norm.py::WrappedTorchNorm.__new__`` asserts
    ``not config.sequence_parallel``. Allow it, and tag the norm's parameters
    ``sequence_parallel=True`` as Apex's ``FusedLayerNorm`` does, so that
    ``distributed/finalize_model_grads.py::_allreduce_non_tensor_model_parallel_grads`` sums their
    gradients over the TP group (each TP rank saw only its slice of the sequence)."""
    from megatron.core.transformer import torch_norm

    def __new__(
        cls,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ):
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

    torch_norm.WrappedTorchNorm.__new__ = __new__


# ----------------------------------------------------------------------------------------- patch E
def _patch_uneven_all_gather() -> None:
    """E: ``megatron/core/tensor_parallel/mappings.py::_gather_along_first_dim`` with
    ``output_split_sizes`` (MoE token dispatch with TP>1 / sequence parallel) calls
    ``torch.distributed.all_gather`` with tensors of different first dimensions, which gloo refuses
    ("ProcessGroupGloo::allgather: invalid tensor size"). On gloo, pad every rank's rows to the
    largest split, gather into one tensor, and trim."""
    from megatron.core.tensor_parallel import mappings

    original = mappings._gather_along_first_dim

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1 or dist.get_backend(group) != "gloo":
            return original(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        if len(set(sizes)) == 1:
            return original(input_, group, sizes, use_global_buffer)
        rows = max(sizes)
        padded = input_.new_zeros((rows, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        gathered = input_.new_empty((rows * len(sizes), *input_.shape[1:]))
        dist.all_gather_into_tensor(gathered, padded, group=group)
        return torch.cat([gathered[r * rows : r * rows + n] for r, n in enumerate(sizes)], dim=0)

    mappings._gather_along_first_dim = _gather_along_first_dim


# ----------------------------------------------------------------------------------------- patch F
def _patch_moe() -> None:
    """F: ``megatron/core/transformer/moe/moe_utils.py``: ``te_general_gemm`` is only defined when
    Transformer Engine imports, yet ``RouterGatingLinearFunction`` tests ``te_general_gemm is not
    None`` (NameError without TE): define it as ``None``. ``maybe_move_tensor_to_cpu`` only converts
    CUDA tensors, so on CPU the alltoall dispatcher's split sizes stay tensors where
    ``token_dispatcher.py::_maybe_dtoh_and_synchronize`` expects numpy arrays: convert CPU tensors
    too. ``token_dispatcher`` imported the function by name, so it is replaced there as well."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor):
            tensor = tensor.cpu()
            if as_numpy:
                tensor = tensor.numpy()
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def apply_cpu_patches() -> bool:
    """Patch megatron-core for CPU (A, B, D, E, F); idempotent, thread-safe.

    Returns:
        True when the patches are in place; False when CUDA is used (nothing is patched).
    """
    global _PATCHED
    if cuda_is_used():
        return False
    with _PATCH_LOCK:
        if not _PATCHED:
            _patch_global_memory_buffer()
            _patch_rng_tracker()
            _patch_torch_norm()
            _patch_uneven_all_gather()
            _patch_moe()
            _PATCHED = True
    return True


# ----------------------------------------------------------------------------------------- patch C
def _as_cpu(device: Any) -> Any:
    """Map a CUDA device spec (``"cuda"``, ``"cuda:1"``, ``torch.device("cuda")``, an index) to CPU."""
    if isinstance(device, torch.device):
        return _CPU if device.type == "cuda" else device
    if isinstance(device, str):
        return _CPU if device.startswith("cuda") else device
    if isinstance(device, int) and not isinstance(device, bool):
        return _CPU
    return device


class _CudaAsCpuMode(TorchFunctionMode):
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
        from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
        from torch.autograd.graph import _engine_run_backward

        if grad_variables is not None:
            grad_tensors = grad_variables
        tensors = (tensors,) if torch.is_tensor(tensors) else tuple(tensors)
        inputs = () if inputs is None else ((inputs,) if torch.is_tensor(inputs) else tuple(inputs))
        with self:
            grads = _make_grads(tensors, _tensor_or_tensors_to_tuple(grad_tensors, len(tensors)),
                                is_grads_batched=False)
            _engine_run_backward(tensors, grads, create_graph if retain_graph is None else retain_graph,
                                 create_graph, inputs, allow_unreachable=True, accumulate_grad=True)


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


def _swap_cuda_attrs(enter: bool) -> None:
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


@contextlib.contextmanager
def megatron_on_cpu(inner: TorchFunctionMode | None = None) -> Iterator[None]:
    """Run the enclosed megatron calls on CPU (patches A-F); a no-op when CUDA is used.

    Re-entrant: nested entries cost one counter increment. The ``TorchFunctionMode`` is per thread;
    the ``torch.cuda`` stand-ins are process-wide while any thread is inside.

    ``inner``: a ``TorchFunctionMode`` the enclosed calls should also run under, seeing CPU devices
    (``hot_switch`` builds DDP's buffers under ``carve_buffers.CarveBuffers``). On CPU, at the
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
            with _CudaAsCpuMode(inner) if inner is not None else contextlib.nullcontext():
                yield
        finally:
            _local.depth = depth
        return
    _swap_cuda_attrs(True)
    _local.depth = 1
    try:
        with _CudaAsCpuMode(inner):
            yield
    finally:
        _local.depth = 0
        _swap_cuda_attrs(False)


__all__ = ["apply_cpu_patches", "cuda_is_used", "megatron_on_cpu"]
