"""Lightning's side of an elastic run: ``LightningFront``, what the elastic driver needs of the Trainer.

The driver (``elastic.driver.ElasticDriver``) reaches the loop only through the small protocol
``elastic.driver.front.TrainingFront``; this is its Lightning implementation: the Trainer's global
step and ``should_stop``, Lightning's checkpoint dict for a joiner, the loggers when rank 0
changes (``loggers.py``), rank-zero messages, and the launcher (``launch``).

Lightning reads a run's world size and this process's rank from its cluster environment on every
use; in an elastic run they are the job store's (``ElasticEnvironment``), and Lightning's
rank-zero-only helpers follow the rank (``set_rank_zero``). A launch (``launch_id``) is the set of
processes one launcher started together: they join the job together.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from lightning_dynatrain.compat.lightning_internals import checkpoint_connector, restore_as_loaded
from lightning_dynatrain.elastic.driver.front import Launch
from lightning_dynatrain.elastic.launch_teardown import ends_with_any_worker
from lightning_dynatrain.elastic.session import ElasticSession
from lightning_dynatrain.strategy.loggers import continue_loggers, hand_off_loggers, logger_versions, pin_logger_versions
from lightning_dynatrain.vps.errors import DynaTrainError

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_dynatrain.strategy.dynatrain import DynaTrainStrategy


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
    rank_zero_only.rank = utils_rank_zero_only.rank = rank


class LightningFront:
    """``TrainingFront`` for ``DynaTrainStrategy`` (see the module docstring): what it reads of the
    strategy is its trainer, launcher, device, backend, timeout, module and precision."""

    def __init__(self, strategy: "DynaTrainStrategy") -> None:
        self._strategy = strategy

    @property
    def _trainer(self) -> "pl.Trainer":
        trainer = self._strategy._running_trainer()
        assert trainer is not None, "an elastic run is a trainer.fit"
        return trainer

    def launch(self) -> Launch:
        """This process as its launcher started it.

        Raises:
            LauncherError: Lightning's own launcher started more than one process (its rank 0 is the
                parent of every other rank and ends them all when one exits).
        """
        strategy = self._strategy
        launcher = strategy.cluster_environment
        if not launcher.creates_processes_externally and launcher.world_size() > 1:
            raise LauncherError(
                "elastic training (OnNodeChange) cannot run under Lightning's own launcher with more than one "
                "process: rank 0 is the parent of every other rank and ends them all when one exits",
                hint="launch with torchrun or srun (or one process per `python train.py`), with DYNATRAIN_STORE "
                "and DYNATRAIN_TOKEN set; start the store with `dynatrain store`")
        device = strategy.root_device if strategy.root_device.type == "cuda" else None
        return Launch(rank=launcher.global_rank(), size=launcher.world_size(), launch_id=launch_id(launcher),
                      node_rank=launcher.node_rank(), backend=strategy.process_group_backend, device=device,
                      timeout=strategy._collective_timeout,
                      ends_together=launcher.creates_processes_externally and ends_with_any_worker())

    def joined(self, session: ElasticSession) -> None:
        self._strategy.cluster_environment = ElasticEnvironment(self._strategy.cluster_environment, session)
        set_rank_zero(session.rank)

    def rank_changed(self) -> None:
        set_rank_zero(self._strategy.cluster_environment.global_rank())

    @property
    def global_step(self) -> int:
        return self._trainer.global_step

    def stop(self) -> None:
        self._trainer.should_stop = True

    def loop_state(self) -> dict[str, Any]:
        """Lightning's checkpoint dict: loops, callbacks, data module, schedulers; no tensors (the
        strategy's holds the optimizer's scalars only, the weights go under logical keys)."""
        return checkpoint_connector(self._trainer).dump_checkpoint(weights_only=False)

    def restore_loop_state(self, state: dict[str, Any]) -> None:
        """Restored as a resumed fit restores it, and the rate the schedulers set last (the
        optimizer's: its tensors came through the engine)."""
        restore_as_loaded(self._trainer, state)
        scalars = (state.get("optimizer_states") or [{}])[0]
        if "schedule" in scalars:
            self._strategy.optimizer_handle.load_schedule(scalars["schedule"])

    def log_versions(self) -> list[Any]:
        return logger_versions(self._loggers())

    def pin_log_versions(self, versions: list[Any]) -> None:
        pin_logger_versions(self._loggers(), versions)

    def hand_off_logs(self) -> None:
        trainer = self._strategy._running_trainer()
        if trainer is not None:
            hand_off_loggers(trainer)

    def continue_logs(self) -> None:
        continue_loggers(self._loggers())

    def _loggers(self) -> list:
        trainer = self._strategy._running_trainer()
        return list(trainer.loggers) if trainer is not None else []

    def latest_checkpoint(self) -> str | None:
        return self._strategy.checkpointing.latest_path()

    def job_description(self) -> tuple[Any, ...]:
        """The module's class, recipe, optimizer settings and hyper-parameters, the precision."""
        strategy = self._strategy
        module = strategy.lightning_module
        recipe = getattr(module, "recipe", None)
        adam = module.configure_optimizers() if module is not None else None
        hparams = dict(getattr(module, "hparams", {}) or {})
        return (type(module).__qualname__, recipe, adam, sorted(hparams.items()),
                type(strategy.precision_plugin).__name__, getattr(strategy.precision_plugin, "precision", None))

    def info(self, message: str) -> None:
        rank_zero_info(message)

    def warn(self, message: str) -> None:
        rank_zero_warn(message)


__all__ = ["ElasticEnvironment", "LauncherError", "LightningFront", "launch_id", "set_rank_zero"]
