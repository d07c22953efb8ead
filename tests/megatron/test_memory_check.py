"""The memory check before a hot switch: the per-rank bound, the verdict over shared pools, and a real
2-process switch whose measured peak memory stays under the bound it was checked against."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_dynatrain.megatron.gpt import GPTShape, logical_spec
from lightning_dynatrain.megatron.memory_check import (
    GRAD_BYTES_PER_ELEMENT,
    MemoryReading,
    SwitchMemoryError,
    local_numels,
    refusal,
    switch_need_bytes,
)
from lightning_dynatrain.transition.compiler import switch_program
from lightning_dynatrain.transition.local_state import RegionIndex, local_numel
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.mapping import rank_regions
from lightning_dynatrain.vps.planner import union_world
from lightning_dynatrain.vps.spec import Precision, StateKind
from lightning_dynatrain.vps.topology import Topology
from tests.dist import run_distributed
from tests.megatron.jobs import DENSE, MOE, SEED

MiB = 2**20
SPECS = {"dense": logical_spec(GPTShape(**DENSE)), "moe": logical_spec(GPTShape(**MOE))}


def _program(spec, src, dst, rank, staging=64 * MiB, precision=Precision.FP32):
    a, b = ParallelConfig.parse(src), ParallelConfig.parse(dst)
    return switch_program(spec, a, b, rank, precision, staging_budget=staging,
                          topology=Topology.uniform(union_world(a, b), 2))


def _need(spec, src, dst, rank, staging=64 * MiB, precision=Precision.FP32):
    old_grads = GRAD_BYTES_PER_ELEMENT * local_numels(spec, ParallelConfig.parse(src), rank, precision)[StateKind.PARAM]
    return switch_need_bytes(_program(spec, src, dst, rank, staging, precision), old_grad_bytes=old_grads)


@pytest.mark.parametrize("layout", ["dp2-tp2-pp1", "dp1-tp2-pp2-zero1", "dp4-tp1-pp1"])
def test_switching_to_the_same_layout_needs_only_what_megatron_builds_beside_the_old_state(layout):
    """The new gradient buffer takes the old one's place and every zero0 tensor is kept in place, so
    what is left is built at construction: under zero1 a second flat param buffer (the old one, all
    views, goes only at the end), in bf16 the optimizer's fp32 main params."""
    spec, parsed = SPECS["dense"], ParallelConfig.parse(layout)
    for rank in range(4):
        for precision in Precision:
            n = local_numels(spec, parsed, rank, precision)
            regions = rank_regions(spec, parsed, rank, precision)
            param_bytes = sum(local_numel(r) * r.itemsize
                              for k, r in RegionIndex(regions).local_tensors().items() if k[1] is StateKind.PARAM)
            built = (param_bytes if parsed.zero else 0) + 4 * n.get(StateKind.MAIN_PARAM, 0)
            assert _need(spec, layout, layout, rank, precision=precision) == built
            assert built > 0 or (precision.params == "fp32" and not parsed.zero)


def test_replicating_a_sharded_state_needs_the_new_copies():
    """tp2 -> dp2 (world 2): each rank goes from half of every TP-split tensor to all of it, so it
    needs at least the params and both moments it does not hold yet, plus the larger gradient buffer."""
    spec = SPECS["dense"]
    src, dst = ParallelConfig.parse("dp1-tp2-pp1"), ParallelConfig.parse("dp2-tp1-pp1")
    for rank in range(2):
        old, new = local_numels(spec, src, rank), local_numels(spec, dst, rank)
        grown = sum(4 * (new[k] - old[k]) for k in (StateKind.PARAM, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ))
        grads = GRAD_BYTES_PER_ELEMENT * (new[StateKind.PARAM] - old[StateKind.PARAM])
        need = _need(spec, "dp1-tp2-pp1", "dp2-tp1-pp1", rank, staging=1)
        assert need >= grown + grads > 0


def test_the_stage_buffer_counts_as_the_program_sizes_it():
    """The bound holds the one stage buffer the program allocates: within the budget (plus a row),
    and never more than the rank sends and receives, whatever the budget."""
    spec = SPECS["dense"]
    for budget in (1024, 2048, 2**40):
        program = _program(spec, "dp1-tp2-pp1", "dp2-tp1-pp1", 0, staging=budget)
        moved = sum(m.nbytes for s in program.steps if hasattr(s, "sends") for m in s.sends + s.recvs)
        assert 0 < program.buffer_bytes <= min(budget + program.needed_budget, moved)
        assert _need(spec, "dp1-tp2-pp1", "dp2-tp1-pp1", 0, staging=budget) >= program.buffer_bytes
    assert _program(spec, "dp1-tp2-pp1", "dp2-tp1-pp1", 0, staging=2048).buffer_bytes > \
        _program(spec, "dp1-tp2-pp1", "dp2-tp1-pp1", 0, staging=1024).buffer_bytes


def _readings(needs, frees, pools=None):
    pools = pools or [7] * len(needs)
    return [MemoryReading(rank=r, pool=p, need=n, free=f) for r, (n, f, p) in enumerate(zip(needs, frees, pools))]


def test_a_pool_fits_when_its_ranks_needs_add_up_to_its_free_memory():
    assert refusal(_readings([3, 3, 4], [10, 11, 12]), what="a -> b") is None
    error = refusal(_readings([3, 3, 5], [10, 11, 12]), what="a -> b", pool_names={7: "node-a"})
    assert isinstance(error, SwitchMemoryError)
    assert "node-a" in str(error) and "ranks 0, 1, 2" in str(error) and "nothing was moved" in str(error)
    assert "HINT" in str(error) and "zero1" in str(error)


def test_pools_are_checked_separately_and_an_unreadable_pool_is_skipped():
    # two hosts of two ranks: each needs 8 of its 10; together they would not fit in one
    assert refusal(_readings([4, 4, 4, 4], [10, 10, 10, 10], [1, 1, 2, 2]), what="x") is None
    assert refusal(_readings([4, 4, 7, 4], [10, 10, 10, 10], [1, 1, 2, 2]), what="x") is not None
    assert refusal(_readings([40, 40], [-1, -1]), what="x") is None  # nobody could read it: not checked


def test_a_limit_refuses_any_rank_over_it():
    error = refusal(_readings([5 * 10**9, 1], [-1, -1]), what="a -> b", limit_bytes=4 * 10**9)
    assert isinstance(error, SwitchMemoryError)
    assert "switch_memory_limit" in str(error) and "rank 0" in str(error) and "5.00 GB" in str(error)
    assert refusal(_readings([4 * 10**9, 1], [-1, -1]), what="a -> b", limit_bytes=4 * 10**9) is None


# large enough that the state (about 84 MB per full copy) dwarfs allocator noise and python objects
SIZED = dict(hidden=512, layers=4, heads=4, ffn_hidden=2048, vocab_size=8192, seq_length=32,
             make_vocab_size_divisible_by=64, tied_embeddings=False)
OPTIMIZER = dict(lr=1e-3)


def _measured_switch(rank: int, world_size: int) -> dict:
    import torch

    from benchmarks.baselines.memory import peak_rss, reset_peak_rss, rss, trim_heap
    from lightning_dynatrain.megatron.gpt import build_gpt_model
    from lightning_dynatrain.megatron.hot_switch import SwitchSetup, hot_switch
    from lightning_dynatrain.megatron.state import MegatronState
    from lightning_dynatrain.megatron.optimizer import build_ddp_and_optimizer
    from lightning_dynatrain.megatron.train_step import run_train_step
    from lightning_dynatrain.megatron.parallel_state_adapter import destroy, initialize_for_layout

    shape = GPTShape(**SIZED)
    src, dst = ParallelConfig.parse("dp1-tp2-pp1"), ParallelConfig.parse("dp2-tp1-pp1")
    pgs = initialize_for_layout(src, seed=SEED)
    ddp, optimizer = build_ddp_and_optimizer(build_gpt_model(shape, src, seed=SEED), src, **OPTIMIZER)
    state = MegatronState(layout=src, groups=pgs, chunks=(ddp,), optimizer=optimizer)
    setup = SwitchSetup(model=shape, seed=SEED, optimizer=OPTIMIZER, staging_budget=16 * 2**20)
    tokens = torch.randint(0, shape.vocab_size, (2, shape.seq_length + 1), generator=torch.Generator().manual_seed(3))
    batch = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
    run_train_step(ddp, optimizer, batch, src, 1)
    before = [p.detach().clone() for p in ddp.module.parameters()]
    out = {}
    try:  # a limit below this rank's need: refused on every rank, before anything is freed or moved
        hot_switch(state, dst, dataclasses.replace(setup, memory_limit=1024))
    except SwitchMemoryError as err:
        out["refused"] = str(err)
    out["unchanged"] = all(torch.equal(a, p) for a, p in zip(before, ddp.module.parameters()))
    out["grads_kept"] = all(b.grad_data.numel() > 0 and b.grad_data.untyped_storage().nbytes() > 0
                            for b in ddp.buffers)
    trim_heap()
    start = rss()
    reset_peak_rss()
    result = hot_switch(state, dst, setup)
    out.update(need=result.need_bytes, extra=peak_rss() - start, param_bytes=sum(v.nbytes for v in before))
    out["loss_after"] = run_train_step(result.state.ddp, result.state.optimizer, batch, dst, 1)
    destroy()
    return out


def test_a_real_switch_stays_under_the_memory_it_was_checked_against():
    runs = run_distributed(_measured_switch, 2, timeout_s=240)
    for rank, r in enumerate(runs):
        assert "switch_memory_limit" in r.get("refused", ""), r.get("refused")
        assert r["unchanged"] and r["grads_kept"], "a refused switch changed the old state"
        # tp2 -> dp2 doubles every rank's state: the bound is real, and the measured peak is within it
        # (plus 16 MiB for megatron's module objects and the allocator's granularity)
        assert r["need"] > 3 * r["param_bytes"], r  # new params and moments, half of them new
        assert 0.5 * r["need"] < r["extra"] <= r["need"] + 16 * MiB, (rank, r["extra"], r["need"])
    assert runs[0]["loss_after"] == runs[1]["loss_after"]
