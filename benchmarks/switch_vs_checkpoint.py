"""Hot switch vs checkpoint-and-reshard, restart, naive all-gather and the floor, per layout pair.

Four gloo processes on 127.0.0.1 hold a megatron-core GPT (fp32, untied embeddings, Adam state
from one real training step). For each layout pair A -> B one spawned job measures, in order:

1. the hot switch (``megatron.hot_switch.hot_switch``): total, rebuild, engine; and the hot switch
   with its program and megatron objects built ahead (``megatron.ahead.prepare_switch``): total,
   binding, engine, and apart from them the background build's seconds;
2. checkpoint and reshard in process: (a) DCP of the logical boxes (``baselines/dcp.py``),
   (b) megatron ``dist_checkpointing`` (``baselines/megatron_ckpt.py``);
4. the naive in-memory switch: all-gather every full tensor, slice (``baselines/allgather.py``);
5. the floor: plan bytes over the measured p2p bandwidth + kept bytes at ``copy_`` speed;

and ends with the first half of 3. (checkpoint-and-restart): a DCP save, after which its processes
exit; a fresh job of 4 processes then starts, initialises and loads at B. Every method's final
state is fingerprinted against A's (layout-independent, ``baselines/fingerprint.py``). Methods
that do not fit in memory, or that megatron cannot run, are skipped with the reason.

Usage::

    python benchmarks/switch_vs_checkpoint.py                 # default: ~270M params, 9 pairs
    python benchmarks/switch_vs_checkpoint.py --quick         # small model, 2 pairs
    python benchmarks/switch_vs_checkpoint.py --pairs 1,6 --json
    python benchmarks/switch_vs_checkpoint.py --pairs dp4-tp1-pp1-zero1:dp2-tp2-pp1-zero1 --layers 8

``--json`` prints one JSON object on the last line (per pair, and geometric means under ``geomean``
for the on-demand switch and ``geomean_ahead`` for the switch built ahead, with the same keys).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: ``benchmarks.baselines``
import _switch_report as report  # noqa: E402  (light: the spawned children import this module too)

WORLD = 4
START_BYTES = 600 * 2**20  # one rank's interpreter, torch, megatron and gloo before any state
DEFAULT_PAIRS = [
    ("dp2-tp2-pp1", "dp1-tp4-pp1"),
    ("dp4-tp1-pp1", "dp2-tp2-pp1"),
    ("dp2-tp2-pp1", "dp1-tp2-pp2"),
    ("dp1-tp1-pp4", "dp4-tp1-pp1"),
    ("dp2-tp2-pp1-zero1", "dp1-tp4-pp1-zero1"),
    ("dp4-tp1-pp1-zero1", "dp2-tp2-pp1-zero1"),
    ("dp2-tp2-pp1-zero1", "dp1-tp2-pp2-zero1"),
    ("dp1-tp1-pp4-zero1", "dp4-tp1-pp1-zero1"),
    ("dp2-tp2-pp1", "dp2-tp2-pp1-zero1"),  # zero1 turned on (same grid: the moments are resharded)
]
QUICK_PAIRS = [1, 7]
QUICK_SHAPE = dict(hidden=256, layers=4, heads=8, vocab=8192, seq=256)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--ffn", type=int, default=None, help="MLP width (default 4 * hidden)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=1024, help="the model's maximum sequence length")
    p.add_argument("--pairs", default=None,
                   help="comma-separated: indices into the default list (1-based) or SRC:DST layouts")
    p.add_argument("--quick", action="store_true", help=f"small model {QUICK_SHAPE}, pairs {QUICK_PAIRS}")
    p.add_argument("--methods", default="hot_switch,hot_switch_ahead,allgather,dcp,megatron,restart")
    p.add_argument("--staging-budget", default="256MiB", help="the hot switch's staging budget")
    p.add_argument("--spec", choices=("hand", "derived"), default="hand",
                   help="the hot switch's model description: the hand-written GPT spec, or read from megatron's "
                        "sharded_state_dict (what a ModelProvider uses)")
    p.add_argument("--no-recycle", action="store_true",
                   help="the hot switch writes new state into fresh memory, not into old storages")
    p.add_argument("--mem-margin-gb", type=float, default=1.5, help="memory kept free beyond a method's need")
    p.add_argument("--workdir", default="/tmp", help="checkpoints go to a fresh directory under it")
    p.add_argument("--list-pairs", action="store_true", help="print the default pairs and exit")
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    p.add_argument("--json-full", action="store_true", help="with --json: every method's detail records too")
    args = p.parse_args(argv)
    if args.quick:
        for k, v in QUICK_SHAPE.items():
            setattr(args, k, v)
        args.pairs = args.pairs or ",".join(map(str, QUICK_PAIRS))
    return args


def select_pairs(text: str | None) -> list[tuple[str, str]]:
    if not text:
        return list(DEFAULT_PAIRS)
    out = []
    for item in text.split(","):
        item = item.strip()
        if ":" in item:
            src, dst = item.split(":")
            out.append((src.strip(), dst.strip()))
        else:
            out.append(DEFAULT_PAIRS[int(item) - 1])
    return out


def vocab_divisor(vocab: int, tps: set[int]) -> int:
    """The largest ``make_vocab_size_divisible_by`` (<= 128) that pads ``vocab`` alike at every tp.

    Megatron pads to a multiple of ``divisor * tp``; different padded sizes would make the layouts
    train different functions, and the rows only one layout has are no state to move.
    """
    for d in (128, 64, 32, 16, 8, 4, 2, 1):
        sizes = {-(-vocab // (d * tp)) * d * tp for tp in tps}
        if len(sizes) == 1:
            return d
    raise SystemExit(f"--vocab {vocab}: no divisor pads it alike at tp {sorted(tps)}; use a multiple of {max(tps)}")


def build_setup(args: argparse.Namespace, pairs: list[tuple[str, str]]):
    from benchmarks.baselines.state import BenchSetup
    from lightning_dynatrain.transition.staging import parse_bytes
    from lightning_dynatrain.megatron.gpt import GPTShape
    from lightning_dynatrain.vps.layout import ParallelConfig

    tps = {ParallelConfig.parse(l).tp for pair in pairs for l in pair}
    shape = GPTShape(hidden=args.hidden, layers=args.layers, heads=args.heads, ffn_hidden=args.ffn or 4 * args.hidden,
                     vocab_size=args.vocab, seq_length=args.seq, tied_embeddings=False,
                     make_vocab_size_divisible_by=vocab_divisor(args.vocab, tps))
    return BenchSetup(shape=shape, staging_budget=parse_bytes(args.staging_budget), recycle=not args.no_recycle,
                      derived=args.spec == "derived")


def run_pair(setup, src: str, dst: str, methods: tuple[str, ...], margin: int, workdir: str) -> dict:
    """Job 1 (every method but the restart's load), then job 2 (fresh processes load)."""
    from benchmarks.baselines.launch import JobError, spawn_job
    from benchmarks.baselines.memory import fmt_gb, mem_available, world_state_bytes
    from benchmarks.baselines.pair import PairConfig, pair_job, restart_job
    from lightning_dynatrain.vps.layout import ParallelConfig

    def missing(layout: str) -> str | None:  # a fresh job holding the state at ``layout``
        need = world_state_bytes(setup.spec, ParallelConfig.parse(layout)) + WORLD * START_BYTES + margin
        free = mem_available()
        return None if need <= free else (f"the state at {layout} needs {fmt_gb(need)} with start-up and margin, "
                                          f"{fmt_gb(free)} available")

    if (reason := missing(src)) is not None:
        return dict(pair=f"{src} -> {dst}", src=src, dst=dst, failed=f"skipped: {reason}")
    pair_dir = tempfile.mkdtemp(prefix="switch-bench-", dir=workdir)
    cfg = PairConfig(setup=setup, src=src, dst=dst, methods=methods, workdir=pair_dir, margin_bytes=margin,
                     gpus_per_node=WORLD)
    try:
        ranks = spawn_job(pair_job, WORLD, cfg, timeout_s=3600, collective_timeout_s=900)
        second = None
        if "restart_save" in ranks[0]:
            if (reason := missing(dst)) is None:  # job 1 has exited: its memory is back
                second = spawn_job(restart_job, WORLD, cfg, ranks[0]["restart_save"]["path"], ranks[0]["fp_src"],
                                   ranks[0]["step"], timeout_s=1800, collective_timeout_s=900)
            else:
                ranks[0]["skipped"]["restart"] = reason
        return report.summarize(src, dst, ranks, second)
    except JobError as err:
        return dict(pair=f"{src} -> {dst}", src=src, dst=dst, failed=str(err)[-4000:])
    finally:
        shutil.rmtree(pair_dir, ignore_errors=True)


def config_record(setup, args: argparse.Namespace) -> dict:
    from lightning_dynatrain.megatron.gpt import padded_vocab_size

    spec = setup.spec
    return dict(shape={k: getattr(setup.shape, k) for k in ("hidden", "layers", "heads", "ffn_hidden", "vocab_size",
                                                             "seq_length", "make_vocab_size_divisible_by",
                                                             "tied_embeddings")},
                padded_vocab=padded_vocab_size(setup.shape, 1), parameters=spec.parameters,
                state_bytes_one_copy=spec.parameters * 12, world=WORLD, dtype="fp32",
                staging_budget=setup.staging_budget, recycle=setup.recycle, spec="derived" if setup.derived else "hand",
                train_step=dict(global_batch=setup.global_batch,
                                                                     seq=setup.train_seq),
                mem_margin_gb=args.mem_margin_gb, thp_mem_alloc=os.environ.get("THP_MEM_ALLOC_ENABLE"))


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    # Every method's processes (spawned below, they inherit it) back large tensors with transparent
    # huge pages where the kernel allows it (madvise): fresh memory then costs a fault per 2 MiB,
    # not per 4 KiB, for the switch and the checkpoint baselines alike. THP_MEM_ALLOC_ENABLE=0 turns
    # it off. (On GPUs the caching allocator reuses memory and this does not matter.)
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    pairs = select_pairs(args.pairs)
    if args.list_pairs:
        for i, (src, dst) in enumerate(DEFAULT_PAIRS, 1):
            print(f"{i}: {src} -> {dst}")
        return 0
    setup = build_setup(args, pairs)
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    from benchmarks.baselines.pair import METHODS

    if unknown := [m for m in methods if m not in METHODS]:
        raise SystemExit(f"--methods: unknown {unknown}; choose among {list(METHODS)} "
                         "(the floor is measured in every run)")
    config = config_record(setup, args)
    print(f"model: {config['parameters'] / 1e6:.1f}M parameters ({config['shape']}), fp32 + Adam "
          f"({config['state_bytes_one_copy'] / 1e9:.2f} GB per full copy of params + moments), {WORLD} gloo ranks",
          flush=True)
    rows, failed = [], []
    for src, dst in pairs:
        t0 = time.perf_counter()
        load = os.getloadavg()
        row = run_pair(setup, src, dst, methods, int(args.mem_margin_gb * 2**30), args.workdir)
        row["wall_seconds"] = time.perf_counter() - t0
        row["load_average_before"] = load[0]  # other jobs share this machine's 2 cores: timings are noisy
        (failed if "failed" in row else rows).append(row)
        status = row.get("failed", "").splitlines()[0] if "failed" in row else "done"
        print(f"[{row['wall_seconds']:.0f}s] {src} -> {dst}: {status}", flush=True)
    means = report.geomeans(rows)
    print()
    print(report.table(rows, means))
    print(report.profile(rows))
    for row in failed:
        print(f"\n{row['pair']} FAILED: {row['failed']}")
    goals = report.goals(means)
    print("\ngoals (geomean, hot switch incl. rebuild): " + ", ".join(
        f"{k} {'-' if g['value'] is None else round(g['value'], 2)} ({'<=' if g['better'] == 'lower' else '>='}"
        f" {g['goal']}: {'met' if g['met'] else 'MISSED'}{_at_floor(g)})" for k, g in goals.items()))
    means_ahead, goals_ahead = None, None
    if "hot_switch_ahead" in methods:
        means_ahead = report.geomeans_ahead(rows)
        goals_ahead = report.goals(means_ahead, report.AHEAD_GOALS)
        print("goals (geomean, hot switch built ahead): " + ", ".join(
            f"{k} {'-' if g['value'] is None else round(g['value'], 2)} ({'<=' if g['better'] == 'lower' else '>='}"
            f" {g['goal']}: {'met' if g['met'] else 'MISSED'})" for k, g in goals_ahead.items()))
    wall = time.perf_counter() - started
    print(f"wall time of the whole run: {wall:.0f} s")
    if args.json:
        view = (lambda r: r) if args.json_full else report.compact
        print(json.dumps(report.rounded(dict(
            config=config, pairs={r["pair"]: view(r) for r in rows}, failed={r["pair"]: r["failed"] for r in failed},
            geomean=means, goals=goals, geomean_ahead=means_ahead, goals_ahead=goals_ahead, all_checks_passed=all(r["all_checks_passed"] for r in rows) and not failed,
            wall_seconds=wall)), default=str))
    return 0


def _at_floor(goal: dict) -> str:
    if goal.get("at_floor") is None:
        return ""
    return f"; {goal['at_floor']:.1f}x at the floor{'' if goal['reachable_at_floor'] else ', out of reach here'}"


if __name__ == "__main__":
    sys.exit(main())
