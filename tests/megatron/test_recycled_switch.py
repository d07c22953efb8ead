"""Hot switches that write new state into old storages (``devices.host.recycling_memory``), on a GPT large enough for
its tensors to be recycled (4 gloo processes). Through dp2-tp2 -> dp4 -> dp2-tp2 -> dp1-tp2-pp2 -> dp2-tp2 ->
dp2-tp2-zero1 -> dp2-tp2 the logical state stays bit-identical; a switch builds the new DDP buffers in the old
gradient buffers' memory where they fit, the zero1 param buffer too (and a switch refused after
that gives them back), and moves retained params into that buffer by their pages; dp4 -> dp2-tp2 keeps its
first-axis tensor-parallel halves as slices of the old full tensors and writes the others into
their memory; the pipeline change after it keeps those recycled tensors in place
(every tensor the plan allows); the round trip gives back every local tensor; and training goes on
exactly as in a run that never switched."""

from __future__ import annotations

import pytest

from lightning_dynatrain.megatron.gpt import GPTShape, logical_spec
from lightning_dynatrain.vps.layout import ParallelConfig
from tests.dist import run_distributed
from tests.megatron.jobs import SEED
from tests.megatron.test_memory_check import OPTIMIZER, SIZED

CHAIN = ["dp2-tp2-pp1", "dp4-tp1-pp1", "dp2-tp2-pp1", "dp1-tp2-pp2", "dp2-tp2-pp1", "dp2-tp2-pp1-zero1", "dp2-tp2-pp1"]
RECYCLE = [True, True, True, True, True, False]  # the last switch writes into fresh memory
INTO_ZERO1 = 4  # the switch that builds a zero1 param buffer


def _walk(rank: int, world_size: int) -> dict:
    import torch

    from lightning_dynatrain.transition.fingerprint import logical_fingerprint
    from lightning_dynatrain.megatron.gpt import build_gpt_model
    from lightning_dynatrain.megatron.hot_switch import SwitchSetup, hot_switch
    from lightning_dynatrain.megatron.state import MegatronState
    from lightning_dynatrain.megatron.optimizer import build_ddp_and_optimizer
    from lightning_dynatrain.megatron.train_step import run_train_step
    from lightning_dynatrain.megatron.parallel_state_adapter import ProcessGroupCache, destroy, initialize_for_layout
    from lightning_dynatrain.megatron.state_bridge import megatron_store

    shape = GPTShape(**SIZED)
    spec = logical_spec(shape)
    tokens = torch.randint(0, shape.vocab_size, (4, shape.seq_length + 1), generator=torch.Generator().manual_seed(5))

    def batch_for(layout):
        per = 4 // layout.dp
        local = tokens[layout.dense_coord(rank).dp * per:][:per]
        return {"tokens": local[:, :-1].contiguous(), "labels": local[:, 1:].contiguous()}

    def snapshot(state):
        store = megatron_store(state.ddp, state.optimizer, spec, state.layout, rank)
        return {k: t.detach().clone() for k, t in store.items()}, logical_fingerprint(store, spec, state.layout, rank)

    groups = ProcessGroupCache()
    first = ParallelConfig.parse(CHAIN[0])
    pgs = initialize_for_layout(first, seed=SEED, groups=groups)
    ddp, optimizer = build_ddp_and_optimizer(build_gpt_model(shape, first, seed=SEED), first, **OPTIMIZER)
    state = MegatronState(layout=first, groups=pgs, chunks=(ddp,), optimizer=optimizer)
    run_train_step(ddp, optimizer, batch_for(first), first, 1)
    start, fingerprint = snapshot(state)
    out = {"fingerprints_equal": [], "recycled": [], "in_place": [], "skipped_copies": [], "param_bytes": [],
           "param_buffer_in_old_grads": [], "moved_pages": [], "grad_bytes": [], "copied": [], "copied_by_pages": [],
           "collections": [], "gc_enabled_after": []}
    # refused at the engine's preflight, after the new DDP buffers were carved from the old gradient
    # buffers: the old gradients come back and training goes on (the checks below still hold)
    from lightning_dynatrain.transition.errors import StagingBudgetError
    try:
        hot_switch(state, ParallelConfig.parse(CHAIN[1]),
                   SwitchSetup(model=shape, seed=SEED, optimizer=OPTIMIZER, staging_budget=8, check_memory=False),
                   groups=groups)
    except StagingBudgetError as err:
        out["refused"] = str(err)
    out["grads_whole"] = all(b.grad_data.untyped_storage().nbytes() >= b.grad_data.nbytes for b in state.ddp.buffers)
    import gc

    collections: list[int] = []  # automatic collections started during a switch
    gc.callbacks.append(lambda phase, info: phase == "start" and gc.isenabled() and collections.append(1))
    for text, recycle in zip(CHAIN[1:], RECYCLE):
        old_grads = {b.grad_data.untyped_storage().data_ptr() for b in state.ddp.buffers}
        before = len(collections)
        result = hot_switch(state, ParallelConfig.parse(text), SwitchSetup(
            model=shape, seed=SEED, optimizer=OPTIMIZER, staging_budget=16 * 2**20, recycle=recycle), groups=groups)
        out["collections"].append(len(collections) - before)
        out["gc_enabled_after"].append(gc.isenabled())
        state = result.state
        out["param_buffer_in_old_grads"].append([b.param_data is not None and
                                                 b.param_data.untyped_storage().data_ptr() in old_grads
                                                 for b in state.ddp.buffers])
        out["fingerprints_equal"].append(snapshot(state)[1] == fingerprint)
        out["recycled"].append(result.memory.recycled_bytes)
        out["moved_pages"].append(result.memory.moved_page_bytes)
        out["grad_bytes"].append(sum(b.grad_data.nbytes for b in state.ddp.buffers))
        out["in_place"].append(result.report.in_place.bytes)
        out["copied"].append(result.report.local_copy.bytes)
        out["copied_by_pages"].append(result.report.local_copy_pages.bytes)
        out["skipped_copies"].append(result.memory.skipped_copy_bytes)
        out["param_bytes"].append(sum(p.nbytes for p in state.ddp.module.parameters()))
    end, _ = snapshot(state)
    out["round_trip_exact"] = start.keys() == end.keys() and all(torch.equal(start[k], end[k]) for k in start)
    out["loss_after"] = run_train_step(state.ddp, state.optimizer, batch_for(state.layout), state.layout, 1)
    # the same two steps without any switch
    ddp, optimizer = build_ddp_and_optimizer(build_gpt_model(shape, first, seed=SEED), first, **OPTIMIZER)
    out["reference"] = [run_train_step(ddp, optimizer, batch_for(first), first, 1) for _ in range(2)][-1]
    destroy()
    return out


@pytest.fixture(scope="module")
def walk():
    return run_distributed(_walk, 4, timeout_s=300)


def _into_zero1_and_back(rank: int, world_size: int) -> dict:
    """dp2 -> dp2-zero1 -> dp2 from a trained state: fingerprints, bytes copied (by pages), round trip."""
    import torch

    from lightning_dynatrain.transition.fingerprint import logical_fingerprint
    from lightning_dynatrain.megatron.gpt import build_gpt_model
    from lightning_dynatrain.megatron.hot_switch import SwitchSetup, hot_switch
    from lightning_dynatrain.megatron.state import MegatronState
    from lightning_dynatrain.megatron.optimizer import build_ddp_and_optimizer
    from lightning_dynatrain.megatron.train_step import run_train_step
    from lightning_dynatrain.megatron.parallel_state_adapter import ProcessGroupCache, destroy, initialize_for_layout
    from lightning_dynatrain.megatron.state_bridge import megatron_store

    shape = GPTShape(**SIZED)
    spec = logical_spec(shape)
    dp2 = ParallelConfig.parse("dp2-tp1-pp1")
    groups = ProcessGroupCache()
    pgs = initialize_for_layout(dp2, seed=SEED, groups=groups)
    ddp, optimizer = build_ddp_and_optimizer(build_gpt_model(shape, dp2, seed=SEED), dp2, **OPTIMIZER)
    tokens = torch.randint(0, shape.vocab_size, (2, shape.seq_length + 1), generator=torch.Generator().manual_seed(5))
    run_train_step(ddp, optimizer, {"tokens": tokens[rank:rank + 1, :-1], "labels": tokens[rank:rank + 1, 1:]}, dp2, 1)
    state = MegatronState(layout=dp2, groups=pgs, chunks=(ddp,), optimizer=optimizer)

    def store():
        return megatron_store(state.ddp, state.optimizer, spec, state.layout, rank)

    start = {k: t.clone() for k, t in store().items()}
    fingerprint = logical_fingerprint(store(), spec, dp2, rank)
    out = {"fingerprints_equal": [], "copied": [], "copied_by_pages": []}
    for text in ("dp2-tp1-pp1-zero1", "dp2-tp1-pp1"):
        result = hot_switch(state, ParallelConfig.parse(text), SwitchSetup(
            model=shape, seed=SEED, optimizer=OPTIMIZER, staging_budget=16 * 2**20), groups=groups)
        state = result.state
        out["fingerprints_equal"].append(logical_fingerprint(store(), spec, state.layout, rank) == fingerprint)
        out["copied"].append(result.report.local_copy.bytes)
        out["copied_by_pages"].append(result.report.local_copy_pages.bytes)
    end = store()
    out["round_trip_exact"] = start.keys() == end.keys() and all(torch.equal(start[k], end[k]) for k in start)
    destroy()
    return out


@pytest.fixture(scope="module")
def zero1_round_trip():
    with pytest.MonkeyPatch.context() as env:
        # PyTorch then starts every tensor of 2 MiB or more on a 2 MiB boundary (the benchmark runs so):
        # old params at the same offset in a page as their place in the zero1 param buffer, for the
        # params megatron lays out at whole pages
        env.setenv("THP_MEM_ALLOC_ENABLE", "1")
        return run_distributed(_into_zero1_and_back, 2, timeout_s=300)


def _kept_in_place_bytes(src: str, dst: str, rank: int, *, slices: bool = True, moments_only: bool = False) -> int:
    """What the plan lets a rank keep in place: whole local tensors at an unchanged local layout,
    and (``slices``) those retained as one contiguous run of an old tensor; ``moments_only``: of the
    Adam moments alone (a zero1 model's params live in megatron's flat buffer: never rebound)."""
    from lightning_dynatrain.transition.adoption import adoptable_keys, slice_keys
    from lightning_dynatrain.transition.local_state import RegionIndex, local_numel
    from lightning_dynatrain.vps.mapping import rank_regions
    from lightning_dynatrain.vps.planner import plan_rank
    from lightning_dynatrain.vps.spec import Precision, StateKind

    spec = logical_spec(GPTShape(**SIZED))
    a, b = ParallelConfig.parse(src), ParallelConfig.parse(dst)
    dst_index = RegionIndex(rank_regions(spec, b, rank))
    plan = plan_rank(spec, a, b, rank, precision=Precision.FP32)
    src_index = RegionIndex(rank_regions(spec, a, rank))
    kept = set(adoptable_keys(plan.retains, src_index, dst_index))
    if slices:
        kept |= set(slice_keys(plan.retains, src_index, dst_index))
    if moments_only:
        kept = {key for key in kept if key[1] in (StateKind.EXP_AVG, StateKind.EXP_AVG_SQ)}
    return sum(4 * local_numel(dst_index.local_tensors()[key]) for key in kept)


def test_recycled_switches_keep_the_logical_state_bit_for_bit(walk):
    for rank, run in enumerate(walk):
        assert run["fingerprints_equal"] == [True] * len(RECYCLE), rank
        assert run["round_trip_exact"], f"rank {rank}: {' -> '.join(CHAIN)} changed a local tensor"


def test_a_refused_switch_gives_the_gradient_buffers_back(walk):
    for run in walk:
        assert "staging budget" in run.get("refused", "").lower() and run["grads_whole"]


def test_new_state_is_written_into_old_storages_only_when_asked(walk):
    for run in walk:
        assert run["recycled"][1] > 0  # dp4 -> dp2-tp2: the halves go into the old full tensors' memory
        assert run["recycled"][-1] == 0  # recycle=False


def test_a_larger_gradient_buffer_takes_the_pages_of_old_state(walk):
    """dp2-tp2 -> dp4 doubles the gradient buffer: no old buffer holds it, so it stays untouched
    while the engine runs, and at the end the pages of old tensors the engine freed are moved into
    it (``StorageRecycler.fill``), all but the last piece: no fresh memory for it."""
    from lightning_dynatrain.devices.host.page_moves import MIN_PIECE, can_move_pages

    if not can_move_pages():
        pytest.skip("mremap is Linux")
    for run in walk:
        assert run["grad_bytes"][0] > 2 * MIN_PIECE
        assert run["grad_bytes"][0] - MIN_PIECE <= run["moved_pages"][0] <= run["recycled"][0]
        assert run["moved_pages"][-1] == 0  # recycle=False


def test_no_automatic_garbage_collection_runs_during_a_switch(walk):
    """``hot_switch`` pauses Python's collector (``lightning_dynatrain.gc_pause``) and turns it back on after: at
    most one automatic collection per switch, the collector catching up as the switch returns."""
    for run in walk:
        assert all(n <= 1 for n in run["collections"]) and all(run["gc_enabled_after"]), run["collections"]


def test_the_zero1_param_buffer_is_written_by_the_engine_alone(walk):
    """Into zero1, DDP's copies of the new model's uninitialised params into its param buffer are
    skipped, every param's bytes (the engine writes them all: the fingerprints above match); no
    other switch builds a param buffer."""
    for run in walk:
        assert run["skipped_copies"][INTO_ZERO1] == run["param_bytes"][INTO_ZERO1] > 0
        assert [b for i, b in enumerate(run["skipped_copies"]) if i != INTO_ZERO1] == [0] * (len(RECYCLE) - 1)


def test_retained_params_go_into_the_zero1_param_buffer_by_their_pages(zero1_round_trip, walk):
    """Into zero1, each rank's params (retained whole) are copied into megatron's flat param buffer:
    those that sit at the same offset in a page as their old tensor change places with the buffer's
    pages (``StorageRecycler.copy_by_pages``) instead of being copied byte by byte, and the state
    stays bit-identical there and back; never with recycle=False."""
    from lightning_dynatrain.devices.host.page_moves import can_move_pages

    if not can_move_pages():
        pytest.skip("mremap is Linux")
    for run in zero1_round_trip:
        assert run["fingerprints_equal"] == [True, True] and run["round_trip_exact"]
        assert 0 < run["copied_by_pages"][0] <= run["copied"][0], (run["copied_by_pages"], run["copied"])
    for run in walk:
        assert run["copied_by_pages"][-1] == 0  # recycle=False
        assert all(p <= c for p, c in zip(run["copied_by_pages"], run["copied"]))


def test_tensor_parallel_halves_of_full_replicas_are_kept_as_slices(walk):
    """dp4 -> dp2-tp2: each rank keeps its first-axis tensor-parallel halves (column-parallel weights,
    the vocabulary) as views into its old full tensors, every one the plan allows; the rest of those
    old tensors takes the second-axis halves, which are copied."""
    for rank, run in enumerate(walk):
        whole = _kept_in_place_bytes(CHAIN[1], CHAIN[2], rank, slices=False)
        expected = _kept_in_place_bytes(CHAIN[1], CHAIN[2], rank)
        assert expected > 2 * whole and run["in_place"][1] == expected, (rank, run["in_place"], whole, expected)


def test_turning_zero1_on_carves_the_param_buffer_and_keeps_the_moment_shards(walk):
    """dp2-tp2 -> dp2-tp2-zero1: the zero1 param buffer (the first buffer megatron's DDP allocates) is
    carved from the old gradient buffer's memory, not fresh (the new gradient buffer, which no old
    buffer is left for, is the one in fresh memory); each rank's zero1 shares of the Adam moments
    stay where they were, as slices of the old whole moments."""
    for rank, run in enumerate(walk):
        assert run["param_buffer_in_old_grads"][INTO_ZERO1] and all(run["param_buffer_in_old_grads"][INTO_ZERO1])
        # the Adam moments' zero1 shards are kept as slices of the old whole moments
        expected = _kept_in_place_bytes(CHAIN[INTO_ZERO1], CHAIN[INTO_ZERO1 + 1], rank, moments_only=True)
        assert expected > 0 and run["in_place"][INTO_ZERO1] == expected, (rank, run["in_place"], expected)
        assert not any(any(row) for i, row in enumerate(run["param_buffer_in_old_grads"]) if i != INTO_ZERO1)


def test_recycled_tensors_are_kept_in_place_by_the_next_switch(walk):
    """dp2-tp2 -> dp1-tp2-pp2 keeps each rank's stage whole. Its tensors live in storages the previous
    switch recycled (each shared by several tensors), and every one the plan allows is kept in place."""
    for rank, run in enumerate(walk):
        expected = _kept_in_place_bytes(CHAIN[2], CHAIN[3], rank)
        assert expected > 0 and run["in_place"][2] == expected, (rank, run["in_place"], expected)


def test_training_goes_on_as_in_a_run_that_never_switched(walk):
    for run in walk:
        assert run["loss_after"] == run["reference"]
