"""Which process holds each rank of the source and the destination layout of a switch.

Within one world, process ``p`` is rank ``p`` of both layouts. A world change renumbers: when rank
1 of four leaves, the survivors 0, 2, 3 become ranks 0, 1, 2 of the new world, and the switch runs
on the old world's four processes (the leaver must send its state). ``Members`` says so: the
process (rank of the switch's process group) of every source rank and of every destination rank.
The planner plans for processes, so its sends, receives and peers are processes.

Example (rank 1 of four leaves)::

    >>> m = Members(src=(0, 1, 2, 3), dst=(0, 2, 3), size=4)
    >>> m.src_rank(2), m.dst_rank(2), m.dst_rank(1)
    (2, 1, None)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_dynatrain.vps.errors import PlanError


@dataclass(frozen=True, slots=True)
class Members:
    """``src[r]``/``dst[r]``: the process holding rank ``r`` of the source/destination layout, among
    the ``size`` processes of the switch's group."""

    src: tuple[int, ...]
    dst: tuple[int, ...]
    size: int
    _src_of: dict = field(default=None, compare=False, hash=False, repr=False)  # type: ignore[assignment]
    _dst_of: dict = field(default=None, compare=False, hash=False, repr=False)  # type: ignore[assignment]
    _hash: int = field(default=0, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        for side, procs in (("source", self.src), ("destination", self.dst)):
            if len(set(procs)) != len(procs) or any(not 0 <= p < self.size for p in procs):
                raise PlanError(f"the {side} ranks' processes {procs} are not distinct processes of {self.size}",
                                hint="give every layout rank its own process of the switch's group")
        object.__setattr__(self, "_src_of", {p: r for r, p in enumerate(self.src)})
        object.__setattr__(self, "_dst_of", {p: r for r, p in enumerate(self.dst)})
        object.__setattr__(self, "_hash", hash((self.src, self.dst, self.size)))

    def __hash__(self) -> int:
        return self._hash

    @classmethod
    def same(cls, src_world: int, dst_world: int) -> "Members":
        """Process ``p`` is rank ``p`` of both layouts (a switch within one world, or a world that
        grows or shrinks at its end)."""
        return cls(tuple(range(src_world)), tuple(range(dst_world)), max(src_world, dst_world))

    def src_rank(self, process: int) -> int | None:
        """The source rank ``process`` holds, or ``None`` (a process that joins)."""
        return self._src_of.get(process)

    def dst_rank(self, process: int) -> int | None:
        """The destination rank ``process`` will hold, or ``None`` (a process that leaves)."""
        return self._dst_of.get(process)

    @property
    def is_identity(self) -> bool:
        return all(p == r for r, p in enumerate(self.src)) and all(p == r for r, p in enumerate(self.dst))

    def __str__(self) -> str:
        return f"src ranks on {list(self.src)}, dst ranks on {list(self.dst)} of {self.size} processes"


__all__ = ["Members"]
