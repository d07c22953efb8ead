"""torch's private names this package uses, each checked on torch 2.13.0.

- ``FakeProcessGroup._create_internal(rank, size)``: a c10d process group that knows its rank and
  size and sends nothing (torch traces distributed programs without peers with it,
  ``torch.testing._internal.distributed.fake_pg``; the constructor has no Python binding). It stands
  in for a layout's groups when a module is built on the meta device only to read its description
  (``megatron.probe``): megatron's constructors ask their groups for rank and size and nothing else.
- ``Tensor._base``: the tensor a view was made from (``megatron.describe`` matches a described view
  to its parameter, on the meta device too, where storages have no address).
"""

from __future__ import annotations

import torch


def fake_process_group(rank: int, size: int) -> "torch.distributed.ProcessGroup":
    """A process group of ``size`` ranks in which this process is ``rank``; any collective is a no-op."""
    from torch._C._distributed_c10d import FakeProcessGroup

    try:
        return FakeProcessGroup._create_internal(rank, size)
    except AttributeError as err:  # a torch without it: the probe cannot run, say which torch
        raise RuntimeError(f"torch {torch.__version__} has no FakeProcessGroup._create_internal; "
                           "lightning-dynatrain reads model descriptions with it (checked on 2.13)") from err


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``tensor`` is a view of, or ``None`` when it is no view."""
    return tensor._base


__all__ = ["fake_process_group", "view_base"]
