"""Hot switches of a real megatron GPT's full training state (params, Adam moments, zero1 shards).

One spawned 4-process gloo job per model walks a chain of layouts, training between switches. At
every switch each rank returns its local tensors before and after; the parent assembles the full
logical state (every param and moment, from the regions the VPS gives each rank) on both sides and
requires it to be bit-identical. A last round trip A -> B -> A without training in between must
give every rank back its local tensors bit for bit. Training after the
switches must give the losses of a run that never switched (same global batches), to rounding.
An MoE's switches (ep 2 -> 4 -> tp2, ZeRO-1 on and off, virtual stages) are checked through
megatron's own description of the state in ``test_virtual_pipeline.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from lightning_dynatrain.megatron.gpt import GPTShape, logical_spec
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.spec import Precision, StateKind
from lightning_dynatrain.vps.topology import Topology
from tests.dist import run_distributed
from tests.logical_state import assemble, common
from tests.megatron.jobs import DENSE, GLOBAL_BATCH, MICROBATCHES, SEED

CHAINS = {
    "dense": (DENSE, ["dp2-tp2-pp1", "dp1-tp2-pp2-zero1", "dp4-tp1-pp1-zero1", "dp2-tp1-pp2", "dp2-tp2-pp1",
                        "dp1-tp2-pp2"]),  # the last keeps whole layers in place
    # bf16 params with fp32 main params, and fp32 norms (megatron keeps them so: no main param, a
    # buffer of their own under zero1); zero1 on and off on either side of a switch
    "bf16": (dict(DENSE, query_groups=4, make_vocab_size_divisible_by=32), ["dp2-tp2-pp1", "dp1-tp2-pp2-zero1", "dp2-tp1-pp2-zero1", "dp1-tp4-pp1",
                                           "dp4-tp1-pp1-zero1", "dp2-tp2-pp1"]),
}
DTYPES = {"bf16": "bfloat16"}
# a target that moves bytes from each chain's first layout: asked with a budget below a row, refused
REFUSED = {"dense": "dp4-tp1-pp1", "bf16": "dp4-tp1-pp1"}
# clip_grad: the gradient norm must see every TP shard after a switch (see test on tags)
OPTIMIZER = dict(lr=1e-2, weight_decay=0.1, clip_grad=1.0)


def _snapshot(state, spec, layout, rank):
    """Every local tensor's bits (an integer view, so bf16 and NaN compare bit for bit), and the
    optimizer's param-group settings."""
    import torch

    from lightning_dynatrain.megatron.state_bridge import adam_step, megatron_store

    ints = {4: torch.int32, 2: torch.int16}
    tensors = {key: t.detach().clone().reshape(-1).view(ints[t.element_size()]).numpy() for key, t in
               megatron_store(state.ddp, state.optimizer, spec, layout, rank).items()}
    groups = sorted({(g["wd_mult"], g["lr_mult"], g["lr"], g["weight_decay"]) for g in state.optimizer.param_groups})
    return {"tensors": tensors, "groups": groups, "step": adam_step(state.optimizer),
            "dtypes": sorted({str(t.dtype) for t in megatron_store(state.ddp, state.optimizer, spec, layout,
                                                                    rank).values()})}


def _chain(rank: int, world_size: int, shape_kwargs: dict, chain: list[str], staging_budget: str,
           refused_target: str, params_dtype: str = "float32") -> dict:
    import torch
    import torch.distributed as dist

    from lightning_dynatrain.megatron.gpt import build_gpt_model
    from lightning_dynatrain.megatron.hot_switch import SwitchSetup, hot_switch
    from lightning_dynatrain.megatron.state import MegatronState
    from lightning_dynatrain.megatron.optimizer import build_ddp_and_optimizer
    from lightning_dynatrain.megatron.train_step import run_train_step
    from lightning_dynatrain.megatron.parallel_state_adapter import destroy, initialize_for_layout
    from lightning_dynatrain.runtime.steps import set_lr_and_wd

    shape = GPTShape(**shape_kwargs)
    spec = logical_spec(shape)
    dtype = getattr(torch, params_dtype)
    tokens = torch.randint(0, shape.vocab_size, (GLOBAL_BATCH, shape.seq_length + 1),
                           generator=torch.Generator().manual_seed(11))

    def train(state, steps):
        pgs_dp = state.layout.dp
        dp_rank = state.layout.dense_coord(rank).dp
        per = GLOBAL_BATCH // pgs_dp
        local = tokens[dp_rank * per:(dp_rank + 1) * per]
        batch = {"tokens": local[:, :-1].contiguous(), "labels": local[:, 1:].contiguous()}
        # as a training loop's scheduler does: no weight decay on biases and norms (wd_mult 0)
        set_lr_and_wd(state.optimizer, lr=OPTIMIZER["lr"], weight_decay=OPTIMIZER["weight_decay"])
        return [run_train_step(state.ddp, state.optimizer, batch, state.layout, MICROBATCHES) for _ in range(steps)]

    first = ParallelConfig.parse(chain[0])
    pgs = initialize_for_layout(first, seed=SEED)
    model = build_gpt_model(shape, first, seed=SEED, params_dtype=dtype)
    ddp, optimizer = build_ddp_and_optimizer(model, first, **OPTIMIZER)
    state = MegatronState(layout=first, groups=pgs, chunks=(ddp,), optimizer=optimizer)
    topology = Topology.uniform(4, 2)

    def setup(budget: int) -> SwitchSetup:
        return SwitchSetup(model=shape, seed=SEED, optimizer=OPTIMIZER, staging_budget=budget, topology=topology)
    out = {"losses": train(state, 2), "switches": []}
    # a switch refused before anything moves (budget below a row, on every rank) leaves the state
    # whole: gradient buffers and megatron's groups come back, and training goes on (losses below)
    from lightning_dynatrain.transition.errors import StagingBudgetError
    try:
        hot_switch(state, ParallelConfig.parse(refused_target), setup(8))
    except StagingBudgetError as err:
        out["refused"] = str(err)
    for text in chain[1:]:
        target = ParallelConfig.parse(text)
        before = _snapshot(state, spec, state.layout, rank)
        result = hot_switch(state, target, setup(staging_budget))
        state = result.state
        after = _snapshot(state, spec, target, rank)
        out["switches"].append(dict(src=result.report.src, dst=result.report.dst, before=before, after=after,
                                    report=str(result.report), peak=result.report.peak_staging_bytes,
                                    in_place=result.report.in_place.bytes, freed=result.memory.freed_bytes))
        out["losses"] += train(state, 1)
    # A -> B -> A with no training in between must give back every local tensor bit for bit
    # (twice, with a process group cache: the second round trip creates no group)
    from lightning_dynatrain.megatron.parallel_state_adapter import ProcessGroupCache

    home, away = state.layout, ParallelConfig.parse(chain[1])
    start = _snapshot(state, spec, home, rank)
    cache, cached = ProcessGroupCache(), []
    for target in (away, home, away, home):
        state = hot_switch(state, target, setup(staging_budget), groups=cache).state
        cached.append(len(cache))
    out["round_trip"] = (start, _snapshot(state, spec, home, rank))
    out["cached_groups"] = cached
    # a model built without init for a switch carries the tensor-parallel tags megatron's init sets
    # (clip_grad_norm leaves untagged TP-split weights of tp ranks > 0 out of the norm)
    def tags(m):
        return {n: tuple(getattr(p, a, None) for a in ("tensor_model_parallel", "partition_dim", "partition_stride"))
                for n, p in m.named_parameters()}
    out["tags"] = (tags(build_gpt_model(shape, home, seed=SEED)), tags(build_gpt_model(shape, home, seed=SEED,
                                                                                        initialize=False)))
    # the same training without any switch, in the same processes
    pgs = initialize_for_layout(first, seed=SEED)
    fresh = build_ddp_and_optimizer(build_gpt_model(shape, first, seed=SEED, params_dtype=dtype), first, **OPTIMIZER)
    out["reference"] = train(MegatronState(layout=first, groups=pgs, chunks=(fresh[0],), optimizer=fresh[1]),
                             len(out["losses"]))
    # what a failed switch does to the cache: the groups made since a mark go, the earlier ones stay
    sizes = {(x.tp, x.pp, x.ep, x.etp) for x in (home, away)}
    other = next((x for x in map(ParallelConfig.parse, chain) if (x.tp, x.pp, x.ep, x.etp) not in sizes), None)
    out["dropped"] = None
    if other is not None:
        kept = cache.keys()
        initialize_for_layout(other, seed=SEED, groups=cache)
        grown = len(cache)
        dist.barrier()  # no rank destroys a group another rank is still connecting (gloo's full mesh)
        out["dropped"] = (len(kept), grown, cache.drop_since(kept), len(cache), cache.keys() == kept)
    destroy()
    cache.close()
    dist.barrier()
    return out


@pytest.fixture(scope="module", params=sorted(CHAINS))
def chain_run(request):
    shape_kwargs, chain = CHAINS[request.param]
    runs = run_distributed(_chain, 4, shape_kwargs, chain, 64 * 1024, REFUSED[request.param],
                           DTYPES.get(request.param, "float32"), timeout_s=240)
    return request.param, shape_kwargs, chain, runs


def test_every_switch_keeps_the_full_logical_state_bit_for_bit(chain_run):
    """Params (bf16 or fp32), fp32 main params, both Adam moments, the step, and the optimizer's
    param-group settings (weight decay and LR, per multiplier) are the same after every switch."""
    name, shape_kwargs, chain, runs = chain_run
    spec = logical_spec(GPTShape(**shape_kwargs))
    precision = Precision.BF16 if name == "bf16" else Precision.FP32
    for i, (src, dst) in enumerate(zip(chain, chain[1:])):
        sides = [r["switches"][i] for r in runs]
        before = assemble(spec, ParallelConfig.parse(src), [s["before"]["tensors"] for s in sides], precision)
        after = assemble(spec, ParallelConfig.parse(dst), [s["after"]["tensors"] for s in sides], precision)
        assert before.keys() == after.keys()
        for key in before:
            assert np.array_equal(*common(before[key], after[key])), f"{name} {src} -> {dst}: {key} changed"
        for s in sides:
            assert s["after"]["step"] == s["before"]["step"] > 0
            assert s["after"]["groups"] == s["before"]["groups"], f"{name} {src} -> {dst}: param groups changed"
            assert len({wd for _, _, _, wd in s["after"]["groups"]}) > 1, "biases and norms have no weight decay"
    if name == "bf16":  # the case megatron builds: bf16 params, fp32 main params, fp32 norms
        kinds = {k[1] for s in runs[0]["switches"] for k in s["after"]["tensors"]}
        assert StateKind.MAIN_PARAM in kinds
        assert runs[0]["switches"][0]["after"]["dtypes"] == ["torch.bfloat16", "torch.float32"]


def test_a_to_b_to_a_gives_back_identical_local_tensors(chain_run):
    name, _, chain, runs = chain_run
    for rank, r in enumerate(runs):
        start, end = (side["tensors"] for side in r["round_trip"])
        assert start.keys() == end.keys()
        for key in start:
            assert np.array_equal(start[key], end[key]), f"{name} rank {rank}: {key} changed over {chain[0]} -> {chain[1]} -> {chain[0]}"


def test_a_refused_switch_leaves_a_state_that_trains_on(chain_run):
    _, _, _, runs = chain_run
    assert all("staging budget" in r.get("refused", "").lower() for r in runs), [r.get("refused") for r in runs]
    # and the losses after it match the run that never switched: test_training_after_switches_...


def test_the_old_state_is_given_back_during_the_switch(chain_run):
    """Every byte of old params and moments is freed by the time the switch returns, or kept in place."""
    name, _, _, runs = chain_run
    for r in runs:
        for s in r["switches"]:
            old = sum(v.nbytes for v in s["before"]["tensors"].values())
            assert s["freed"] + s["in_place"] >= old, (name, s["src"], s["dst"], s["freed"], s["in_place"], old)


def test_switching_back_reuses_cached_process_groups(chain_run):
    _, _, _, runs = chain_run
    for r in runs:
        first_away, first_home, second_away, second_home = r["cached_groups"]
        assert 0 < first_away <= first_home == second_away == second_home, r["cached_groups"]
        if r["dropped"] is not None:  # a chain with a layout of other group sizes than the round trip's
            kept, grown, dropped, left, same = r["dropped"]
            assert grown > kept and (dropped, left, same) == (grown - kept, kept, True), r["dropped"]


def test_uninitialised_models_carry_megatrons_tensor_parallel_tags(chain_run):
    _, _, _, runs = chain_run
    for r in runs:
        initialised, bare = r["tags"]
        assert bare == initialised
        assert any(t[0] for t in initialised.values())


def test_peak_staging_stays_within_the_budget(chain_run):
    name, _, _, runs = chain_run
    peaks = [s["peak"] for r in runs for s in r["switches"]]
    for r in runs:
        for s in r["switches"]:
            assert s["peak"] <= 64 * 1024 + max(v.nbytes for v in s["after"]["tensors"].values()), s["report"]
    assert max(peaks) > 0, "no switch staged anything: the chain moved no bytes"


def test_whole_retained_tensors_are_kept_in_place(chain_run):
    """zero0 -> zero0 keeps the retained params and moments (rebound, not copied); a zero1 model's
    params are views into DDP's buffer and are copied into, while its zero1 moment shards cut from
    whole old moments are kept (slices); every switch above stays exact."""
    name, _, chain, runs = chain_run
    if name != "dense":
        pytest.skip("the dense chain ends with the switch that keeps whole layers")
    # dp2-tp2-pp1 -> dp1-tp2-pp2: each stage's layers stay on the ranks that hold them
    last = [r["switches"][-1] for r in runs]
    assert sum(s["in_place"] for s in last) > 0.5 * sum(v.nbytes for s in last for v in s["after"]["tensors"].values())
    into_zero1 = [r["switches"][0] for r in runs]  # dp2-tp2-pp1 -> dp1-tp2-pp2-zero1
    for s in into_zero1:  # the params (buffer views) are copied, the retained moments kept
        moments = sum(v.nbytes for key, v in s["after"]["tensors"].items()
                      if key[1] in (StateKind.EXP_AVG, StateKind.EXP_AVG_SQ))
        assert 0 < s["in_place"] <= moments, (s["in_place"], moments)
    assert sum(s["in_place"] for s in into_zero1) > 0.5 * sum(
        v.nbytes for s in into_zero1 for key, v in s["after"]["tensors"].items() if key[1] is not StateKind.PARAM)


def test_training_after_switches_tracks_a_run_that_never_switched(chain_run):
    name, shape_kwargs, chain, runs = chain_run
    losses = runs[0]["losses"]
    assert all(r["losses"] == losses for r in runs), "ranks report different losses"
    np.testing.assert_allclose(losses, runs[0]["reference"], rtol=1e-2 if name == "bf16" else 1e-5)
