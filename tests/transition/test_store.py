"""Box views into local tensors and zero1 shards, checked against an independent construction."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from lightning_dynatrain.transition.errors import EngineInternalError, StateStoreError
from lightning_dynatrain.transition.local_state import RegionIndex, box_pieces, box_view, check_local, local_numel
from lightning_dynatrain.vps.box import Box
from lightning_dynatrain.vps.mapping import rank_regions
from lightning_dynatrain.vps.spec import Precision, StateKind
from tests.transition.state import PAD, bits, local_state, offsets
from tests.vps.strategies import layouts, small_specs

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


def _expected_bits(spec, base, name, kind, box, dtype) -> torch.Tensor:
    shape = spec.tensor(name).shape
    index = torch.arange(spec.tensor(name).numel).view(shape)[tuple(slice(l, h) for l, h in zip(box.lo, box.hi))]
    values = base[(name, kind)] + index
    width = 8 * dtype.itemsize
    half = 1 << (width - 1)
    return ((values + half) % (1 << width)) - half


@settings(max_examples=60, **SETTINGS)
@given(st.data())
def test_box_views_hold_the_logical_values(data):
    spec = data.draw(small_specs())
    layout = data.draw(layouts(spec, max_world=8))
    rank = data.draw(st.integers(0, layout.world_size - 1))
    precision = data.draw(st.sampled_from(list(Precision)))
    store = local_state(spec, layout, rank, precision)
    base = offsets(spec, precision)
    regions = rank_regions(spec, layout, rank, precision)
    index = RegionIndex(regions)
    assert set(index.local_tensors()) == set(store), "one store key per local tensor"
    for (name, kind), lst in regions.items():
        for region in lst:
            for key, sub in box_pieces(name, kind, region, region.box):
                local = store[key]
                assert local.numel() == local_numel(region)
                n = len(region.origin) - len(region.view_shape)
                view = box_view(local, region, sub)
                assert view.shape == sub.shape[n:]
                want = _expected_bits(spec, base, name, kind, sub, local.dtype).reshape(view.shape)
                assert torch.equal(bits(view).to(torch.int64), want), f"{key} {region} {sub}"
                assert index.find(name, kind, sub) is not None
                # a view, not a copy: writing it writes the local tensor
                bits(view).fill_(PAD)
                assert (bits(local) == PAD).sum() >= sub.numel



def test_find_outside_every_region_is_an_internal_error():
    from lightning_dynatrain.vps.gpt_spec import GPTDims, build_gpt_spec
    from lightning_dynatrain.vps.layout import ParallelConfig

    spec = build_gpt_spec("tiny", GPTDims(num_layers=2, hidden=4, num_heads=2, ffn_hidden=4, vocab_size=8))
    regions = rank_regions(spec, ParallelConfig.parse("tp2"), 0)
    name = "decoder.layers.mlp.linear_fc2.weight"
    region = regions[(name, StateKind.PARAM)][0]
    index = RegionIndex(regions)
    outside = Box(region.box.lo, region.box.hi[:-1] + (region.box.hi[-1] + 1,))
    with pytest.raises(EngineInternalError, match="no region of decoder.layers.mlp.linear_fc2.weight"):
        index.find(name, StateKind.PARAM, outside)
    with pytest.raises(StateStoreError, match="HINT"):
        check_local((name, StateKind.PARAM, (0,)), torch.empty(3), region, where="source")
