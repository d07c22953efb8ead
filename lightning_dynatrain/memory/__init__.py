"""Where a switch's memory comes from and goes to, on any device.

``policy`` (``PlainMemory``, every device's plain policy; ``KeepOldMemory``, which holds the old
state until the switch is confirmed; the ``Destination`` and ``BufferMode`` they talk to) and
``old_storage`` (giving the old state's storages back as the engine finishes with them). Which
policy a switch gets is its device kind's choice (``devices.device_kind(device).switch_memory``):
the host's recycling policy and what it needs (page moves, carved buffers) live in ``devices.host``.
"""

from lightning_dynatrain.memory.policy import (
    BufferMode,
    Destination,
    FreshDestination,
    KeepOldMemory,
    MemoryFigures,
    PlainMemory,
)

__all__ = ["BufferMode", "Destination", "FreshDestination", "KeepOldMemory", "MemoryFigures", "PlainMemory"]
