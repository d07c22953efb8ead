"""What the strategy asks of a layout-free model, whoever wrote it.

Two kinds answer: ``megatron.provider.ModelProvider`` (a user's megatron-core model: a
``TransformerConfig``, a ``model_provider`` and a ``forward_step``, as Megatron-LM's ``pretrain``
takes them; its Virtual Parameter Space read from its own sharded description), and
``megatron.gpt.GPTShape`` (this project's GPT preset, hand-described). Everything past the recipe
(build, switch, checkpoint, elastic policy) speaks to this protocol only.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from megatron.core.process_groups_config import ProcessGroupCollection

from lightning_dynatrain.megatron.execution import ExecutionOptions
from lightning_dynatrain.megatron.model_chunks import chunk_list
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.spec import ModelSpec

#: megatron's ``forward_step_func``: ``(data_iterator, model) -> (output, loss_func)``
ForwardStep = Callable[[Iterator[Any], torch.nn.Module], tuple[Any, Callable]]


class ModelSource(Protocol):
    """A model the strategy builds at any layout (see the module docstring)."""

    @property
    def name(self) -> str:
        """A short name for messages and checkpoint summaries."""

    @property
    def seq_length(self) -> int | None:
        """Tokens per sequence, when fixed (pipeline buffers, sequence-parallel checks)."""

    @property
    def is_moe(self) -> bool: ...

    @property
    def hidden(self) -> int: ...

    @property
    def layers(self) -> int: ...

    def spec(self) -> ModelSpec:
        """The model's logical tensors (the Virtual Parameter Space's description)."""

    def config_record(self) -> dict[str, str]:
        """Its configuration, field by field, as text that is the same in every process (recorded
        with checkpoints; its whole is in the elastic job's fingerprint)."""

    @property
    def builds_beside_training(self) -> bool:
        """Whether it can be built for a layout other than the installed one (switches built ahead)."""

    def validate(self, layout: ParallelConfig, execution: ExecutionOptions) -> None:
        """Raise ``LayoutError`` (naming the rule) when the model cannot run at ``layout``."""

    def build(self, layout: ParallelConfig, *, seed: int, params_dtype: torch.dtype,
              pg_collection: ProcessGroupCollection, execution: ExecutionOptions, initialize: bool = True,
              device: torch.device | None = None, reseed: bool = True) -> torch.nn.Module:
        """This rank's module at ``layout`` on ``pg_collection`` (``initialize=False``: weights left
        for a switch or a checkpoint to fill)."""

    def forward_step(self, data_iterator: Iterator[Any], model: torch.nn.Module) -> tuple[Any, Callable]:
        """Megatron's forward step for one micro-batch (the pipeline schedules call it)."""


def build_unfilled(source: ModelSource, layout: ParallelConfig, *, seed: int, params_dtype: torch.dtype,
                   pg_collection: ProcessGroupCollection, execution: ExecutionOptions,
                   device: torch.device | None = None) -> torch.nn.Module:
    """This rank's module for a switch to fill (``build(initialize=False)``), with no collective at
    all: megatron's all-reduce of a tied embedding's last-stage copy over the embedding group, as a
    language model is built, is left out (the switch writes that copy). For builds beside training,
    and for joiners whose peers build so; torch's generator is left alone."""
    quiet = copy.copy(pg_collection)
    quiet.embd = None
    model = source.build(layout, seed=seed, params_dtype=params_dtype, initialize=False, pg_collection=quiet,
                         execution=execution, device=device, reseed=False)
    for chunk in chunk_list(model):
        if hasattr(chunk, "embd_group"):
            chunk.embd_group = pg_collection.embd  # as megatron's own build leaves it
    return model


__all__ = ["ForwardStep", "ModelSource", "build_unfilled"]
