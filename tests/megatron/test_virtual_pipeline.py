"""Training at virtual pipeline stages (``-vppN``: megatron's interleaved 1F1B over model chunks), and
hot switches into and out of them, in one spawned 4-process gloo job of a real megatron GPT.

The job trains the same global batches along a chain of layouts, switching in memory between
them: plain pp2, pp2 with two virtual stages, the same with ZeRO-1 (each chunk's buffers sharded
over two data-parallel ranks), then with tp2, pp4 with two virtual stages, an uneven pp2, and back;
and an MoE (experts over ep2, ZeRO-1, tp2 with etp1) into and out of pp2-vpp2, then to ep4 and
tp2 without a pipeline. Around every switch each rank describes its whole training state through
megatron itself (each chunk's ``sharded_state_dict()`` and the optimizer's, as Megatron-LM saves a
model of chunks): assembled, the state after the switch must be the state before, bit for bit.
The losses must be those of the same steps at a layout that never switched, to rounding where tp
changes the order of a sum, and bit for bit where only the interleaving differs. A second run from
scratch at ``pp2-vpp2`` trains bit for bit as the same steps at plain ``pp2`` (megatron's
interleaved schedule computes the same sums as its 1F1B), and evaluates a batch to the same loss.
Megatron's own ``dist_checkpointing`` writes the dense chain's last state and
``load_megatron_checkpoint`` reads it into model chunks at another layout: the same state as
megatron describes it.
"""

from __future__ import annotations

import pytest

from tests.dist import run_distributed
from tests.megatron_description import assemble, differences

#: 8 layers, so that pp4 with two virtual stages holds one layer per chunk; tied embeddings (the
#: first chunk of the first stage and the last chunk of the last stage hold the two copies)
DENSE = dict(hidden=32, layers=8, heads=4, query_groups=2, ffn_hidden=64, vocab_size=120, seq_length=16,
             make_vocab_size_divisible_by=64, gated_mlp=True, add_bias_linear=True, tied_embeddings=True)
#: an MoE of 4 layers (4 experts, top-2, a shared expert, untied), its experts switched with the chunks
MOE = dict(hidden=32, layers=4, heads=4, query_groups=2, ffn_hidden=64, vocab_size=120, seq_length=16,
           make_vocab_size_divisible_by=64, gated_mlp=True, normalization="RMSNorm", add_bias_linear=False,
           tied_embeddings=False, num_experts=4, moe_ffn_hidden=32, moe_router_topk=2, moe_shared_expert_ffn_hidden=32)
CHAINS = {
    "dense": (DENSE, ["dp2-tp1-pp2", "dp2-tp1-pp2-vpp2", "dp2-tp1-pp2-vpp2-zero1", "dp1-tp2-pp2-vpp2-zero1",
                      "dp1-tp1-pp4-vpp2", "dp2-tp1-pp2-first3-last5", "dp2-tp1-pp2"]),
    "moe": (MOE, ["dp2-tp1-pp2-ep2", "dp2-tp1-pp2-vpp2-ep2-zero1", "dp1-tp2-pp2-vpp2-ep2-etp1",
                  "dp4-tp1-pp1-ep4-etp1-zero1", "dp2-tp2-pp1-ep2"]),
}
GLOBAL_BATCH, SEED = 8, 1234
#: where a megatron checkpoint of the dense chain's last state (dp2-tp1-pp2, no ZeRO) is imported
IMPORT_LAYOUT = "dp1-tp2-pp2-vpp2-zero1"
OPTIMIZER = dict(lr=1e-2, weight_decay=0.1, clip_grad=1.0)


def _chain_job(rank: int, world_size: int, checkpoint: str) -> dict:
    return {name: _chain(rank, *CHAINS[name], dense=name == "dense", checkpoint=checkpoint) for name in CHAINS}


def _megatron_import(state, built, path: str) -> tuple[dict, dict]:
    """megatron's own ``dist_checkpointing`` writes ``state``; ``load_megatron_checkpoint`` reads it
    into a fresh state at ``IMPORT_LAYOUT`` (model chunks). Both as megatron describes them."""
    from benchmarks.baselines import megatron_ckpt
    from lightning_dynatrain.checkpoint.megatron_import import load_megatron_checkpoint
    from lightning_dynatrain.compat.megatron_internals import in_process_checkpoint_write_results
    from tests.megatron_description import describe

    in_process_checkpoint_write_results()  # a synchronous save: no helper process (the files are the same)
    saved = describe(state)
    megatron_ckpt.save(state, path)
    imported = built(IMPORT_LAYOUT)
    load_megatron_checkpoint(path, model=imported.model, state=imported)
    return saved, describe(imported)


def _chain(rank: int, shape_kwargs: dict, chain: list[str], *, dense: bool, checkpoint: str) -> dict:
    import torch

    from lightning_dynatrain.megatron.gpt import GPTShape, build_gpt_model
    from lightning_dynatrain.megatron.hot_switch import SwitchSetup, hot_switch
    from lightning_dynatrain.megatron.optimizer import adam_config, build_ddp_chunks_and_optimizer
    from lightning_dynatrain.megatron.parallel_state_adapter import ProcessGroupCache, initialize_for_layout
    from lightning_dynatrain.megatron.state import MegatronState
    from lightning_dynatrain.megatron.train_step import run_eval_step, run_train_step
    from lightning_dynatrain.runtime.layout_checks import layout_microbatches
    from lightning_dynatrain.runtime.steps import set_lr_and_wd
    from lightning_dynatrain.vps.layout import ParallelConfig
    from tests.megatron_description import describe

    shape = GPTShape(**shape_kwargs)
    tokens = torch.randint(0, shape.vocab_size, (GLOBAL_BATCH * 8, shape.seq_length + 1),
                           generator=torch.Generator().manual_seed(11))
    cache = ProcessGroupCache()

    def built(text: str) -> MegatronState:
        layout = ParallelConfig.parse(text)
        pgs = initialize_for_layout(layout, seed=SEED, groups=cache)
        model = build_gpt_model(shape, layout, seed=SEED)
        chunks, optimizer = build_ddp_chunks_and_optimizer(model, layout, config=adam_config(**OPTIMIZER),
                                                           pg_collection=pgs)
        return MegatronState(layout=layout, groups=pgs, chunks=chunks, optimizer=optimizer)

    def train(state: MegatronState, steps: int, first_step: int) -> list[float]:
        dp, dp_rank = state.layout.dp, state.layout.dense_coord(rank).dp
        losses = []
        for step in range(first_step, first_step + steps):
            rows = tokens[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH]
            local = rows[dp_rank * GLOBAL_BATCH // dp:(dp_rank + 1) * GLOBAL_BATCH // dp]
            batch = {"tokens": local[:, :-1].contiguous(), "labels": local[:, 1:].contiguous()}
            set_lr_and_wd(state.optimizer, lr=OPTIMIZER["lr"], weight_decay=OPTIMIZER["weight_decay"])
            losses.append(run_train_step(state.chunks, state.optimizer, batch, state.layout,
                                         layout_microbatches(GLOBAL_BATCH, 1, state.layout)))
        return losses

    out: dict = {"chunks": {}, "switches": [], "losses": []}
    state = built(chain[0])
    out["losses"] += train(state, 2, 0)
    setup = SwitchSetup(model=shape, seed=SEED, optimizer=OPTIMIZER, staging_budget=1 << 20)
    for text in chain[1:]:
        before = describe(state)
        state = hot_switch(state, ParallelConfig.parse(text), setup, groups=cache).state
        out["switches"].append((text, before, describe(state)))
        out["chunks"][text] = [[layer.layer_number for layer in ddp.module.decoder.layers] for ddp in state.chunks]
        out["losses"] += train(state, 1, len(out["losses"]))
    if dense:
        out["imported"] = _megatron_import(state, built, checkpoint)
    # the same steps at the first layout without a switch, and from scratch at pp2-vpp2; then each
    # evaluates the next batch (megatron's forward-only schedule, interleaved for the second)
    out["evaluated"] = []
    for text, key in ((chain[0], "static"), *([("dp2-tp1-pp2-vpp2", "interleaved")] if dense else [])):
        state = built(text)
        out[key] = train(state, len(out["losses"]), 0)
        rows = tokens[-GLOBAL_BATCH:][state.layout.dense_coord(rank).dp::state.layout.dp]
        batch = {"tokens": rows[:, :-1].contiguous(), "labels": rows[:, 1:].contiguous()}
        out["evaluated"].append(run_eval_step(state.chunks, batch, state.layout,
                                              layout_microbatches(GLOBAL_BATCH, 1, state.layout)))
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> list[dict]:
    # megatron's checkpoint writer starts processes of its own: the ranks cannot be daemons
    return run_distributed(_chain_job, 4, str(tmp_path_factory.mktemp("megatron_checkpoint")), timeout_s=300,
                           daemon=False)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CHAINS))
def test_switches_into_and_out_of_virtual_stages_keep_the_whole_state_as_megatron_describes_it(job, name):
    runs = [rank[name] for rank in job]
    for index, (target, _, _) in enumerate(runs[0]["switches"]):
        before = assemble([run["switches"][index][1] for run in runs])
        after = assemble([run["switches"][index][2] for run in runs])
        assert before and differences(before, after) == [], f"switch to {target}"
        # the optimizer's step and settings came along (megatron's description of the param groups)
        for run in runs:
            (_, was, now) = run["switches"][index]
            assert was["steps"] == now["steps"] == [2 + index] and was["groups"] == now["groups"], target
    if name == "moe":  # every expert's weights and moments were among what was compared
        assert {key for key in before if ".experts." in key and key.startswith("decoder.")}


@pytest.mark.slow
def test_each_rank_holds_its_chunks_layers_round_robin(job):
    # megatron's own layer numbers (1-based) in each model chunk of each rank (ranks 0 and 1 are
    # data-parallel replicas of pipeline rank 0 at dp2, order tp-cp-ep-dp-pp)
    chunks = [rank["dense"]["chunks"] for rank in job]
    assert [chunks[r]["dp2-tp1-pp2-vpp2"] for r in (0, 1, 2)] == [[[1, 2], [5, 6]]] * 2 + [[[3, 4], [7, 8]]]
    assert [chunks[r]["dp1-tp1-pp4-vpp2"] for r in (0, 1)] == [[[1], [5]], [[2], [6]]]
    assert chunks[0]["dp2-tp1-pp2-first3-last5"] == [[1, 2, 3]]
    assert [rank["moe"]["chunks"]["dp2-tp1-pp2-vpp2-ep2-zero1"] for rank in job][::2] == [[[1], [3]], [[2], [4]]]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CHAINS))
def test_training_across_the_switches_matches_a_run_that_never_switched(job, name):
    runs = [rank[name] for rank in job]
    losses, static = runs[0]["losses"], runs[0]["static"]
    assert all(run["losses"] == losses for run in runs)  # the same float on every rank
    assert losses[:2] == static[:2]  # before the first switch: the same run
    assert losses == pytest.approx(static, rel=1e-5)  # tp2, ZeRO-1 and other splits sum in another order
    if name == "dense":  # the step after the switch to pp2-vpp2 (nothing else changed): the same sums
        assert losses[2] == static[2]


@pytest.mark.slow
def test_interleaving_trains_and_evaluates_bit_for_bit_as_the_plain_pipeline(job):
    dense = [rank["dense"] for rank in job]
    assert dense[0]["interleaved"] == dense[0]["static"]
    evaluated = dense[0]["evaluated"]
    assert evaluated[0] == evaluated[1] and all(run["evaluated"] == evaluated for run in dense)


@pytest.mark.slow
def test_a_megatron_checkpoint_is_imported_into_model_chunks_bit_for_bit(job):
    """megatron's own ``dist_checkpointing`` wrote the dense chain's last state at ``dp2-tp1-pp2``
    (Megatron-LM's format); ``load_megatron_checkpoint`` read it into ``IMPORT_LAYOUT``'s model
    chunks and distributed optimizer: as megatron describes both, the same state bit for bit, with
    Adam's step and the param groups' settings."""
    saved = assemble([rank["dense"]["imported"][0] for rank in job])
    imported = assemble([rank["dense"]["imported"][1] for rank in job])
    assert any(key.startswith("optimizer.state.exp_avg_sq.") for key in saved), sorted(saved)
    assert differences(saved, imported) == []
    for rank in job:
        was, now = rank["dense"]["imported"]
        assert was["steps"] == now["steps"] and was["groups"] == now["groups"]
