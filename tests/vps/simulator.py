"""An in-process simulator that runs plans on fake ranks and checks the result element by element.

Every source element holds its global logical index (tensor offset + row-major index, shifted per
state kind), so after running all plans each destination element must hold exactly its own index,
written exactly once, and every send must be owned by its sender.

A recovery from an in-memory snapshot is modelled too: each keeper holds only the copies the
snapshot plan gave it (read from its senders' regions), and a fill piece is written from the copy
kept by the keeper the piece names, so a piece naming the wrong keeper fails, naming it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from functools import lru_cache

import numpy as np

from lightning_dynatrain.vps.box import Box
from lightning_dynatrain.vps.mapping import Region, rank_regions as library_rank_regions
from lightning_dynatrain.vps.members import Members
from lightning_dynatrain.vps.plan import RankPlan, Transfer
from lightning_dynatrain.vps.snapshot_plan import FillPiece, SnapshotPlan
from lightning_dynatrain.vps.spec import ModelSpec, Precision, StateKind


#: the library's ``rank_regions`` (pure), each answer kept: a switch's check asks for every rank's
#: regions of both layouts, in ``simulate`` and again in ``minimum_moved`` (callers only read them)
rank_regions = lru_cache(maxsize=4096)(library_rank_regions)


class LogicalIndices:
    """Each element's global logical index: the tensor's offset (per state kind, in the order of
    ``precision.kinds`` then ``spec.tensors``) plus its row-major index in the tensor. Each tensor's
    table is built once, at its first use; ``of`` returns a read-only view of a box of it."""

    def __init__(self, spec: ModelSpec, precision: Precision) -> None:
        self.spec, self.bases, self.tables = spec, {}, {}
        base = 0
        for k, _ in precision.kinds:
            for t in spec.tensors:
                self.bases[(t.name, k)] = base
                base += t.numel

    def of(self, tensor: str, kind, box: Box) -> np.ndarray:
        table = self.tables.get((tensor, kind))
        if table is None:
            shape = self.spec.tensor(tensor).shape
            table = np.arange(self.bases[(tensor, kind)], self.bases[(tensor, kind)] + int(np.prod(shape)),
                              dtype=np.int64).reshape(shape)
            table.flags.writeable = False
            self.tables[(tensor, kind)] = table
        return table[box.relative_to((0,) * len(box.lo))]


def _find(regions: list[Region], box: Box) -> Region:
    for r in regions:
        if r.box.contains(box):
            return r
    raise AssertionError(f"no region contains {box}")


def _view(arr: np.ndarray, region: Region, box: Box) -> np.ndarray:
    return arr[box.relative_to(region.box.lo)]


class SimulationResult:
    def __init__(self) -> None:
        self.moved_elements = 0
        self.retained_elements = 0
        self.dest_elements = 0
        self.filled_elements = 0
        self.patched_elements = 0


KeptCopies = dict[int, dict[tuple[str, StateKind, Box], np.ndarray]]


def kept_copies(spec: ModelSpec, snapshot: SnapshotPlan, indices: LogicalIndices | None = None) -> KeptCopies:
    """What each old rank keeps for others after a snapshot: by keeper, the copy of every box
    ``snapshot.copies`` gives it, as its sender held it (the sender must hold the box)."""
    indices = indices or LogicalIndices(spec, snapshot.precision)
    kept: KeptCopies = {}
    for c in snapshot.copies:
        regions = rank_regions(spec, snapshot.layout, c.sender, snapshot.precision).get((c.tensor, c.kind), [])
        region = _find(regions, c.box)  # the sender copies out what it holds, nothing else
        held = indices.of(c.tensor, c.kind, region.box)
        copies = kept.setdefault(c.keeper, {})
        assert (c.tensor, c.kind, c.box) not in copies, f"old rank {c.keeper} keeps {c.tensor} {c.box} twice"
        copies[(c.tensor, c.kind, c.box)] = _view(held, region, c.box).copy()
    return kept


def _keeper_data(kept: KeptCopies, members: Members, piece: FillPiece,
                 keepers: Mapping[tuple[str, StateKind, Box], int] | None) -> np.ndarray:
    """``piece``'s data as its keeper sends it: a slice of the copy the named keeper holds of
    ``piece.lost``; an ``AssertionError`` naming the piece, its keeper and the actual ones if the
    keeper holds no such copy, or is not the one ``keepers`` (old ranks) names for the box."""
    key = (piece.tensor, piece.kind, piece.lost)
    old = members.src_rank(piece.keeper)  # fill pieces name processes; the snapshot plan old ranks
    what = (f"fill piece {piece.tensor} {piece.kind.value} {piece.piece} of lost box {piece.lost} -> process "
            f"{piece.dest}: its keeper, process {piece.keeper} (old rank {old})")
    if old is None or key not in kept.get(old, {}):
        actual = [f"old rank {r} ({'dead' if members.src[r] is None else f'process {members.src[r]}'})"
                  for r in sorted(r for r, copies in kept.items() if key in copies)]
        raise AssertionError(f"{what}, keeps no copy of that box; kept by {', '.join(actual) or 'no rank'}")
    if keepers is not None:
        assert keepers.get(key) == old, \
            f"{what}, is not the box's keeper in the recovery source (old rank {keepers.get(key)})"
    assert piece.lost.contains(piece.piece), f"{what}: the piece is not inside its lost box"
    return kept[old][key][piece.piece.relative_to(piece.lost.lo)]


def simulate(spec, src, dst, plans: dict[int, RankPlan], precision=Precision.FP32,
             members: Members | None = None, patch: Sequence[FillPiece] = (), snapshot: SnapshotPlan | None = None,
             keepers: Mapping[tuple[str, StateKind, Box], int] | None = None,
             weights_only: bool = False) -> SimulationResult:
    """Run ``plans`` (every process of the switch) and assert the destination state is exact.
    ``members``: which process holds each source and destination rank (default: the same);
    ``patch``: with ``members.holes``, the pieces a snapshot's keepers write after the switch, which
    must fill every hole the plans left, once. ``snapshot``: the plan the snapshot was taken with (at
    ``src``; needed with a ``patch``): each keeper holds only the copies it gives it, and a piece is
    written from the copy its named keeper (a process, see ``members``) holds, or fails naming it;
    ``keepers``: the old rank keeping each lost box (``SnapshotSource.keepers``), which every
    piece's keeper must be. ``weights_only``: the destination's params alone must be written (a
    rollout's switch); a transfer of any other kind fails."""
    indices = LogicalIndices(spec, precision)
    assert not patch or snapshot is not None, "a patch needs the snapshot plan: the keepers hold only its copies"
    if snapshot is not None:
        assert (snapshot.layout, snapshot.precision) == (src, precision), "the snapshot is not of the source state"
    kept = kept_copies(spec, snapshot, indices) if snapshot is not None else {}
    members = members or Members.same(src.world_size, dst.world_size)
    src_regions = {p: rank_regions(spec, src, r, precision) for r, p in enumerate(members.src) if p is not None}
    dst_regions = {members.dst[r]: _kinds(rank_regions(spec, dst, r, precision), weights_only)
                   for r in range(dst.world_size)}
    # source storage: each region holds the global indices of its elements
    src_store = {
        (r, key, i): indices.of(key[0], key[1], reg.box)
        for r, regs in src_regions.items() for key, lst in regs.items() for i, reg in enumerate(lst)
    }
    dst_store = {}
    writes = {}
    for r, regs in dst_regions.items():
        for key, lst in regs.items():
            for i, reg in enumerate(lst):
                dst_store[(r, key, i)] = np.full(reg.box.shape, -1, dtype=np.int64)
                writes[(r, key, i)] = np.zeros(reg.box.shape, dtype=np.int64)

    # sends and receives must mirror each other exactly, in the same order per peer
    sent = Counter()
    for r, plan in plans.items():
        for t in plan.sends:
            sent[(r, t.peer, t.tensor, t.kind, t.box)] += 1
            # the sender owns what it sends
            _find(src_regions[r][(t.tensor, t.kind)], t.box)
    received = Counter()
    for r, plan in plans.items():
        for t in plan.recvs:
            received[(t.peer, r, t.tensor, t.kind, t.box)] += 1
    assert sent == received, "send and receive lists do not mirror each other"
    for r, plan in plans.items():
        for peer in plan.peers():
            mine = [(t.tensor, t.kind, t.box) for t in plan.sends_to(peer)]
            theirs = [(t.tensor, t.kind, t.box) for t in plans[peer].recvs_from(r)]
            assert mine == theirs, f"rank {r} -> {peer}: order of boxes differs"

    result = SimulationResult()

    def copy(src_rank: int, dst_rank: int, t: Transfer) -> None:
        key = (t.tensor, t.kind)
        s_regs = src_regions[src_rank][key]
        s_i = s_regs.index(_find(s_regs, t.box))
        d_regs = dst_regions[dst_rank][key]
        d_i = d_regs.index(_find(d_regs, t.box))
        _view(dst_store[(dst_rank, key, d_i)], d_regs[d_i], t.box)[...] = _view(
            src_store[(src_rank, key, s_i)], s_regs[s_i], t.box)
        _view(writes[(dst_rank, key, d_i)], d_regs[d_i], t.box)[...] += 1

    for r, plan in plans.items():
        for t in plan.recvs:
            copy(t.peer, r, t)
            result.moved_elements += t.box.numel
        for t in plan.retains:
            assert t.peer == r
            copy(r, r, t)
            result.retained_elements += t.box.numel
        for t in plan.fills:
            key = (t.tensor, t.kind)
            d_regs = dst_regions[r][key]
            d_i = d_regs.index(_find(d_regs, t.box))
            tensor = spec.tensor(t.tensor)
            axis = tensor.axes.index("vocab") if "vocab" in tensor.axes else None
            if axis is None or t.box.lo[axis] < min(spec.padded_vocab(src.tp), tensor.shape[axis]):
                assert members.holes, f"rank {r}: a fill of {key} {t.box} outside the vocabulary padding"
                continue  # a hole: zeroed, then written by the patch
            # otherwise only vocabulary padding rows the source layout does not have may be filled
            assert t.box.lo[axis] >= min(spec.padded_vocab(src.tp), tensor.shape[axis]) >= spec.vocab_size
            _view(dst_store[(r, key, d_i)], d_regs[d_i], t.box)[...] = indices.of(t.tensor, t.kind, t.box)
            _view(writes[(r, key, d_i)], d_regs[d_i], t.box)[...] += 1
            result.filled_elements += t.box.numel

    for piece in patch:  # the keepers' fill: from the copy the named keeper holds, nothing else
        data = _keeper_data(kept, members, piece, keepers)
        key = (piece.tensor, piece.kind)
        d_regs = dst_regions[piece.dest][key]
        d_i = d_regs.index(_find(d_regs, piece.piece))
        _view(dst_store[(piece.dest, key, d_i)], d_regs[d_i], piece.piece)[...] = data
        _view(writes[(piece.dest, key, d_i)], d_regs[d_i], piece.piece)[...] += 1
        result.patched_elements += piece.piece.numel

    for (r, key, i), arr in dst_store.items():
        reg = dst_regions[r][key][i]
        w = writes[(r, key, i)]
        assert (w == 1).all(), f"rank {r} {key} {reg.box}: elements written {w.min()}..{w.max()} times"
        assert (arr == indices.of(key[0], key[1], reg.box)).all(), f"rank {r} {key}: wrong data"
        result.dest_elements += arr.size
    return result


def _kinds(regions: dict, weights_only: bool) -> dict:
    """``regions`` (by tensor and kind), of the params alone when ``weights_only``."""
    return {key: regs for key, regs in regions.items() if not weights_only or key[1] is StateKind.PARAM}


def minimum_moved(spec, src, dst, precision=Precision.FP32, members: Members | None = None,
                  weights_only: bool = False) -> int:
    """Elements destination ranks need, did not hold, and some source rank holds (brute force;
    ``weights_only``: of the params alone)."""
    members = members or Members.same(src.world_size, dst.world_size)
    src_regions = [rank_regions(spec, src, r, precision) for r in range(src.world_size)]
    held: dict = {}  # each box once, however many replicas hold it (the dead hold nothing)
    for regions in (regs for regs, p in zip(src_regions, members.src) if p is not None):
        for key, regs in regions.items():
            held.setdefault(key, set()).update(reg.box for reg in regs)
    total = 0
    for r in range(dst.world_size):
        src_rank = members.src_rank(members.dst[r])
        have = src_regions[src_rank] if src_rank is not None else {}
        for key, regs in _kinds(rank_regions(spec, dst, r, precision), weights_only).items():
            for reg in regs:
                exists = np.zeros(reg.box.shape, dtype=bool)
                for box in held.get(key, []):
                    inter = box.intersect(reg.box)
                    if inter is not None:
                        exists[inter.relative_to(reg.box.lo)] = True
                need = exists.copy()
                for h in have.get(key, []):
                    inter = h.box.intersect(reg.box)
                    if inter is not None:
                        need[inter.relative_to(reg.box.lo)] = False
                total += int(need.sum())
    return total


def held_elements(spec: ModelSpec, layout, precision=Precision.FP32) -> dict[tuple[str, StateKind], np.ndarray]:
    """Brute force from each rank's regions: for every (tensor, kind), a boolean array shaped
    ``(world_size, *tensor shape)`` saying which elements each rank holds."""
    out: dict[tuple[str, StateKind], np.ndarray] = {}
    for r in range(layout.world_size):
        for key, regs in rank_regions(spec, layout, r, precision).items():
            held = out.setdefault(key, np.zeros((layout.world_size, *spec.tensor(key[0]).shape), dtype=bool))
            for reg in regs:
                held[(r, *reg.box.relative_to((0,) * reg.box.ndim))] = True
    return out


def only_held_by(held: dict[tuple[str, StateKind], np.ndarray], ranks) -> dict[tuple[str, StateKind], np.ndarray]:
    """Per (tensor, kind) of ``held`` (``held_elements``), the elements some of ``ranks`` hold and
    no other rank does (what losing ``ranks`` loses)."""
    ranks = sorted(ranks)
    out = {}
    for key, h in held.items():
        others = np.delete(h, ranks, axis=0)
        out[key] = h[ranks].any(axis=0) & ~others.any(axis=0)
    return out
