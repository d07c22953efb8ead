"""What the elastic driver needs of the front end that trains: ``TrainingFront`` and ``Launch``.

The driver (``driver.ElasticDriver``) does a world change's and a recovery's work on the run's
megatron side (``runtime.training_run.TrainingRun``: layout, state, switcher, install) and needs
little of the loop around it: the step count, stopping, the loop's own state for a joiner, the
log files when rank 0 changes, the messages. That little is this protocol, which the Lightning
strategy implements (``strategy/elastic_front.py``: the Trainer's global step, ``should_stop``,
checkpoint connector and loggers) and so does the loop engine of Fabric (``loop/elastic_front.py``:
the engine's step, ``should_stop`` and progress); nothing of the driver imports Lightning.

``Launch`` is what the front end's launcher says of this process when it enters the job, and
``ElasticCallback`` what a front end looks for to make a run elastic (``OnNodeChange`` is one).
Importing this module imports neither megatron-core nor the driver.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from lightning_dynatrain.elastic.driver.driver import ElasticDriver
    from lightning_dynatrain.elastic.session import ElasticSession
    from lightning_dynatrain.runtime.training_run import TrainingRun


@dataclass(frozen=True)
class Launch:
    """This process as its launcher started it (``torchrun``, ``srun``, one ``python train.py``)."""

    rank: int
    """Its rank among the processes the launcher started together."""
    size: int
    """How many processes the launcher started together (they join the job together)."""
    launch_id: str
    """What those processes share and no other launch does (``launch_id`` of the Lightning front)."""
    node_rank: int
    """Its node's number, as the launcher counts nodes (with the host name: ``gather_topology``)."""
    backend: str
    """The process groups' backend (gloo, nccl)."""
    device: torch.device | None
    """The accelerator NCCL groups bind to, or ``None`` on the host."""
    timeout: timedelta
    """The process groups' timeout outside switches."""
    ends_together: bool = False
    """Its launcher ends every process of the launch once one of them ended (torchrun's agent): the
    job's store then records them failed together (``launch_teardown.ends_with_any_worker``)."""


class TrainingFront(Protocol):
    """The front end's side of an elastic run (see the module docstring)."""

    @property
    def global_step(self) -> int:
        """Optimizer steps done."""

    def stop(self) -> None:
        """This process left the job: its loop ends at this boundary."""

    def loop_state(self) -> dict[str, Any]:
        """The loop's state without tensors (progress, callbacks, schedulers), for a joiner."""

    def restore_loop_state(self, state: dict[str, Any]) -> None:
        """A joiner's: the loop's state the members sent (``loop_state``), restored as a resume would."""

    def joined(self, session: "ElasticSession") -> None:
        """This process entered the job: from now on its rank and world are ``session``'s."""

    def rank_changed(self) -> None:
        """A new world was installed: this process's rank may have changed."""

    def log_versions(self) -> list[Any]:
        """Where this process's loggers would write (rank 0's are every member's)."""

    def pin_log_versions(self, versions: list[Any]) -> None:
        """Write where ``versions`` say, whichever rank logs later."""

    def hand_off_logs(self) -> None:
        """This process is rank 0 and leaves: write out what its loggers hold and log nothing more
        (what it would log later is the next rank 0's)."""

    def continue_logs(self) -> None:
        """This process just became rank 0: go on with the files the old rank 0 wrote."""

    def latest_checkpoint(self) -> str | None:
        """The run's latest checkpoint (what a job that cannot go on names to restart from)."""

    def job_description(self) -> tuple[Any, ...]:
        """What a joiner must train alike (the module, its recipe and optimizer, the precision)."""

    def info(self, message: str) -> None:
        """Tell the user (once per job)."""

    def warn(self, message: str) -> None:
        """Warn the user (once per job)."""


class ElasticCallback(abc.ABC):
    """What a front end looks for to make a run elastic (``OnNodeChange`` is one): it makes the
    run's driver at set-up, before any other callback hook runs."""

    @abc.abstractmethod
    def make_driver(self, run: "TrainingRun", front: "TrainingFront") -> "ElasticDriver":
        """The driver of ``run``, reaching its loop through ``front``."""


__all__ = ["ElasticCallback", "Launch", "TrainingFront"]
