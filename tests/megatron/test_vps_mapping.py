"""The VPS mapping checked against real megatron-core models, optimizers and buffers.

For every layout of the spawned jobs and every rank:

- the parameter names the VPS says a rank builds are exactly ``GPTModel.named_parameters()``, and
  each local tensor has the size of its logical view (counts agree, nothing unmapped);
- every local parameter, viewed on the logical axes and cut to its box, equals the same box of the
  dp1-tp1-pp1 model (the fused QKV grouping, the gated fc1 halves, vocab and expert splits);
- under zero1, the flat range the VPS gives each rank's optimizer shard is the range megatron's
  distributed optimizer gave it, and the Adam moments in it equal the same boxes of the
  replicated (zero0, world 1) moments.

The jobs train two Adam steps first, so values agree to rounding amplified by Adam (about 1e-3 of
the tensor's scale), not bit for bit; a box mapped to the wrong place is off by the whole scale.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from lightning_dynatrain.megatron.gpt import GPTShape, logical_spec
from lightning_dynatrain.vps.box import Box
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.mapping import rank_regions
from lightning_dynatrain.vps.names import local_parameters
from lightning_dynatrain.vps.spec import StateKind
from tests.megatron.jobs import SHAPES, WORLD1, WORLD2, WORLD4

CASES = [(1, key) for key in WORLD1] + [(2, key) for key in WORLD2] + [(4, key) for key in WORLD4]
IDS = [f"{k[0]}-{k[1]}" for _, k in CASES]


def _spec(shape_name: str):
    return logical_spec(GPTShape(**SHAPES[shape_name]), shape_name)


@pytest.mark.parametrize("shape_name", sorted(SHAPES))
def test_spec_read_from_a_transformer_config_is_the_builders(shape_name):
    """``dims_from_megatron`` on megatron's own ``TransformerConfig`` gives the same logical tensors."""
    from lightning_dynatrain.megatron.gpt import transformer_config
    from lightning_dynatrain.vps.gpt_spec import build_gpt_spec, dims_from_megatron

    shape = GPTShape(**SHAPES[shape_name])
    config = transformer_config(shape, ParallelConfig.parse("dp1-tp1-pp1"))
    dims = dims_from_megatron(config, vocab_size=shape.vocab_size, seq_length=shape.seq_length,
                              tied_embeddings=shape.tied_embeddings, position_embedding=shape.position_embedding,
                              make_vocab_size_divisible_by=shape.make_vocab_size_divisible_by)
    assert build_gpt_spec(shape_name, dims).tensors == _spec(shape_name).tensors


def _logical(world1: list[dict], shape_name: str, what: str) -> dict[str, np.ndarray]:
    """Full logical tensors of the dp1-tp1-pp1 run, from its local params (``what='params'``) or moments."""
    spec = _spec(shape_name)
    layout = ParallelConfig.parse("dp1-tp1-pp1")
    result = world1[0][(shape_name, "dp1-tp1-pp1")]
    full = {t.name: np.zeros(t.shape, dtype=np.float32) for t in spec.tensors}
    for name, local in local_parameters(spec, layout, 0).items():
        flat = result["params"][name] if what == "params" else result["views"][name][what]
        view = flat.reshape(local.view_shape)
        tensor = spec.tensor(local.tensor)
        valid = tuple(slice(0, n) for n in tensor.shape[tensor.stack_axes:])  # drop vocab padding rows
        full[local.tensor][local.stack] = view[valid]
    return full


def assert_close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Equal up to 1% of the tensor's scale (a misplaced box differs by about 100%)."""
    assert got.shape == want.shape, what
    scale = float(np.abs(want).max()) if want.size else 0.0
    error = float(np.abs(got - want).max()) if want.size else 0.0
    assert error <= 1e-2 * scale + 1e-7, f"{what}: max error {error:.3g} against scale {scale:.3g}"


def _box_of(local, tensor, box_shape=None) -> Box:
    lo = local.stack + local.origin
    hi = tuple(s + 1 for s in local.stack) + tuple(o + n for o, n in zip(local.origin, local.view_shape))
    return Box(lo, tuple(min(h, n) for h, n in zip(hi, tensor.shape)))


@pytest.mark.parametrize("world,key", CASES, ids=IDS)
def test_megatron_parameters_are_exactly_the_vps_local_tensors(job, world, key):
    spec = _spec(key[0])
    layout = ParallelConfig.parse(key[1])
    for rank, result in enumerate(job(world)):
        expected = local_parameters(spec, layout, rank)
        actual = {name: shape for name, shape, _ in result[key]["names"]}
        assert set(actual) == set(expected), f"rank {rank}: {set(actual) ^ set(expected)}"
        for name, local in expected.items():
            assert math.prod(actual[name]) == math.prod(local.view_shape), (rank, name)
        # every logical tensor is held somewhere, and the local tensors cover exactly the params
        regions = rank_regions(spec, layout, rank)
        held = {t for t, kind in regions if kind is StateKind.PARAM}
        assert held == {p.tensor for p in expected.values() if _box_of(p, spec.tensor(p.tensor)).numel > 0}


@pytest.mark.parametrize("world,key", CASES, ids=IDS)
def test_local_parameters_hold_their_logical_boxes(job, world1, world, key):
    spec = _spec(key[0])
    layout = ParallelConfig.parse(key[1])
    reference = _logical(world1, key[0], "params")
    for rank, result in enumerate(job(world)):
        for name, local in local_parameters(spec, layout, rank).items():
            tensor = spec.tensor(local.tensor)
            box = _box_of(local, tensor)
            if box.is_empty():
                continue  # all vocabulary padding
            view = result[key]["params"][name].reshape(local.view_shape)
            mine = view[tuple(slice(0, n) for n in box.shape[tensor.stack_axes:])]
            want = reference[local.tensor][box.relative_to((0,) * tensor.ndim)].reshape(mine.shape)
            assert_close(mine, want, f"rank {rank} {name} {box}")


ZERO1 = [(w, k) for w, k in CASES if k[1].endswith("zero1")]


@pytest.mark.parametrize("world,key", ZERO1, ids=[f"{k[0]}-{k[1]}" for _, k in ZERO1])
def test_zero1_shards_are_megatrons(job, world1, world, key):
    spec = _spec(key[0])
    layout = ParallelConfig.parse(key[1])
    reference = {m: _logical(world1, key[0], m) for m in ("exp_avg", "exp_avg_sq")}
    checked = 0
    for rank, result in enumerate(job(world)):
        regions = rank_regions(spec, layout, rank)
        for name, local in local_parameters(spec, layout, rank).items():
            view = result[key]["views"][name]
            mine = [r for r in regions.get((local.tensor, StateKind.EXP_AVG), [])
                    if r.box.lo[:len(local.stack)] == local.stack]
            if view["shard"] is None:
                assert not mine, f"rank {rank} {name}: VPS says it holds {mine}, megatron says no shard"
                continue
            # all of a local tensor's zero boxes live in the one shard megatron gave the rank
            flats = {r.flat for r in mine}
            if not mine:  # megatron's shard may cover only vocabulary padding
                tensor = spec.tensor(local.tensor)
                assert tensor.axes[0] == "vocab", (rank, name)
                continue
            assert flats == {tuple(view["shard"])}, (rank, name, flats, view["shard"])
            for region in mine:
                for moment in ("exp_avg", "exp_avg_sq"):
                    got = view[moment][region.shard_offset(): region.shard_offset() + region.box.numel]
                    want = reference[moment][local.tensor][region.box.relative_to((0,) * len(region.box.lo))]
                    assert_close(got, want.reshape(-1), f"rank {rank} {name} {moment} {region.box}")
                    checked += got.size
    # the shards of all ranks together cover every optimizer element once per model-parallel replica
    assert checked >= 2 * spec.parameters
