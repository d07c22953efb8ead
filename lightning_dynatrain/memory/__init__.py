"""Where a switch's memory comes from and goes to: one policy per device kind.

``policy`` (``PlainMemory`` for accelerators and any CPU, ``RecyclingMemory`` for CPU memory, and
``switch_memory`` that picks one from the device), ``old_storage`` (giving the old state's storages
back as the engine finishes with them), ``recycler`` (carving new state out of old storages) and
``page_moves`` (moving whole pages between address ranges, Linux).
"""

from lightning_dynatrain.memory.policy import (
    Destination,
    FreshDestination,
    MemoryFigures,
    PlainMemory,
    RecyclingMemory,
    switch_memory,
)

__all__ = ["Destination", "FreshDestination", "MemoryFigures", "PlainMemory", "RecyclingMemory", "switch_memory"]
