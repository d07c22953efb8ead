"""Hypothesis strategies: random small GPT specs and random layouts that fit them."""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from lightning_dynatrain.vps.errors import LayoutError
from lightning_dynatrain.vps.gpt_spec import GPTDims, build_gpt_spec
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.validate import layout_problems


@st.composite
def small_specs(draw, *, moe: bool | None = None):
    """A tiny GPT whose sizes are divisible by 1, 2 and 4 (and sometimes not by 4; 3 layers
    split over 2 stages only unevenly; 4 layers into virtual stages too)."""
    is_moe = draw(st.booleans()) if moe is None else moe
    groups = draw(st.sampled_from([1, 2, 4]))
    heads = groups * draw(st.sampled_from([1, 2]))
    dims = GPTDims(
        num_layers=draw(st.sampled_from([1, 2, 3, 4])),
        hidden=draw(st.sampled_from([4, 8])),
        num_heads=heads,
        num_query_groups=groups,
        head_dim=draw(st.sampled_from([2, 4])),
        ffn_hidden=draw(st.sampled_from([4, 8, 12])),
        vocab_size=draw(st.integers(5, 40)),
        seq_length=8,
        gated_mlp=draw(st.booleans()),
        normalization=draw(st.sampled_from(["LayerNorm", "RMSNorm"])),
        add_bias_linear=draw(st.booleans()),
        qk_layernorm=draw(st.booleans()),
        position_embedding=draw(st.sampled_from(["rope", "learned_absolute"])),
        tied_embeddings=draw(st.booleans()),
        make_vocab_size_divisible_by=draw(st.sampled_from([1, 4, 8])),
        num_experts=draw(st.sampled_from([2, 4])) if is_moe else 0,
        moe_ffn_hidden=draw(st.sampled_from([4, 8])) if is_moe else 0,
        shared_expert_ffn=draw(st.sampled_from([0, 4])) if is_moe else 0,
    )
    if dims.add_bias_linear and dims.shared_expert_ffn:
        dims = dataclasses.replace(dims, shared_expert_ffn=0)
    return build_gpt_spec("tiny-moe" if is_moe else "tiny", dims)


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def layouts(draw, spec, *, world_size: int | None = None, max_world: int = 64):
    """A valid layout of ``spec`` (of ``world_size`` ranks if given), tp/pp/cp/ep often above 1, and
    at pp > 1 often an uneven pipeline (``first``/``last``) or virtual stages (``vpp``), or both."""
    for _ in range(50):
        if world_size is None:
            tp = draw(st.sampled_from([1, 2, 4]))
            pp = draw(st.sampled_from([1, 2, 4]))
            cp = draw(st.sampled_from([1, 1, 2]))
            dp = draw(st.integers(1, max(1, max_world // (tp * pp * cp))))
        else:
            tp = draw(st.sampled_from(_divisors(world_size)))
            pp = draw(st.sampled_from(_divisors(world_size // tp)))
            cp = draw(st.sampled_from(_divisors(world_size // (tp * pp))))
            dp = world_size // (tp * pp * cp)
        ep, etp = 1, tp
        if spec.num_experts:
            ep = draw(st.sampled_from(_divisors(tp * cp * dp)))
            etp = tp if ep == 1 else draw(st.sampled_from(_divisors(tp * cp * dp // ep)))
        first = last = None
        vpp = draw(st.sampled_from([1, 1, 2])) if pp > 1 else 1
        if pp > 1 and draw(st.booleans()):
            ends = st.none() | st.integers(1, max(1, spec.num_layers - 1))
            first, last = draw(ends), draw(ends)
        try:
            layout = ParallelConfig(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, zero=draw(st.sampled_from([0, 1])),
                                    first=first, last=last, vpp=vpp)
        except LayoutError:
            continue
        if not layout_problems(layout, spec, layout.world_size):
            return layout
    return ParallelConfig(dp=world_size or 1)
