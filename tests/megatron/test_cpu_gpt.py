"""Megatron GPT training on CPU with real gloo process groups, at world sizes 1, 2 and 4.

The jobs (``jobs.py``, run once per session by ``conftest.py``) walk through several layouts in the
same processes; these tests assert on what they return.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.megatron.jobs import STEPS, WORLD1, WORLD2, WORLD4

# ---------------------------------------------------------------------------------------- tests
def test_reference_trains(world1):
    for key in WORLD1:
        first, second = world1[0][key]["losses"]
        assert math.isfinite(first) and 4.0 < first < 6.0  # about ln(vocab) = 4.8 at init
        assert second < first


def test_a_steps_layers_check_as_they_start_forward_and_backward(world1):
    """``StepProgress.stop_if_lost`` is called at every transformer layer's forward and backward of
    each micro-batch (how a survivor's step stops at its next layer once a member died); what it
    raises leaves the step at once, as that exception; no hook outlives its step."""
    from tests.megatron.jobs import MICROBATCHES, SHAPES

    for key in WORLD1:
        probe = world1[0][key]["layer_checks"]
        assert probe == dict(per_step=2 * SHAPES[key[0]]["layers"] * MICROBATCHES, stopped_after=3,
                             raised="_Stop", plain_step=0), (key, probe)


CASES = [(2, key) for key in WORLD2] + [(4, key) for key in WORLD4]


@pytest.mark.parametrize("world,key", CASES, ids=[f"{k[0]}-{k[1]}" for _, k in CASES])
def test_same_losses_as_dp1_tp1_pp1(job, world, key):
    reference = job(1)[0][(key[0], "dp1-tp1-pp1")]["losses"]
    per_rank = [r[key]["losses"] for r in job(world)]
    assert all(losses == per_rank[0] for losses in per_rank), f"ranks disagree: {per_rank}"
    # step 1: same initial model; step 2: same gradients and Adam update as well
    np.testing.assert_allclose(per_rank[0], reference, rtol=1e-5, atol=0)


@pytest.mark.parametrize("world,key", CASES, ids=[f"{k[0]}-{k[1]}" for _, k in CASES])
def test_rank_coordinates_match_layout(job, world, key):
    from lightning_dynatrain.vps.layout import ParallelConfig

    layout = ParallelConfig.parse(key[1])
    for rank, r in enumerate(job(world)):
        assert r[key]["dense"] == tuple(layout.dense_coord(rank))
        etp, ep, edp, pp = layout.expert_coord(rank)
        assert r[key]["expert"] == (etp, ep, edp, pp)


@pytest.mark.parametrize("world,key", CASES, ids=[f"{k[0]}-{k[1]}" for _, k in CASES])
def test_destroy_releases_every_group(job, world, key):
    assert all(r[key]["groups_leaked"] == 0 for r in job(world))


def test_uneven_all_gather_on_gloo(world2):
    assert world2[0]["uneven_gather"] == world2[1]["uneven_gather"] == [1.0, 2.0, 2.0, 2.0]


def test_wrong_world_size_is_refused(world2):
    assert "needs 3 ranks" in world2[0]["wrong_world_error"]
    assert "HINT" in world2[0]["wrong_world_error"]


@pytest.mark.parametrize("key", [("dense", "dp2-tp1-pp1-zero1"), ("moe", "dp2-tp1-pp1-ep2-zero1")])
def test_zero1_shards_partition_every_parameter(world2, key):
    """Under zero1 the dp ranks' shard ranges of a parameter are disjoint and cover it exactly."""
    names = world2[0][key]["views"].keys()
    for name in names:
        numel = world2[0][key]["views"][name]["numel"]
        kind = world2[0][key]["views"][name]["kind"]
        # ranks that share this parameter's buffer shard it: dense over dp2; experts (ep2, edp1) not
        holders = [0, 1] if kind == "dense" else [0]
        shards = sorted(tuple(r[key]["views"][name]["shard"]) for r in (world2[i] for i in holders)
                        if r[key]["views"][name]["shard"] is not None)
        assert sum(end - start for start, end in shards) == numel, (name, shards)
        assert shards[0][0] == 0 and shards[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(shards, shards[1:])), (name, shards)
        for r in world2:
            view = r[key]["views"][name]
            if view["shard"] is not None:
                assert view["exp_avg"].size == view["shard"][1] - view["shard"][0]
                assert view["step"] == STEPS


def test_zero1_state_equals_replicated_state(world2):
    """The dp ranks' zero1 shards of exp_avg / exp_avg_sq, put together, are zero0's full moments."""
    zero0, zero1 = ("dense", "dp2-tp1-pp1"), ("dense", "dp2-tp1-pp1-zero1")
    for name, full in world2[0][zero0]["views"].items():
        pieces = sorted(
            (r[zero1]["views"][name]["shard"], r[zero1]["views"][name]) for r in world2
            if r[zero1]["views"][name]["shard"] is not None
        )
        for moment in ("exp_avg", "exp_avg_sq"):
            joined = np.concatenate([view[moment] for _, view in pieces])
            np.testing.assert_allclose(joined, full[moment], rtol=1e-5, atol=1e-9, err_msg=f"{name} {moment}")


# -------------------------------------------- megatron facts that NOTES.md states (guards upgrades)
def _expected_buffer(names_in_order, numel, shared, group_size, distributed):
    """Recompute megatron's buffer from the rules in NOTES.md."""
    def pad(n, d):
        return -(-n // d) * d

    divisor = math.lcm(group_size, 128)
    entries, buckets, bucket_start, start, open_bucket = [], [], 0, 0, False
    for name in reversed(names_in_order):
        start = pad(start, 64) if distributed else start
        if shared[name] and distributed and open_bucket:
            end = pad(start, divisor)
            buckets.append((bucket_start, end))
            bucket_start = start = end
        entries.append((name, start, start + numel[name], len(buckets)))
        open_bucket, start = True, start + numel[name]
        if shared[name] and distributed:
            end = pad(start, divisor)
            buckets.append((bucket_start, end))
            bucket_start, start, open_bucket = end, end, False
    if open_bucket:
        buckets.append((bucket_start, pad(start, divisor) if distributed else start))
    return sorted(entries, key=lambda e: e[1]), buckets


BUFFER_CASES = [(2, ("dense", "dp2-tp1-pp1")), (2, ("dense", "dp2-tp1-pp1-zero1")), (2, ("dense", "dp1-tp1-pp2")),
                (2, ("moe", "dp2-tp1-pp1-ep2-zero1")), (4, ("dense", "dp2-tp1-pp2-zero1")),
                (4, ("moe", "dp2-tp2-pp1-ep2"))]


@pytest.mark.parametrize("world,key", BUFFER_CASES, ids=[f"{k[0]}-{k[1]}" for _, k in BUFFER_CASES])
def test_buffer_layout_follows_notes(job, world, key):
    distributed = key[1].endswith("zero1")
    for r in job(world):
        numel = {n: math.prod(s) for n, s, _ in r[key]["names"]}
        shared = {n: sh for n, _, sh in r[key]["names"]}
        for buf in r[key]["buffers"]:
            members = {e[0] for e in buf["entries"]}
            order = [n for n, _, _ in r[key]["names"] if n in members]
            entries, buckets = _expected_buffer(order, numel, shared, buf["group_size"], distributed)
            assert [tuple(e) for e in buf["entries"]] == entries
            assert [tuple(b) for b in buf["buckets"]] == buckets
            if buf["kind"] == "expert":
                assert all(".mlp.experts.local_experts." in n for n in members)


def test_tied_embedding_has_its_own_bucket_at_pp2(world4):
    key = ("dense", "dp2-tp1-pp2-zero1")
    first, last = world4[0][key], world4[3][key]  # rank 0: pp stage 0, rank 3: pp stage 1
    (buf0,), (buf1,) = first["buffers"], last["buffers"]
    assert [e[0] for e in buf0["entries"] if e[3] == 1] == ["embedding.word_embeddings.weight"]
    assert [e[0] for e in buf1["entries"] if e[3] == 0] == ["output_layer.weight"]
    assert [n for n, _, sh in last["names"] if sh] == ["output_layer.weight"]


def test_named_parameter_order_dense(world1):
    names = [(n, s) for n, s, _ in world1[0][("dense", "dp1-tp1-pp1")]["names"]]
    layer0 = [(n[len("decoder.layers.0."):], s) for n, s in names if n.startswith("decoder.layers.0.")]
    assert names[0] == ("embedding.word_embeddings.weight", (128, 32))
    assert layer0 == [
        ("input_layernorm.weight", (32,)),
        ("input_layernorm.bias", (32,)),
        ("self_attention.linear_proj.weight", (32, 32)),
        ("self_attention.linear_proj.bias", (32,)),
        ("self_attention.linear_qkv.weight", (64, 32)),
        ("self_attention.linear_qkv.bias", (64,)),
        ("self_attention.q_layernorm.weight", (8,)),
        ("self_attention.q_layernorm.bias", (8,)),
        ("self_attention.k_layernorm.weight", (8,)),
        ("self_attention.k_layernorm.bias", (8,)),
        ("pre_mlp_layernorm.weight", (32,)),
        ("pre_mlp_layernorm.bias", (32,)),
        ("mlp.linear_fc1.weight", (128, 32)),
        ("mlp.linear_fc1.bias", (128,)),
        ("mlp.linear_fc2.weight", (32, 64)),
        ("mlp.linear_fc2.bias", (32,)),
    ]
    assert names[-2:] == [("decoder.final_layernorm.weight", (32,)), ("decoder.final_layernorm.bias", (32,))]
    assert len(names) == 1 + 4 * 16 + 2  # tied at pp1: no output_layer.weight


def test_named_parameter_order_moe_ep2(world2):
    names = [(n, s) for n, s, _ in world2[1][("moe", "dp2-tp1-pp1-ep2")]["names"]]
    mlp = [(n[len("decoder.layers.1.mlp."):], s) for n, s in names if n.startswith("decoder.layers.1.mlp.")]
    assert mlp == [
        ("router.weight", (4, 32)),
        ("experts.local_experts.0.linear_fc1.weight", (64, 32)),
        ("experts.local_experts.0.linear_fc2.weight", (32, 32)),
        ("experts.local_experts.1.linear_fc1.weight", (64, 32)),
        ("experts.local_experts.1.linear_fc2.weight", (32, 32)),
        ("shared_experts.linear_fc1.weight", (64, 32)),
        ("shared_experts.linear_fc2.weight", (32, 32)),
    ]
    assert names[-1] == ("output_layer.weight", (128, 32))
