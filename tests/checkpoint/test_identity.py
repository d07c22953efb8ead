"""What a checkpoint says it holds, and the refusals made before anything is loaded (no processes)."""

from __future__ import annotations

import pytest

from lightning_dynatrain.checkpoint.identity import (
    FORMAT,
    CheckpointError,
    CheckpointInfo,
    CheckpointMismatchError,
    spec_digest,
)
from lightning_dynatrain.checkpoint.logical import fqn, parse_fqn
from lightning_dynatrain.megatron.gpt import GPTShape, logical_spec
from lightning_dynatrain.vps.spec import Precision, StateKind

SHAPE = dict(hidden=32, layers=2, heads=4, ffn_hidden=64, vocab_size=256, seq_length=32)


def _info(spec, precision=Precision.FP32) -> CheckpointInfo:
    return CheckpointInfo.of(spec, layout="dp2-tp2-pp1-zero1", world_size=4, precision=precision,
                             kinds=("param", "exp_avg", "exp_avg_sq"))


def test_the_digest_is_a_pure_function_of_the_spec():
    """Built from plain values (no ``hash()``, which Python salts per process): the same digest in
    every process and run; this value pins it (a change breaks every saved checkpoint's check)."""
    assert spec_digest(logical_spec(GPTShape(**SHAPE))) == "3e9a45f6b4354982f1cef4f3608868e7"


def test_the_digest_follows_the_state_structure_not_the_init():
    spec = logical_spec(GPTShape(**SHAPE))
    assert spec_digest(logical_spec(GPTShape(**SHAPE, init_method_std=0.5))) == spec_digest(spec)
    for change in (dict(layers=4), dict(ffn_hidden=128), dict(gated_mlp=True), dict(tied_embeddings=False),
                   dict(make_vocab_size_divisible_by=64)):
        assert spec_digest(logical_spec(GPTShape(**{**SHAPE, **change}))) != spec_digest(spec), change


def test_another_model_is_refused_naming_what_differs():
    saved = _info(logical_spec(GPTShape(**SHAPE)))
    other = logical_spec(GPTShape(**{**SHAPE, "layers": 4, "hidden": 64}))
    with pytest.raises(CheckpointMismatchError) as err:
        saved.check(other, precision=Precision.FP32, path="ckpt")
    text = str(err.value)
    assert "num_layers=2 (run: 4)" in text and "hidden=32 (run: 64)" in text and "HINT" in text
    untied = logical_spec(GPTShape(**{**SHAPE, "tied_embeddings": False}))
    with pytest.raises(CheckpointMismatchError, match="other tensors"):
        saved.check(untied, precision=Precision.FP32, path="ckpt")


def test_another_precision_is_refused_with_the_trainer_setting_to_use():
    spec = logical_spec(GPTShape(**SHAPE))
    with pytest.raises(CheckpointMismatchError, match="precision='bf16-mixed'"):
        _info(spec, Precision.BF16).check(spec, precision=Precision.FP32, path="ckpt")


def test_info_round_trips_and_other_formats_are_refused():
    info = _info(logical_spec(GPTShape(**SHAPE)))
    assert CheckpointInfo.from_dict(info.to_dict(), path="p") == info and info.format == FORMAT
    for bad in (None, {"format": "something-else"}):
        with pytest.raises(CheckpointError, match="not a layout-free") as err:
            CheckpointInfo.from_dict(bad, path="p")
        assert "HINT" in str(err.value)


def test_keys_name_the_logical_tensor_and_kind():
    key = fqn(("decoder.layers.mlp.linear_fc1.weight", StateKind.EXP_AVG))
    assert key == "decoder.layers.mlp.linear_fc1.weight::exp_avg"
    assert parse_fqn(key) == ("decoder.layers.mlp.linear_fc1.weight", StateKind.EXP_AVG)
    assert parse_fqn("dynatrain.trainer") is None and parse_fqn("x::nonsense") is None


def test_a_checkpoint_records_the_models_configuration_and_names_what_differs():
    """The configuration travels with the checkpoint (``ModelSource.config_record``); a run resuming
    with other values learns which (the state's structure, the digest's, may still match)."""
    shape = GPTShape(**SHAPE)
    saved = CheckpointInfo.of(logical_spec(shape), layout="dp2", world_size=2, precision=Precision.FP32,
                              kinds=("param",), config=shape.config_record())
    again = CheckpointInfo.from_dict(saved.to_dict(), path="ckpt")
    assert again.config == shape.config_record() and again.config_differences(shape.config_record()) == []
    other = GPTShape(**SHAPE, init_method_std=0.01).config_record()
    assert again.config_differences(other) == ["init_method_std: 0.02 -> 0.01"]
    old = {k: v for k, v in saved.to_dict().items() if k != "config"}  # written before the field existed
    assert CheckpointInfo.from_dict(old, path="ckpt").config_differences(other) == []
