"""Collective promotion: one ``broadcast`` instead of k point-to-point sends of the same box.

When the planner has a source rank send the same ``(tensor, kind, box)`` to ``k >= 2`` peers (new
data-parallel replicas all reading from the one rank that holds a shard), a broadcast in the
subgroup ``{sender} ∪ peers`` can move it once. Whether that pays depends on the links, so the
decision is made by a cost model fed with measured bandwidths (``measure_link_costs``):

- point to point: the sender pushes ``k * B`` bytes through its link: ``k * B / p2p_bytes_per_s``;
- broadcast: ``broadcast_setup_s + B / broadcast_bytes_per_s``, the bandwidth measured over the
  whole group (a ring or tree broadcast, NCCL's, costs about ``B / bw`` whatever k; gloo's pushes to
  each member in turn, which the measurement over the whole group shows as a low bandwidth, so the
  model stays conservative for smaller k).

Without costs nothing is promoted. A sender's jobs follow from its plan and the costs alone, so
each member of a job computes the same job (``compile_switch`` asks for the plans of the senders a
rank receives from; ``measure_link_costs`` agrees on the costs with an all-reduce), creates its
subgroup and runs its broadcasts in the same global order (sorted by members). That order, and
running all broadcasts in a phase of their own before the XOR steps, is what keeps the switch free
of deadlocks: the first unfinished broadcast always has all its members waiting on it.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from lightning_dynatrain.compat.torch_internals import is_registered, named_group_count
from lightning_dynatrain.transition.comm import GroupComm
from lightning_dynatrain.vps.box import Box
from lightning_dynatrain.vps.plan import RankPlan
from lightning_dynatrain.vps.spec import StateKind

Item = tuple[str, StateKind, Box]


@dataclass(frozen=True, slots=True)
class LinkCosts:
    """Measured link speeds of a group (identical on every rank).

    Attributes:
        p2p_bytes_per_s: one direction of a pairwise exchange, both directions running at once.
        broadcast_bytes_per_s: payload bytes over seconds of a broadcast over the whole group.
        broadcast_setup_s: the time of a tiny broadcast (latency, launch and subgroup overhead).
    """

    p2p_bytes_per_s: float
    broadcast_bytes_per_s: float
    broadcast_setup_s: float = 0.0

    def p2p_seconds(self, nbytes: int, peers: int) -> float:
        return peers * nbytes / self.p2p_bytes_per_s

    def broadcast_seconds(self, nbytes: int) -> float:
        return self.broadcast_setup_s + nbytes / self.broadcast_bytes_per_s

    def broadcast_pays(self, nbytes: int, peers: int) -> bool:
        """True when one broadcast of ``nbytes`` beats ``peers`` point-to-point sends of it."""
        return self.broadcast_seconds(nbytes) < self.p2p_seconds(nbytes, peers)

    def __str__(self) -> str:
        return (f"p2p {self.p2p_bytes_per_s / 2**20:.1f} MiB/s, broadcast {self.broadcast_bytes_per_s / 2**20:.1f}"
                f" MiB/s + {self.broadcast_setup_s * 1e6:.0f} us")


class BroadcastJob(NamedTuple):
    """Boxes one sender broadcasts to the same receivers, in the sender's plan order."""

    sender: int
    receivers: tuple[int, ...]
    items: tuple[Item, ...]

    @property
    def members(self) -> tuple[int, ...]:
        return tuple(sorted((self.sender,) + self.receivers))

    def __str__(self) -> str:
        return f"bcast {self.sender}->{list(self.receivers)} ({len(self.items)} boxes)"


@dataclass(frozen=True, slots=True)
class BroadcastPlan:
    """The promoted broadcasts of one switch, in the global order every rank runs them in."""

    jobs: tuple[BroadcastJob, ...] = ()

    def member_sets(self) -> tuple[tuple[int, ...], ...]:
        """Every subgroup the plan needs (plan ranks), sorted: the order to create them in."""
        return tuple(sorted({j.members for j in self.jobs}))

    def jobs_of(self, rank: int) -> tuple[BroadcastJob, ...]:
        return tuple(j for j in self.jobs if rank in j.members)

    def promoted(self, rank: int) -> frozenset[tuple[int, int, str, StateKind, Box]]:
        """``(sender, receiver, tensor, kind, box)`` of every transfer of ``rank`` a broadcast carries."""
        return frozenset(
            (j.sender, r, t, k, b) for j in self.jobs_of(rank) for r in j.receivers for t, k, b in j.items
        )

    def __str__(self) -> str:
        return "; ".join(map(str, self.jobs)) or "no broadcasts"


def plan_broadcasts(plans: Mapping[int, RankPlan], costs: LinkCosts | None, *,
                    itemsize: Callable[[str, StateKind], int], min_peers: int = 2,
                    member: int | None = None) -> BroadcastPlan:
    """The broadcasts worth running instead of point-to-point sends, from the senders' plans.

    A box a sender sends to ``min_peers`` or more peers is grouped with the sender's other boxes for
    the same peers into one job; a job is promoted when ``costs`` says one broadcast of its bytes
    (``itemsize(tensor, kind)`` per element) beats that many sends. ``costs=None`` promotes nothing.
    Pure and deterministic; each sender's jobs depend on its plan only, so the plans of a subset of
    senders give exactly those senders' jobs. ``member``: only the jobs that rank takes part in
    (``itemsize`` is then asked only about what it holds).
    """
    if costs is None:
        return BroadcastPlan()
    jobs: list[BroadcastJob] = []
    for sender in sorted(plans):
        peers_of: dict[Item, list[int]] = defaultdict(list)
        for t in plans[sender].sends:
            peers_of[(t.tensor, t.kind, t.box)].append(t.peer)
        by_receivers: dict[tuple[int, ...], list[Item]] = defaultdict(list)
        for item, peers in peers_of.items():  # dicts keep the plan's order
            if len(peers) >= min_peers:
                by_receivers[tuple(sorted(peers))].append(item)
        for receivers, items in by_receivers.items():
            if member is not None and member != sender and member not in receivers:
                continue
            nbytes = sum(b.numel * itemsize(t, k) for t, k, b in items)
            if costs.broadcast_pays(nbytes, len(receivers)):
                jobs.append(BroadcastJob(sender, receivers, tuple(items)))
    jobs.sort(key=lambda j: (j.members, j.sender, j.receivers))
    return BroadcastPlan(tuple(jobs))


class SubgroupNamingError(RuntimeError):
    """The members of a broadcast subgroup would create it under different names (and wait forever)."""


def diverging_names(counts: Mapping[int, int], member_sets: Iterable[tuple[int, ...]]
                    ) -> list[tuple[tuple[int, ...], dict[int, int]]]:
    """The member sets, created in the given order with ``use_local_synchronization``, whose members
    would name the group differently: torch hashes each member's count of named groups into the
    name, and each creation adds one on its members only. ``counts``: rank -> that count before the
    first. Returns ``(members, {rank: count})`` for each set that diverges (pure: no process needed)."""
    counts = dict(counts)
    clashes = []
    for members in member_sets:
        seen = {r: counts[r] for r in members}
        if len(set(seen.values())) > 1:
            clashes.append((members, seen))
        for r in members:
            counts[r] += 1
    return clashes


class SubgroupCache:
    """Subgroups for broadcasts, created once and kept by their members (global ranks).

    Pass the same cache to every switch of a run (a strategy owns one): switching back to a layout
    then creates nothing. ``ensure`` is collective: the ranks gather the member sets each takes
    part in, and all create the missing ones in sorted order.

    How torch names a new group decides whether its members meet: a group made by every process of
    the default world (``new_group`` without local synchronization) is named by a counter all of them
    advance together, so that is how a switch over a group spanning the world (the switch's own
    group, or WORLD) creates them. Over a group of fewer processes only its members can call, with
    ``use_local_synchronization``, and torch names such a group by its ranks *and* by how many groups
    each creating process has registered: members with different histories (a subgroup made earlier
    that some of them are not in) would wait on different names until the timeout. ``ensure``
    checks that first and raises ``SubgroupNamingError`` naming the ranks. ``close()`` destroys them.
    """

    def __init__(self) -> None:
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}

    def ensure(self, member_sets: Iterable[tuple[int, ...]], comm: GroupComm, *,
               timeout: timedelta | None = None) -> None:
        """Create the missing subgroups of every rank's ``member_sets`` (plan ranks: the broadcasts
        each rank takes part in), in sorted order, with ``timeout`` (default torch's). Collective
        over ``comm``: every rank calls it, with what it knows (possibly nothing).

        Raises:
            SubgroupNamingError: ``comm`` spans fewer processes than the world and its members'
                histories would give a subgroup different names (nothing was created).
        """
        spans_world = comm.size == dist.get_world_size()
        gathered: list[tuple[list[tuple[int, ...]], int] | None] = [None] * comm.size
        dist.all_gather_object(gathered, (sorted(set(member_sets)), 0 if spans_world else named_group_count()),
                               group=comm.group)
        wanted = sorted({tuple(m) for sets, _ in gathered for m in sets})  # type: ignore[misc]
        missing = [members for members in wanted if comm.global_ranks(members) not in self._groups]
        if not spans_world:
            counts = {r: count for r, (_, count) in enumerate(gathered)}  # type: ignore[misc]
            clashes = diverging_names(counts, missing)
            if clashes:
                members, counts = clashes[0]
                raise SubgroupNamingError(
                    f"the broadcast subgroup of ranks {members} would get a different name on each of its members "
                    f"(torch names a locally synchronized group by each member's count of groups: {counts}), "
                    f"so they would never meet; {len(clashes)} of {len(missing)} new subgroups diverge. "
                    "Switch over a group spanning every process of the default world, or without link costs "
                    "(no broadcasts)")
        for members in missing:
            ranks = comm.global_ranks(members)
            self._groups[ranks] = dist.new_group(list(ranks), use_local_synchronization=not spans_world,
                                                 timeout=timeout)

    def get(self, members: tuple[int, ...], comm: GroupComm) -> dist.ProcessGroup:
        ranks = comm.global_ranks(members)
        assert ranks in self._groups, f"subgroup {ranks} used before ensure()"
        return self._groups[ranks]

    def __len__(self) -> int:
        return len(self._groups)

    def close(self) -> None:
        for group in self._groups.values():
            if is_registered(group):
                dist.destroy_process_group(group)
        self._groups.clear()


def measure_link_costs(group: dist.ProcessGroup | None = None, *, nbytes: int = 4 * 2**20,
                       device: torch.device | None = None) -> LinkCosts:
    """Time one pairwise exchange and one broadcast of ``nbytes`` on ``group``; same result on every rank.

    Pairs are ``(i, i ^ 1)`` exchanging both ways at once; the broadcast goes from group rank 0 to the
    whole group; a one-element broadcast gives the setup time. Each figure is the slowest rank's
    (an all-reduce MAX), so every rank gets the same ``LinkCosts``. Collective: call on every rank.
    """
    comm = GroupComm(group, device)
    if comm.size == 1:
        return LinkCosts(float("inf"), float("inf"), 0.0)
    send = torch.zeros(nbytes, dtype=torch.uint8, device=comm.device)
    recv = torch.empty_like(send)
    tiny = torch.zeros(1, dtype=torch.uint8, device=comm.device)
    peer = comm.rank ^ 1

    def exchange(a: torch.Tensor, b: torch.Tensor) -> None:
        if peer < comm.size:
            ops = [dist.P2POp(dist.isend, a, group=group, group_peer=peer),
                   dist.P2POp(dist.irecv, b, group=group, group_peer=peer)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        comm.synchronize()

    def timed(fn) -> float:
        dist.barrier(group=group)
        comm.synchronize()
        start = time.perf_counter()
        fn()
        comm.synchronize()
        return time.perf_counter() - start

    exchange(tiny, tiny.clone())  # warm-up: lazily created communicators and connections
    dist.broadcast(tiny, group=group, group_src=0)
    t_p2p = timed(lambda: exchange(send, recv))
    t_bcast = timed(lambda: dist.broadcast(send, group=group, group_src=0))
    t_setup = timed(lambda: dist.broadcast(tiny, group=group, group_src=0))
    times = torch.tensor([t_p2p, t_bcast, t_setup], dtype=torch.float64, device=comm.device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    t_p2p, t_bcast, t_setup = times.tolist()
    return LinkCosts(nbytes / max(t_p2p, 1e-9), nbytes / max(t_bcast, 1e-9), t_setup)


__all__ = ["BroadcastJob", "BroadcastPlan", "LinkCosts", "SubgroupCache", "SubgroupNamingError", "diverging_names",
           "measure_link_costs", "plan_broadcasts"]
