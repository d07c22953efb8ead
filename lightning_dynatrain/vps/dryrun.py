"""Dry run of a switch at cluster scale: plan every rank, add up the bytes, estimate the time.

Every rank's plan is computed exactly (the same function a rank runs in a real switch). Ranks share
the planner's caches here (atoms, holder lists, Megatron buffer layouts), which is how symmetric
ranks cost little after the first; the per-rank figure is also measured *cold* (caches cleared) on
a spread of ranks, since that is what one real rank pays.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from lightning_dynatrain.vps.grid import grid_placement
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.mapping import state_placement
from lightning_dynatrain.vps.plan import RankPlan
from lightning_dynatrain.vps.planner import choose_source, default_topology, plan_rank, union_world
from lightning_dynatrain.vps.spec import ModelSpec, Precision
from lightning_dynatrain.vps.topology import Topology
from lightning_dynatrain.vps.validate import validate_layout
from lightning_dynatrain.vps.zero_buffer import shard_buffer

GB = 1e9


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkModel:
    """Bandwidths (bytes/s, per rank and direction) used to estimate the transfer time.

    Attributes:
        intra_node: GPU-to-GPU inside a node (NVLink class).
        inter_node: across nodes (one 200 Gb/s NIC per GPU is 25 GB/s).
        local_copy: device memory copy for retained state.
    """

    intra_node: float = 150 * GB
    inter_node: float = 25 * GB
    local_copy: float = 1000 * GB


@dataclass(frozen=True, kw_only=True, slots=True)
class DryRunReport:
    """The figures of one planned switch. Bytes count params and every optimizer state kind, or the
    params alone when ``weights_only`` (a rollout's switch)."""

    weights_only: bool
    parameters: int
    state_bytes: int
    moved_bytes: int
    retained_bytes: int
    intra_node_bytes: int
    inter_node_bytes: int
    max_rank_send_bytes: int
    max_rank_recv_bytes: int
    plan_seconds: float
    plan_seconds_per_rank_max: float
    estimated_transfer_seconds: float

    def as_dict(self) -> dict:
        return asdict(self)


def clear_planner_caches() -> None:
    state_placement.cache_clear()
    grid_placement.cache_clear()
    shard_buffer.cache_clear()
    choose_source.cache_clear()


def _sample(ranks: list[int], count: int) -> list[int]:
    if len(ranks) <= count:
        return ranks
    step = (len(ranks) - 1) / (count - 1)
    return sorted({ranks[round(i * step)] for i in range(count)})


def dry_run(
    spec: ModelSpec,
    src: ParallelConfig,
    dst: ParallelConfig,
    *,
    precision: Precision = Precision.BF16,
    topology: Topology | None = None,
    links: LinkModel = LinkModel(),
    only_rank: int | None = None,
    cold_samples: int = 32,
    weights_only: bool = False,
) -> tuple[DryRunReport, dict[int, RankPlan]]:
    """Plan the switch ``src -> dst`` on every rank (or only ``only_rank``) and add it up.

    Returns the report and, when ``only_rank`` is given, that rank's plan (else an empty dict).
    """
    validate_layout(src, spec)
    validate_layout(dst, spec)
    world = union_world(src, dst)
    topology = default_topology(src, dst) if topology is None else topology.covers(world)
    if only_rank is not None and not 0 <= only_rank < world:
        raise IndexError(f"rank {only_rank} is outside the union world of {world} ranks")
    ranks = list(range(world)) if only_rank is None else [only_rank]

    # cold: what one rank pays alone
    cold_max = 0.0
    for r in _sample(ranks, cold_samples):
        clear_planner_caches()
        t0 = time.perf_counter()
        plan_rank(spec, src, dst, r, precision=precision, topology=topology, weights_only=weights_only)
        cold_max = max(cold_max, time.perf_counter() - t0)

    # every rank, sharing caches; each plan is added up and dropped (a rank keeps only its own)
    kept_plans: dict[int, RankPlan] = {}
    total = warm_max = est = 0.0
    moved = retained = intra = inter = max_send = max_recv = 0
    for r in ranks:
        t0 = time.perf_counter()
        plan = plan_rank(spec, src, dst, r, precision=precision, topology=topology, weights_only=weights_only)
        dt = time.perf_counter() - t0
        total += dt
        warm_max = max(warm_max, dt)
        if only_rank is not None:
            kept_plans[r] = plan
        send_intra, send_inter = _split_bytes(plan.sends, r, topology, spec, precision)
        recv_intra, recv_inter = _split_bytes(plan.recvs, r, topology, spec, precision)
        kept = plan.bytes(plan.retains, spec, precision)
        moved += recv_intra + recv_inter
        intra += recv_intra
        inter += recv_inter
        retained += kept
        max_send = max(max_send, send_intra + send_inter)
        max_recv = max(max_recv, recv_intra + recv_inter)
        wire = max(send_intra / links.intra_node + send_inter / links.inter_node,
                   recv_intra / links.intra_node + recv_inter / links.inter_node)
        est = max(est, wire + kept / links.local_copy)

    report = DryRunReport(
        weights_only=weights_only,
        parameters=spec.parameters,
        state_bytes=spec.state_bytes(precision, weights_only=weights_only),
        moved_bytes=moved,
        retained_bytes=retained,
        intra_node_bytes=intra,
        inter_node_bytes=inter,
        max_rank_send_bytes=max_send,
        max_rank_recv_bytes=max_recv,
        plan_seconds=total,
        plan_seconds_per_rank_max=max(cold_max, warm_max),
        estimated_transfer_seconds=est,
    )
    return report, kept_plans


def _split_bytes(transfers, rank: int, topology: Topology, spec: ModelSpec, precision: Precision) -> tuple[int, int]:
    """Bytes of ``transfers`` to/from peers on the same node, and on other nodes."""
    intra = inter = 0
    for t in transfers:
        b = t.box.numel * spec.itemsize(t.tensor, t.kind, precision)
        if topology.same_node(t.peer, rank):
            intra += b
        else:
            inter += b
    return intra, inter
