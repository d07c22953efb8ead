"""Worlds kept after a change, for a return to the same members (``OnNodeChange(keep_worlds=...)``).

A world is its default group and every group made on it (megatron's, the switches'). When a grow
replaces it, its members are all still in the job: instead of destroying its groups, the change
keeps them here, keyed by the world's members in rank order. A later change back to exactly those
members (a shrink that gives the borrowed processes back, the common elastic pattern) installs the
kept world and builds no group at all (on NCCL: no communicator, which is what costs there).

A kept world is usable only while all its members are in the job (a process that left never comes
back under the same id): after every change the cache drops the worlds that name a process outside
the running world, and the oldest beyond ``capacity``. Every member of a world went through the
same changes since they shared it, so every member holds the same kept worlds (the callback's
settings are part of the job's fingerprint, which a joiner must match).

Pure bookkeeping: what to destroy is returned to the caller (``world.retire`` does that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class WorldGroups:
    """A world's groups as ``world.install`` left them when it installed the next one."""

    default: dist.ProcessGroup | None
    """Its default group (WORLD), ``None`` for a process that had none."""
    groups: tuple[dist.ProcessGroup, ...]
    """Every group of that world, its default group included."""
    group_count: int
    """c10d's ``group_count`` its members had reached (a return to it goes on from there, alike on
    every member: ``new_group`` names groups by it)."""


@dataclass(frozen=True, eq=False)
class KeptWorld:
    """A world kept for a return to the same members."""

    members: tuple[str, ...]
    """Its members in rank order (the key)."""
    generation: int
    """The generation it was built for (its groups live under that generation's store prefix)."""
    groups: WorldGroups
    extra: Any = None
    """What the strategy keeps with it (its caches of that world's megatron and switch groups)."""


class WorldCache:
    """At most ``capacity`` kept worlds, the latest kept first (see the module docstring)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"keep_worlds must be >= 0, got {capacity}")
        self.capacity = capacity
        self._worlds: list[KeptWorld] = []

    def __len__(self) -> int:
        return len(self._worlds)

    def find(self, members: tuple[str, ...]) -> KeptWorld | None:
        """The kept world of exactly ``members`` (in this rank order), if any."""
        return next((w for w in self._worlds if w.members == members), None)

    def take(self, members: tuple[str, ...]) -> KeptWorld | None:
        """``find``, and forget it (it is about to run again)."""
        world = self.find(members)
        if world is not None:
            self._worlds.remove(world)
        return world

    def groups(self) -> frozenset[dist.ProcessGroup]:
        """Every group of every kept world (not the running world's: ``install`` leaves them alone)."""
        return frozenset(g for w in self._worlds for g in w.groups.groups)

    def keep(self, world: KeptWorld, running: tuple[str, ...]) -> list[dist.ProcessGroup]:
        """Keep ``world`` (just left for the world of ``running``) if it can be returned to; returns
        the groups to destroy: ``world``'s own if it cannot be kept, and those of kept worlds that
        name a process no longer running or fall beyond ``capacity``."""
        if self.capacity > 0 and set(world.members) <= set(running):
            self._worlds.insert(0, world)
        else:
            return list(world.groups.groups) + self.prune(running)
        return self.prune(running)

    def prune(self, running: tuple[str, ...]) -> list[dist.ProcessGroup]:
        """Forget the kept worlds a process outside ``running`` belongs to, and the oldest beyond
        ``capacity``; their groups, to destroy."""
        kept = [w for w in self._worlds if set(w.members) <= set(running)][:self.capacity]
        gone = [w for w in self._worlds if w not in kept]
        self._worlds = kept
        return [g for w in gone for g in w.groups.groups]

    def __str__(self) -> str:
        return ", ".join(f"{len(w.members)} members (generation {w.generation})" for w in self._worlds) or "none"


__all__ = ["KeptWorld", "WorldCache", "WorldGroups"]
