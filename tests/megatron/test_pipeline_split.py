"""Uneven pipelines and virtual stages against megatron-core itself: for every split the layouts can state, megatron's
``TransformerConfig`` accepts the splits ``ParallelConfig.pipeline_problem`` accepts (and more: end stages
holding more layers than the model has, which give a stage a negative count there), and its
``get_num_layers_to_build`` / ``get_transformer_layer_offset`` put each stage's layers where
``ParallelConfig.layer_cuts`` says (what the Virtual Parameter Space and the distributed
optimizer's buffers are computed from)."""

from __future__ import annotations

import itertools

import torch

from lightning_dynatrain.vps.layout import ParallelConfig


def _megatron_split(layers: int, layout: ParallelConfig) -> tuple[int, ...] | None:
    """Megatron's first layer of each block (model chunk ``k // pp`` of pipeline rank ``k % pp``) and
    the end, or ``None`` when its config refuses the split."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    try:
        config = TransformerConfig(num_layers=layers, hidden_size=8, num_attention_heads=2,
                                   pipeline_model_parallel_size=layout.pp, pipeline_dtype=torch.float32,
                                   num_layers_in_first_pipeline_stage=layout.first,
                                   num_layers_in_last_pipeline_stage=layout.last,
                                   virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None)
    except ValueError:
        return None
    blocks = [(k % layout.pp, k // layout.pp if layout.vpp > 1 else None) for k in range(layout.pp * layout.vpp)]
    try:
        offsets = [get_transformer_layer_offset(config, chunk, stage) for stage, chunk in blocks]
    except ZeroDivisionError:  # virtual stages with both end stages given and none between (megatron 0.16-0.19)
        return None
    counts = [get_num_layers_to_build(config, chunk, stage) for stage, chunk in blocks]
    assert [o + c for o, c in zip(offsets, counts)][:-1] == offsets[1:], (layers, str(layout))
    return (*offsets, offsets[-1] + counts[-1])


def test_every_small_split_is_where_megatron_puts_it():
    """1-12 layers, pp 2-4, vpp 1-3, end stages of 1-4 layers or an even share."""
    checked = refused = interleaved = 0
    for layers, pp, vpp in itertools.product(range(1, 13), (2, 3, 4), (1, 2, 3)):
        for first, last in itertools.product((None, 1, 2, 3, 4), repeat=2):
            layout = ParallelConfig(pp=pp, first=first, last=last, vpp=vpp)
            if not layout.uneven and layers % (pp * vpp):
                continue  # megatron's even split of such a model is no split this library states
            ours = None if layout.pipeline_problem(layers) else layout.layer_cuts(layers)
            theirs = _megatron_split(layers, layout)
            if ours is None and theirs is not None:  # megatron's config takes end stages of more layers than
                # the model has, and its split then gives a stage a negative count: refused here
                assert any(b < a for a, b in zip(theirs, theirs[1:])), (layers, str(layout), theirs)
                theirs = None
            assert theirs == ours, (layers, str(layout))
            checked += ours is not None
            refused += ours is None
            interleaved += ours is not None and vpp > 1
    assert checked > 300 and refused > 1000 and interleaved > 50, (checked, refused, interleaved)
