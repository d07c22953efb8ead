"""What one rank's switch cost: seconds per phase, bytes by locality and by primitive, staging peak.

``SwitchReport`` is frozen and prints on one line, for logs and for the Trainer's loggers::

    rank 1 dp2-tp1-pp1->dp1-tp2-pp1: 0.0123s (plan 0.0010 alloc 0.0001 copy 0.0004 pack 0.0020 ...)
      sent 1.0 MiB (intra 1.0 MiB, inter 0 B) recv ... retained ... stages 3 peak 2.0 MiB/4.0 MiB ...

Bytes are *logical*: a box delivered to a peer counts once per peer, whatever primitive carried it.
``p2p``, ``broadcast``, ``local_copy`` and ``in_place`` count what each primitive handled on this
rank: operations posted (an ``isend`` and an ``irecv`` are two; a local tensor kept in place is one)
and payload bytes (a broadcast of B bytes counts B on every member that joined it). Retained bytes
are ``local_copy`` plus ``in_place`` bytes.

``SwitchRecorder`` is the mutable accumulator the engine fills while it runs; it lives for one
switch only and produces the frozen report at the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from lightning_dynatrain.transition.staging import format_bytes
from lightning_dynatrain.vps.topology import Topology

PHASES = ("plan", "allocate", "copy", "pack", "transfer", "unpack", "free")


@dataclass(frozen=True, slots=True)
class PrimitiveStats:
    """Operations one primitive ran on a rank and the payload bytes it carried."""

    ops: int = 0
    bytes: int = 0

    def __str__(self) -> str:
        return f"{self.ops}/{format_bytes(self.bytes)}"


@dataclass(frozen=True, slots=True, kw_only=True)
class SwitchReport:
    """One rank's figures for one switch.

    Attributes:
        rank: the rank (plan numbering).
        src: source layout, printed.
        dst: destination layout, printed.
        plan_s ... free_s: seconds per phase (``PHASES``): ``plan`` (checks, schedule, stages,
            subgroups), ``allocate`` (destination tensors), ``copy`` (retained boxes), ``pack``,
            ``transfer`` (waiting on p2p and broadcasts), ``unpack``, ``free`` (dropping source tensors).
        total_seconds: wall time of the whole switch on this rank.
        sent_intra_node_bytes / sent_inter_node_bytes: bytes this rank delivered to peers on its
            node / on other nodes (the switch's ``Topology``).
        recv_intra_node_bytes / recv_inter_node_bytes: bytes this rank received, by the sender's node.
        retained_bytes: bytes this rank keeps: copied from the old storage to the new, or kept in place.
        stages: pack buffers exchanged (p2p stages with a peer, plus broadcast stages joined).
        peak_staging_bytes: most bytes of pack/unpack buffers alive at once (measured).
        staging_budget_bytes: the budget the switch ran under.
        p2p, broadcast, local_copy, in_place: operations and bytes per primitive (``in_place``: local
            tensors the new layout took over from the old one, no copy).
        p2p_direct: the part of ``p2p`` sent from or received into state storage directly (no
            pack or unpack copy on this rank).
        local_copy_pages: the bytes of ``local_copy`` moved by their whole pages instead of copied
            (the recycling memory policy, CPU), and the copies that did so.
        recv_broadcast_bytes: of the bytes received, those promoted broadcasts carried.
    """

    rank: int
    src: str
    dst: str
    plan_s: float
    allocate_s: float
    copy_s: float
    pack_s: float
    transfer_s: float
    unpack_s: float
    free_s: float
    total_seconds: float
    sent_intra_node_bytes: int
    sent_inter_node_bytes: int
    recv_intra_node_bytes: int
    recv_inter_node_bytes: int
    retained_bytes: int
    stages: int
    peak_staging_bytes: int
    staging_budget_bytes: int
    p2p: PrimitiveStats
    p2p_direct: PrimitiveStats
    broadcast: PrimitiveStats
    local_copy: PrimitiveStats
    in_place: PrimitiveStats
    local_copy_pages: PrimitiveStats = PrimitiveStats()
    recv_broadcast_bytes: int = 0

    @property
    def seconds(self) -> dict[str, float]:
        """Seconds per phase, keyed by ``PHASES``."""
        return {p: getattr(self, f"{p}_s") for p in PHASES}

    @property
    def sent_bytes(self) -> int:
        return self.sent_intra_node_bytes + self.sent_inter_node_bytes

    @property
    def recv_bytes(self) -> int:
        return self.recv_intra_node_bytes + self.recv_inter_node_bytes

    def __str__(self) -> str:
        phases = " ".join(f"{p} {s:.4f}" for p, s in self.seconds.items())
        return (
            f"rank {self.rank} {self.src}->{self.dst}: {self.total_seconds:.4f}s ({phases})"
            f" | sent {format_bytes(self.sent_bytes)} (intra {format_bytes(self.sent_intra_node_bytes)},"
            f" inter {format_bytes(self.sent_inter_node_bytes)})"
            f" recv {format_bytes(self.recv_bytes)} (intra {format_bytes(self.recv_intra_node_bytes)},"
            f" inter {format_bytes(self.recv_inter_node_bytes)})"
            f" retained {format_bytes(self.retained_bytes)}"
            f" | stages {self.stages} peak {format_bytes(self.peak_staging_bytes)}"
            f"/{format_bytes(self.staging_budget_bytes)}"
            f" | p2p {self.p2p} (direct {self.p2p_direct}) bcast {self.broadcast} copy {self.local_copy} (by pages {self.local_copy_pages}) in place {self.in_place}"
        )


class SwitchRecorder:
    """Accumulates one switch's figures on one rank (mutable, local to one ``execute_switch`` call)."""

    def __init__(self, rank: int, topology: Topology, sync: Callable[[], None] = lambda: None) -> None:
        self.rank = rank
        self.topology = topology
        self._sync = sync
        self.seconds = {p: 0.0 for p in PHASES}
        self.sent = [0, 0]  # intra, inter
        self.recv = [0, 0]
        self.retained = 0
        self.recv_broadcast = 0
        self.stages = 0
        self.live_staging = 0
        self.peak_staging = 0
        self.ops = {"p2p": [0, 0], "p2p_direct": [0, 0], "broadcast": [0, 0], "local_copy": [0, 0], "in_place": [0, 0],
                    "local_copy_pages": [0, 0]}
        self._start = time.perf_counter()

    @contextmanager
    def phase(self, name: str, *, sync: bool = True) -> Iterator[None]:
        """Time a phase. With ``sync``, wait for queued device kernels first, so their time lands here.

        Small repeated phases (one retain copy, one allocation) pass ``sync=False`` and the caller
        syncs once after the loop (``settle``): a device sync per box costs more than the copies.
        """
        start = time.perf_counter()
        try:
            yield
        finally:
            if sync:
                self._sync()
            self.seconds[name] += time.perf_counter() - start

    def settle(self, name: str) -> None:
        """Wait for queued device work and book the wait to phase ``name``."""
        with self.phase(name):
            pass

    def same_node(self, peer: int) -> bool:
        return self.topology.same_node(peer, self.rank)

    def delivered(self, peer: int, nbytes: int) -> None:
        self.sent[0 if self.same_node(peer) else 1] += nbytes

    def received(self, peer: int, nbytes: int) -> None:
        self.recv[0 if self.same_node(peer) else 1] += nbytes

    def primitive(self, name: str, ops: int, nbytes: int) -> None:
        self.ops[name][0] += ops
        self.ops[name][1] += nbytes

    def staging_alloc(self, nbytes: int) -> None:
        self.live_staging += nbytes
        self.peak_staging = max(self.peak_staging, self.live_staging)

    def staging_free(self, nbytes: int) -> None:
        self.live_staging -= nbytes
        assert self.live_staging >= 0, "staging bytes freed twice"

    def report(self, *, src: str, dst: str, budget: int) -> SwitchReport:
        assert self.live_staging == 0, "a staging buffer outlived the switch"
        return SwitchReport(
            rank=self.rank,
            src=src,
            dst=dst,
            **{f"{p}_s": self.seconds[p] for p in PHASES},
            total_seconds=time.perf_counter() - self._start,
            sent_intra_node_bytes=self.sent[0],
            sent_inter_node_bytes=self.sent[1],
            recv_intra_node_bytes=self.recv[0],
            recv_inter_node_bytes=self.recv[1],
            retained_bytes=self.retained,
            stages=self.stages,
            peak_staging_bytes=self.peak_staging,
            staging_budget_bytes=budget,
            p2p=PrimitiveStats(*self.ops["p2p"]),
            p2p_direct=PrimitiveStats(*self.ops["p2p_direct"]),
            broadcast=PrimitiveStats(*self.ops["broadcast"]),
            local_copy=PrimitiveStats(*self.ops["local_copy"]),
            in_place=PrimitiveStats(*self.ops["in_place"]),
            local_copy_pages=PrimitiveStats(*self.ops["local_copy_pages"]),
            recv_broadcast_bytes=self.recv_broadcast,
        )


__all__ = ["PHASES", "PrimitiveStats", "SwitchRecorder", "SwitchReport"]
