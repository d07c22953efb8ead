"""Who gives whom how many bytes in a switch: a ranks x ranks matrix built from the pure planner.

Entry ``[i, j]`` is the bytes of state (params and every optimizer state kind) that rank ``i``
holds at the source layout and rank ``j`` needs at the destination layout: sent from ``i`` to
``j`` off the diagonal, kept in ``i``'s own memory on it. It is built from ``plan_rank`` for every
rank, the same plans the ranks of a real switch compute, so its off-diagonal sum is the switch's
moved bytes and its trace the retained bytes (as ``dynatrain plan`` reports them).

Example (4 ranks, ``dp4 -> dp2-tp2``: each rank keeps half its replica, nothing moves)::

    m = transfer_matrix(logical_spec(shape), ParallelConfig.parse("dp4"), ParallelConfig.parse("dp2-tp2"),
                        gpus_per_node=4)
    m.bytes.diagonal()   # kept bytes per rank
    m.moved_bytes        # 0
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.planner import plan_rank, union_world
from lightning_dynatrain.vps.spec import ModelSpec, Precision
from lightning_dynatrain.vps.topology import Topology

Progress = Callable[[int, int], None]
"""Called as ``progress(ranks_done, ranks_total)`` after each rank's plan."""


@dataclass(frozen=True, eq=False, slots=True)
class TransferMatrix:
    """A switch's bytes from every source rank (rows) to every destination rank (columns).

    Attributes:
        src, dst: the two layouts' printed forms.
        bytes: ``[world, world]`` int64; the diagonal holds the bytes each rank keeps.
        gpus_per_node: ranks per node; rank ``r`` is on node ``r // gpus_per_node``.
        precision: the precision the bytes are counted at.
    """

    src: str
    dst: str
    bytes: np.ndarray
    gpus_per_node: int
    precision: Precision

    @property
    def world(self) -> int:
        return int(self.bytes.shape[0])

    def same_node(self) -> np.ndarray:
        """``[world, world]`` bools: both ranks on one node."""
        node = np.arange(self.world) // self.gpus_per_node
        return node[:, None] == node[None, :]

    @property
    def kept_bytes(self) -> int:
        return int(np.trace(self.bytes))

    @property
    def moved_bytes(self) -> int:
        return int(self.bytes.sum()) - self.kept_bytes

    @property
    def intra_node_bytes(self) -> int:
        """Moved bytes between two ranks of one node (the diagonal excluded)."""
        off = ~np.eye(self.world, dtype=bool)
        return int(self.bytes[self.same_node() & off].sum())

    @property
    def inter_node_bytes(self) -> int:
        return int(self.bytes[~self.same_node()].sum())

    def __str__(self) -> str:
        return (f"{self.src} -> {self.dst} on {self.world} ranks: kept {self.kept_bytes} B, moved {self.moved_bytes} B "
                f"({self.intra_node_bytes} B inside nodes of {self.gpus_per_node}, {self.inter_node_bytes} B across)")


def transfer_matrix(spec: ModelSpec, src: ParallelConfig, dst: ParallelConfig, *,
                    precision: Precision = Precision.FP32, gpus_per_node: int = 8,
                    progress: Progress | None = None, weights_only: bool = False) -> TransferMatrix:
    """Plan the switch ``src -> dst`` on every rank (``plan_rank``) and add its bytes up by rank pair
    (``weights_only``: the params alone, a rollout's switch).

    A rank's receive list names the rank each box comes from, so the receive lists alone give every
    off-diagonal entry; the retain lists give the diagonal. Ranks beyond one of the two worlds (a
    switch that changes the world size) only send or only receive.
    """
    world = union_world(src, dst)
    topology = Topology.uniform(world, gpus_per_node)
    matrix = np.zeros((world, world), dtype=np.int64)
    for rank in range(world):
        plan = plan_rank(spec, src, dst, rank, precision=precision, topology=topology, weights_only=weights_only)
        for t in plan.recvs:
            matrix[t.peer, rank] += t.box.numel * spec.itemsize(t.tensor, t.kind, precision)
        matrix[rank, rank] += plan.bytes(plan.retains, spec, precision)
        if progress is not None:
            progress(rank + 1, world)
    return TransferMatrix(src=str(src), dst=str(dst), bytes=matrix, gpus_per_node=gpus_per_node, precision=precision)


__all__ = ["Progress", "TransferMatrix", "transfer_matrix"]
