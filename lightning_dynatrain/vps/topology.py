"""Which node each rank runs on: what the planner prefers sources by and the report splits bytes by.

A job's ranks need not fill nodes evenly (SLURM's ``--ntasks-per-node`` can give ``2(x3),1``), and
ranks that join later land wherever the scheduler puts them, so a ``Topology`` is a node id per
rank, gathered from the ranks themselves (``runtime.world_topology.gather_topology``), not a ranks-per-node
constant. ``Topology.uniform`` is the even layout dry runs assume.

Example::

    >>> t = Topology((0, 0, 0, 1, 1, 1, 2))   # SLURM's 3(x2),1
    >>> t.same_node(1, 2), t.same_node(2, 3), len(t)
    (True, False, 7)
    >>> Topology.uniform(4, 2).nodes
    (0, 0, 1, 1)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_dynatrain.vps.errors import PlanError


@dataclass(frozen=True, slots=True)
class Topology:
    """The node id of every rank of a world (ids are any integers; equal ids share a node)."""

    nodes: tuple[int, ...]
    _hash: int = field(default=0, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.nodes:
            raise PlanError("a topology needs at least one rank", hint="pass one node id per rank")
        object.__setattr__(self, "_hash", hash(self.nodes))  # planner caches key on it: hash once

    def __hash__(self) -> int:
        return self._hash

    @classmethod
    def uniform(cls, world: int, ranks_per_node: int) -> "Topology":
        """``world`` ranks filling nodes of ``ranks_per_node`` in rank order."""
        if ranks_per_node < 1 or world < 1:
            raise PlanError(f"cannot lay {world} ranks on nodes of {ranks_per_node}", hint="use positive sizes")
        return cls(tuple(r // ranks_per_node for r in range(world)))

    def __len__(self) -> int:
        return len(self.nodes)

    def node_of(self, rank: int) -> int:
        return self.nodes[rank]

    def same_node(self, a: int, b: int) -> bool:
        return self.nodes[a] == self.nodes[b]

    def covers(self, world: int) -> "Topology":
        """This topology, checked to name a node for every rank of a ``world``-rank switch."""
        if len(self.nodes) < world:
            raise PlanError(f"the topology names the nodes of {len(self.nodes)} ranks but the switch spans {world}",
                            hint="gather one node id per rank of the union of both worlds")
        return self

    def __str__(self) -> str:
        counts: list[list[int]] = []  # runs of (ranks on a node) like SLURM's 2(x3),1
        for node in dict.fromkeys(self.nodes):
            n = self.nodes.count(node)
            if counts and counts[-1][0] == n:
                counts[-1][1] += 1
            else:
                counts.append([n, 1])
        return ",".join(f"{n}(x{k})" if k > 1 else str(n) for n, k in counts) + " ranks per node"


__all__ = ["Topology"]
