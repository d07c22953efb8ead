"""The state routing planner: per rank, which boxes to send, receive and retain in a switch.

For every destination region of a rank and every source *atom* overlapping it (``mapping.py``):
if the rank holds the atom in the source layout it retains the overlap; otherwise it receives it
from one holder, chosen by ``choose_source``: a holder on the same node if there is one, the one
the engine's XOR schedule meets first. A send list is the mirror image: for each
atom a rank holds and each destination rank that chose it. No rank talks to another to plan.

Exactness: atoms are held whole, so a destination element is retained iff its rank already held
it, and received exactly once otherwise; moved bytes are therefore the minimum possible. The only
destination elements no source holds are vocabulary padding rows the source layout does not pad
to; they are listed as ``fills`` (zeroed by the engine).

After a death (``Members.after_loss``) the dead hold nothing: every box is read from a surviving
holder, and a box no survivor holds fails the plan with ``StateLostError`` listing what went (or,
with ``Members.holes``, is a fill that a snapshot's copy overwrites after the switch).

The optimizer's state kinds share one geometry (they are sharded alike), so the geometry is
computed once per tensor and expanded per kind.

A *weights-only* plan (``weights_only=True``) moves the params alone, in the dtype the model trains
in (bf16 params under ``Precision.BF16``): the switch to a rollout layout and back, while the
optimizer's state (main params, moments) stays where it is. It is the full plan's ``PARAM``
transfers, planned without the rest.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Iterable

from lightning_dynatrain.gc_pause import automatic_gc_paused
from lightning_dynatrain.vps.box import Box
from lightning_dynatrain.vps.errors import PlanError, StateLostError
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.lost_state import describe_lost, lost_state
from lightning_dynatrain.vps.mapping import state_placement
from lightning_dynatrain.vps.members import Members
from lightning_dynatrain.vps.plan import RankPlan, Transfer
from lightning_dynatrain.vps.spec import VOCAB, ModelSpec, Precision, StateKind
from lightning_dynatrain.vps.topology import Topology


@lru_cache(maxsize=65536)
def choose_source(holders: tuple[int, ...], dest: int, topology: Topology) -> int:
    """The holder ``dest`` reads an atom from: same node first, then the nearest in XOR distance.

    The engine pairs ``dest`` with holder ``h`` in XOR step ``dest ^ h``, so the nearest holder is
    the one met first. Different destinations have different nearest holders (``h ^ dest`` is
    distinct for distinct ``dest``), which spreads the replicas of one atom over its holders, and
    the traffic lands in as few, as early and as parallel steps as the holders allow: in
    ``dp2-tp2 -> dp1-tp4`` ranks 1 and 2 read from ranks 0 and 3 at once in step 1, instead of rank
    2 waiting for rank 1 to finish its own receive first.
    """
    candidates = _candidates(holders, topology.node_of(dest), topology)
    return min(candidates, key=lambda h: h ^ dest)


@lru_cache(maxsize=65536)
def _candidates(holders: tuple[int, ...], node: int, topology: Topology) -> tuple[int, ...]:
    local = tuple(h for h in holders if topology.node_of(h) == node)
    return local or holders


def _kind_groups(src: ParallelConfig, dst: ParallelConfig, kinds: tuple[tuple[StateKind, int], ...]
                 ) -> list[tuple[bool, bool, tuple[StateKind, ...]]]:
    """A tensor's state ``kinds`` grouped by how they are distributed: (src sharded, dst sharded, kinds)."""
    optimizer = tuple(k for k, _ in kinds if k is not StateKind.PARAM)
    return [(False, False, (StateKind.PARAM,)), (src.zero == 1, dst.zero == 1, optimizer)]


def _check_same_model(spec: ModelSpec, src: ParallelConfig, dst: ParallelConfig) -> None:
    for layout, side in ((src, "source"), (dst, "destination")):
        if layout.pipeline_problem(spec.num_layers) or (spec.num_experts and spec.num_experts % layout.ep):
            raise PlanError(
                f"{side} layout {layout} does not fit model {spec.name}",
                hint="validate layouts with lightning_dynatrain.vps.validate_layout before planning",
            )


def plan_rank(
    spec: ModelSpec,
    src: ParallelConfig,
    dst: ParallelConfig,
    rank: int,
    *,
    precision: Precision = Precision.FP32,
    topology: Topology | None = None,
    members: Members | None = None,
    weights_only: bool = False,
) -> RankPlan:
    """The plan of process ``rank`` for the switch ``src -> dst``. A process outside a layout's
    world only sends (it leaves) or only receives (it joins). ``weights_only``: the params only
    (see the module docstring).

    ``topology``: the node of every process (sources on the process's own node are preferred);
    ``None`` assumes nodes of 8 in order. ``members``: which process holds each source and each
    destination rank (a world change that renumbers); ``None``: process ``p`` is rank ``p`` of both.
    """
    _check_same_model(spec, src, dst)
    members = Members.same(src.world_size, dst.world_size) if members is None else _checked(members, src, dst)
    topology = Topology.uniform(members.size, 8) if topology is None else topology.covers(members.size)
    # Planning allocates many small acyclic tuples; a cyclic-GC pass over a training process's
    # large heap in the middle of it can cost more than the plan itself.
    with automatic_gc_paused():
        return _plan_rank(spec, src, dst, rank, precision, topology, members, weights_only)


def _checked(members: Members, src: ParallelConfig, dst: ParallelConfig) -> Members:
    if (len(members.src), len(members.dst)) != (src.world_size, dst.world_size):
        raise PlanError(f"{members} does not name a process for each of the {src.world_size} source and "
                        f"{dst.world_size} destination ranks of {src} -> {dst}",
                        hint="build Members with one process per rank of each layout")
    return members


def default_topology(src: ParallelConfig, dst: ParallelConfig) -> Topology:
    """Nodes of 8 ranks in rank order over the union world (what a dry run assumes)."""
    return Topology.uniform(union_world(src, dst), 8)


def _plan_rank(
    spec: ModelSpec, src: ParallelConfig, dst: ParallelConfig, rank: int, precision: Precision, topology: Topology,
    members: Members, weights_only: bool,
) -> RankPlan:
    order = {t.name: i for i, t in enumerate(spec.tensors)}
    kind_order = {k: i for i, (k, _) in enumerate(precision.kinds)}
    sends: list[Transfer] = []
    recvs: list[Transfer] = []
    retains: list[Transfer] = []
    fills: list[Transfer] = []
    src_rank, dst_rank = members.src_rank(rank), members.dst_rank(rank)
    # layout ranks -> processes (the identity within one world)
    as_src = (lambda holders: holders) if members.is_identity else \
        (lambda h: tuple(p for p in (members.src[r] for r in h) if p is not None))  # the dead hold nothing
    as_dst = (lambda holders: holders) if members.is_identity else (lambda h: tuple(members.dst[r] for r in h))
    for group in (0,) if weights_only else (0, 1):  # params first, then the optimizer's state
        for tensor in spec.tensors:
            src_sharded, dst_sharded, kinds = _kind_groups(src, dst, precision.kinds_of(tensor))[group]
            source = state_placement(spec, src, tensor.name, src_sharded, precision if src_sharded else Precision.FP32)
            target = state_placement(spec, dst, tensor.name, dst_sharded, precision if dst_sharded else Precision.FP32)
            vocab_axis = tensor.axis_of(VOCAB)
            if dst_rank is not None:
                for region in target.regions(dst_rank):
                    if vocab_axis is not None:
                        fill = _beyond(region.box, vocab_axis, source.grid.limits[vocab_axis])
                        if fill is not None:
                            fills.extend(Transfer(rank, tensor.name, k, fill) for k in kinds)
                    for dbox, _ in target.pieces(region.box):
                        for box, src_holders in source.pieces(dbox):
                            holders = as_src(src_holders)
                            if not holders and members.holes:  # written from a snapshot after the switch
                                fills.extend(Transfer(rank, tensor.name, k, box) for k in kinds)
                                continue
                            if not holders:
                                raise _lost(spec, src, members, precision)
                            if rank in holders:
                                retains.extend(Transfer(rank, tensor.name, k, box) for k in kinds)
                            else:
                                peer = choose_source(holders, rank, topology)
                                recvs.extend(Transfer(peer, tensor.name, k, box) for k in kinds)
            if src_rank is not None:
                for region in source.regions(src_rank):
                    for abox, src_holders in source.pieces(region.box):
                        holders = as_src(src_holders)
                        held = frozenset(holders)
                        for box, dholders in target.pieces(abox):
                            for dest in as_dst(dholders):
                                if dest in held:
                                    continue
                                if choose_source(holders, dest, topology) == rank:
                                    sends.extend(Transfer(dest, tensor.name, k, box) for k in kinds)

    def key(t: Transfer) -> tuple:
        return (t.peer, order[t.tensor], kind_order[t.kind], t.box.lo)

    return RankPlan(
        rank=rank,
        src=src,
        dst=dst,
        group_size=members.size,
        sends=tuple(sorted(sends, key=key)),
        recvs=tuple(sorted(recvs, key=key)),
        retains=tuple(sorted(retains, key=key)),
        fills=tuple(sorted(fills, key=key)),
        weights_only=weights_only,
    )


def _lost(spec: ModelSpec, src: ParallelConfig, members: Members, precision: Precision) -> StateLostError:
    """The error of a plan that needs a box only dead ranks held: every such box, counted."""
    lost = lost_state(spec, src, members.lost, precision)
    counted, shown = describe_lost(spec, lost, precision)
    return StateLostError(
        f"{counted} of the {src} state were held only "
        f"by the dead rank{'s' * (len(members.lost) > 1)} {', '.join(map(str, members.lost))}: {shown}",
        hint="recover from an in-memory snapshot or the last checkpoint; a layout with data-parallel replicas "
             "(dp >= 2, without zero1 for the optimizer's state) keeps a copy of every box on another rank",
        lost=lost, ranks=members.lost)


def _beyond(box: Box, axis: int, limit: int) -> Box | None:
    """The part of ``box`` at or past ``limit`` on ``axis`` (rows the source layout does not have)."""
    if box.hi[axis] <= limit:
        return None
    lo = list(box.lo)
    lo[axis] = max(lo[axis], limit)
    return Box(tuple(lo), box.hi)


@lru_cache(maxsize=256)
def plan_rank_cached(
    spec: ModelSpec, src: ParallelConfig, dst: ParallelConfig, rank: int, precision: Precision,
    topology: Topology | None = None, members: Members | None = None, weights_only: bool = False,
) -> RankPlan:
    """``plan_rank`` memoised on its inputs (plans are frozen, so sharing them is safe)."""
    return plan_rank(spec, src, dst, rank, precision=precision, topology=topology, members=members,
                     weights_only=weights_only)


def union_world(src: ParallelConfig, dst: ParallelConfig) -> int:
    return max(src.world_size, dst.world_size)


def plan_all(
    spec: ModelSpec,
    src: ParallelConfig,
    dst: ParallelConfig,
    *,
    precision: Precision = Precision.FP32,
    topology: Topology | None = None,
    ranks: Iterable[int] | None = None,
    members: Members | None = None,
    weights_only: bool = False,
) -> dict[int, RankPlan]:
    """Plans of every process of the switch (or of ``ranks``)."""
    size = members.size if members is not None else union_world(src, dst)
    ranks = range(size) if ranks is None else ranks
    return {r: plan_rank(spec, src, dst, r, precision=precision, topology=topology, members=members,
                         weights_only=weights_only) for r in ranks}


__all__ = ["choose_source", "default_topology", "plan_all", "plan_rank", "plan_rank_cached", "union_world"]
