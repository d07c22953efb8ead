"""How much memory one rank's switch needs on top of its old state, from the plan alone (pure).

The engine's order is replayed (``execute_switch``: fills, XOR exchanges stage by stage, retains)
with its memory rules: a destination local tensor takes memory at its first write, a source local
tensor gives it back after its last read, a tensor kept in place does neither. The result is the
peak of (new memory taken - old memory given back) over the switch, without the staging buffers
(at most the budget, on top).

It is an upper bound: a destination tensor is counted whole at its first write, though its pages
fill as it is written. ``shared_source_kinds`` names state kinds whose source tensors are views
into one buffer (megatron's params under the distributed optimizer): they give nothing back until
the end. ``preallocated_kinds`` names destination kinds whose memory was taken before the switch
(a zero1 model's param buffer, zeroed by megatron at construction): writing them takes nothing more.

Example::

    plan = plan_rank(spec, src, dst, rank)
    need = switch_peak_bytes(plan, rank_regions(spec, src, rank), rank_regions(spec, dst, rank),
                             staging_budget="256MiB")
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from lightning_dynatrain.engine.adoption import adoptable_keys
from lightning_dynatrain.engine.engine import _plan_exchanges, _source_reads
from lightning_dynatrain.engine.staging import parse_bytes
from lightning_dynatrain.engine.store import RegionIndex, RegionMap, StoreKey, box_pieces, local_numel
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.plan import RankPlan, Transfer
from lightning_dynatrain.vps.spec import StateKind


class _Ledger:
    def __init__(self, src: RegionIndex, dst: RegionIndex, kept: frozenset[StoreKey], shared: frozenset[StateKind], preallocated: frozenset[StateKind]) -> None:
        self.src, self.dst = src, dst
        self.src_locals, self.dst_locals = src.local_tensors(), dst.local_tensors()
        self.kept, self.shared, self.preallocated = kept, shared, preallocated
        self.reads: Counter[StoreKey] = Counter()
        self.written: set[StoreKey] = set()
        self.net = 0
        self.peak = 0

    def count_reads(self, reads: Iterable[tuple[str, StateKind, object]]) -> None:
        for tensor, kind, box in reads:
            for key, _ in box_pieces(tensor, kind, self.src.find(tensor, kind, box), box):
                self.reads[key] += 1

    def write(self, t: Transfer, box) -> None:
        for key, _ in box_pieces(t.tensor, t.kind, self.dst.find(t.tensor, t.kind, box), box):
            if key in self.written or key in self.kept:
                continue
            self.written.add(key)
            if key[1] not in self.preallocated:
                self.net += local_numel(self.dst_locals[key]) * self.dst_locals[key].itemsize
        self.peak = max(self.peak, self.net)

    def done_reading(self, t: Transfer, box) -> None:
        for key, _ in box_pieces(t.tensor, t.kind, self.src.find(t.tensor, t.kind, box), box):
            self.reads[key] -= 1
            if self.reads[key] == 0:
                self._give_back(key)

    def give_back_unread(self) -> None:
        for key in self.src_locals:
            if self.reads[key] == 0:
                self._give_back(key)

    def _give_back(self, key: StoreKey) -> None:
        if key not in self.kept and key[1] not in self.shared:
            self.net -= local_numel(self.src_locals[key]) * self.src_locals[key].itemsize


def switch_peak_bytes(
    plan: RankPlan,
    source_regions: RegionMap,
    dest_regions: RegionMap,
    *,
    staging_budget: int | str,
    keeps_in_place: bool = True,
    shared_source_kinds: Iterable[StateKind] = (),
    preallocated_kinds: Iterable[StateKind] = (),
) -> int:
    """Peak bytes this rank's switch takes beyond its old state, staging buffers not included.

    ``keeps_in_place``: whole retained tensors are adopted (``adoption.py``), as the engine does with
    its own allocator or an adopter that accepts them.
    """
    budget = parse_bytes(staging_budget)
    src, dst = RegionIndex(source_regions), RegionIndex(dest_regions)
    kept = adoptable_keys(plan.retains, src, dst) if keeps_in_place else frozenset()
    ledger = _Ledger(src, dst, kept, frozenset(shared_source_kinds), frozenset(preallocated_kinds))
    world = max(ParallelConfig.parse(plan.src).world_size, ParallelConfig.parse(plan.dst).world_size)
    exchanges = _plan_exchanges(plan.rank, world, list(plan.sends), list(plan.recvs),
                                lambda tensor, kind: dst.itemsize(tensor, kind) or src.itemsize(tensor, kind), budget)
    ledger.count_reads(_source_reads(plan, exchanges, []))
    ledger.give_back_unread()
    for t in plan.fills:
        ledger.write(t, t.box)
    for peer, mine, theirs, stages in exchanges:
        low = plan.rank < peer
        for stage in stages:
            sent, received = (stage.low, stage.high) if low else (stage.high, stage.low)
            for chunk, _ in received:
                ledger.write(theirs[chunk.item], chunk.box)
            for chunk, _ in sent:
                ledger.done_reading(mine[chunk.item], chunk.box)
    for t in plan.retains:
        ledger.write(t, t.box)
        ledger.done_reading(t, t.box)
    return ledger.peak


__all__ = ["switch_peak_bytes"]
