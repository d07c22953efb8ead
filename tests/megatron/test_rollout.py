"""A rollout phase on a real megatron GPT (2 gloo processes): the weights alone move to the rollout
layout, the rollout model scores and samples with them, and leaving gives training its state back
bit for bit; the next step's loss is the loss of a run that never entered the rollout.

Every check reads the state through megatron's own description (``tests/megatron_description``),
never through the library's mapping: the full training state before and after the phase (params,
main params, Adam's moments and step), and the rollout model's weights against the training
weights. Log-probabilities at the rollout layout are compared with megatron's forward of the
training model at its own layout; tokens sampled at two rollout layouts with the same seed agree.

Cases: fp32 tp2 -> dp2 with everything in place; bf16 zero1 -> tp2 with the weights freed and the
optimizer parked on the host; an MoE whose experts change ep (ep2 zero1 -> tp2); a pipeline (pp2 ->
dp2, weights freed); scoring and sampling at a rollout layout with two pipeline stages, and with two
virtual stages each; sampling with megatron's KV cache against recomputing the whole sequence for
every token.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.dist import run_distributed
from tests.megatron.jobs import DENSE, MOE, SEED
from tests.megatron_description import assemble, differences

pytestmark = pytest.mark.slow

#: the bf16 GPT without biases: megatron-core 0.16's fully reshardable description of a bf16
#: distributed optimizer fails on this GPT's biases (a size mismatch in ``get_parameter_state_dp_zero``)
BF16 = dict(DENSE, add_bias_linear=False)
CASES = [  # (name, shape, dtype, training layout, rollout layout, park, keep_weights)
    ("fp32", DENSE, "float32", "dp1-tp2-pp1", "dp2-tp1-pp1", "in_place", True),
    ("bf16", BF16, "bfloat16", "dp2-tp1-pp1-zero1", "dp1-tp2-pp1", "host", False),
    ("moe", MOE, "float32", "dp2-tp1-pp1-ep2-zero1", "dp1-tp2-pp1", "in_place", False),
    ("pp", DENSE, "float32", "dp1-tp1-pp2", "dp2-tp1-pp1", "host", False),
]
ROWS, NEW = 3, 4  # 3 rows: uneven over dp2


def _tokens(vocab: int, rows: int, length: int, seed: int):
    import torch

    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))


def _build(shape, layout, dtype, cache):
    import torch

    from lightning_dynatrain.megatron.gpt import GPTShape, build_gpt_model
    from lightning_dynatrain.megatron.optimizer import build_ddp_and_optimizer
    from lightning_dynatrain.megatron.parallel_state_adapter import initialize_for_layout
    from lightning_dynatrain.megatron.state import MegatronState

    groups = initialize_for_layout(layout, seed=SEED, groups=cache)
    model = build_gpt_model(GPTShape(**shape), layout, seed=SEED, params_dtype=getattr(torch, dtype))
    ddp, optimizer = build_ddp_and_optimizer(model, layout, lr=1e-2)
    return MegatronState(layout=layout, groups=groups, chunks=(ddp,), optimizer=optimizer)


def _step(state, shape, seed):
    from lightning_dynatrain.megatron.train_step import run_train_step
    from lightning_dynatrain.runtime.steps import local_share

    tokens = _tokens(shape["vocab_size"], 4, shape["seq_length"] + 1, seed)
    local = local_share({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}, dp_rank=state.dp_rank,
                        dp_size=state.dp_size, global_batch_size=4)
    return run_train_step(state.ddp, state.optimizer, local, state.layout, 1)


def _training_log_probs(state, tokens):
    """Megatron's forward of the training model at its own layout (every rank, every row)."""
    import torch

    from lightning_dynatrain.devices import device_kind

    model = state.model
    model.eval()
    positions = torch.arange(tokens.shape[1] - 1).unsqueeze(0).expand(tokens.shape[0], -1)
    with device_kind("cpu").megatron_context(), torch.no_grad():
        loss = model(input_ids=tokens[:, :-1], position_ids=positions, attention_mask=None, labels=tokens[:, 1:])
    model.train()
    return (-loss.float()).numpy()


def _case(rank, shape, dtype, train_text, rollout_text, park, keep_weights) -> dict:
    from lightning_dynatrain.megatron.gpt import GPTShape
    from lightning_dynatrain.megatron.hot_switch import SwitchSetup
    from lightning_dynatrain.megatron.parallel_state_adapter import ProcessGroupCache, destroy
    from lightning_dynatrain.megatron.rollout import enter_rollout, leave_rollout
    from lightning_dynatrain.runtime.rollout import RolloutPolicy
    from lightning_dynatrain.vps.layout import ParallelConfig
    from tests.megatron_description import describe, describe_model

    train, rollout = ParallelConfig.parse(train_text), ParallelConfig.parse(rollout_text)
    out: dict = {}
    cache = ProcessGroupCache()
    state = _build(shape, train, dtype, cache)
    _step(state, shape, seed=1)
    setup = SwitchSetup(model=GPTShape(**shape), seed=SEED, optimizer=dict(lr=1e-2), staging_budget=2**16)
    tokens = _tokens(shape["vocab_size"], ROWS, 10, seed=5)
    if train.pp == 1:
        out["train_log_probs"] = _training_log_probs(state, tokens)
    out["before"] = describe(state)
    phase = enter_rollout(state, rollout, setup, groups=cache, park=park, keep_weights=keep_weights)
    policy = RolloutPolicy(phase, setup.spec)
    out["rollout_model"] = describe_model(phase.model)
    out["log_probs"] = policy.log_probs(tokens).numpy()
    prompts = tokens[:, :6]
    sampled = policy.generate(prompts, max_new_tokens=NEW, temperature=1.0, top_k=20, seed=3)
    greedy = policy.generate(prompts, max_new_tokens=NEW, temperature=0.0)
    out["sampled"] = (sampled.tokens.numpy(), sampled.log_probs.numpy())  # (tensors do not outlive the child)
    out["greedy"] = (greedy.tokens.numpy(), greedy.log_probs.numpy())
    recomputed = policy.generate(prompts, max_new_tokens=NEW, temperature=1.0, top_k=20, seed=3, kv_cache=False)
    out["recomputed"] = (recomputed.tokens.numpy(), recomputed.log_probs.numpy())  # every token over the whole sequence
    out["parked_bytes"] = phase.parked_bytes
    out["rescored"] = policy.log_probs(sampled.tokens)[:, 5:].numpy()
    leave_rollout(phase, setup, groups=cache)
    out["after"] = describe(state)
    out["loss"] = _step(state, shape, seed=2)
    if train.pp == 1:
        out["policy_step"] = _policy_step(state, shape)
    destroy(keep=None)
    cache.close()
    # the same run without the rollout: its second step's loss
    cache = ProcessGroupCache()
    plain = _build(shape, train, dtype, cache)
    _step(plain, shape, seed=1)
    out["plain_loss"] = _step(plain, shape, seed=2)
    destroy(keep=None)
    cache.close()
    return out


ADVANTAGES = (1.0, 0.5, -1.0, -0.25)  # one per row of the RL batch


def _policy_step(state, shape) -> dict:
    """One RL step (``PolicyLoss``) through megatron's schedule, the old log-probabilities read with
    megatron's forward: the loss it reports, and each scored token's log-probability before and after."""
    import torch

    from lightning_dynatrain.megatron.policy_loss import PolicyLoss
    from lightning_dynatrain.megatron.train_step import run_train_step
    from lightning_dynatrain.runtime.steps import local_share

    tokens = _tokens(shape["vocab_size"], 4, shape["seq_length"] + 1, seed=7)
    old = torch.from_numpy(_training_log_probs(state, tokens))
    mask = torch.zeros_like(old)
    mask[:, shape["seq_length"] // 2:] = 1  # the "generated" half is scored
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "old_log_probs": old, "loss_mask": mask,
             "advantages": torch.tensor(ADVANTAGES)[:, None].expand_as(old).contiguous()}
    local = local_share(batch, dp_rank=state.dp_rank, dp_size=state.dp_size, global_batch_size=4)
    loss = run_train_step(state.ddp, state.optimizer, local, state.layout, 1, forward_step=PolicyLoss().forward_step)
    return {"loss": loss, "before": old.numpy(), "after": _training_log_probs(state, tokens), "mask": mask.numpy()}


def _scoring_at_pp2(rank: int) -> dict:
    """At a rollout layout with two stages, scoring and sampling run through megatron's pipeline; at a
    layout with two context-parallel ranks they are refused, naming why (the preset refuses cp > 1
    before a rollout enters it: the phase's layout is relabelled to reach the policy's own check)."""
    from dataclasses import replace

    from lightning_dynatrain.megatron.gpt import GPTShape
    from lightning_dynatrain.megatron.hot_switch import SwitchSetup
    from lightning_dynatrain.megatron.parallel_state_adapter import ProcessGroupCache, destroy
    from lightning_dynatrain.megatron.rollout import enter_rollout, leave_rollout
    from lightning_dynatrain.runtime.rollout import RolloutError, RolloutPolicy
    from lightning_dynatrain.vps.layout import ParallelConfig
    from tests.megatron_description import describe

    cache = ProcessGroupCache()
    state = _build(DENSE, ParallelConfig.parse("dp2-tp1-pp1"), "float32", cache)
    _step(state, DENSE, seed=1)
    setup = SwitchSetup(model=GPTShape(**DENSE), seed=SEED, optimizer=dict(lr=1e-2), staging_budget=2**16)
    tokens = _tokens(DENSE["vocab_size"], ROWS, 10, seed=5)
    out = {"before": describe(state), "train_log_probs": _training_log_probs(state, tokens)}
    phase = enter_rollout(state, ParallelConfig.parse("dp1-tp1-pp2"), setup, groups=cache, keep_weights=False)
    policy = RolloutPolicy(phase, setup.spec)
    out["log_probs"] = policy.log_probs(tokens).numpy()
    sampled = policy.generate(tokens[:, :6], max_new_tokens=NEW, temperature=1.0, top_k=20, seed=3)
    out["sampled"] = (sampled.tokens.numpy(), sampled.log_probs.numpy())
    recomputed = policy.generate(tokens[:, :6], max_new_tokens=NEW, temperature=1.0, top_k=20, seed=3, kv_cache=False)
    out["recomputed"] = (recomputed.tokens.numpy(), recomputed.log_probs.numpy())
    try:
        RolloutPolicy(replace(phase, layout=ParallelConfig.parse("dp1-tp1-pp1-cp2")), setup.spec).log_probs(tokens)
    except RolloutError as err:
        out["refused"] = str(err)
    leave_rollout(phase, setup, groups=cache)
    out["after"] = describe(state)
    out["rescored"] = _training_log_probs(state, sampled.tokens)[:, 5:]
    # at virtual stages: two model chunks a rank, megatron's interleaved schedule (the rows in two micro-batches)
    phase = enter_rollout(state, ParallelConfig.parse("dp1-tp1-pp2-vpp2"), setup, groups=cache, keep_weights=False)
    policy = RolloutPolicy(phase, setup.spec)
    out["vpp_layers"] = [[layer.layer_number for layer in chunk.decoder.layers] for chunk in phase.model]
    out["vpp_log_probs"] = policy.log_probs(tokens).numpy()
    for key, kv_cache in (("vpp_sampled", True), ("vpp_recomputed", False)):
        again = policy.generate(tokens[:, :6], max_new_tokens=NEW, temperature=1.0, top_k=20, seed=3, kv_cache=kv_cache)
        out[key] = (again.tokens.numpy(), again.log_probs.numpy())
    leave_rollout(phase, setup, groups=cache)
    out["vpp_after"] = describe(state)
    destroy(keep=None)
    cache.close()
    return out


def _job(rank: int, world_size: int) -> dict:
    return {**{name: _case(rank, *args) for name, *args in CASES}, "pp2": _scoring_at_pp2(rank)}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_job, 2, timeout_s=600)


def _whole(results, name, key):
    return assemble([r[name][key] for r in results])


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_leaving_gives_training_its_full_state_back_bit_for_bit(results, name):
    assert differences(_whole(results, name, "before"), _whole(results, name, "after")) == []
    assert [r[name]["loss"] for r in results] == [r[name]["plain_loss"] for r in results]


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_the_rollout_model_holds_the_training_weights(results, name):
    training = _whole(results, name, "before")
    rollout = _whole(results, name, "rollout_model")
    params = {k: v for k, v in training.items() if not k.startswith(("optimizer.", "chained_"))}
    assert set(rollout) == set(params)
    assert differences(params, rollout) == []


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_every_rank_gets_every_row_and_the_same_tokens(results, name):
    first = results[0][name]
    for r in results[1:]:
        assert np.array_equal(r[name]["log_probs"], first["log_probs"])
        for key in ("sampled", "greedy"):
            assert all(np.array_equal(a, b) for a, b in zip(r[name][key], first[key]))
    tokens, log_probs = first["sampled"]
    assert tokens.shape == (ROWS, 6 + NEW) and log_probs.shape == (ROWS, NEW)
    assert (log_probs <= 0).all() and np.isfinite(log_probs).all()


@pytest.mark.parametrize("name, bound", [("fp32", 1e-5), ("moe", 1e-5), ("bf16", 0.05), ("pp", 1e-5), ("pp2", 1e-5)])
def test_generating_with_the_kv_cache_samples_what_recomputing_every_token_samples(results, name, bound):
    """Megatron's static KV cache (each new token alone through the model; across two stages at pp2)
    against the whole sequence run again for every token: the same tokens, the same log-probabilities
    (bf16: a token's probability within 5%; the MoE at tp2 pads single tokens and recomputes)."""
    (tokens, log_probs), (again, again_log_probs) = results[0][name]["sampled"], results[0][name]["recomputed"]
    assert np.array_equal(tokens, again)
    assert np.abs(np.exp(log_probs - again_log_probs) - 1).max() <= bound if name == "bf16" else \
        np.abs(log_probs - again_log_probs).max() <= bound


@pytest.mark.parametrize("name, bound", [("fp32", 1e-5), ("moe", 1e-5), ("bf16", None)])
def test_log_probs_at_the_rollout_layout_match_the_training_forward(results, name, bound):
    rollout, training = results[0][name]["log_probs"], results[0][name]["train_log_probs"]
    assert rollout.shape == training.shape == (ROWS, 9)
    if bound is not None:
        assert np.abs(rollout - training).max() <= bound
    else:  # bf16: a token's probability within 5%
        assert np.abs(np.exp(rollout - training) - 1).max() <= 0.05


@pytest.mark.parametrize("name", ["fp32", "moe"])
def test_a_sampled_tokens_log_prob_is_the_scored_one(results, name):
    """``generate`` keeps each prompt and reports what ``log_probs`` gives the sampled sequence."""
    tokens, log_probs = results[0][name]["sampled"]
    shape = {"fp32": DENSE, "moe": MOE}[name]
    assert tokens[:, :6].tolist() == _tokens(shape["vocab_size"], ROWS, 10, seed=5)[:, :6].tolist()
    assert np.abs(results[0][name]["rescored"] - log_probs).max() <= 1e-5


def test_parking_frees_what_it_says(results):
    """fp32 in place frees nothing; without keep_weights the training shards of the weights go; on
    CPU processes park="host" moves nothing (their memory is the host's)."""
    assert all(r["fp32"]["parked_bytes"] == 0 for r in results)
    for name in ("bf16", "moe", "pp"):
        assert all(r[name]["parked_bytes"] > 0 for r in results), name


@pytest.mark.parametrize("name, bound", [("fp32", 1e-6), ("moe", 1e-6), ("bf16", 1e-3)])
def test_a_policy_step_reports_the_clipped_loss_and_raises_what_its_advantages_favour(results, name, bound):
    """At the weights that sampled (ratio 1) the clipped loss is minus the mean advantage of the scored
    tokens; after the step the advantage-weighted log-probability of those tokens has risen."""
    step = results[0][name]["policy_step"]
    mask, advantages = step["mask"], np.array(ADVANTAGES)[:, None]
    assert all(r[name]["policy_step"]["loss"] == step["loss"] for r in results)
    assert abs(step["loss"] + (advantages * mask).sum() / mask.sum()) <= bound
    gain = (advantages * mask * (step["after"] - step["before"])).sum()
    assert gain > 0, gain


def test_at_a_rollout_layout_with_two_stages_scoring_and_sampling_run_through_the_pipeline(results):
    """Log-probabilities at dp1-tp1-pp2 against megatron's forward of the training model (dp2), and
    the sampled tokens' reported log-probabilities against the same forward after the phase."""
    assert differences(_whole(results, "pp2", "before"), _whole(results, "pp2", "after")) == []
    first = results[0]["pp2"]
    assert np.abs(first["log_probs"] - first["train_log_probs"]).max() <= 1e-5
    tokens, log_probs = first["sampled"]
    assert tokens.shape == (ROWS, 6 + NEW) and np.abs(first["rescored"] - log_probs).max() <= 1e-5
    for r in results[1:]:
        assert np.array_equal(r["pp2"]["sampled"][0], tokens) and np.array_equal(r["pp2"]["log_probs"],
                                                                                 first["log_probs"])


def test_at_virtual_stages_scoring_and_sampling_run_through_the_interleaved_schedule(results):
    """At ``dp1-tp1-pp2-vpp2`` (rank 0 holds layers 1 and 3, rank 1 layers 2 and 4; three rows in two
    micro-batches of two) the log-probabilities are the training forward's, and the tokens sampled
    with the same seed, with the KV cache (one per micro-batch) or without, are those sampled at
    ``dp1-tp1-pp2``; leaving gives training its state back bit for bit."""
    assert [r["pp2"]["vpp_layers"] for r in results] == [[[1], [3]], [[2], [4]]]
    first = results[0]["pp2"]
    assert differences(_whole(results, "pp2", "before"), _whole(results, "pp2", "vpp_after")) == []
    assert np.abs(first["vpp_log_probs"] - first["train_log_probs"]).max() <= 1e-5
    tokens, log_probs = first["sampled"]
    for key in ("vpp_sampled", "vpp_recomputed"):
        assert np.array_equal(first[key][0], tokens), key
        assert np.abs(first[key][1] - log_probs).max() <= 1e-5, key
    for r in results[1:]:
        assert np.array_equal(r["pp2"]["vpp_sampled"][0], tokens)
        assert np.array_equal(r["pp2"]["vpp_log_probs"], first["vpp_log_probs"])


def test_scoring_at_a_rollout_layout_with_context_parallel_ranks_is_refused(results):
    assert all("2 context-parallel ranks" in r["pp2"]["refused"] and "HINT" in r["pp2"]["refused"] for r in results)
