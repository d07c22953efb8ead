"""Which boxes an in-memory snapshot must copy, from which rank to which, so that losing any one
failure domain loses no state (pure).

A failure domain is a node of the rank -> node map (``Topology``); on a single node every process is
its own. A box held in two or more domains survives any one domain's loss: its replicas stay (data
parallel, and without ZeRO the optimizer's state). A box whose holders all share one domain (a ZeRO-1
shard, a tp/pp shard at dp1, or replicas that happen to sit on one node) is copied by one of its
holders to a *buddy* rank in the next domain of a ring, which keeps it in host memory. The holder
that sends each such box rotates over its holders (box order), so replicas share the work.

Example::

    >>> plan = snapshot_plan(spec, ParallelConfig.parse("dp2-tp2-zero1"), Topology.uniform(4, 4),
    ...                      Precision.BF16)
    >>> plan.domains                # one node: every process its own domain
    ((0,), (1,), (2,), (3,))
    >>> print(plan)                 # the params have replicas on other ranks; each zero1 shard goes once
    snapshot of dp2-tp2-pp1-zero1 over 4 failure domains: 60 boxes (0->[1]: 0.01 MiB, 1->[2]: 0.01 MiB, ...)

The runtime (``megatron.snapshot``: a thread copies every N steps) builds on this plan;
``uncovered`` says which boxes a domain's loss would take that no snapshot holds. After a loss,
``fill_plan`` says which piece of each box only the dead held goes from the survivor keeping its
copy to which rank of the new layout (``megatron.snapshot_fill`` runs it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_dynatrain.vps.box import Box
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.lost_state import LostBox, lost_state
from lightning_dynatrain.vps.mapping import held_boxes, is_sharded, state_placement
from lightning_dynatrain.vps.spec import ModelSpec, Precision, StateKind
from lightning_dynatrain.vps.topology import Topology


@dataclass(frozen=True)
class SnapshotCopy:
    """``sender`` (a holder of the box) copies ``tensor``'s ``kind`` over ``box`` to ``keeper``."""

    tensor: str
    kind: StateKind
    box: Box
    sender: int
    keeper: int


@dataclass(frozen=True)
class SnapshotPlan:
    """The copies a snapshot makes (``copies``), in the spec's tensor order, for one layout."""

    layout: ParallelConfig
    precision: Precision
    domains: tuple[tuple[int, ...], ...]
    """The failure domains: the ranks of each (nodes, or one process each on a single node)."""
    copies: tuple[SnapshotCopy, ...]
    itemsizes: tuple[tuple[tuple[str, StateKind], int], ...]

    def _bytes(self, copy: SnapshotCopy) -> int:
        return copy.box.numel * dict(self.itemsizes)[(copy.tensor, copy.kind)]

    def sent_bytes(self, rank: int) -> int:
        """What ``rank`` copies out at each snapshot."""
        return sum(self._bytes(c) for c in self.copies if c.sender == rank)

    def held_bytes(self, rank: int) -> int:
        """What ``rank`` keeps for others (host memory the memory check must count)."""
        return sum(self._bytes(c) for c in self.copies if c.keeper == rank)

    def domain_of(self, rank: int) -> int:
        return next(i for i, ranks in enumerate(self.domains) if rank in ranks)

    def uncovered(self, spec: ModelSpec, domain: int) -> tuple[LostBox, ...]:
        """The boxes losing ``domain`` would take that no snapshot kept outside it holds (empty:
        the snapshot restores everything)."""
        dead = frozenset(self.domains[domain])
        kept = {(c.tensor, c.kind, c.box) for c in self.copies if c.keeper not in dead}
        return tuple(b for b in lost_state(spec, self.layout, dead, self.precision)
                     if (b.tensor, b.kind, b.box) not in kept)

    def __str__(self) -> str:
        ranks = sorted({c.sender for c in self.copies} | {c.keeper for c in self.copies})
        sent = ", ".join(f"{r}->{sorted({c.keeper for c in self.copies if c.sender == r})}: "
                         f"{self.sent_bytes(r) / 2**20:.2f} MiB" for r in ranks if self.sent_bytes(r))
        return (f"snapshot of {self.layout} over {len(self.domains)} failure domains: {len(self.copies)} boxes"
                + (f" ({sent})" if sent else " (every box has a replica in another domain)"))


def failure_domains(topology: Topology, world: int) -> tuple[tuple[int, ...], ...]:
    """The ranks of each node in node order, or one rank each when all ``world`` ranks share a node."""
    nodes: dict[int, list[int]] = {}
    for rank in range(world):
        nodes.setdefault(topology.node_of(rank), []).append(rank)
    if len(nodes) == 1:
        return tuple((r,) for r in range(world))
    return tuple(tuple(ranks) for ranks in nodes.values())


def snapshot_plan(spec: ModelSpec, layout: ParallelConfig, topology: Topology,
                  precision: Precision = Precision.FP32) -> SnapshotPlan:
    """The copies that let ``layout``'s state survive the loss of any one failure domain."""
    world = layout.world_size
    domains = failure_domains(topology.covers(world), world)
    domain_of = {r: i for i, ranks in enumerate(domains) for r in ranks}

    def keeper(sender: int) -> int:  # the sender's place in its domain, in the next domain of the ring
        mine, nxt = domains[domain_of[sender]], domains[(domain_of[sender] + 1) % len(domains)]
        return nxt[mine.index(sender) % len(nxt)]

    copies: list[SnapshotCopy] = []
    itemsizes = {(t.name, kind): spec.itemsize(t.name, kind, precision) for t in spec.tensors
                 for kind, _ in precision.kinds_of(t)}
    if len(domains) > 1:
        for tensor, kind, box, holders in held_boxes(spec, layout, precision):
            if len({domain_of[h] for h in holders}) == 1:  # one domain's loss would take it: copy it out
                sender = sorted(holders)[len(copies) % len(holders)]
                copies.append(SnapshotCopy(tensor, kind, box, sender, keeper(sender)))
    return SnapshotPlan(layout, precision, domains, tuple(copies), tuple(itemsizes.items()))


@dataclass(frozen=True)
class FillPiece:
    """``piece`` (inside ``lost``) of ``tensor``'s ``kind`` goes from process ``keeper`` to ``dest``."""

    tensor: str
    kind: StateKind
    lost: Box
    piece: Box
    keeper: int
    dest: int


def fill_plan(spec: ModelSpec, target: ParallelConfig, precision: Precision, lost: Sequence[LostBox],
              keeper_of: Mapping[tuple[str, StateKind, Box], int]) -> tuple[FillPiece, ...]:
    """Every piece of the ``lost`` boxes and who sends it to whom at ``target`` (process ``p`` of
    the new world is rank ``p`` of ``target``); ``keeper_of``: the process keeping each box's copy."""
    out = []
    for box in lost:
        sharded = is_sharded(target, box.kind)
        placement = state_placement(spec, target, box.tensor, sharded, precision if sharded else Precision.FP32)
        keeper = keeper_of[(box.tensor, box.kind, box.box)]
        for piece, holders in placement.pieces(box.box):
            out.extend(FillPiece(box.tensor, box.kind, box.box, piece, keeper, dest) for dest in holders)
    return tuple(out)


__all__ = ["FillPiece", "SnapshotCopy", "SnapshotPlan", "failure_domains", "fill_plan", "snapshot_plan"]
