"""A rank's model chunks at a layout with virtual pipeline stages (``-vppN``, megatron's interleaved 1F1B).

With ``vpp`` virtual stages a pipeline rank holds ``vpp`` model chunks, each a whole megatron module
built with its ``vp_stage``: chunk ``c`` of pipeline rank ``r`` holds layer block ``c * pp + r``
(``ParallelConfig.layer_cuts``); only chunk 0 of the first rank embeds and only the last chunk of
the last rank computes the loss. Megatron trains such a rank as a list: one DDP per chunk, one
optimizer over them, the interleaved schedule over the list.

Here the chunks of one rank are one ``ModelChunks`` module (a ``torch.nn.ModuleList``), so whatever
takes "this rank's model" takes it whole, and its parameters are named ``"{chunk}.{megatron name}"``
(``ModuleList``'s own naming; ``vps.names`` names them so). Without virtual stages a rank's model is
its one megatron module, as before.

Example (``dp1-tp1-pp2-vpp2``, 8 layers, rank 1)::

    >>> from lightning_dynatrain.vps.layout import ParallelConfig
    >>> chunk_stages(ParallelConfig.parse("dp1-tp1-pp2-vpp2"), pp_rank=1)
    (ChunkStage(vp_stage=0, pre_process=False, post_process=False), ChunkStage(vp_stage=1, pre_process=False, post_process=True))
    >>> chunk_stages(ParallelConfig.parse("dp1-tp1-pp2"), pp_rank=0)
    (ChunkStage(vp_stage=None, pre_process=True, post_process=False),)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from lightning_dynatrain.vps.layout import ParallelConfig


class ChunkStage(NamedTuple):
    """What one model chunk of a pipeline rank is: its ``vp_stage`` (``None`` without virtual
    stages, as megatron's builders take it) and whether it embeds and whether it computes the loss."""

    vp_stage: int | None
    pre_process: bool
    post_process: bool


def chunk_stages(layout: ParallelConfig, *, pp_rank: int) -> tuple[ChunkStage, ...]:
    """The chunks pipeline rank ``pp_rank`` builds at ``layout``, in chunk order."""
    first, last = pp_rank == 0, pp_rank == layout.pp - 1
    if layout.vpp == 1:
        return (ChunkStage(None, first, last),)
    return tuple(ChunkStage(c, first and c == 0, last and c == layout.vpp - 1) for c in range(layout.vpp))


def pipeline_config_kwargs(layout: ParallelConfig) -> dict[str, Any]:
    """``TransformerConfig``'s pipeline fields at ``layout`` beyond its sizes: the virtual stages, the
    micro-batches each chunk runs in a row (megatron's default, pp, set here because a config made at
    another pp keeps the value its own pp gave it), and unbatched point-to-point transfers. Megatron's
    batched transfers (``batch_p2p_comm``, its default) cross a stage's activation and gradient when
    the previous and the next rank are the same process (pp2) under interleaving, silently, as both
    have the same shape (Megatron-LM issues 750 and 1450); Megatron-LM itself turns batching off
    whenever it interleaves with overlap."""
    if layout.vpp == 1:
        return {"virtual_pipeline_model_parallel_size": None}
    return {"virtual_pipeline_model_parallel_size": layout.vpp, "microbatch_group_size_per_vp_stage": layout.pp,
            "batch_p2p_comm": False}


class ModelChunks(torch.nn.ModuleList):
    """The model chunks of one rank at a layout with virtual stages, in chunk order (see the module
    docstring); ``config`` is theirs (every chunk is built from the same ``TransformerConfig``)."""

    @property
    def config(self) -> Any:
        return self[0].config

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict[str, Any]:
        """Megatron's description of every chunk, under the chunk's index (each chunk describes its
        own layers at their global place); ``metadata`` is given to each as a copy of its own."""
        return {str(index): chunk.sharded_state_dict(prefix=prefix, sharded_offsets=sharded_offsets,
                                                     metadata=None if metadata is None else dict(metadata))
                for index, chunk in enumerate(self)}


def chunk_list(model: torch.nn.Module | Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """A rank's model chunks as megatron's schedules, DDP and optimizer take them: a list."""
    if isinstance(model, (ModelChunks, list, tuple)):
        return list(model)
    return [model]


def build_chunks(layout: ParallelConfig, pp_rank: int,
                 build_one: Callable[[ChunkStage], torch.nn.Module]) -> torch.nn.Module:
    """``build_one(stage)`` for each of the rank's chunks: the one module, or ``ModelChunks``."""
    stages = chunk_stages(layout, pp_rank=pp_rank)
    if len(stages) == 1:
        return build_one(stages[0])
    return ModelChunks([build_one(stage) for stage in stages])


__all__ = ["ChunkStage", "ModelChunks", "build_chunks", "chunk_list", "chunk_stages", "pipeline_config_kwargs"]
