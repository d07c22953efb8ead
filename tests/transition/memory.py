"""``PlainMemory`` for engine tests: new tensors filled with ``PAD`` bits, keeping on request, releases recorded.

An element the switch forgets to write keeps ``PAD`` and fails the bit-for-bit check; keeping in
place is off by default so the copies are tested too; ``released`` lists ``(key, start, end)``
address ranges the engine gave back, so a test can check every old byte went back exactly once.
"""

from __future__ import annotations

import torch

from lightning_dynatrain.devices.memory_policy import PlainMemory
from tests.transition.state import padded_empty


class CheckedMemory(PlainMemory):
    """See the module docstring. ``extra`` elements on every allocation make a wrong-sized tensor."""

    def __init__(self, *, keep: bool = False, extra: int = 0) -> None:
        super().__init__()
        self.keeps, self.extra = keep, extra
        self.released: list[tuple[tuple, int, int]] = []

    def allocate(self, key, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return padded_empty(key, numel + self.extra, dtype, device)

    def keep(self, key, tensor, span):
        return super().keep(key, tensor, span) if self.keeps else None

    def release(self, key, tensor) -> None:
        if key in self._kept and self._kept[key] is not None:  # the parts around a kept slice
            flat = tensor.view(-1)
            start, stop = self._kept[key]
            for rest in (flat[:start], flat[stop:]):
                if rest.numel():
                    self.released.append((key, rest.data_ptr(), rest.data_ptr() + rest.nbytes))
        elif key not in self._kept:
            self.released.append((key, tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes))
        super().release(key, tensor)
