"""Patch B: megatron's CUDA RNG tracker over CPU generator states."""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def patch_rng_tracker() -> None:
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


__all__ = ["patch_rng_tracker"]
