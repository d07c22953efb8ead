"""Ahead-of-time switches (``megatron.ahead``): the target's objects built in a background thread
while the old layout trains, bound to memory inside the switch.

One spawned 4-process gloo job per precision walks a chain of layouts. Before each switch it starts
``prepare_switch`` and trains one step while the background thread builds; the switch then runs
with ``prepared=``. The full logical state must be bit for bit the same around every switch, the
losses those of a run that never switched, and the switch must have built nothing itself.
"""

from __future__ import annotations

import numpy as np
import pytest

from lightning_dynatrain.megatron.gpt import GPTShape, logical_spec
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.spec import Precision
from lightning_dynatrain.vps.topology import Topology
from tests.dist import run_distributed
from tests.logical_state import assemble, common
from tests.megatron.jobs import DENSE, GLOBAL_BATCH, MICROBATCHES, SEED
from tests.megatron.test_hot_switch import OPTIMIZER, _snapshot

pytestmark = pytest.mark.slow

# zero0 -> zero1 (params become views into DDP's buffer) -> zero0 -> pp2 built while pp2 trains
# (the tied embedding's group is the same: training's all-reduces on it run beside the build)
# -> a layout seen before
CHAIN = ["dp2-tp2-pp1", "dp1-tp2-pp2-zero1", "dp4-tp1-pp1", "dp2-tp1-pp2-zero1", "dp1-tp2-pp2", "dp2-tp2-pp1"]
SHAPES = {"float32": DENSE, "bfloat16": dict(DENSE, query_groups=4, make_vocab_size_divisible_by=32)}


def _ahead_chain(rank: int, world_size: int, shape_kwargs: dict, params_dtype: str) -> dict:
    import dataclasses
    import torch
    import torch.distributed as dist

    from lightning_dynatrain.megatron.ahead import PreparedSwitchError, prepare_switch
    from lightning_dynatrain.megatron.gpt import build_gpt_model
    from lightning_dynatrain.megatron.hot_switch import SwitchSetup, hot_switch
    from lightning_dynatrain.megatron.optimizer import build_ddp_and_optimizer
    from lightning_dynatrain.megatron.train_step import run_train_step
    from lightning_dynatrain.megatron.parallel_state_adapter import ProcessGroupCache, destroy, initialize_for_layout
    from lightning_dynatrain.megatron.state import MegatronState
    from lightning_dynatrain.runtime.steps import set_lr_and_wd

    shape = GPTShape(**shape_kwargs)
    spec = logical_spec(shape)
    dtype = getattr(torch, params_dtype)
    tokens = torch.randint(0, shape.vocab_size, (GLOBAL_BATCH, shape.seq_length + 1),
                           generator=torch.Generator().manual_seed(11))

    def train(state):
        per = GLOBAL_BATCH // state.layout.dp
        local = tokens[state.layout.dense_coord(rank).dp * per:][:per]
        set_lr_and_wd(state.optimizer, lr=OPTIMIZER["lr"], weight_decay=OPTIMIZER["weight_decay"])
        return run_train_step(state.ddp, state.optimizer, {"tokens": local[:, :-1].contiguous(),
                                                           "labels": local[:, 1:].contiguous()},
                              state.layout, MICROBATCHES)

    def fresh(layout, groups):
        pgs = initialize_for_layout(layout, seed=SEED, groups=groups)
        model = build_gpt_model(shape, layout, seed=SEED, params_dtype=dtype)
        ddp, optimizer = build_ddp_and_optimizer(model, layout, **OPTIMIZER)
        return MegatronState(layout=layout, groups=pgs, chunks=(ddp,), optimizer=optimizer)

    cache = ProcessGroupCache()
    setup = SwitchSetup(model=shape, seed=SEED, optimizer=OPTIMIZER, staging_budget=64 * 1024,
                        topology=Topology.uniform(4, 2))
    state = fresh(ParallelConfig.parse(CHAIN[0]), cache)
    out = {"losses": [train(state)], "switches": []}
    for text in CHAIN[1:]:
        target = ParallelConfig.parse(text)
        pending = prepare_switch(state, target, setup, groups=cache)
        out["losses"].append(train(state))  # the old layout trains while the target is built
        prepared = pending.result(timeout=120)
        released = prepared.released_bytes
        before = _snapshot(state, spec, state.layout, rank)
        result = hot_switch(state, target, setup, groups=cache, prepared=prepared)
        state = result.state
        out["switches"].append(dict(before=before, after=_snapshot(state, spec, target, rank), phases=result.phases,
                                    released=released, build=prepared.build_seconds, src=str(result.report.src)))
        out["losses"].append(train(state))
        try:  # a prepared switch serves one switch
            hot_switch(state, ParallelConfig.parse(CHAIN[0]), setup, groups=cache, prepared=prepared)
        except PreparedSwitchError as err:
            out["reused"] = str(err)
    # a build that fails on one rank (rank 1: an optimizer megatron's config does not name) before megatron's
    # all-gather: every rank's build ends with an error naming it, none waits, and the switch runs
    # on demand
    target = ParallelConfig.parse(CHAIN[1])
    broken = dataclasses.replace(setup, optimizer=dataclasses.replace(setup.optimizer, optimizer="no_such_optimizer")) \
        if rank == 1 else setup
    try:
        prepare_switch(state, target, broken, groups=cache).result(timeout=120)
    except PreparedSwitchError as err:
        out["failed_build"] = f"{err} | {err.__cause__!r}"
    state = hot_switch(state, target, setup, groups=cache).state
    out["losses"].append(train(state))
    # the same training with no switch, in the same processes
    reference = fresh(ParallelConfig.parse(CHAIN[0]), cache)
    out["reference"] = [train(reference) for _ in out["losses"]]
    destroy()
    cache.close()
    dist.barrier()
    return out


@pytest.fixture(scope="module", params=sorted(SHAPES))
def ahead_run(request):
    return request.param, run_distributed(_ahead_chain, 4, SHAPES[request.param], request.param, timeout_s=300)


def test_a_prepared_switch_keeps_the_full_logical_state_bit_for_bit(ahead_run):
    dtype, runs = ahead_run
    spec = logical_spec(GPTShape(**SHAPES[dtype]))
    precision = Precision.BF16 if dtype == "bfloat16" else Precision.FP32
    for i, (src, dst) in enumerate(zip(CHAIN, CHAIN[1:])):
        sides = [r["switches"][i] for r in runs]
        before = assemble(spec, ParallelConfig.parse(src), [s["before"]["tensors"] for s in sides], precision)
        after = assemble(spec, ParallelConfig.parse(dst), [s["after"]["tensors"] for s in sides], precision)
        assert before.keys() == after.keys() and before
        for key in before:
            assert np.array_equal(*common(before[key], after[key])), f"{dtype} {src} -> {dst}: {key} changed"
        for s in sides:
            assert s["after"]["step"] == s["before"]["step"] > 0
            assert s["after"]["groups"] == s["before"]["groups"]


def test_a_prepared_switch_builds_nothing_in_the_pause(ahead_run):
    """No plan compiled, no model, DDP or optimizer built inside the switch: only the binding."""
    dtype, runs = ahead_run
    for r in runs:
        for s in r["switches"]:
            assert "model" not in s["phases"] and "ddp_optimizer" not in s["phases"], s["phases"]
            assert "bind" in s["phases"], s["phases"]
            assert s["released"] > 0 and s["build"] > 0, s


def test_training_through_prepared_switches_tracks_a_run_that_never_switched(ahead_run):
    dtype, runs = ahead_run
    losses = runs[0]["losses"]
    assert all(r["losses"] == losses for r in runs), "ranks report different losses"
    np.testing.assert_allclose(losses, runs[0]["reference"], rtol=1e-2 if dtype == "bfloat16" else 1e-5)


def test_a_build_failing_on_one_rank_fails_every_rank_without_a_hang(ahead_run):
    _, runs = ahead_run
    assert "no_such_optimizer" in runs[1]["failed_build"], runs[1]["failed_build"]
    for rank in (0, 2, 3):
        assert "failed on rank(s) [1]" in runs[rank]["failed_build"], runs[rank]["failed_build"]
    # and the switch then ran on demand: the losses after it are in the comparison above


def test_a_prepared_switch_serves_one_switch(ahead_run):
    _, runs = ahead_run
    assert all("used already" in r["reused"] for r in runs), [r.get("reused") for r in runs]
