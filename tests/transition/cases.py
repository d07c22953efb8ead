"""Switch cases for multi-process engine tests: small random GPTs and valid layouts, seeded.

Specs are drawn with ``random.Random(seed)`` in the parent (every rank must see the same case) and
sent to the children as ``GPTDims``; each child rebuilds the spec. Layouts are every valid layout of a
world size (dp, tp, pp, ep, etp, zero), drawn from the same generator.
"""

from __future__ import annotations

import random
from typing import NamedTuple

from lightning_dynatrain.transition import DIRECT_MIN_BYTES, LinkCosts, SwitchProgram, compile_switch, parse_bytes
from lightning_dynatrain.vps.errors import LayoutError
from lightning_dynatrain.vps.gpt_spec import GPTDims, build_gpt_spec
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.mapping import rank_regions
from lightning_dynatrain.vps.planner import plan_rank, union_world
from lightning_dynatrain.vps.spec import ModelSpec, Precision
from lightning_dynatrain.vps.topology import Topology
from lightning_dynatrain.vps.validate import layout_problems


def regions(spec: ModelSpec, layout: ParallelConfig, rank: int, precision: Precision) -> dict:
    """``rank_regions``, empty for a rank outside the layout's world."""
    return rank_regions(spec, layout, rank, precision) if rank < layout.world_size else {}


class Case(NamedTuple):
    """One switch to run on every rank: model, layouts, precision, staging budget, node size."""

    dims: GPTDims
    src: str
    dst: str
    precision: Precision = Precision.FP32
    budget: int | str = "1MiB"
    gpus_per_node: int = 2

    def spec(self) -> ModelSpec:
        return build_gpt_spec("tiny-moe" if self.dims.num_experts else "tiny", self.dims)

    def program(self, rank: int, src: str, dst: str, *, costs: LinkCosts | None = None,
                direct_min_bytes: int | None = DIRECT_MIN_BYTES) -> SwitchProgram:
        """This rank's compiled program for ``src -> dst`` (with promotion where ``costs`` say so)."""
        spec, a, b = self.spec(), ParallelConfig.parse(src), ParallelConfig.parse(dst)
        topology = Topology.uniform(union_world(a, b), self.gpus_per_node)

        def plan(r: int):
            return plan_rank(spec, a, b, r, precision=self.precision, topology=topology)

        mine = plan(rank)
        peers = {r: plan(r) for r in {t.peer for t in mine.recvs}} if costs is not None else {}
        return compile_switch(mine, regions(spec, a, rank, self.precision), regions(spec, b, rank, self.precision),
                              staging_budget=parse_bytes(self.budget), direct_min_bytes=direct_min_bytes,
                              link_costs=costs, peer_plans=peers, topology=topology)

    def __str__(self) -> str:
        return f"{self.src}->{self.dst} {self.precision.value} budget={self.budget} ({self.dims})"


def random_dims(rng: random.Random, *, moe: bool) -> GPTDims:
    """A tiny GPT whose sizes divide by 1, 2 and 4 where layouts need it (world <= 4)."""
    groups = rng.choice([2, 4])
    return GPTDims(
        num_layers=rng.choice([2, 4]),
        hidden=rng.choice([4, 8, 24]),
        num_heads=groups * rng.choice([1, 2]),
        num_query_groups=groups,
        head_dim=rng.choice([2, 4, 6]),
        ffn_hidden=rng.choice([4, 8, 12, 20]),
        vocab_size=rng.randint(5, 40),
        seq_length=8,
        gated_mlp=rng.random() < 0.5,
        normalization=rng.choice(["LayerNorm", "RMSNorm"]),
        add_bias_linear=(not moe) and rng.random() < 0.5,
        qk_layernorm=rng.random() < 0.5,
        position_embedding=rng.choice(["rope", "learned_absolute"]),
        tied_embeddings=rng.random() < 0.5,
        make_vocab_size_divisible_by=rng.choice([1, 4, 8]),
        num_experts=rng.choice([2, 4]) if moe else 0,
        moe_ffn_hidden=rng.choice([4, 8, 12]) if moe else 0,
        shared_expert_ffn=rng.choice([0, 4]) if moe else 0,
    )


def valid_layouts(spec: ModelSpec, world: int) -> list[ParallelConfig]:
    """Every layout of ``world`` ranks (cp = 1) that fits ``spec``."""
    out = []
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    for tp in divisors:
        for pp in [d for d in divisors if (world // tp) % d == 0]:
            dp = world // (tp * pp)
            experts = [(1, tp)] + [(ep, etp) for ep in divisors[1:] for etp in divisors if spec.num_experts]
            for ep, etp in experts:
                for zero in (0, 1):
                    try:
                        layout = ParallelConfig(dp=dp, tp=tp, pp=pp, ep=ep, etp=etp, zero=zero)
                    except LayoutError:
                        continue
                    if not layout_problems(layout, spec, world):
                        out.append(layout)
    return sorted(set(out), key=str)


def random_cases(seed: int, count: int, *, src_world: int, dst_world: int, moe: bool | None = None,
                 budget: int | str = "1MiB") -> list[Case]:
    """``count`` random switches between worlds of the given sizes, dense or MoE (random if None)."""
    rng = random.Random(seed)
    cases = []
    while len(cases) < count:
        dims = random_dims(rng, moe=rng.random() < 0.4 if moe is None else moe)
        spec = build_gpt_spec("tiny", dims)
        srcs, dsts = valid_layouts(spec, src_world), valid_layouts(spec, dst_world)
        if not srcs or not dsts:
            continue
        precision = rng.choice([Precision.BF16, Precision.FP32])  # Adam's state; SGD's: tests/strategy/test_own_models.py
        cases.append(Case(dims, str(rng.choice(srcs)), str(rng.choice(dsts)), precision, budget))
    return cases
