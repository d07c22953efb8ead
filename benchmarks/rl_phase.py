"""RL's two phases in the same processes: a rollout phase's transitions against a second model refit.

For each (training layout, rollout layout) pair, one spawned job of 4 gloo processes builds a
megatron GPT at the training layout (fp32, Adam state from one real step on a batch the size of an
iteration's samples) and measures, slowest rank:

1. **enter** (``megatron.rollout.enter_rollout``, ``keep_weights=True``, ``park="in_place"``): the
   weights-only switch into a bare model at the rollout layout, and its engine's part (the walker's
   report, and its phases: ``enter_phases``; the rest is the groups, the program and the model's
   build); its bytes; the floor of that plan
   (``baselines.floor``: received bytes over the measured p2p rate + kept bytes at ``copy_`` speed),
   and the same floor into untouched memory (``fresh_floor_seconds``: the rollout model is new memory
   at each entry, and PyTorch's CPU allocator gives large blocks back to the kernel; a GPU's caching
   allocator keeps them);
2. **leave** with ``keep_weights=True``: nothing moves back;
3. the same with ``keep_weights=False``: entering frees the training shards of the weights, leaving
   refills them (the inverse weights-only switch), and the process's RSS in the phase against before;
4. **generation**: tokens/s of ``RolloutPolicy.generate`` at the rollout layout, and at the training
   layout (a rollout at the training layout itself: every weight kept in place; across its pipeline
   stages where it has several);
5. **the RL frameworks' way**: a second model built once at the rollout layout (as verl and
   NeMo-RL keep an inference copy), refilled by a weights-only gather-and-slice refit
   (``baselines.allgather``, params only) per iteration;
6. one training step on what the iteration generated (``--rows`` sequences of ``--prompt`` +
   ``--new`` tokens, as a GRPO step trains on its samples), for the share of an iteration
   (enter + generate + leave + step) spent in the two transitions.

megatron-core's ``swap_model_weights`` / ``resharding`` (0.19) need CUDA (a ``torch.cuda.Stream`` and
``torch.cuda.synchronize`` even on their gloo path): not run here.

Usage::

    .venv/bin/python benchmarks/rl_phase.py --json          # 270M GPT, the issue's three pairs
    .venv/bin/python benchmarks/rl_phase.py --quick          # a tiny GPT, one pair (seconds)

Prints a table per pair and, with ``--json``, one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PAIRS = [("dp1-tp2-pp2-zero1", "dp4-tp1-pp1"), ("dp2-tp2-pp1", "dp4-tp1-pp1"), ("dp1-tp4-pp1-zero1", "dp2-tp2-pp1")]
QUICK_PAIRS = [("dp2-tp2-pp1", "dp4-tp1-pp1")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny GPT and one pair")
    p.add_argument("--pairs", default=None, help="TRAIN>ROLLOUT[,TRAIN>ROLLOUT...] (default: the issue's three)")
    p.add_argument("--rows", type=int, default=8, help="prompts generated per iteration (all ranks)")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    p.add_argument("--new", type=int, default=16, help="tokens generated after each prompt")
    p.add_argument("--json", action="store_true", help="one JSON object on the last line")
    return p.parse_args(argv)


def _shape(quick: bool):
    from lightning_dynatrain.megatron.gpt import GPTShape

    if quick:
        return GPTShape(hidden=64, layers=4, heads=4, ffn_hidden=256, vocab_size=512, seq_length=64,
                        tied_embeddings=False, make_vocab_size_divisible_by=128)
    return GPTShape(hidden=1024, layers=16, heads=16, ffn_hidden=4096, vocab_size=32000, seq_length=1024,
                    tied_embeddings=False, make_vocab_size_divisible_by=64)


def _slowest(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _slowest_phases(report) -> dict[str, float]:
    """The walker's seconds per phase (``SwitchReport.seconds``), each the slowest rank's (collective)."""
    return {name: _slowest(seconds) for name, seconds in report.seconds.items()}


def _timed(fn):
    """``fn()`` between two barriers: its result and the slowest rank's seconds."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    out = fn()
    return out, _slowest(time.perf_counter() - start)


def _job(rank: int, world: int, quick: bool, train_text: str, rollout_text: str, rows: int, prompt: int,
         new: int) -> dict:
    import torch

    from benchmarks.baselines.allgather import allgather_switch
    from benchmarks.baselines.floor import measure_speeds, switch_floor
    from benchmarks.baselines.memory import rss
    from benchmarks.baselines.state import BenchSetup, build_trained_state
    from lightning_dynatrain.megatron.model_source import build_unfilled
    from lightning_dynatrain.megatron.execution import ExecutionOptions
    from lightning_dynatrain.megatron.parallel_state_adapter import ProcessGroupCache, initialize_for_layout
    from lightning_dynatrain.megatron.rollout import enter_rollout, leave_rollout
    from lightning_dynatrain.megatron.state_bridge import param_store
    from lightning_dynatrain.megatron.train_step import run_train_step
    from lightning_dynatrain.runtime.rollout import RolloutPolicy
    from lightning_dynatrain.vps.layout import ParallelConfig
    from lightning_dynatrain.vps.spec import Precision, StateKind
    from lightning_dynatrain.vps.topology import Topology

    torch.set_num_threads(1)
    train, rollout = ParallelConfig.parse(train_text), ParallelConfig.parse(rollout_text)
    bench = BenchSetup(shape=_shape(quick), global_batch=rows, train_seq=prompt + new)  # a GRPO step's batch
    cache = ProcessGroupCache()
    state = build_trained_state(bench, train, rank, groups=cache)
    setup = bench.switch_setup(Topology.uniform(world, 8))
    spec, out = setup.spec, {}
    speeds = measure_speeds(nbytes=(4 if quick else 64) * 2**20, copy_bytes=(16 if quick else 256) * 2**20,
                            fresh=True)
    floor = switch_floor(spec, train, rollout, rank, speeds, weights_only=True)
    out["floor_seconds"], out["fresh_floor_seconds"] = floor.seconds, floor.fresh_seconds
    prompts = torch.randint(0, spec.vocab_size, (rows, prompt), generator=torch.Generator().manual_seed(3))

    def generate(phase) -> float:
        policy = RolloutPolicy(phase, spec)
        _, seconds = _timed(lambda: policy.generate(prompts, max_new_tokens=new, temperature=1.0, seed=1))
        return rows * new / seconds

    before = rss()
    phase, out["enter_seconds"] = _timed(lambda: enter_rollout(state, rollout, setup, groups=cache))
    out["enter_bytes"] = phase.enter_report.recv_bytes
    out["enter_engine_seconds"] = _slowest(phase.enter_report.total_seconds)  # the walker's part of it
    out["enter_phases"] = _slowest_phases(phase.enter_report)
    out["tokens_per_s"] = generate(phase)
    out["rss_in_phase_kept"] = rss() - before
    report, out["leave_seconds"] = _timed(lambda: leave_rollout(phase, setup, groups=cache))
    out["leave_bytes"] = 0 if report is None else report.recv_bytes
    phase, out["enter_freed_seconds"] = _timed(lambda: enter_rollout(state, rollout, setup, groups=cache,
                                                                     keep_weights=False))
    out["rss_in_phase_freed"] = rss() - before
    out["enter_freed_engine_seconds"] = _slowest(phase.enter_report.total_seconds)
    out["enter_freed_phases"] = _slowest_phases(phase.enter_report)
    out["parked_bytes"] = phase.parked_bytes
    report, out["leave_refill_seconds"] = _timed(lambda: leave_rollout(phase, setup, groups=cache))
    out["leave_refill_bytes"] = 0 if report is None else report.recv_bytes
    phase = enter_rollout(state, train, setup, groups=cache)  # generating at the training layout itself
    out["train_layout_tokens_per_s"] = generate(phase)
    leave_rollout(phase, setup, groups=cache)
    # the RL frameworks' way: a second model at the rollout layout, refilled by gather-and-slice
    pgs = initialize_for_layout(rollout, seed=bench.seed, groups=cache)
    second = build_unfilled(bench.shape, rollout, seed=bench.seed, params_dtype=torch.float32, pg_collection=pgs,
                            execution=ExecutionOptions(), device=torch.device("cpu"))
    initialize_for_layout(train, seed=bench.seed, groups=cache)
    source, dest = param_store(state.model, spec, train, rank), param_store(second, spec, rollout, rank)
    _, out["refit_seconds"] = _timed(lambda: allgather_switch(source, dest, spec, train, rollout, rank,
                                                              precision=Precision.FP32, kinds=(StateKind.PARAM,)))
    del second, source, dest
    from benchmarks.baselines.state import _batch

    batch = _batch(bench, train, rank)
    _, out["step_seconds"] = _timed(lambda: run_train_step(state.ddp, state.optimizer, batch, train,
                                                           num_microbatches=batch["tokens"].shape[0]))
    return out


def run_pair(quick: bool, train: str, rollout: str, args: argparse.Namespace) -> dict:
    from benchmarks.baselines.launch import spawn_job

    per_rank = spawn_job(_job, 4, quick, train, rollout, args.rows, args.prompt, args.new, timeout_s=1800,
                         stamp_entry=False)
    first = per_rank[0]
    row = {k: v for k, v in first.items() if not k.startswith("rss") and k not in ("enter_bytes", "leave_bytes",
                                                                                      "leave_refill_bytes")}
    for key in ("enter_bytes", "leave_bytes", "leave_refill_bytes", "parked_bytes"):
        row[key] = sum(r[key] for r in per_rank)
    for key in ("rss_in_phase_kept", "rss_in_phase_freed"):
        row[key] = max(r[key] for r in per_rank)
    transitions = row["enter_seconds"] + row["leave_seconds"]
    generation = args.rows * args.new / row["tokens_per_s"]
    for entry in ("enter", "enter_freed"):  # the walker's two largest phases, in the table too
        for name in ("transfer", "unpack"):
            row[f"{entry}_{name}_seconds"] = first[f"{entry}_phases"][name]
    row["enter_over_floor"] = row["enter_seconds"] / row["floor_seconds"]
    row["enter_over_fresh_floor"] = row["enter_seconds"] / row["fresh_floor_seconds"]
    row["refit_over_enter"] = row["refit_seconds"] / row["enter_seconds"]
    row["transition_share"] = transitions / (transitions + generation + row["step_seconds"])
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    pairs = QUICK_PAIRS if args.quick else PAIRS
    if args.pairs:
        pairs = [tuple(p.split(">")) for p in args.pairs.split(",")]
    start, rows = time.perf_counter(), {}
    for train, rollout in pairs:
        print(f"[rl_phase] {train} <-> {rollout} ...", flush=True)
        rows[f"{train} <-> {rollout}"] = run_pair(args.quick, train, rollout, args)
    keys = ["floor_seconds", "fresh_floor_seconds", "enter_seconds", "enter_engine_seconds", "enter_over_floor",
            "enter_over_fresh_floor", "enter_bytes",
            "enter_transfer_seconds", "enter_unpack_seconds", "leave_seconds", "leave_bytes", "enter_freed_seconds",
            "enter_freed_engine_seconds", "enter_freed_transfer_seconds", "enter_freed_unpack_seconds",
            "leave_refill_seconds", "leave_refill_bytes", "refit_seconds", "refit_over_enter",
            "tokens_per_s", "train_layout_tokens_per_s", "step_seconds", "transition_share", "rss_in_phase_kept",
            "rss_in_phase_freed"]
    print(f"{'':28}" + "".join(f"{name[:26]:>28}" for name in rows))
    for key in keys:
        values = [r.get(key) for r in rows.values()]
        print(f"{key:28}" + "".join(f"{'-' if v is None else (f'{v:.3f}' if isinstance(v, float) else f'{v:,}'):>28}"
                                    for v in values))
    geomean = {k: math.exp(sum(math.log(r[k]) for r in rows.values()) / len(rows))
               for k in ("enter_over_floor", "enter_over_fresh_floor", "refit_over_enter", "transition_share")}
    goals = {"enter_over_floor": (geomean["enter_over_floor"], 1.5, "<="),
             "refit_over_enter": (min(r["refit_over_enter"] for r in rows.values()), 3.0, ">="),
             "transition_share": (max(r["transition_share"] for r in rows.values()), 0.05, "<="),
             "leave_bytes_kept": (max(r["leave_bytes"] for r in rows.values()), 0, "<=")}
    met = {k: (v <= g if how == "<=" else v >= g) for k, (v, g, how) in goals.items()}
    print("goals: " + ", ".join(f"{k} {v:.3f} {how} {g}: {'met' if met[k] else 'MISSED'}"
                                for k, (v, g, how) in goals.items()))
    if args.json:
        print(json.dumps({"model": "tiny" if args.quick else "270m", "rows": args.rows, "new_tokens": args.new,
                          "pairs": rows, "geomean": geomean,
                          "goals": {k: {"value": v, "goal": g, "met": met[k]} for k, (v, g, how) in goals.items()},
                          "wall_seconds": time.perf_counter() - start}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
