"""Megatron parameter names of a rank's local tensors, and back: the bridge from VPS keys to modules.

A logical tensor with stack axes is many local parameters: ``decoder.layers.mlp.linear_fc1.weight``
at ``dp1-tp1-pp2`` with 4 layers is ``decoder.layers.{0,1}.mlp.linear_fc1.weight`` on each stage,
whose global layers are 0-1 on stage 0 and 2-3 on stage 1. A tied embedding is
``embedding.word_embeddings.weight`` on the first stage and ``output_layer.weight`` on the last.

>>> from lightning_dynatrain.vps.presets import preset
>>> from lightning_dynatrain.vps.layout import ParallelConfig
>>> names = local_parameters(preset("llama2-7b"), ParallelConfig.parse("dp1-tp1-pp2"), rank=1)
>>> names["decoder.layers.0.mlp.linear_fc1.weight"]
LocalParameter(tensor='decoder.layers.mlp.linear_fc1.weight', stack=(16,), view_shape=(2, 11008, 4096), origin=(0, 0, 0))
"""

from __future__ import annotations

from typing import NamedTuple

from lightning_dynatrain.vps.box import iter_cells
from lightning_dynatrain.vps.grid import grid_placement
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.spec import ModelSpec, Place


class LocalParameter(NamedTuple):
    """One local parameter: its logical tensor, global stack index, and its view on the logical axes."""

    tensor: str
    stack: tuple[int, ...]
    view_shape: tuple[int, ...]
    origin: tuple[int, ...]  # logical coordinate of element 0 on the non-stack axes


def local_parameters(spec: ModelSpec, layout: ParallelConfig, rank: int) -> dict[str, LocalParameter]:
    """Megatron ``named_parameters()`` name -> ``LocalParameter`` for every parameter ``rank`` builds.

    With virtual pipeline stages a rank's model is its chunks in a ``torch.nn.ModuleList``, so each
    name starts with its chunk: ``"1.decoder.layers.0.mlp.linear_fc1.weight"`` is the first layer of
    chunk 1 (``megatron.model_chunks``).
    """
    out: dict[str, LocalParameter] = {}
    for tensor in spec.tensors:
        grid = grid_placement(spec, tensor.name, layout)
        stage = grid.coord(rank).pp
        for cell in grid.cells_of(rank):
            chunk = next(c for s, c in grid.homes(cell) if s == stage)
            name = tensor.megatron_name
            if tensor.place is Place.FIRST_AND_LAST and layout.pp > 1 and stage == layout.pp - 1:
                name = tensor.last_stage_name or name
            if layout.vpp > 1:
                name = f"{chunk}.{name}"
            origin = grid.local_origin(cell)
            stacks = grid.local_stack(cell) if grid.cell_box(cell) is not None else tuple(
                range(0) for _ in range(tensor.stack_axes))
            for stack in iter_cells(stacks):
                local = tuple(s - r.start for s, r in zip(stack, stacks))
                fields = {"layer": local[0]} if local else {}
                if len(local) > 1:
                    fields["expert"] = local[1]
                out[name.format(**fields)] = LocalParameter(tensor.name, stack, grid.local_shape(), origin)
    return out
