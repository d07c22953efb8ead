"""``accelerator.save_state`` / ``load_state`` for a ``DynaTrainEngine``: every rank's shard, per rank.

Accelerate writes each model's ``state_dict()`` and each optimizer's ``state_dict()`` from rank 0
only, and loads that one copy on every rank: right for replicas, wrong for tensor- and
pipeline-parallel shards (a pipeline stage's layer names are stage-local: stage 1 would silently
load stage 0's layers). So the engine registers Accelerate's save and load pre-hooks, which take
its model out of Accelerate's lists and write (read) every rank's own file instead::

    checkpoint/                       # accelerator.save_state("checkpoint")
      dynatrain/rank00000.pt ...      # model shard + optimizer shard of each rank (strategy.checkpoint)
      dynatrain/layout.json           # {"layout", "world_size", "step"}, by rank 0
      optimizer.bin                   # DynaTrainOptimizer.state_dict(): layout and world size
      custom_checkpoint_0.pkl         # DynaTrainEngine.state_dict(): step, schedule progress, switches
      random_states_<rank>.pkl        # Accelerate's own

Loading: every rank reads ``layout.json`` and the ranks agree on it (one small all-gather, so a
missing or different file stops every rank, never one). A checkpoint written at another layout
of the same world size is loaded by switching the engine to that layout in memory first
(``engine.reconfigure``: the same hot switch as a scheduled one), then reading the shards; the run
then continues at the checkpoint's layout and with its schedule progress. A checkpoint of another
world size is refused (``WorldSizeError``). bf16 runs cannot be saved yet (``CheckpointError``):
megatron keeps their fp32 main params inside its optimizer, and the per-rank optimizer state
written here holds Adam's moments only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_dynatrain.strategy.checkpoint import load_rank_checkpoint, save_rank_checkpoint
from lightning_dynatrain.strategy.validation import WorldSizeError
from lightning_dynatrain.vps.errors import DynaTrainError, LayoutError

if TYPE_CHECKING:
    from accelerate import Accelerator
    from torch.utils.hooks import RemovableHandle

    from lightning_dynatrain.accelerate.engine import DynaTrainEngine

#: the folder of the per-rank files inside an Accelerate checkpoint
SHARDS = "dynatrain"
_META = "layout.json"


class CheckpointError(DynaTrainError):
    """An Accelerate checkpoint of a ``DynaTrainEngine`` run cannot be written or read."""


def register_checkpoint_hooks(accelerator: "Accelerator", engine: "DynaTrainEngine") -> list["RemovableHandle"]:
    """Register the save and load pre-hooks of ``engine`` on ``accelerator``; their handles."""

    def save(models: list, weights: list, output_dir: str) -> None:
        index = _position(models, engine.model)
        if index is not None and index < len(weights):
            del weights[index]  # Accelerate would write this (empty) state dict as model.safetensors
        save_shards(engine, output_dir)

    def load(models: list, input_dir: str) -> None:
        index = _position(models, engine.model)
        if index is not None:
            del models[index]  # a local list of load_state: Accelerate then loads no weights for it
        load_shards(engine, input_dir)

    return [accelerator.register_save_state_pre_hook(save), accelerator.register_load_state_pre_hook(load)]


def _position(items: list, target: Any) -> int | None:
    return next((i for i, item in enumerate(items) if item is target), None)


def save_shards(engine: "DynaTrainEngine", output_dir: str | Path) -> Path:
    """Write this rank's model and optimizer shards (collective: ends with a barrier, so every file
    is complete when ``save_state`` returns on any rank).

    Raises:
        CheckpointError: a bf16 run (see the module docstring).
    """
    from lightning_dynatrain.strategy.megatron_step import optimizer_state_dict

    if engine.recipe.params_dtype == torch.bfloat16:
        raise CheckpointError(
            "save_state of a bf16 run is not supported: megatron's fp32 main params are not in the per-rank files",
            hint='train with Accelerator(mixed_precision="no") to checkpoint, or save the weights yourself')
    folder = Path(output_dir) / SHARDS
    state = engine.state
    checkpoint = {"model": state.model.state_dict(), "optimizer": optimizer_state_dict(state)}
    path = save_rank_checkpoint(checkpoint, folder, rank=engine.rank, layout=state.layout,
                                world_size=engine.world_size)
    if engine.rank == 0:
        meta = {"layout": str(state.layout), "world_size": engine.world_size, "step": engine.step}
        (folder / _META).write_text(json.dumps(meta, sort_keys=True) + "\n")
    engine.accelerator.wait_for_everyone()
    return path


def load_shards(engine: "DynaTrainEngine", input_dir: str | Path) -> None:
    """Read this rank's shards, switching the engine to the checkpoint's layout first if needed
    (collective).

    Raises:
        CheckpointError: the folder has no ``dynatrain/layout.json`` on some rank, or the ranks read
            different ones.
        WorldSizeError: the checkpoint was written on another number of processes.
        LayoutError: a rank's file was written at another layout than ``layout.json`` says.
    """
    from lightning_dynatrain.strategy.megatron_step import load_optimizer_state_dict

    folder = Path(input_dir) / SHARDS
    meta = agreed_meta(_gathered(folder / _META), where=folder / _META, world_size=engine.world_size)
    if meta["layout"] != str(engine.layout):  # to the checkpoint's layout, in memory, then read its shards
        engine.accelerator.print(f"[dynatrain] load_state: {input_dir} was written at {meta['layout']} (step "
                                 f"{meta['step']}); switching from {engine.layout} to it before reading the shards")
        engine.reconfigure(meta["layout"])
    try:
        checkpoint = load_rank_checkpoint(folder, rank=engine.rank, layout=engine.layout,
                                          world_size=engine.world_size)
    except LayoutError as err:  # the strategy's hint names the Lightning strategy; say it for this loop
        raise LayoutError(err.message, hint=f"this rank's file disagrees with {folder / _META}: load a "
                          "checkpoint written by one save_state call") from err
    engine.state.model.load_state_dict(checkpoint["model"])
    load_optimizer_state_dict(engine.state, checkpoint["optimizer"])


def _gathered(path: Path) -> list[dict[str, Any] | str]:
    """``path`` (JSON) as every rank read it, or the error each met (one all-gather)."""
    try:
        mine: dict[str, Any] | str = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        mine = f"{type(err).__name__}: {err}"
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def agreed_meta(everyone: list[dict[str, Any] | str], *, where: Path, world_size: int) -> dict[str, Any]:
    """The checkpoint's ``layout.json`` if every rank read the same one, written on ``world_size``
    processes; pure, so every rank takes the same decision from the same gathered list.

    Raises:
        CheckpointError: some rank could not read it (a string in ``everyone``), or the ranks read
            different ones.
        WorldSizeError: it was written on another number of processes.
    """
    failed = {rank: text for rank, text in enumerate(everyone) if isinstance(text, str)}
    if failed:
        raise CheckpointError(f"cannot read {where} on ranks {sorted(failed)}: {next(iter(failed.values()))}",
                              hint="load a folder written by accelerator.save_state of a DynaTrainEngine run, "
                              "visible to every process")
    if any(other != everyone[0] for other in everyone):
        raise CheckpointError(f"the ranks read different {where}: {everyone}",
                              hint="every process must see the same checkpoint folder (a shared file system)")
    meta = everyone[0]
    if meta["world_size"] != world_size:
        raise WorldSizeError(
            f"checkpoint {where.parent.parent} was written on {meta['world_size']} processes at layout "
            f"{meta['layout']}, this run has {world_size}",
            hint=f"launch {meta['world_size']} processes to load it (accelerate launch --num_processes "
            f"{meta['world_size']} ...); a layout switch keeps the number of processes")
    return meta


__all__ = ["CheckpointError", "SHARDS", "agreed_meta", "load_shards", "register_checkpoint_hooks", "save_shards"]
