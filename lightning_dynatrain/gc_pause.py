"""Python's automatic garbage collection, paused for the length of a switch.

A switch builds many small objects (plans, regions, boxes, megatron modules) in a process that
already holds hundreds of thousands (a megatron model, its optimizer, cached layouts). Each of
CPython's full collections walks all of them, which can take a large share of a switch on a big
model (``benchmarks/RESULTS.md``). Megatron-LM pauses the collector during training steps for the
same reason (``--manual-gc``).

The planner pauses it around ``plan_rank`` too, for a caller that plans outside a switch.

Nothing in a switch depends on the collector: old state is freed by its storages as the engine
is done with it (``devices.old_storage``), not by collection. The old model's module graph, full of
reference cycles, is taken apart once its successor is installed (``megatron.state.release_state``),
so reference counting frees it without waiting for a full collection.

Example::

    with automatic_gc_paused():
        result = execute_switch(...)

    @automatic_gc_paused()   # or around a whole function
    def hot_switch(...): ...
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def automatic_gc_paused() -> Iterator[None]:
    """Disable automatic collection inside the block; restore what was set before (nesting is fine)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


__all__ = ["automatic_gc_paused"]
