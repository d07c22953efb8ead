"""Uneven pipelines against megatron-core itself: for every split the layouts can state, megatron's
``TransformerConfig`` accepts the splits ``ParallelConfig.pipeline_problem`` accepts (and more: end stages
holding more layers than the model has, which give a stage a negative count there), and its
``get_num_layers_to_build`` / ``get_transformer_layer_offset`` put each stage's layers where
``ParallelConfig.stage_bounds`` says (what the Virtual Parameter Space and the distributed
optimizer's buffers are computed from)."""

from __future__ import annotations

import itertools

import torch

from lightning_dynatrain.vps.layout import ParallelConfig


def _megatron_split(layers: int, layout: ParallelConfig) -> tuple[int, ...] | None:
    """Megatron's first layer of each stage and the end, or ``None`` when its config refuses the split."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    try:
        config = TransformerConfig(num_layers=layers, hidden_size=8, num_attention_heads=2,
                                   pipeline_model_parallel_size=layout.pp, pipeline_dtype=torch.float32,
                                   num_layers_in_first_pipeline_stage=layout.first,
                                   num_layers_in_last_pipeline_stage=layout.last)
    except ValueError:
        return None
    offsets = [get_transformer_layer_offset(config, None, stage) for stage in range(layout.pp)]
    counts = [get_num_layers_to_build(config, None, stage) for stage in range(layout.pp)]
    assert [o + c for o, c in zip(offsets, counts)][:-1] == offsets[1:], (layers, str(layout))
    return (*offsets, offsets[-1] + counts[-1])


def test_every_small_split_is_where_megatron_puts_it():
    checked = refused = 0
    for layers, pp in itertools.product(range(1, 9), (2, 3, 4)):
        for first, last in itertools.product((None, 1, 2, 3), repeat=2):
            layout = ParallelConfig(pp=pp, first=first, last=last)
            if not layout.uneven and layers % pp:
                continue  # megatron's even split of such a model is no split this library states
            ours = None if layout.pipeline_problem(layers) else layout.stage_bounds(layers)
            theirs = _megatron_split(layers, layout)
            if ours is None and theirs is not None:  # megatron's config takes end stages of more layers than
                # the model has, and its split then gives a stage a negative count: refused here
                assert any(b < a for a, b in zip(theirs, theirs[1:])), (layers, str(layout), theirs)
                theirs = None
            assert theirs == ours, (layers, str(layout))
            checked += ours is not None
            refused += ours is None
    assert checked > 100 and refused > 100, (checked, refused)
