import pytest

from lightning_dynatrain.vps.errors import ModelSpecError
from lightning_dynatrain.vps.presets import preset, preset_names
from lightning_dynatrain.vps.spec import Place, Precision


@pytest.mark.parametrize("name", preset_names())
def test_parameter_count_matches_the_published_count(name):
    spec = preset(name)
    assert abs(spec.parameters / spec.published_parameters - 1) < 0.01


def test_qwen_moe_shapes():
    spec = preset("qwen-moe-235b")
    fc1 = spec.tensor("decoder.layers.mlp.experts.linear_fc1.weight")
    assert fc1.shape == (94, 128, 2, 1536, 4096) and fc1.stack_axes == 2
    qkv = spec.tensor("decoder.layers.self_attention.linear_qkv.weight")
    assert qkv.shape == (94, 4, 16 + 2, 128, 4096)
    assert spec.tensor("decoder.layers.self_attention.q_layernorm.weight").shape == (94, 128)
    assert spec.tensor("output_layer.weight").place is Place.LAST
    assert spec.padded_vocab(4) == 152064


def test_tied_embedding_is_one_tensor_held_by_both_end_stages():
    spec = preset("gpt3-175b")
    emb = spec.tensor("embedding.word_embeddings.weight")
    assert emb.place is Place.FIRST_AND_LAST and emb.last_stage_name == "output_layer.weight"
    assert "output_layer.weight" not in spec.by_name


def test_state_bytes_count_every_kind():
    spec = preset("llama2-7b")
    # megatron's local spec keeps the norms in fp32 under bf16: fp32 param, no main param
    norms = sum(t.numel for t in spec.tensors if t.always_fp32)
    assert norms == (2 * 32 + 1) * 4096
    assert spec.state_bytes(Precision.BF16) == (spec.parameters - norms) * (2 + 4 + 4 + 4) + norms * 12
    assert spec.state_bytes(Precision.FP32) == spec.parameters * 12


def test_unknown_model_lists_the_presets():
    with pytest.raises(ModelSpecError, match="choose one of gpt-1.3b"):
        preset("llama3-8b")
