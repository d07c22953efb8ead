"""A ``DynaTrainEngine``'s state on disk: a layout-free checkpoint, as ``DynaTrainStrategy`` writes.

Accelerate and Fabric both write each model's and optimizer's ``state_dict()`` from rank 0 only,
and load that one copy on every rank: right for replicas, wrong for tensor- and pipeline-parallel
shards (a pipeline stage's layer names are stage-local: stage 1 would silently load stage 0's
layers). So their integrations write the engine's state here instead, next to what the library
writes itself (``accelerate/checkpoint.py``: ``save_state``'s pre-hooks; ``fabric/strategy.py``:
the strategy's ``save_checkpoint``)::

    checkpoint/                       # accelerator.save_state("checkpoint") or fabric.save("checkpoint", ...)
      dynatrain/                      # every piece of state under its logical key and global offsets (DCP):
        .metadata  __0_0.distcp ...   #   params, fp32 main params (bf16), Adam's moments; Adam's step
      ...                             # the library's own files (the run's progress among them)

``dynatrain/`` is the format of ``DynaTrainStrategy``'s checkpoints (``checkpoint/training_checkpoint.py``,
``lightning_dynatrain.checkpoint``): it loads at any layout and any number of processes, bf16
included, and says what model and precision it holds, which are checked before anything is
loaded. A loaded run trains on at the layout the engine was built at (its plugin's ``layout``);
the schedule's progress comes with the run's progress.

Folders of earlier versions (``dynatrain/rank00000.pt ...`` and ``dynatrain/layout.json``: every
rank's own shard) still load, on the number of processes that wrote them: the engine switches to
their layout in memory first (``engine.reconfigure``), then reads the shards.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_dynatrain.checkpoint.identity import CheckpointError
from lightning_dynatrain.checkpoint.reader import is_layout_free
from lightning_dynatrain.loop.gather import every_rank
from lightning_dynatrain.checkpoint.training_checkpoint import load_rank_checkpoint
from lightning_dynatrain.runtime.layout_checks import WorldSizeError
from lightning_dynatrain.vps.errors import LayoutError

if TYPE_CHECKING:
    from lightning_dynatrain.loop.engine import DynaTrainEngine

#: the engine's checkpoint directory inside the library's checkpoint folder
SHARDS = "dynatrain"
_META = "layout.json"  # in the per-rank folders of earlier versions


def save_engine_state(engine: "DynaTrainEngine", output_dir: str | Path) -> Path:
    """Write the engine's training state as the layout-free checkpoint ``output_dir/dynatrain``
    (collective: every file is in place when it returns on any rank); its path."""
    from lightning_dynatrain.checkpoint.writer import CheckpointWriter
    from lightning_dynatrain.checkpoint import training_checkpoint as checkpointing

    state, path = engine.state, Path(output_dir) / SHARDS
    checkpoint = {"optimizer_states": [checkpointing.optimizer_scalars(state)], "dynatrain_step": engine.step}
    checkpointing.save(checkpoint, path, writer=CheckpointWriter(), model=state.model, state=state,
                       spec=engine.recipe.model.spec(), layout=state.layout, rank=engine.rank,
                       world_size=engine.world_size, config=engine.recipe.model.config_record())
    engine.last_checkpoint = str(output_dir)
    return path


def load_engine_state(engine: "DynaTrainEngine", input_dir: str | Path) -> None:
    """Load ``input_dir/dynatrain`` into the engine at its current layout (collective).

    Raises:
        CheckpointMismatchError: the checkpoint holds another model or another precision.
        CheckpointError: ``input_dir`` holds no checkpoint of a ``DynaTrainEngine`` run.
        WorldSizeError / LayoutError: a per-rank folder of an earlier version, written on another
            number of processes (or a rank's file disagrees with its ``layout.json``).
    """
    from lightning_dynatrain.megatron.state_bridge import precision_of
    from lightning_dynatrain.checkpoint import training_checkpoint as checkpointing

    path = Path(input_dir) / SHARDS
    if _agreed_kind(path) == "per_rank":
        _load_per_rank(engine, input_dir)
        return
    state, spec = engine.state, engine.recipe.model.spec()
    checkpoint = checkpointing.read(path, spec=spec, precision=precision_of(state.model), layout=state.layout,
                                    rank=engine.rank, world_size=engine.world_size,
                                    config=engine.recipe.model.config_record())
    checkpointing.load_params(checkpoint, state.model, spec, state.layout, engine.rank)
    checkpointing.load_optimizer(checkpoint, state, spec, engine.rank)
    info = checkpointing.source_of(checkpoint).info
    engine.loaded_step, engine.last_checkpoint = checkpoint.get("dynatrain_step"), str(input_dir)
    engine.library.print(f"[dynatrain] loaded {input_dir} (step {checkpoint.get('dynatrain_step')}, written at "
                      f"{info.layout} on {info.world_size} processes) into {state.layout} on {engine.world_size}")


def _load_per_rank(engine: "DynaTrainEngine", input_dir: str | Path) -> None:
    """Read this rank's shards of an earlier version's folder, switching the engine to the
    checkpoint's layout first if needed (collective)."""
    from lightning_dynatrain.runtime.steps import load_optimizer_state_dict

    folder = Path(input_dir) / SHARDS
    meta = agreed_meta(_gathered(folder / _META), where=folder / _META, world_size=engine.world_size)
    if meta["layout"] != str(engine.layout):  # to the checkpoint's layout, in memory, then read its shards
        engine.library.print(f"[dynatrain] loading {input_dir}: it was written at {meta['layout']} (step "
                          f"{meta['step']}) in per-rank files; switching from {engine.layout} to it before "
                          "reading the shards")
        engine.reconfigure(meta["layout"])
    try:
        checkpoint = load_rank_checkpoint(folder, rank=engine.rank, layout=engine.layout,
                                          world_size=engine.world_size)
    except LayoutError as err:  # the strategy's hint names the Lightning strategy; say it for this loop
        raise LayoutError(err.message, hint=f"this rank's file disagrees with {folder / _META}: load a "
                          "checkpoint written by one save call (save_state or fabric.save)") from err
    engine.state.model.load_state_dict(checkpoint["model"])
    load_optimizer_state_dict(engine.state, checkpoint["optimizer"])
    engine.loaded_step, engine.last_checkpoint = int(meta["step"]), str(input_dir)


def _agreed_kind(path: Path) -> str:
    """``"logical"`` or ``"per_rank"``: what every rank sees at ``path`` (one all-gather, so a
    folder that is missing or different on some rank stops every rank, never one)."""
    mine = "logical" if is_layout_free(path) else "per_rank" if (path / _META).is_file() else "none"
    return agreed_kind(every_rank(mine), where=path)


def agreed_kind(everyone: list[str], *, where: Path) -> str:
    """The kind of checkpoint every rank saw at ``where`` (pure: every rank decides the same).

    Raises:
        CheckpointError: some rank saw none there, or the ranks saw different kinds.
    """
    if set(everyone) != {everyone[0]} or everyone[0] == "none":
        missing = [rank for rank, kind in enumerate(everyone) if kind == "none"]
        raise CheckpointError(f"{where} holds no DynaTrainEngine checkpoint on ranks {missing} (each rank saw "
                              f"{everyone})", hint="load a folder written by accelerator.save_state or fabric.save of "
                              "a DynaTrainEngine run, visible to every process (a shared file system)")
    return everyone[0]


def _gathered(path: Path) -> list[dict[str, Any] | str]:
    """``path`` (JSON) as every rank read it, or the error each met (one all-gather)."""
    try:
        mine: dict[str, Any] | str = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        mine = f"{type(err).__name__}: {err}"
    return every_rank(mine)


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
                              hint="load a folder written by accelerator.save_state or fabric.save of a "
                              "DynaTrainEngine run, visible to every process")
    if any(other != everyone[0] for other in everyone):
        raise CheckpointError(f"the ranks read different {where}: {everyone}",
                              hint="every process must see the same checkpoint folder (a shared file system)")
    meta = everyone[0]
    if meta["world_size"] != world_size:
        raise WorldSizeError(
            f"checkpoint {where.parent.parent} was written on {meta['world_size']} processes at layout "
            f"{meta['layout']}, this run has {world_size}",
            hint=f"launch {meta['world_size']} processes to load it (accelerate launch --num_processes "
            f"{meta['world_size']}, fabric run --devices {meta['world_size']}, ...); a layout switch keeps the "
            "number of processes")
    return meta


__all__ = ["SHARDS", "CheckpointError", "agreed_kind", "agreed_meta", "load_engine_state", "save_engine_state"]
