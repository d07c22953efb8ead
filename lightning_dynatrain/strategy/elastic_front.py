"""Lightning's side of an elastic run: ``LightningFront``, what the elastic driver needs of the Trainer.

The driver (``elastic.driver.ElasticDriver``) reaches the loop only through the small protocol
``elastic.driver.front.TrainingFront``; this is its Lightning implementation: the Trainer's global
step and ``should_stop``, Lightning's checkpoint dict for a joiner, the loggers when rank 0
changes (``loggers.py``), rank-zero messages, and the launcher (``launch``). The world size and
rank Lightning reads follow the job's store (``launch_environment.ElasticEnvironment``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_dynatrain.compat.lightning_internals import checkpoint_connector, restore_as_loaded
from lightning_dynatrain.elastic.driver.front import Launch
from lightning_dynatrain.elastic.session import ElasticSession
from lightning_dynatrain.launch_environment import ElasticEnvironment, launch_of, set_rank_zero
from lightning_dynatrain.strategy.loggers import continue_loggers, hand_off_loggers, logger_versions, pin_logger_versions

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_dynatrain.strategy.dynatrain import DynaTrainStrategy


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
        """This process as its launcher started it (``launch_environment.launch_of``, which raises
        ``LauncherError`` under Lightning's own launcher of more than one process)."""
        strategy = self._strategy
        return launch_of(strategy.cluster_environment, backend=lambda: strategy.process_group_backend,
                         device=lambda: strategy.root_device, timeout=strategy._collective_timeout, library="Lightning")

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


__all__ = ["LightningFront"]
