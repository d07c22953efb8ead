"""The cluster environment of an elastic run: the launcher's devices and nodes, the job's world.

Lightning reads a run's world size and this process's rank from its cluster environment on every
use; in an elastic run they are the job store's (``ElasticEnvironment``), and Lightning's
rank-zero-only helpers follow the rank (``set_rank_zero``). A launch (``launch_id``) is the set of
processes one launcher started together: they join the job together.
"""

from __future__ import annotations

import os

from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from lightning_dynatrain.elastic.session import ElasticSession
from lightning_dynatrain.vps.errors import DynaTrainError


class LauncherError(DynaTrainError):
    """The processes were started by a launcher that cannot carry an elastic job."""


class ElasticEnvironment(ClusterEnvironment):
    """The launcher's environment for devices and nodes; the world and this process's rank from
    the elastic session, live (Lightning reads them on every use)."""

    def __init__(self, launcher: ClusterEnvironment, session: ElasticSession) -> None:
        self.launcher, self.session = launcher, session

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return self.launcher.main_address

    @property
    def main_port(self) -> int:
        return self.launcher.main_port

    @staticmethod
    def detect() -> bool:
        return False

    def world_size(self) -> int:
        return self.session.size

    def set_world_size(self, size: int) -> None:
        pass  # the job's store says it

    def global_rank(self) -> int:
        return self.session.rank

    def set_global_rank(self, rank: int) -> None:
        pass  # the job's store says it

    def local_rank(self) -> int:
        return self.launcher.local_rank()

    def node_rank(self) -> int:
        return self.launcher.node_rank()


def launch_id(launcher: ClusterEnvironment, me: str) -> str:
    """What the processes one launch started share, and no other launch: a SLURM job step (two
    ``srun`` steps of one job share its address and port), else the launcher's address and port;
    a process launched alone is a launch of its own."""
    if launcher.world_size() <= 1:
        return me
    job, step = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_STEP_ID")
    if isinstance(launcher, SLURMEnvironment) and job is not None and step is not None:
        return f"slurm:{job}.{step}"
    return f"{launcher.main_address}:{launcher.main_port}"


def set_rank_zero(rank: int) -> None:
    """Lightning reads the rank for its rank-zero-only calls from a module global: keep it current."""
    rank_zero_only.rank = utils_rank_zero_only.rank = rank


__all__ = ["ElasticEnvironment", "LauncherError", "launch_id", "set_rank_zero"]
