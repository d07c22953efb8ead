"""``SwitchMemory``: what the walker asks of the memory a switch runs in.

The walker (``walker.execute_switch``) never allocates or frees state itself: it asks its memory
policy, chosen once per device kind (``devices.DeviceKind.switch_memory``: plain allocation on an
accelerator, storage recycling on the host, the old state held for a roll-back under
``switch_safety="keep_old"``). This is that conversation, so the walker depends on no policy.

Example (every rank)::

    new_store, report = execute_switch(program, store, device_kind(device).switch_memory(...))
"""

from __future__ import annotations

from typing import Protocol

import torch

from lightning_dynatrain.transition.program import StoreKey


class SwitchMemory(Protocol):
    """Where one switch's tensors come from and go to (``devices.memory_policy.PlainMemory`` and its kinds)."""

    def start(self, source: dict[StoreKey, torch.Tensor]) -> None:
        """The switch starts with ``source``, this rank's old local tensors."""

    def allocate(self, key: StoreKey, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D tensor for destination ``key``, written before it is read."""

    def keep(self, key: StoreKey, tensor: torch.Tensor, span: tuple[int, int] | None) -> torch.Tensor | None:
        """Destination ``key`` made of the old ``tensor`` (or its flat run ``span``) in place, or ``None``."""

    def release(self, key: StoreKey, tensor: torch.Tensor) -> None:
        """The walker no longer reads the old ``tensor`` of ``key`` (or a part of it)."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, last_read: bool) -> int:
        """Copy ``src`` into ``dst``; the bytes that moved by their pages instead of by a copy."""

    def staging(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A ``uint8`` buffer of ``nbytes`` for packed messages."""

    def unstage(self, buffer: torch.Tensor) -> None:
        """The walker is done with the stage ``buffer``."""

    def finish(self) -> None:
        """Every step ran: what the policy still holds goes where it belongs."""


__all__ = ["SwitchMemory"]
