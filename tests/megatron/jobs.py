"""The spawned jobs behind tests/megatron: Megatron GPT training on CPU with real gloo groups, world 1, 2 and 4.

Each world size is one spawned job that walks through several layouts in the same processes
(``initialize_for_layout`` -> build -> DDP + optimizer -> 2 training steps -> ``destroy``), which is
also how the strategy will switch. Per layout it returns the losses, the rank coordinates, the
optimizer-state views and megatron's buffer layout; the tests below assert on them.

Both steps use the same global batch of 8 sequences, split over data-parallel ranks and into 2
micro-batches, so every layout computes the same losses as dp1-tp1-pp1 up to float rounding.
"""

from __future__ import annotations

import torch

from tests.dist import run_distributed

#: Dense GPT: gated MLP, qk-layernorm, biases, tied embeddings (shared-embedding path at pp>1).
DENSE = dict(
    hidden=32, layers=4, heads=4, query_groups=2, ffn_hidden=64, vocab_size=120, seq_length=16,
    make_vocab_size_divisible_by=64, gated_mlp=True, qk_layernorm=True, add_bias_linear=True,
    tied_embeddings=True,
)
#: MoE GPT: 4 experts, top-2, shared expert, RMSNorm, untied, no biases (needed for etp > 1).
MOE = dict(
    hidden=32, layers=2, heads=4, query_groups=2, ffn_hidden=64, vocab_size=120, seq_length=16,
    make_vocab_size_divisible_by=64, gated_mlp=True, normalization="RMSNorm", add_bias_linear=False,
    tied_embeddings=False, num_experts=4, moe_ffn_hidden=32, moe_router_topk=2,
    moe_shared_expert_ffn_hidden=32,
)
SHAPES = {"dense": DENSE, "moe": MOE}
GLOBAL_BATCH, MICROBATCHES, STEPS, SEED = 8, 2, 2, 1234

WORLD1 = [("dense", "dp1-tp1-pp1"), ("moe", "dp1-tp1-pp1")]
WORLD2 = [
    ("dense", "dp2-tp1-pp1"),
    ("dense", "dp1-tp2-pp1"),
    ("dense", "dp1-tp1-pp2"),
    ("dense", "dp2-tp1-pp1-zero1"),
    ("moe", "dp2-tp1-pp1-ep2"),
    ("moe", "dp2-tp1-pp1-ep2-zero1"),
]
WORLD4 = [
    ("dense", "dp1-tp2-pp2"),
    ("dense", "dp2-tp2-pp1-zero1"),
    ("dense", "dp2-tp1-pp2-zero1"),
    ("moe", "dp2-tp2-pp1-ep2"),  # sequence parallel + expert TP: uneven gloo all_gather (patch E)
]


# ------------------------------------------------------------------------------ the spawned job
def _global_batch(vocab: int, seq: int) -> torch.Tensor:
    return torch.randint(0, vocab, (GLOBAL_BATCH, seq + 1), generator=torch.Generator().manual_seed(7))


def _buffers(ddp) -> list[dict]:
    name_of = {p: n for n, p in ddp.module.named_parameters()}
    out = []
    for kind, buffers in (("dense", ddp.buffers), ("expert", ddp.expert_parallel_buffers)):
        for buf in buffers:
            entries = sorted(((name_of[p], *r) for p, r in buf.param_index_map.items()), key=lambda e: e[1])
            out.append(dict(
                kind=kind,
                group_size=buf.data_parallel_group.size(),
                buckets=[(b.offset, b.offset + b.grad_data.numel()) for b in buf.buckets],
                entries=entries,
            ))
    return out


def _uneven_gather_probe(rank: int) -> list[float]:
    """Patch E directly: a TP gather with per-rank row counts 1 and 3 (gloo refuses it unpatched)."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    from lightning_dynatrain.devices.host.megatron_patches import megatron_on_cpu
    from lightning_dynatrain.megatron.parallel_state_adapter import destroy, initialize_for_layout
    from lightning_dynatrain.vps.layout import ParallelConfig

    pgs = initialize_for_layout(ParallelConfig.parse("dp1-tp2-pp1"), seed=SEED)
    rows = torch.full((1 + 2 * rank, 2), float(rank + 1))
    with megatron_on_cpu():
        gathered = gather_from_sequence_parallel_region(rows, group=pgs.tp, output_split_sizes=[1, 3])
    destroy()
    return gathered[:, 0].tolist()


class _Stop(Exception):
    """What the layer check of ``_layer_check_probe`` raises."""


def _layer_check_probe(ddp, optimizer, batch, layout) -> dict:
    """``step_progress.checked_at_layers`` on real steps of ``ddp``: how often one step's layers call
    the check (a counting one), how many calls a check that raises on its third lets through (the
    step leaves there, with the check's own exception), and how many calls a plain step makes after
    both (0 when the hooks went with each step, also with the exception)."""
    from lightning_dynatrain.megatron.step_progress import StepProgress
    from lightning_dynatrain.megatron.train_step import run_train_step

    calls: list[str] = []

    def counting() -> None:
        calls.append("count")

    def stop_at_third() -> None:
        calls.append("stop")
        if calls.count("stop") == 3:
            raise _Stop

    run_train_step(ddp, optimizer, batch, layout, MICROBATCHES, progress=StepProgress(step=0, rank=0,
                                                                                       stop_if_lost=counting))
    raised = None
    try:
        run_train_step(ddp, optimizer, batch, layout, MICROBATCHES, progress=StepProgress(step=1, rank=0,
                                                                                           stop_if_lost=stop_at_third))
    except _Stop as err:
        raised = type(err).__name__
    before_plain = len(calls)
    run_train_step(ddp, optimizer, batch, layout, MICROBATCHES)
    return dict(per_step=calls.count("count"), stopped_after=calls.count("stop"), raised=raised,
                plain_step=len(calls) - before_plain)


def _run_layouts(rank: int, world_size: int, plan: list[tuple[str, str]]) -> dict:
    import torch.distributed as dist

    from lightning_dynatrain.megatron.gpt import GPTShape, build_gpt_model
    from lightning_dynatrain.megatron.optimizer import build_ddp_and_optimizer, optimizer_state_views
    from lightning_dynatrain.megatron.train_step import run_train_step
    from lightning_dynatrain.megatron.parallel_state_adapter import destroy, initialize_for_layout
    from lightning_dynatrain.vps.errors import LayoutError
    from lightning_dynatrain.vps.layout import ParallelConfig

    results: dict = {}
    try:  # a layout of the wrong world size is refused before any group is built
        initialize_for_layout(ParallelConfig.parse(f"dp{world_size + 1}"), seed=SEED)
    except LayoutError as err:
        results["wrong_world_error"] = str(err)
    if world_size == 2:
        results["uneven_gather"] = _uneven_gather_probe(rank)

    for shape_name, layout_str in plan:
        shape, layout = GPTShape(**SHAPES[shape_name]), ParallelConfig.parse(layout_str)
        groups_before = len(dist.distributed_c10d._world.pg_map)
        pgs = initialize_for_layout(layout, seed=SEED)
        model = build_gpt_model(shape, layout, seed=SEED)
        ddp, optimizer = build_ddp_and_optimizer(model, layout, lr=1e-2, weight_decay=0.1)

        tokens = _global_batch(shape.vocab_size, shape.seq_length)
        per_dp = GLOBAL_BATCH // pgs.dp.size()
        local = tokens[pgs.dp.rank() * per_dp : (pgs.dp.rank() + 1) * per_dp]
        batch = {"tokens": local[:, :-1].contiguous(), "labels": local[:, 1:].contiguous()}
        losses = [run_train_step(ddp, optimizer, batch, layout, MICROBATCHES) for _ in range(STEPS)]

        views = optimizer_state_views(ddp, optimizer)
        results[(shape_name, layout_str)] = dict(
            losses=losses,
            dense=(pgs.tp.rank(), pgs.cp.rank(), pgs.dp.rank(), pgs.pp.rank()),
            expert=(pgs.expt_tp.rank(), pgs.ep.rank(), pgs.expt_dp.rank(), pgs.pp.rank()),
            names=[(n, tuple(p.shape), bool(getattr(p, "shared_embedding", False))) for n, p in model.named_parameters()],
            views={
                n: dict(
                    numel=v.param.numel(),
                    shard=v.shard_range,
                    kind=v.buffer.kind,
                    step=v.step,
                    exp_avg=None if v.exp_avg is None else v.exp_avg.detach().reshape(-1).numpy().copy(),
                    exp_avg_sq=None if v.exp_avg_sq is None else v.exp_avg_sq.detach().reshape(-1).numpy().copy(),
                )
                for n, v in views.items()
            },
            params={n: p.detach().reshape(-1).numpy().copy() for n, p in model.named_parameters()},
            buffers=_buffers(ddp),
        )
        if world_size == 1:  # (after the results above: these steps move the state on)
            results[(shape_name, layout_str)]["layer_checks"] = _layer_check_probe(ddp, optimizer, batch, layout)
        destroy()
        results[(shape_name, layout_str)]["groups_leaked"] = len(dist.distributed_c10d._world.pg_map) - groups_before
    return results


def run_job(world_size: int, plan: list[tuple[str, str]]) -> list[dict]:
    return run_distributed(_run_layouts, world_size, plan, timeout_s=150)
