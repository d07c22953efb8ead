"""Lightning's private names this package uses, each behind a name here, checked on lightning 2.6.6.

The process-group set-up Lightning's own strategies run (``_init_dist_connection``, the default
backend for a device), its reduction of a tensor over a group (``_sync_ddp_if_available``), its
launcher of processes for ``python train.py`` (``_SubprocessScriptLauncher``), and the Trainer's
connectors a strategy or a callback reaches into: the accelerator connector (turning off its
``DistributedSampler``), the checkpoint connector (a joiner's Lightning state restored as a resume
restores it), the signal connector (``OnNodeChange`` wraps its handler registration) and the logger
connector (a step whose switch ends the fit is logged first); and the collectives its training loop
runs before each step (a step redone after a recovery runs them again).
``tests/test_private_names.py`` fails on a private name used elsewhere.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device
from lightning.fabric.utilities.distributed import _init_dist_connection as init_dist_connection
from lightning.fabric.utilities.distributed import _sync_ddp_if_available as sync_ddp_if_available
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

#: the launcher of ``python train.py`` (the script started again for each other local rank)
SubprocessScriptLauncher = _SubprocessScriptLauncher


def default_backend_for_device(device: Any) -> str:
    """``"nccl"`` for a CUDA device, else ``"gloo"`` (Lightning's rule)."""
    return _get_default_process_group_backend_for_device(device)


def accelerator_connector(trainer: Any) -> Any:
    return trainer._accelerator_connector


def checkpoint_connector(trainer: Any) -> Any:
    return trainer._checkpoint_connector


def signal_connector(trainer: Any) -> Any:
    return trainer._signal_connector


def restore_as_loaded(trainer: Any, checkpoint: dict) -> None:
    """What a resume restores before training, from ``checkpoint`` (Lightning's dict, no tensors):
    the module's ``on_load_checkpoint``, the data module, the callbacks; the loops, precision and
    schedulers follow in Lightning's own ``restore_training_state`` (the checkpoint is its loaded one)."""
    from lightning.pytorch.trainer import call

    connector = trainer._checkpoint_connector
    connector._loaded_checkpoint = checkpoint
    call._call_lightning_module_hook(trainer, "on_load_checkpoint", checkpoint)
    connector.restore_datamodule()
    connector.restore_callbacks()


def log_this_step(trainer: Any) -> bool:
    """Write the metrics the module logged in this step to the loggers now, as the training loop does
    right after ``on_train_batch_end`` (a callback about to end the fit there would leave the step
    out), and flush them. Not when a metric of the step is to be reduced over the ranks
    (``sync_dist=True``): that collective would wait on the ranks that failed. Whether it logged."""
    results = trainer._results
    if results is not None and any(getattr(getattr(getattr(m, "meta", None), "sync", None), "should", False)
                                   for m in results.values()):
        return False
    connector = trainer._logger_connector
    connector.on_batch_end()
    connector.update_train_step_metrics()
    for logger in trainer.loggers:
        logger.save()
    return True


def step_start_collectives(trainer: Any) -> None:
    """The collectives Lightning's training loop runs over the world before each training step
    (2.6: ``_broadcast_sigterm_tensor``, rank 0's SIGTERM flag), run now: a survivor that redoes a
    step inside it after a recovery runs them again, as the survivors that go through the loop to
    that step do, so that every survivor's collectives stay in the same order."""
    import torch.distributed as dist

    broadcast = getattr(trainer.fit_loop.epoch_loop, "_broadcast_sigterm_tensor", None)
    if broadcast is not None and dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
        broadcast()


__all__ = ["SubprocessScriptLauncher", "accelerator_connector", "checkpoint_connector", "default_backend_for_device",
           "init_dist_connection", "log_this_step", "restore_as_loaded", "signal_connector", "step_start_collectives",
           "sync_ddp_if_available"]
