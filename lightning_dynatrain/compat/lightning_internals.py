"""Lightning's private names this package uses, each behind a name here, checked on lightning 2.6.6.

The process-group set-up Lightning's own strategies run (``_init_dist_connection``, the default
backend for a device), its reduction of a tensor over a group (``_sync_ddp_if_available``), its
launcher of processes for ``python train.py`` (``_SubprocessScriptLauncher``, which a strategy
attaches in the private ``_configure_launcher``: ``ScriptLaunchedStrategy``), and the Trainer's
connectors a strategy or a callback reaches into: the accelerator connector (turning off its
``DistributedSampler``), the checkpoint connector (a joiner's Lightning state restored as a resume
restores it), the signal connector (``OnNodeChange`` wraps its handler registration) and the logger
connector (a step whose switch ends the fit is logged first); the collectives its training loop
runs before each step (a step redone after a recovery runs them again); what a strategy keeps in
private attributes of Lightning's ``Strategy`` (its precision plugin, its ``LightningOptimizer``
wrappers) and of Fabric's (the precision asked for); a module's trainer; the file loggers' version
and CSV writer (``strategy/loggers.py`` keeps one version directory when rank 0 changes); a
callback's state key; and ``LightningCLI``'s parser and config lookup of a subcommand.
``tests/test_private_names.py`` fails on a private name used elsewhere; ``tests/test_compat.py``
checks that each one here is still where it is read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device
from lightning.fabric.utilities.distributed import _init_dist_connection as init_dist_connection
from lightning.fabric.utilities.distributed import _sync_ddp_if_available as sync_ddp_if_available
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from typing_extensions import override

from lightning_dynatrain.compat import InternalsChangedError

if TYPE_CHECKING:
    from lightning.fabric.strategies.strategy import Strategy as FabricStrategy
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
    from lightning.pytorch.strategies.strategy import Strategy
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
    from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import _LoggerConnector

#: the launcher of ``python train.py`` (the script started again for each other local rank)
SubprocessScriptLauncher = _SubprocessScriptLauncher


def default_backend_for_device(device: Any) -> str:
    """``"nccl"`` for a CUDA device, else ``"gloo"`` (Lightning's rule)."""
    return _get_default_process_group_backend_for_device(device)


# ------------------------------------------------------------------------------ the Trainer
def accelerator_connector(trainer: Trainer) -> Any:
    return trainer._accelerator_connector


def checkpoint_connector(trainer: Trainer) -> Any:
    return trainer._checkpoint_connector


def signal_connector(trainer: Trainer) -> Any:
    return trainer._signal_connector


def module_trainer(module: LightningModule) -> Trainer | None:
    """The trainer ``module`` is attached to, ``None`` before (``LightningModule.trainer`` raises then)."""
    return module._trainer


def restore_as_loaded(trainer: Trainer, checkpoint: dict) -> None:
    """What a resume restores before training, from ``checkpoint`` (Lightning's dict, no tensors):
    the module's ``on_load_checkpoint``, the data module, the callbacks; the loops, precision and
    schedulers follow in Lightning's own ``restore_training_state`` (the checkpoint is its loaded one)."""
    from lightning.pytorch.trainer import call

    connector: _CheckpointConnector = trainer._checkpoint_connector
    connector._loaded_checkpoint = checkpoint
    call._call_lightning_module_hook(trainer, "on_load_checkpoint", checkpoint)
    connector.restore_datamodule()
    connector.restore_callbacks()


def log_this_step(trainer: Trainer) -> bool:
    """Write the metrics the module logged in this step to the loggers now, as the training loop does
    right after ``on_train_batch_end`` (a callback about to end the fit there would leave the step
    out), and flush them. Not when a metric of the step is to be reduced over the ranks
    (``sync_dist=True``): that collective would wait on the ranks that failed. Whether it logged."""
    results = trainer._results
    if results is not None and any(getattr(getattr(getattr(m, "meta", None), "sync", None), "should", False)
                                   for m in results.values()):
        return False
    connector: _LoggerConnector = trainer._logger_connector
    connector.on_batch_end()
    connector.update_train_step_metrics()
    for logger in trainer.loggers:
        logger.save()
    return True


def step_start_collectives(trainer: Trainer) -> None:
    """The collectives Lightning's training loop runs over the world before each training step
    (2.6: ``_broadcast_sigterm_tensor``, rank 0's SIGTERM flag), run now: a survivor that redoes a
    step inside it after a recovery runs them again, as the survivors that go through the loop to
    that step do, so that every survivor's collectives stay in the same order.

    Raises:
        InternalsChangedError: the installed Lightning's loop has no ``_broadcast_sigterm_tensor``
            (skipping it would leave this survivor one collective behind the others).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and trainer.world_size > 1):
        return
    epoch_loop: _TrainingEpochLoop = trainer.fit_loop.epoch_loop
    broadcast = getattr(epoch_loop, "_broadcast_sigterm_tensor", None)
    if broadcast is None:
        raise InternalsChangedError.missing("lightning", "_TrainingEpochLoop._broadcast_sigterm_tensor",
                                            checked_on="lightning 2.6.6")
    broadcast()


# ------------------------------------------------------------------------------ strategies
class ScriptLaunchedStrategy(ParallelStrategy):
    """A ``ParallelStrategy`` whose processes start as Lightning's DDP's do: Lightning's subprocess
    launcher for ``python train.py`` (the script run again for each other local rank), none when
    something else started them (torchrun, ``fabric run``, srun). Lightning asks a strategy for its
    launcher through the private ``_configure_launcher`` and keeps it in ``_launcher``; a subclass
    has ``num_processes`` and ``num_nodes``."""

    num_processes: int
    num_nodes: int

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = None


def strategy_precision_plugin(strategy: Strategy) -> Any:
    """The precision plugin set on ``strategy`` (``None`` before the Trainer sets one; Lightning's
    ``precision_plugin`` property answers a default plugin then)."""
    return strategy._precision_plugin


def set_strategy_precision_plugin(strategy: Strategy, plugin: Any) -> None:
    strategy._precision_plugin = plugin


def lightning_optimizers(strategy: Strategy) -> list[Any]:
    """The ``LightningOptimizer`` wrapper of each of ``strategy``'s optimizers (what a training step
    hands ``optimizer_step``)."""
    return strategy._lightning_optimizers


def requested_precision(strategy: FabricStrategy) -> Any:
    """The precision plugin ``Fabric(precision=...)`` gave a Fabric strategy (``None``: none yet)."""
    return strategy._precision


def set_requested_precision(strategy: FabricStrategy, precision: Any) -> None:
    strategy._precision = precision


# ------------------------------------------------------------------------------ loggers
def has_version_directory(logger: Any) -> bool:
    """``logger`` writes into a version directory (``version_N``) and keeps its version in
    ``_version`` (Lightning's ``CSVLogger`` and ``TensorBoardLogger``). A logger without one (WandB's
    run ids) is safely left as it is: it has no directory a new rank 0 could pick anew."""
    return hasattr(logger, "_version")  # safe to skip: see the docstring


def pin_version(logger: CSVLogger | TensorBoardLogger, version: Any) -> None:
    """Make ``logger`` write to ``version``'s directory, as the constructor's ``version=`` does."""
    logger._version = version


def csv_writer(logger: CSVLogger) -> Any:
    """The metrics writer of ``logger`` (``None`` before its first use, which makes one that
    deletes the ``metrics.csv`` it finds)."""
    return logger._experiment


def set_csv_writer(logger: CSVLogger, writer: Any) -> None:
    logger._experiment = writer


# ------------------------------------------------------------------------------ callbacks, CLI
def callback_state_key(callback: Callback, **key: Any) -> str:
    """A ``state_key`` for ``callback`` from ``key``'s values, prefixed by its class name as
    Lightning's own callbacks make theirs."""
    return callback._generate_state_key(**key)


def cli_parser(cli: LightningCLI, subcommand: str | None) -> LightningArgumentParser:
    """The parser of ``subcommand`` (``None``: the CLI's own, without subcommands)."""
    return cli._parser(subcommand)


def cli_config_value(cli: LightningCLI, config: Any, key: str, default: Any = None) -> Any:
    """``key`` of ``config``, inside the section of the subcommand being run when there is one."""
    return cli._get(config, key, default)


__all__ = ["ScriptLaunchedStrategy", "SubprocessScriptLauncher", "accelerator_connector", "callback_state_key",
           "checkpoint_connector", "cli_config_value", "cli_parser", "csv_writer", "default_backend_for_device",
           "has_version_directory", "init_dist_connection", "lightning_optimizers", "log_this_step",
           "module_trainer", "pin_version", "requested_precision", "restore_as_loaded", "set_csv_writer",
           "set_requested_precision", "set_strategy_precision_plugin", "signal_connector", "step_start_collectives",
           "strategy_precision_plugin", "sync_ddp_if_available"]
