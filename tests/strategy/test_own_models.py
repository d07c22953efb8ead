"""Models of the user's, described by nobody here (``own_models``): a GPT with the user's own MLP
submodule (bf16, megatron's ``OptimizerParamScheduler``), megatron's BERT (SGD with momentum, a
torch ``LambdaLR``), and an MoE with a sigmoid, group-limited router and shared experts; each through
``Trainer`` with switches over dp/tp/pp (and ep), pipelines with uneven stages and virtual stages
among them (``-firstN``/``-lastN``, ``-vpp2``: the GPT and the MoE), ``verify=True`` on every switch (the fit would raise otherwise), against a
run that never switched. One spawned job (``own_models_job``), 4 processes.

The state around each switch is read through megatron's own description of the model and optimizer
(``tests/megatron_description.py``), not through the spec the library derived from it: a wrongly
derived axis would scramble the switch and its check alike otherwise (``tests/runtime/test_state_oracles.py``).
"""

from __future__ import annotations

import re

import pytest

from tests.megatron_description import assemble, differences
from tests.strategy.own_models_job import CASES, RESUME_AT, RESUME_AT_VPP, ROLLOUTS, STEPS, run_own_models4

pytestmark = pytest.mark.slow


def _optimizer_state_of(name: str, key: str) -> bool:
    """``key`` names an optimizer state of the model's ``name`` (several optimizers, e.g. dense and
    expert ones, prefix theirs ``chained_<i>.``)."""
    return re.fullmatch(r"(chained_\d+\.)?optimizer\.state\.\w+\." + re.escape(name), key) is not None


@pytest.fixture(scope="module")
def own4(tmp_path_factory) -> list[dict]:
    return run_own_models4(str(tmp_path_factory.mktemp("own_models4")))


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_switch_keeps_the_full_logical_state_bit_for_bit(own4, name: str) -> None:
    """Every parameter (bf16 ones too), fp32 main param, Adam moment and SGD momentum, as megatron
    describes them on every rank right before and right after each switch, assembled whole: the same
    keys and bits, every parameter of the model among them; the param groups' settings (Adam's step
    among them) unchanged."""
    runs = [r[name]["switched"] for r in own4]
    spec, adam = runs[0]["spec"], name != "bert"  # the BERT trains with SGD (no step kept)
    for step in CASES[name]["schedule"]:
        before = assemble([r["before"][step] for r in runs])
        after = assemble([r["after"][step] for r in runs])
        assert differences(before, after) == [], step
        # every logical tensor of the model is in megatron's description, and its optimizer state too
        assert sorted(t.name for t in spec.tensors if t.name not in before) == [], sorted(before)
        assert sorted(t.name for t in spec.tensors if not any(_optimizer_state_of(t.name, k) for k in before)) == [], \
            sorted(before)
        for r in runs:
            assert r["before"][step]["groups"] == r["after"][step]["groups"], step
            assert r["before"][step]["steps"] == r["after"][step]["steps"] == ([step] if adam else []), step


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_fit_switches_at_the_scheduled_steps_and_tracks_a_static_run(own4, name: str) -> None:
    case = CASES[name]
    layouts = [case["start"], *case["schedule"].values()]
    for r in own4:
        switched, static = r[name]["switched"], r[name]["static"]
        assert switched["refusals"] == [], "a scheduled switch was refused (and training went on at the old layout)"
        assert switched["history"] == [(s, a, b) for s, a, b in zip(case["schedule"], layouts, layouts[1:])]
        assert len(switched["losses"]) == len(static["losses"]) == STEPS
        assert switched["losses"][:2] == static["losses"][:2]  # before the first switch: the same run
        assert switched["losses"] == pytest.approx(static["losses"], rel=1e-4)
        assert switched["losses"][-1] < switched["losses"][0] - 0.2


@pytest.mark.parametrize("name, bound", [("split-mlp", 0.05), ("sigmoid-moe", 1e-5)])
def test_a_rollout_of_the_users_model_leaves_its_state_as_it_was(own4, name, bound) -> None:
    """The split-MLP GPT (bf16, at dp2-tp1-pp2-vpp2-zero1: two model chunks of one layer on each stage)
    enters a rollout at dp1-tp2-pp2-vpp2 (virtual stages again, tensor-parallel: megatron's interleaved
    schedule generates) with its weights freed and its optimizer parked on the host; the MoE of
    the user's (fp32, at dp2-tp2-pp1-ep2) one at dp4-tp1-pp1-ep4, everything in place. Each generates
    and scores there, and leaves: megatron's description of the whole state is the same before and
    after (and the fit's ``verify=True`` fingerprint too, or it would have raised); the rollout model
    held the training weights; a switch asked for inside was refused; every rank got every row, the
    same."""
    import numpy as np

    runs = [r[name]["switched"]["rollout"] for r in own4]
    before, after = assemble([r["before"] for r in runs]), assemble([r["after"] for r in runs])
    assert differences(before, after) == []
    params = {k: v for k, v in before.items() if not k.startswith(("optimizer.", "chained_"))}
    assert differences(params, assemble([r["model"] for r in runs])) == []
    assert {r["refused"] for r in runs} == {"RolloutError"}
    # the freed training shards of the weights (host memory: nothing else moved); in place: nothing
    assert all((r["parked_bytes"] > 0) == (not ROLLOUTS[name][3]) for r in runs)
    tokens, log_probs = runs[0]["generated"]
    assert tokens.shape == (4, 9) and tokens[:, :6].tolist() == np.arange(24).reshape(4, 6).tolist()
    for r in runs[1:]:
        assert np.array_equal(r["generated"][0], tokens) and np.array_equal(r["scored"], runs[0]["scored"])
    # what generate reports for its tokens is what scoring the sequence gives (bf16: to its precision)
    assert np.abs(runs[0]["scored"][:, 5:] - log_probs).max() <= bound
    assert ROLLOUTS[name][0] not in CASES[name]["schedule"]


def test_the_user_mlp_trains_in_bf16_with_its_own_tensors(own4) -> None:
    """The split-MLP GPT's gate and up projections are tensors of their own, tp-split on their rows,
    bf16 (with fp32 main params); its norms stay fp32 (megatron's local spec builds torch norms)."""
    spec = own4[0]["split-mlp"]["switched"]["spec"]
    gate = spec.tensor("decoder.layers.mlp.linear_fc1.gate.weight")
    assert gate.axes == ("layer", "tp", "") and gate.megatron_name == "decoder.layers.{layer}.mlp.linear_fc1.gate.weight"
    assert not gate.always_fp32 and spec.tensor("decoder.final_layernorm.weight").always_fp32
    assert own4[0]["split-mlp"]["switched"]["dtypes"] == ["torch.bfloat16", "torch.float32"]


def test_the_moe_router_and_experts_are_read_from_the_model(own4) -> None:
    spec = own4[0]["sigmoid-moe"]["switched"]["spec"]
    experts = [t for t in spec.tensors if t.group.value == "expert"]
    assert {t.name for t in experts} == {"decoder.layers.mlp.experts.experts.linear_fc1.weight",
                                         "decoder.layers.mlp.experts.experts.linear_fc2.weight"}
    assert all(t.axes[:2] == ("layer", "expert") for t in experts)
    assert spec.tensor("decoder.layers.mlp.router.weight").axes == ("layer", "", "")
    assert spec.tensor("decoder.layers.mlp.shared_experts.linear_fc2.weight").axes == ("layer", "", "tp")


def test_bert_reads_megatrons_globals_so_its_switches_are_built_on_demand(own4) -> None:
    """megatron-core 0.16's ``BertModel`` builds its encoder on megatron's globals, not its groups:
    its switches run on demand, never built beside training (where the globals are another layout's)."""
    for r in own4:
        assert r["bert"]["switched"]["ahead"] == [False] * 3
        assert r["sigmoid-moe"]["switched"]["ahead"] == [True] * 3
    spec = own4[0]["bert"]["switched"]["spec"]
    tied = spec.tensor("embedding.word_embeddings.weight")
    assert tied.place.value == "first+last" and tied.last_stage_name == "output_layer.weight"
    assert spec.tensor("output_layer.bias").axes == ("vocab",) and spec.tensor("pooler.dense.weight").always_fp32


def test_a_resumed_fit_continues_the_schedule_exactly(own4) -> None:
    """Saved after step 4 at dp2-tp1-pp2-vpp2-zero1 (virtual stages, ZeRO-1; megatron's scheduler:
    warmup, cosine decay, weight decay growing), resumed in a new fit at dp2-tp2-pp1: the whole state
    the new fit starts from, as megatron describes it, is the saved one bit for bit; each later step's
    rate and weight decay are the uninterrupted run's, and the steps at the resumed layout track the
    run that never switched (which trained the steps before at other layouts)."""
    saved = assemble([r["split-mlp"]["switched"]["saved"] for r in own4])
    loaded = assemble([r["split-mlp"]["resumed"]["start"] for r in own4])
    assert saved and differences(saved, loaded) == []
    for r in own4:
        switched, resumed, static = (r["split-mlp"][k] for k in ("switched", "resumed", "static"))
        assert switched["saved"]["steps"] == resumed["start"]["steps"] == [RESUME_AT]  # Adam's step
        assert resumed["lr"] == switched["lr"][RESUME_AT:]
        assert len({lr for lr, _ in switched["lr"]}) > 4 and len({wd for _, wd in switched["lr"]}) > 4
        assert resumed["losses"] == pytest.approx(static["losses"][RESUME_AT:], rel=1e-4)


def test_a_checkpoint_saved_at_a_plain_layout_resumes_at_virtual_stages(own4) -> None:
    """The run that never switched saves after step 4 at dp2-tp2-pp1; a new fit resumes it at
    dp1-tp2-pp2-vpp2 (each rank two model chunks): the whole state it starts from, as megatron
    describes each chunk, is the saved one bit for bit, and its steps track the static run's."""
    saved = assemble([r["split-mlp"]["static"]["saved"] for r in own4])
    loaded = assemble([r["split-mlp"]["resumed_at_vpp"]["start"] for r in own4])
    assert saved and differences(saved, loaded) == []
    for r in own4:
        resumed, static = r["split-mlp"]["resumed_at_vpp"], r["split-mlp"]["static"]
        assert resumed["layouts"] == [RESUME_AT_VPP] and resumed["start"]["steps"] == [RESUME_AT]
        assert resumed["losses"] == pytest.approx(static["losses"][RESUME_AT:], rel=1e-4)
