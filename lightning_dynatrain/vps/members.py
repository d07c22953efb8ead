"""Which process holds each rank of the source and the destination layout of a switch.

Within one world, process ``p`` is rank ``p`` of both layouts. A world change renumbers: when rank
1 of four leaves, the survivors 0, 2, 3 become ranks 0, 1, 2 of the new world, and the switch runs
on the old world's four processes (the leaver must send its state). ``Members`` says so: the
process (rank of the switch's process group) of every source rank and of every destination rank.
The planner plans for processes, so its sends, receives and peers are processes.

A process that died holds nothing any more: its source rank has no process (``None``), and the
planner sources every box from a surviving holder, or says which boxes went with it
(``StateLostError``). The switch then runs on the survivors' group. With ``holes`` the boxes only
the dead held are zero-filled instead, for the caller to write from an in-memory snapshot
(``elastic/driver/snapshots.py``).

Example (rank 1 of four leaves)::

    >>> m = Members(src=(0, 1, 2, 3), dst=(0, 2, 3), size=4)
    >>> m.src_rank(2), m.dst_rank(2), m.dst_rank(1)
    (2, 1, None)

Example (rank 1 of four died; the three survivors are the processes of the switch)::

    >>> m = Members.after_loss(4, dead={1}, dst_world=3)
    >>> m.src, m.dst, m.lost
    ((0, None, 1, 2), (0, 1, 2), (1,))
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_dynatrain.vps.errors import PlanError


@dataclass(frozen=True, slots=True)
class Members:
    """``src[r]``/``dst[r]``: the process holding rank ``r`` of the source/destination layout, among
    the ``size`` processes of the switch's group; ``src[r] is None``: the process that held source
    rank ``r`` died (its state is gone)."""

    src: tuple[int | None, ...]
    dst: tuple[int, ...]
    size: int
    holes: bool = False
    """Boxes only dead ranks held are zero-filled (written afterwards from a snapshot), not an error."""
    _src_of: dict = field(default=None, compare=False, hash=False, repr=False)  # type: ignore[assignment]
    _dst_of: dict = field(default=None, compare=False, hash=False, repr=False)  # type: ignore[assignment]
    _hash: int = field(default=0, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        if None in self.dst:
            raise PlanError(f"a destination rank without a process ({self.dst})",
                            hint="plan for the world that will hold the state: one process per rank")
        for side, procs in (("source", tuple(p for p in self.src if p is not None)), ("destination", self.dst)):
            if len(set(procs)) != len(procs) or any(not 0 <= p < self.size for p in procs):
                raise PlanError(f"the {side} ranks' processes {procs} are not distinct processes of {self.size}",
                                hint="give every layout rank its own process of the switch's group")
        object.__setattr__(self, "_src_of", {p: r for r, p in enumerate(self.src) if p is not None})
        object.__setattr__(self, "_dst_of", {p: r for r, p in enumerate(self.dst)})
        object.__setattr__(self, "_hash", hash((self.src, self.dst, self.size, self.holes)))

    def __hash__(self) -> int:
        return self._hash

    @classmethod
    def same(cls, src_world: int, dst_world: int) -> "Members":
        """Process ``p`` is rank ``p`` of both layouts (a switch within one world, or a world that
        grows or shrinks at its end)."""
        return cls(tuple(range(src_world)), tuple(range(dst_world)), max(src_world, dst_world))

    @classmethod
    def after_loss(cls, src_world: int, *, dead: "set[int] | frozenset[int]", dst_world: int) -> "Members":
        """The survivors of a world of ``src_world`` in which the ranks ``dead`` died, in rank order,
        are processes ``0 .. src_world - len(dead) - 1`` of the switch and ranks ``0 .. dst_world - 1``
        of the destination (the new world, ``dst_world`` = the survivors)."""
        if not dead or any(not 0 <= r < src_world for r in dead):
            raise PlanError(f"dead ranks {sorted(dead)} of a world of {src_world}",
                            hint="name at least one rank of the old world that died")
        survivors = [r for r in range(src_world) if r not in dead]
        if dst_world != len(survivors):
            raise PlanError(f"{len(survivors)} survivors cannot hold a destination of {dst_world} ranks",
                            hint="plan for a layout of the survivors' world")
        process = {r: p for p, r in enumerate(survivors)}
        return cls(tuple(process.get(r) for r in range(src_world)), tuple(range(dst_world)), len(survivors))

    def with_holes(self) -> "Members":
        """The same processes, the boxes only the dead held left as zeroed holes (``holes``)."""
        return Members(self.src, self.dst, self.size, holes=True)

    @property
    def lost(self) -> tuple[int, ...]:
        """The source ranks whose process died."""
        return tuple(r for r, p in enumerate(self.src) if p is None)

    @property
    def holders(self) -> frozenset[int]:
        """The processes that hold a part of the source state."""
        return frozenset(p for p in self.src if p is not None)

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
        lost = f" (source ranks {list(self.lost)} lost)" if self.lost else ""
        return f"src ranks on {list(self.src)}, dst ranks on {list(self.dst)} of {self.size} processes{lost}"


__all__ = ["Members"]
