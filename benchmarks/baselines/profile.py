"""Where a hot switch's rebuild time goes: time the steps ``hot_switch`` calls, without changing it.

``hot_switch`` checks memory (``switch_need_bytes``, ``check_switch_memory``) and rebuilds the new
layout's megatron objects between its plan and the engine:
``initialize_for_layout`` (process groups), ``build_gpt_model`` (parameters, no init),
``build_ddp_and_optimizer`` (DDP's contiguous buffers, the optimizer, an all_gather_object),
``materialize_adam_state`` (moments: uninitialised for the switch, zeroed for the checkpoint
baselines, whose loads fill only what the checkpoint holds), ``megatron_store`` (the old model's views)
and ``megatron_store_and_adopter`` (the new one's).
``profiled(module)`` swaps those names in the module's namespace for timing wrappers for the
duration of a ``with`` block and yields the seconds per step (summed over calls). The same wrappers
also serve ``state.build_empty_state`` (the checkpoint baselines' rebuild).

Example::

    from lightning_dynatrain.megatron import hot_switch as hs
    with profiled(hs) as seconds:
        hs.hot_switch(...)
    seconds   # {"build_gpt_model": 0.41, "build_ddp_and_optimizer": 0.93, ...}
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import wraps
from types import ModuleType

STEPS = ("plan_rank_cached", "switch_need_bytes", "check_switch_memory", "initialize_for_layout", "build_gpt_model",
         "build_ddp_and_optimizer", "materialize_adam_state", "megatron_store", "megatron_store_and_adopter", "execute_switch")


def _timed(fn, name: str, seconds: dict[str, float]):
    @wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start

    return wrapper


@contextmanager
def profiled(module: ModuleType, steps: tuple[str, ...] = STEPS) -> Iterator[dict[str, float]]:
    seconds: dict[str, float] = {}
    originals = {name: getattr(module, name) for name in steps if hasattr(module, name)}
    for name, fn in originals.items():
        setattr(module, name, _timed(fn, name, seconds))
    try:
        yield seconds
    finally:
        for name, fn in originals.items():
            setattr(module, name, fn)


__all__ = ["STEPS", "profiled"]
