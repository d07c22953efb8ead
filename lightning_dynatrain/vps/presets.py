"""Model presets with real shapes, for dry-run planning at cluster scale and for benchmarks.

Each preset's parameter count is checked against its published count (``tests/vps/test_presets.py``).
"""

from __future__ import annotations

from lightning_dynatrain.vps.errors import ModelSpecError
from lightning_dynatrain.vps.gpt_spec import GPTDims, build_gpt_spec
from lightning_dynatrain.vps.spec import ModelSpec

# name -> (dims, published parameter count, where the count comes from)
_PRESETS: dict[str, tuple[GPTDims, int, str]] = {
    "gpt-1.3b": (
        GPTDims(num_layers=24, hidden=2048, num_heads=16, ffn_hidden=8192, vocab_size=50257, seq_length=2048,
                gated_mlp=False, normalization="LayerNorm", add_bias_linear=True,
                position_embedding="learned_absolute", tied_embeddings=True),
        1_315_575_808, "GPT-3 XL shape; count as published for GPT-Neo 1.3B, the same shape",
    ),
    "llama2-7b": (
        GPTDims(num_layers=32, hidden=4096, num_heads=32, ffn_hidden=11008, vocab_size=32000, seq_length=4096),
        6_738_415_616, "Llama 2 7B",
    ),
    "llama2-13b": (
        GPTDims(num_layers=40, hidden=5120, num_heads=40, ffn_hidden=13824, vocab_size=32000, seq_length=4096),
        13_015_864_320, "Llama 2 13B",
    ),
    "llama2-70b": (
        GPTDims(num_layers=80, hidden=8192, num_heads=64, num_query_groups=8, ffn_hidden=28672, vocab_size=32000,
                seq_length=4096),
        68_976_648_192, "Llama 2 70B",
    ),
    "gpt3-175b": (
        GPTDims(num_layers=96, hidden=12288, num_heads=96, ffn_hidden=49152, vocab_size=50257, seq_length=2048,
                gated_mlp=False, normalization="LayerNorm", add_bias_linear=True,
                position_embedding="learned_absolute", tied_embeddings=True),
        175_000_000_000, "GPT-3 175B (published as 175B)",
    ),
    "qwen-moe-235b": (
        GPTDims(num_layers=94, hidden=4096, num_heads=64, num_query_groups=4, head_dim=128, ffn_hidden=12288,
                vocab_size=151936, seq_length=4096, qk_layernorm=True, num_experts=128, moe_ffn_hidden=1536),
        235_093_634_560, "Qwen3-235B-A22B (128 experts, 8 active)",
    ),
}


def preset_names() -> tuple[str, ...]:
    return tuple(_PRESETS)


def preset(name: str) -> ModelSpec:
    """The ``ModelSpec`` of a named preset; an unknown name raises ``ModelSpecError`` listing them."""
    try:
        dims, published, _ = _PRESETS[name]
    except KeyError:
        raise ModelSpecError(f"unknown model {name!r}", hint=f"choose one of {', '.join(_PRESETS)}") from None
    return build_gpt_spec(name, dims, published_parameters=published)


def preset_dims(name: str) -> GPTDims:
    preset(name)  # raises the typed error for unknown names
    return _PRESETS[name][0]
