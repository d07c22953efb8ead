"""How the engine sees a process group: its rank numbering, its device, and how to wait on it.

Plan ranks are *group* ranks: rank ``r`` of a plan is rank ``r`` of the process group the switch runs
on (for the default group, the global rank). Point-to-point ops address peers with ``group_peer``;
creating subgroups needs global ranks, which ``global_rank`` gives.

Nothing here names a backend or a device: buffers go where the state lives, or, for a rank that holds
no state yet, on the accelerator the group's backend drives (CPU for plain gloo).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from lightning_dynatrain.compat.torch_internals import default_group


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank in ``group`` (default: WORLD), as the group itself numbers it.

    ``dist.get_rank(group)`` maps the *current* world's rank through the group's table, which is
    wrong for a group of an earlier world (a world change runs its switch on the old world's group
    after the new world became the default)."""
    return (group if group is not None else default_group()).rank()


class GroupComm:
    """The process group of one switch, with its rank numbering and device. Build one per switch."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device | None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "execute_switch needs an initialised torch.distributed default group "
                "(torch.distributed.init_process_group); the strategy sets it up in setup_environment"
            )
        self.group = group
        self.rank = group_rank(group)
        self.size = dist.get_world_size(group)
        self.device = device if device is not None else default_device(group)

    def global_rank(self, rank: int) -> int:
        """Global rank of group rank ``rank``."""
        if self.group is None or self.group is dist.group.WORLD:
            return rank
        return dist.get_global_rank(self.group, rank)

    def global_ranks(self, ranks: Iterable[int]) -> tuple[int, ...]:
        return tuple(self.global_rank(r) for r in ranks)

    def is_world(self) -> bool:
        return self.group is None or self.group is dist.group.WORLD

    def synchronize(self) -> None:
        """Wait for queued device work (no-op on CPU), so phase timings are honest."""
        synchronize(self.device)


def default_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device a group's collectives expect: the current accelerator unless the backend is gloo."""
    backend = str(dist.get_backend(group)).lower()
    if backend != "gloo" and torch.accelerator.is_available():
        acc = torch.accelerator.current_accelerator()
        assert acc is not None
        return torch.device(acc.type, torch.accelerator.current_device_index())
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


__all__ = ["GroupComm", "default_device", "group_rank", "synchronize"]
