"""The launcher of an elastic job as Lightning and Fabric see it: ``ElasticEnvironment``, ``launch_of``.

Lightning's Trainer and Fabric read a run's world size and this process's rank from their cluster
environment on every use; in an elastic run they are the job store's. ``ElasticEnvironment`` wraps the
launcher's environment (torchrun's, SLURM's, a process alone) and answers them from the elastic
session, live; Lightning's rank-zero-only helpers follow the rank (``set_rank_zero``). ``launch_of``
says what the launcher started (``elastic.driver.front.Launch``): a launch (``launch_id``) is the set
of processes one launcher started together, and they join the job together. The Lightning strategy
(``strategy/elastic_front.py``) and the Fabric strategy (``fabric/strategy.py``) both use them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning_utilities.core.rank_zero import rank_zero_only

from lightning_dynatrain.elastic.driver.front import Launch
from lightning_dynatrain.elastic.launch_teardown import ends_with_any_worker
from lightning_dynatrain.vps.errors import DynaTrainError

if TYPE_CHECKING:
    from lightning_dynatrain.elastic.session import ElasticSession


class LauncherError(DynaTrainError):
    """The processes were started by a launcher that cannot carry an elastic job."""


class ElasticEnvironment(ClusterEnvironment):
    """The launcher's environment for devices and nodes; the world and this process's rank from
    the elastic session, live (Lightning and Fabric read them on every use)."""

    def __init__(self, launcher: ClusterEnvironment, session: "ElasticSession") -> None:
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


def launch_id(launcher: ClusterEnvironment) -> str:
    """What the processes one launch started share, and no other launch: a SLURM job step (two
    ``srun`` steps of one job share its address and port), else the launcher's address and port
    (a process launched alone is a launch of its own: the driver names it after itself)."""
    job, step = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_STEP_ID")
    if isinstance(launcher, SLURMEnvironment) and job is not None and step is not None:
        return f"slurm:{job}.{step}"
    return f"{launcher.main_address}:{launcher.main_port}"


def set_rank_zero(rank: int) -> None:
    """Lightning reads the rank for its rank-zero-only calls from a module global: keep it current."""
    rank_zero_only.rank = rank


def launch_of(launcher: ClusterEnvironment, *, backend: Callable[[], str], device: Callable[[], torch.device],
              timeout: timedelta, library: str) -> Launch:
    """This process as ``launcher`` started it; ``backend`` and ``device``: the process groups' and
    the process's (NCCL groups bind to an accelerator), read once the launcher is known to be one;
    ``library``: who launched, for the message.

    Raises:
        LauncherError: the library's own launcher started more than one process (its rank 0 is the
            parent of every other rank and ends them all when one exits).
    """
    if not launcher.creates_processes_externally and launcher.world_size() > 1:
        raise LauncherError(
            f"elastic training cannot run under {library}'s own launcher with more than one process: rank 0 is "
            "the parent of every other rank and ends them all when one exits",
            hint="launch with torchrun or srun (or one process per `python train.py`), with DYNATRAIN_STORE "
            "and DYNATRAIN_TOKEN set; start the store with `dynatrain store`")
    accelerator = device()
    return Launch(rank=launcher.global_rank(), size=launcher.world_size(), launch_id=launch_id(launcher),
                  node_rank=launcher.node_rank(), backend=backend(),
                  device=accelerator if accelerator.type == "cuda" else None, timeout=timeout,
                  ends_together=launcher.creates_processes_externally and ends_with_any_worker())


__all__ = ["ElasticEnvironment", "LauncherError", "launch_id", "launch_of", "set_rank_zero"]
