"""Megatron's DDP buffers built into old memory during a switch (CPU, with the recycling policy).

Megatron's ``DistributedDataParallel`` allocates its contiguous gradient buffers (and, for the
distributed optimizer, its param buffers) with one ``torch.zeros(n, dtype=...)`` each, then copies
each parameter into the param buffer. During a switch that building happens while the old
gradient buffers are held by the recycler (``recycler.py``, group ``BUFFER_GROUP``):
``CarveBuffers`` serves those ``torch.zeros`` calls from them, and knows which of DDP's copies it
may skip (the new model's params are uninitialised: the engine writes the param buffer).
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from lightning_dynatrain.devices.host.page_moves import can_move_pages, populate_pages, untouched_runs
from lightning_dynatrain.devices.host.recycler import StorageRecycler
from lightning_dynatrain.devices.old_storage import BUFFER_GROUP


class CarveBuffers(TorchFunctionMode):
    """Inside this mode, ``torch.zeros(n, ...)`` of a CPU tensor of at least the recycler's
    ``min_bytes`` is served by ``take_whole`` from ``group`` (memory already touched: no page
    faults), else allocated as usual, after the storages held for ``group`` are freed (one that
    fits none of them would otherwise come on top of them). Wraps the construction of megatron's
    DDP buffers.

    ``zero``: zero what is served, as ``torch.zeros`` promises. ``zero=False`` hands it over with
    the old storage's bytes, for buffers whose elements are each written before they are read (or
    never read); megatron's DDP buffers are such (``hot_switch``), which saves one pass over them.

    ``skip_copies``: for a model whose params are uninitialised and written later, element by
    element (a switch's new model: the engine writes them). A ``Tensor.copy_`` into a buffer served
    here is skipped (megatron's DDP copies each param into its zero1 param buffer), and a buffer
    that does not fit a held storage is served untouched (``torch.empty``): the one a copy targeted
    (the param buffer) is left to its writer, whose writes fault its pages in once; the others
    (gradient buffers) get their memory from ``fault_in_untouched``, which the caller calls when
    their pages should come, e.g. once the old state's memory is back. Their bytes are never
    zeroed here: megatron zeroes a gradient buffer before its first use.
    """

    def __init__(self, recycler: StorageRecycler, group: str, *, zero: bool = True, skip_copies: bool = False) -> None:
        super().__init__()
        self.recycler, self.group, self.zero, self.skip_copies = recycler, group, zero, skip_copies
        self._served: dict[int, tuple[torch.Tensor, bool]] = {}  # storage address -> (buffer, fresh)
        self._written_later: set[int] = set()  # storage addresses of buffers a copy targeted
        self.skipped_copy_bytes = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and self.skip_copies and self._served:
            address = args[0].untyped_storage().data_ptr()
            if address in self._served:
                self._written_later.add(address)
                self.skipped_copy_bytes += args[0].nbytes
                return args[0]
        if func is torch.zeros and len(args) == 1 and isinstance(args[0], int) and "out" not in kwargs \
                and torch.device(kwargs.get("device") or "cpu").type == "cpu":
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
            requires_grad = bool(kwargs.get("requires_grad", False))
            carved = self.recycler.take_whole(args[0], dtype, self.group)
            if carved is not None:
                if self.zero:
                    carved.zero_()
                return self._serve(carved, fresh=False).requires_grad_(requires_grad)
            if args[0] * dtype.itemsize >= self.recycler.min_bytes:
                # no held storage fits: their pages go into the new buffer (``fill``), what is left is
                # freed before the buffer takes fresh memory, so the two never add up
                buffer = torch.empty(args[0], dtype=dtype)
                self.recycler.fill(buffer, self.group)
                self.recycler.drop_group(self.group)
                if self.skip_copies:  # untouched until ``fault_in_untouched`` or the caller writes it
                    return self._serve(buffer, fresh=True).requires_grad_(requires_grad)
                return buffer.zero_().requires_grad_(requires_grad)
        return func(*args, **kwargs)

    def adopt(self, buffer: torch.Tensor, *, written_later: bool) -> None:
        """A buffer built elsewhere (ahead of the switch) with fresh memory, handled as one served
        here untouched: ``fault_in_untouched`` gives it its pages unless its writer does
        (``written_later``)."""
        address = buffer.untyped_storage().data_ptr()
        self._served[address] = (buffer, True)
        if written_later:
            self._written_later.add(address)

    def _serve(self, buffer: torch.Tensor, *, fresh: bool) -> torch.Tensor:
        if self.skip_copies:
            self._served[buffer.untyped_storage().data_ptr()] = (buffer, fresh)
        return buffer

    def _untouched(self) -> list[torch.Tensor]:
        return [b for address, (b, fresh) in self._served.items() if fresh and address not in self._written_later]

    @property
    def untouched_bytes(self) -> int:
        """Bytes of the fresh buffers ``fault_in_untouched`` takes care of that are not in memory yet
        (all of them where the page map cannot be read); known once the buffers are built."""
        if not can_move_pages():
            return sum(b.nbytes for b in self._untouched())
        return sum(hi - lo for b in self._untouched() for lo, hi in untouched_runs(b.data_ptr(), b.data_ptr() + b.nbytes))

    def fault_in_untouched(self) -> int:
        """Give the fresh buffers no copy targeted (``skip_copies``: gradient buffers) their memory now,
        rather than in their first use: the pages the recycler holds idle first (``fill``; they
        keep the old bytes, as a carved buffer does), fresh pages for the rest, faulted in as the
        kernel zeroes them (``populate_pages``; else a zeroing pass). The bytes of those buffers.
        Only for buffers their user zeroes before use (megatron's step: ``zero_grad_buffer``)."""
        pending = self._untouched()
        self._served.clear()
        for buffer in pending:
            self.recycler.fill(buffer)
            if not can_move_pages():  # no page map to read: a pass over the whole buffer
                buffer.zero_()
                continue
            flat = buffer.view(-1).view(torch.uint8)
            for lo, hi in untouched_runs(buffer.data_ptr(), buffer.data_ptr() + buffer.nbytes):
                if not populate_pages(lo, hi):
                    flat[lo - buffer.data_ptr(): hi - buffer.data_ptr()].zero_()
        return sum(b.nbytes for b in pending)


def switch_buffers(recycler: StorageRecycler) -> CarveBuffers:
    """The mode a switch builds megatron's DDP buffers under (``RecyclingMemory(buffer_mode=...)``):
    into the old gradient buffers the recycler holds (``BUFFER_GROUP``), not zeroed (megatron
    zeroes a gradient buffer before its first use, and the engine writes every param of a zero1
    param buffer), DDP's copies of the new model's uninitialised params into it skipped."""
    return CarveBuffers(recycler, BUFFER_GROUP, zero=False, skip_copies=True)


__all__ = ["CarveBuffers", "switch_buffers"]
