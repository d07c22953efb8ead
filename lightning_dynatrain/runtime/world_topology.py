"""Which node every rank of the world runs on, gathered once per world (``vps.topology.Topology``).

A rank's node is its host name together with the node rank its launcher gives it (the front end
reads it from Lightning's cluster environment: ``SLURM_NODEID`` under SLURM, ``GROUP_RANK`` under torchrun, ``NODE_RANK``
otherwise). Either alone can mislead: several nodes may share a host name in containers, and a
launcher's node rank is 0 for every process a single-node launch starts. Ranks with equal pairs
share a node; nodes are numbered in order of their first rank, so uneven nodes (SLURM's
``2(x3),1``) come out as they are.
"""

from __future__ import annotations

import socket

import torch.distributed as dist

from lightning_dynatrain.vps.topology import Topology


def this_node(node_rank: int) -> tuple[str, int]:
    """This process's node: its host name and ``node_rank``, as its launcher numbers nodes
    (Lightning's ``cluster_environment.node_rank()``)."""
    return socket.gethostname(), node_rank


def topology_of(nodes: list[tuple[str, int]]) -> Topology:
    """The topology of a world whose rank ``r`` runs on ``nodes[r]`` (``this_node`` of each rank)."""
    ids: dict[tuple[str, int], int] = {}
    return Topology(tuple(ids.setdefault(tuple(node), len(ids)) for node in nodes))


def gather_topology(node_rank: int, group: dist.ProcessGroup | None = None) -> Topology:
    """Every rank's node (collective over ``group``: one small all-gather of ``this_node``)."""
    everyone: list[tuple[str, int] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, this_node(node_rank), group=group)
    return topology_of(everyone)


__all__ = ["gather_topology", "this_node", "topology_of"]
