"""``DynaTrainStrategy``'s checkpoints: what each Lightning checkpoint hook does, as plain functions.

A checkpoint is a directory holding every piece of state under its logical key and global offsets
(PyTorch DCP, ``lightning_dynatrain.checkpoint``), plus Lightning's dict without tensors, written
once: loops (global step, data position: the global-batch sampler's state), callbacks' states
(``ScheduledReconfig``'s, ``ModelCheckpoint``'s), the LR schedulers, and the optimizer's scalars
(Adam's step, each kind of param group's learning rate and weight decay). It loads at any layout
and world size. Per-rank checkpoints of earlier versions still load at the layout that wrote them
(``checkpoint.legacy``).

Where the state is restored, in Lightning's order (``Trainer._run``), and why there:

1. ``configure_model``: the model shard exists (initialised, on the current layout).
2. ``load_checkpoint`` (``read``): Lightning's part only, on every rank by itself; the checkpoint's
   model digest and precision are checked against this run's before anything is touched.
3. ``load_model_state_dict`` (``load_params``): the **parameters**, straight into the model's
   tensors. The model exists and megatron's DDP and optimizer do not yet: they are built from the
   loaded parameters in ``setup`` (DDP copies them into its buffer, a bf16 optimizer makes its fp32
   main params from them). ``trainer.validate(ckpt_path=...)``, which builds no optimizer, stops here.
4. ``setup``: megatron DDP and optimizer.
5. ``load_optimizer_state_dict`` (``load_optimizer``): Adam's state is created at the saved step,
   then the **fp32 main params and both moments** are loaded into the optimizer's (zero1: sharded)
   tensors, and the param groups get their saved settings. Only now do these tensors exist.

Example (what the hooks call, every rank)::

    save(checkpoint, "ckpt/step=3.ckpt", writer=writer, model=model, state=state, spec=spec, rank=rank)
    checkpoint = read("ckpt/step=3.ckpt", spec=spec, precision=Precision.FP32, layout=layout, rank=rank,
                      world_size=world)
    load_params(checkpoint, model, spec, layout, rank)             # before DDP + optimizer
    load_optimizer(checkpoint, state, spec, rank)                  # after them
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from lightning_dynatrain.checkpoint.identity import FORMAT, CheckpointError, CheckpointInfo, CheckpointMismatchError
# ``save_rank_checkpoint`` too: the per-rank format's writer and reader, imported from here by code
# that keeps per-rank files (the Accelerate integration's ``save_state``)
from lightning_dynatrain.checkpoint.legacy import is_per_rank, load_rank_checkpoint, save_rank_checkpoint
from lightning_dynatrain.checkpoint.logical import logical_state_dict
from lightning_dynatrain.checkpoint.reader import (
    INFO_KEY,
    TRAINER_KEY,
    encode_trainer_state,
    is_layout_free,
    load_logical,
    read_trainer_state,
)
from lightning_dynatrain.checkpoint.writer import CheckpointWriter
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.spec import ModelSpec, Precision, StateKind

if TYPE_CHECKING:
    from lightning_dynatrain.megatron.state import MegatronState

#: Where ``read`` records what it read, in the checkpoint dict Lightning hands to the later hooks.
SOURCE_KEY = "_dynatrain_source"


@dataclass(frozen=True, slots=True)
class CheckpointSource:
    """What ``read`` found at a checkpoint path."""

    kind: Literal["logical", "per_rank"]
    path: str
    info: CheckpointInfo | None = None


def source_of(checkpoint: Mapping[str, Any]) -> CheckpointSource | None:
    return checkpoint.get(SOURCE_KEY)


def optimizer_scalars(state: "MegatronState") -> dict[str, Any]:
    """The optimizer's layout-free scalars (Lightning's ``optimizer_states[0]``): Adam's step and
    each kind of param group's learning rate and weight decay."""
    from lightning_dynatrain.megatron.optimizer import group_settings
    from lightning_dynatrain.megatron.state_bridge import adam_step

    return {"format": FORMAT, "adam_step": adam_step(state.optimizer) or 0, "groups": group_settings(state.optimizer)}


def save(checkpoint: dict[str, Any], path: str | Path, *, writer: CheckpointWriter, model: torch.nn.Module,
         state: "MegatronState | None", spec: ModelSpec, layout: ParallelConfig, rank: int, world_size: int,
         config: Mapping[str, str] | None = None) -> None:
    """Write ``checkpoint`` (Lightning's dict) and the training state as checkpoint ``path``; collective.
    ``config``: the model's configuration (``ModelSource.config_record``), recorded with it.

    The optimizer's state is written with the parameters unless there is no optimizer or Lightning
    asked for the weights only (no ``optimizer_states``).
    """
    from lightning_dynatrain.megatron.state_bridge import (
        adam_step,
        materialize_optimizer_state,
        megatron_store,
        param_store,
        precision_of,
    )

    precision = precision_of(model, state.optimizer if state is not None else None)
    if state is not None and "optimizer_states" in checkpoint:
        if adam_step(state.optimizer) is None:  # before the first step: zero moments at step 0
            materialize_optimizer_state(state.optimizer, 0)
        store = megatron_store(state.chunks, state.optimizer, spec, layout, rank)
        kinds = tuple(k for k, _ in precision.kinds)
    else:
        store = param_store(model, spec, layout, rank)
        kinds = (StateKind.PARAM,)
    info = CheckpointInfo.of(spec, layout=layout, world_size=world_size, precision=precision,
                             kinds=tuple(k.value for k in kinds), config=dict(config or {}))
    tensors = logical_state_dict(store, spec, layout, rank, precision=precision, kinds=kinds,
                                 copy_to_cpu=writer.async_save)
    if rank == 0:
        lightning = {k: v for k, v in checkpoint.items() if k != SOURCE_KEY}
        tensors[TRAINER_KEY] = encode_trainer_state({**lightning, INFO_KEY: info.to_dict()})
    writer.save(tensors, path, rank=rank)


def read(path: str | Path, *, spec: ModelSpec, precision: Precision, layout: ParallelConfig, rank: int,
         world_size: int, weights_only: bool | None = None, config: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Lightning's checkpoint dict of ``path``, after checking it holds this run's model (and warning,
    naming them, of configuration fields that differ from ``config``'s).

    Raises:
        CheckpointMismatchError: the checkpoint holds another model, or another precision.
        CheckpointError: ``path`` is not a checkpoint of this strategy.
        LayoutError: a per-rank checkpoint of an earlier version, written at another layout.
    """
    if is_layout_free(path):
        checkpoint = read_trainer_state(path, weights_only=weights_only)
        info = CheckpointInfo.from_dict(checkpoint.pop(INFO_KEY, None), path=path)
        info.check(spec, precision=precision, path=path)
        differ = info.config_differences(dict(config or {}))
        if differ and rank == 0:
            warnings.warn(f"checkpoint {path} was written by a model configured otherwise ({'; '.join(differ[:6])}"
                          f"{'; ...' if len(differ) > 6 else ''}): its state loads (the same tensors), the run goes "
                          "on with this run's values", stacklevel=2)
        checkpoint[SOURCE_KEY] = CheckpointSource("logical", str(path), info)
        return checkpoint
    if is_per_rank(path):
        checkpoint = load_rank_checkpoint(path, rank=rank, layout=layout, world_size=world_size,
                                          weights_only=weights_only)
        checkpoint[SOURCE_KEY] = CheckpointSource("per_rank", str(path))
        return checkpoint
    megatron = (Path(path) / "metadata.json").is_file()
    raise CheckpointError(
        f"{path} is not a DynaTrainStrategy checkpoint" + (" (it looks like megatron dist_checkpointing's)" if megatron
                                                           else ""),
        hint="start from a megatron checkpoint with DynaTrainStrategy(init_from_megatron=PATH)" if megatron else
        "pass a directory written by trainer.save_checkpoint under DynaTrainStrategy (it holds a .metadata file)")


def load_params(checkpoint: Mapping[str, Any], model: torch.nn.Module, spec: ModelSpec, layout: ParallelConfig,
                rank: int) -> None:
    """Fill ``model``'s parameters from a layout-free checkpoint (collective)."""
    from lightning_dynatrain.megatron.state_bridge import param_store, precision_of

    source = source_of(checkpoint)
    assert source is not None and source.kind == "logical"
    load_logical(param_store(model, spec, layout, rank), spec, layout, rank, source.path,
                 precision=precision_of(model), kinds=[StateKind.PARAM])


def load_optimizer(checkpoint: Mapping[str, Any], state: "MegatronState", spec: ModelSpec, rank: int) -> None:
    """Give ``state``'s optimizer the checkpoint's Adam step, group settings, main params and moments
    (collective).

    Raises:
        CheckpointError: the checkpoint holds no optimizer state (written with ``weights_only``).
    """
    from lightning_dynatrain.megatron.optimizer import set_group_settings
    from lightning_dynatrain.megatron.state_bridge import materialize_optimizer_state, megatron_store, precision_of

    source = source_of(checkpoint)
    assert source is not None and source.kind == "logical" and source.info is not None
    scalars = (checkpoint.get("optimizer_states") or [None])[0]
    if not isinstance(scalars, Mapping) or scalars.get("format") != FORMAT or source.info.kinds == ("param",):
        raise CheckpointError(f"checkpoint {source.path} holds no optimizer state (saved with weights_only?)",
                              hint="resume from a checkpoint saved with the optimizer, or load the weights only "
                                   "(trainer.validate / a new fit without ckpt_path)")
    precision = precision_of(state.model, state.optimizer)
    kinds = [k for k, _ in precision.kinds if k is not StateKind.PARAM]
    missing = [k.value for k in kinds if k.value not in source.info.kinds]
    if missing:
        raise CheckpointMismatchError(
            f"checkpoint {source.path} holds the state of another optimizer ({', '.join(source.info.kinds)}); this "
            f"run's {precision.optimizer} needs {', '.join(missing)}",
            hint="resume with the optimizer the checkpoint was trained with, or load its weights only")
    materialize_optimizer_state(state.optimizer, int(scalars["adam_step"]))
    set_group_settings(state.optimizer, list(scalars["groups"]))
    load_logical(megatron_store(state.chunks, state.optimizer, spec, state.layout, rank), spec, state.layout, rank,
                 source.path, precision=precision, kinds=kinds)


__all__ = ["SOURCE_KEY", "CheckpointSource", "load_optimizer", "load_params", "load_rank_checkpoint",
           "optimizer_scalars", "read", "save", "save_rank_checkpoint", "source_of"]
