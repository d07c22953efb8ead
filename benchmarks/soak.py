"""Long runs: many layout switches in one ``Trainer.fit``, and what each process holds as they go.

One real fit (Lightning ``Trainer``, ``DynaTrainStrategy``, megatron-core on CPU, gloo) of a small
GPT on 4 processes, with ``ScheduledReconfig`` switching the layout every ``--every`` optimizer
steps through a cycle of layouts (default: ``dp4`` -> ``dp2-tp2-pp1-zero1`` -> ``dp1-tp2-pp2`` ->
``dp2-tp1-pp2-zero1`` -> ``dp4`` ...: tensor and pipeline changes, zero1 on and off). Right after
every switch each rank samples what it holds: resident memory (``VmRSS``), open file descriptors,
threads (Python's and the OS's) and live process groups (c10d's registry), next to the switch's
seconds (``ReconfigReport.seconds``: the slowest rank's).

Growth is measured from the end of the first cycle (every layout and its groups seen once) to the
end of the run. Goals: per rank ``rss_growth_bytes`` <= 64 MiB, ``fd_growth``, ``thread_growth``
and ``process_groups_growth`` 0; and the last cycle's median seconds per switch at most 1.1x the
second cycle's.

    python benchmarks/soak.py                    # 100 switches, 4 processes
    python benchmarks/soak.py --quick            # 3 cycles, a smoke run
    python benchmarks/soak.py --switches 200 --json
    python benchmarks/soak.py --switch-timeout 60    # every switch under a deadline watch

Lightning's launcher starts the 4 processes (``Trainer(devices=4)``), each with 1 intra-op
thread. Prints a table on rank 0; with ``--json`` the last line is one JSON object: per rank
(``ranks``) the growth figures (``rss_growth_bytes``, ``rss_peak_growth_bytes``, ``fds_growth``,
``python_threads_growth``, ``os_threads_growth``, ``process_groups_growth``, each also as
``..._peak_growth``: the most above the first cycle's end at any switch) and the samples at each
cycle's end (with the objects Python's cyclic collector tracks and its full collections so far);
seconds per switch by cycle (``cycle_seconds``, ``cycle_median_seconds``, per phase
``cycle_median_phase_seconds``); as a control for a shared machine's pace, rank 0's seconds of the
training step before each switch (``cycle_median_step_seconds``, ``step_last_over_second_cycle``);
and ``goals`` ({name: {value, limit, met}}) with ``all_met``.

``soak_fit`` (the fit and its samples, per rank) and ``summarize`` are what ``tests/strategy/test_soak.py``
runs, shorter.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: one cycle: pipeline on and off, tensor parallel on and off, zero1 on and off
LAYOUTS = ("dp4-tp1-pp1", "dp2-tp2-pp1-zero1", "dp1-tp2-pp2", "dp2-tp1-pp2-zero1")
SHAPE = dict(hidden=64, layers=4, heads=4, ffn_hidden=128, vocab_size=256, seq_length=32,
             make_vocab_size_divisible_by=128)
GLOBAL_BATCH, MICRO_BATCH, SEED = 8, 1, 1234
RSS_GOAL_BYTES = 64 * 2**20
SECONDS_GOAL_RATIO = 1.10
QUICK_CYCLES = 3


# ------------------------------------------------------------------------------------ one sample
@dataclass(frozen=True, slots=True)
class Sample:
    """What one process holds at one moment."""

    rss_bytes: int
    fds: int
    python_threads: int
    os_threads: int
    process_groups: int
    gc_objects: int
    """Objects the cyclic collector tracks (live ones and cyclic garbage not yet collected)."""
    gc_full_collections: int
    """Full (generation 2) collections so far in this process."""


def _proc_status() -> dict[str, str]:
    with open("/proc/self/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def live_process_groups() -> int:
    """Process groups registered with c10d now (WORLD included; ``destroy_process_group`` removes one)."""
    from lightning_dynatrain.compat.torch_internals import registered_groups

    return len(registered_groups())


def sample() -> Sample:
    """This process now: ``VmRSS``, entries of ``/proc/self/fd``, threads, live process groups,
    the cyclic collector's objects and full collections (Linux)."""
    status = _proc_status()
    return Sample(rss_bytes=int(status["VmRSS"].split()[0]) * 1024, fds=len(os.listdir("/proc/self/fd")),
                  python_threads=threading.active_count(), os_threads=int(status["Threads"]),
                  process_groups=live_process_groups(), gc_objects=len(gc.get_objects()),
                  gc_full_collections=gc.get_stats()[2]["collections"])


# ------------------------------------------------------------------------------------ the fit
def make_schedule(layouts: tuple[str, ...], switches: int, every: int) -> dict[int, str]:
    """``switches`` entries, one every ``every`` steps, cycling from ``layouts[1]`` (the run starts at ``layouts[0]``)."""
    if len(layouts) < 2:
        raise ValueError(f"a soak needs at least 2 layouts to cycle through, got {list(layouts)}")
    if switches < 1 or every < 1:
        raise ValueError(f"switches ({switches}) and every ({every}) must be at least 1")
    return {every * i: layouts[i % len(layouts)] for i in range(1, switches + 1)}


def _clock_callback():
    from lightning.pytorch import Callback

    class StepClock(Callback):
        """This rank's seconds of each training step (runs before ``ScheduledReconfig``: no switch in them)."""

        def __init__(self) -> None:
            self.started = 0.0
            self.last = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.started = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.last = time.perf_counter() - self.started

    return StepClock()


def _probe_callback(clock):
    from lightning.pytorch import Callback

    class SwitchProbe(Callback):
        """Samples this rank at the fit's start and right after every switch (after ``ScheduledReconfig``)."""

        def __init__(self) -> None:
            self.start: Sample | None = None
            self.rows: list[dict] = []

        def on_train_start(self, trainer, pl_module) -> None:
            self.start = sample()

        def on_train_end(self, trainer, pl_module) -> None:
            """Every rank's samples, on every rank (WORLD still stands here; teardown comes next)."""
            import torch.distributed as dist

            mine = dict(rank=trainer.global_rank, start=asdict(self.start), samples=self.rows,
                        losses=[loss for _, loss in pl_module.losses])
            self.gathered = [None] * trainer.world_size
            dist.all_gather_object(self.gathered, mine)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            history = trainer.strategy.switch_history
            if len(history) > len(self.rows):
                report = history[-1]
                self.rows.append(dict(step=report.step, dst=report.dst, seconds=report.seconds,
                                      phase_seconds=dict(report.phase_seconds), step_seconds=clock.last,
                                      built_ahead=report.ahead_build_seconds is not None, **asdict(sample())))

    return SwitchProbe()


def soak_fit(layouts: tuple[str, ...] = LAYOUTS, switches: int = 100, every: int = 1,
             callbacks: Sequence = (), switch_timeout: float | None = None) -> tuple[int, list[dict]]:
    """One ``Trainer.fit`` with ``switches`` scheduled switches: this process's rank, and every rank's
    samples (the same list on every rank).

    Every rank calls it (under Lightning's launcher, torchrun, or a harness that made the processes).
    A rank's samples: ``{"rank", "start": Sample fields at the fit's start, "samples": [per switch:
    step, dst, seconds, Sample fields], "losses"}``. ``callbacks`` run after the schedule and the probe;
    ``switch_timeout`` is the strategy's (every switch under a deadline watch).
    """
    from lightning.pytorch import Trainer

    from lightning_dynatrain import DynaTrainStrategy, GPTLightningModule
    from lightning_dynatrain.callbacks import ScheduledReconfig
    from lightning_dynatrain.data import StdlibTextDataModule
    from lightning_dynatrain.megatron.gpt import GPTShape

    schedule = make_schedule(layouts, switches, every)
    max_steps = max(schedule) + 1  # one step at the last layout
    module = GPTLightningModule(GPTShape(**SHAPE), lr=1e-3, weight_decay=0.01, global_batch_size=GLOBAL_BATCH,
                                micro_batch_size=MICRO_BATCH, warmup_steps=2, max_steps=max_steps, seed=SEED,
                                eps=1e-6)
    clock = _clock_callback()
    probe = _probe_callback(clock)
    strategy = DynaTrainStrategy(layouts[0], seed=SEED, switch_timeout=switch_timeout)
    trainer = Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=max_steps,
                      callbacks=[clock, ScheduledReconfig(schedule, on_refused="raise"), probe, *callbacks], logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0, num_sanity_val_steps=0)
    data = StdlibTextDataModule(seq_length=SHAPE["seq_length"], global_batch_size=GLOBAL_BATCH, shuffle=True, seed=0,
                                max_bytes=300_000)
    trainer.fit(module, datamodule=data)
    return trainer.global_rank, probe.gathered


# ------------------------------------------------------------------------------------ the figures
COUNTS = ("fds", "python_threads", "os_threads", "process_groups")


def rank_growth(result: dict, cycle: int) -> dict:
    """One rank's growth from the end of the first cycle (switch ``cycle``) to its last switch."""
    samples = result["samples"]
    if len(samples) < 2 * cycle:
        raise ValueError(f"rank {result['rank']}: {len(samples)} switches sampled, growth needs at least two "
                         f"cycles ({2 * cycle})")
    first, later = samples[cycle - 1], samples[cycle - 1:]
    out = {"rank": result["rank"], "rss_growth_bytes": samples[-1]["rss_bytes"] - first["rss_bytes"],
           "rss_peak_growth_bytes": max(s["rss_bytes"] for s in later) - first["rss_bytes"],
           "rss_first_cycle_growth_bytes": first["rss_bytes"] - result["start"]["rss_bytes"]}
    for name in COUNTS:
        out[f"{name}_growth"] = samples[-1][name] - first[name]
        out[f"{name}_peak_growth"] = max(s[name] for s in later) - first[name]
    out["cycle_ends"] = [{k: s[k] for k in ("step", "rss_bytes", *COUNTS, "gc_objects", "gc_full_collections")}
                         for s in samples[cycle - 1::cycle]]
    out["start"] = result["start"]
    return out


def summarize(results: list[dict], cycle: int) -> dict:
    """The job's figures and goals from every rank's ``soak_fit`` result (``cycle``: layouts per cycle)."""
    samples = results[0]["samples"]  # a switch's seconds are the slowest rank's, the same on every rank
    seconds = [s["seconds"] for s in samples]
    cycles = _by_cycle(seconds, cycle)
    medians = [statistics.median(c) for c in cycles]
    phases = {p: [round(statistics.median(c), 4) for c in _by_cycle([s["phase_seconds"][p] for s in samples], cycle)]
              for p in samples[0]["phase_seconds"]}
    steps = [round(statistics.median(c), 4) for c in _by_cycle([s["step_seconds"] for s in samples], cycle)]
    ranks = [rank_growth(r, cycle) for r in sorted(results, key=lambda r: r["rank"])]
    ratio = medians[-1] / medians[1]
    goals = {"rss_growth_bytes": _goal(max(r["rss_growth_bytes"] for r in ranks), RSS_GOAL_BYTES)}
    for name in ("fd", "thread", "process_groups"):
        keys = {"fd": ("fds",), "thread": ("python_threads", "os_threads"), "process_groups": ("process_groups",)}[name]
        goals[f"{name}_growth"] = _goal(max(r[f"{k}_growth"] for r in ranks for k in keys), 0)
    goals["last_over_second_cycle_seconds"] = _goal(round(ratio, 4), SECONDS_GOAL_RATIO)
    return {"switches": len(seconds), "built_ahead": sum(bool(s.get("built_ahead")) for s in samples),
            "layouts_per_cycle": cycle, "cycles": len(cycles), "ranks": ranks,
            "cycle_seconds": [[round(s, 4) for s in c] for c in cycles],
            "cycle_median_seconds": [round(m, 4) for m in medians], "last_over_second_cycle": round(ratio, 4),
            "cycle_median_phase_seconds": phases, "cycle_median_step_seconds": steps,
            "step_last_over_second_cycle": round(steps[-1] / steps[1], 4),
            "final_loss": results[0]["losses"][-1] if results[0]["losses"] else None,
            "goals": goals, "all_met": all(g["met"] for g in goals.values())}


def _by_cycle(values: list, cycle: int) -> list[list]:
    return [values[i:i + cycle] for i in range(0, len(values), cycle)]


def _goal(value: float, limit: float) -> dict:
    return {"value": value, "limit": limit, "met": value <= limit}


def _mib(n: int) -> str:
    return f"{n / 2**20:+.1f} MiB"


def print_table(summary: dict, layouts: tuple[str, ...], wall_s: float) -> None:
    print(f"\nsoak: {summary['switches']} switches in one fit, {summary['cycles']} cycles of "
          f"{' -> '.join(layouts)}; {wall_s:.0f} s; {summary['built_ahead']} built ahead")
    print(f"{'rank':>4} {'RSS at cycle 1 end':>19} {'growth':>12} {'peak growth':>12} "
          f"{'fds':>4} {'thr':>4} {'os thr':>6} {'groups':>6}  (growth after the first cycle)")
    for r in summary["ranks"]:
        first = r["cycle_ends"][0]
        print(f"{r['rank']:>4} {first['rss_bytes'] / 2**20:15.1f} MiB {_mib(r['rss_growth_bytes']):>12} "
              f"{_mib(r['rss_peak_growth_bytes']):>12} {r['fds_growth']:>+4} {r['python_threads_growth']:>+4} "
              f"{r['os_threads_growth']:>+6} {r['process_groups_growth']:>+6}")
    ends = summary["ranks"][0]["cycle_ends"]
    print(f"rank 0 at each cycle's end: {ends[0]['fds']} fds, {ends[0]['os_threads']} OS threads, "
          f"{ends[0]['process_groups']} process groups; RSS (MiB) "
          + " ".join(f"{c['rss_bytes'] / 2**20:.0f}" for c in ends)
          + "; objects the collector tracks (k) " + " ".join(f"{c['gc_objects'] / 1e3:.0f}" for c in ends)
          + f"; full collections {ends[0]['gc_full_collections']} -> {ends[-1]['gc_full_collections']}")
    print("median seconds per switch by cycle: " + " ".join(f"{m:.3f}" for m in summary["cycle_median_seconds"]))
    print("  and of the training step before it (rank 0; the machine's pace): "
          + " ".join(f"{m:.3f}" for m in summary["cycle_median_step_seconds"]))
    print(f"  last cycle over the second: switches {summary['last_over_second_cycle']:.3f}, "
          f"training steps {summary['step_last_over_second_cycle']:.3f}")
    for name, goal in summary["goals"].items():
        print(f"  {name:32} {goal['value']!s:>12} <= {goal['limit']!s:<10} {'met' if goal['met'] else 'NOT MET'}")


# ------------------------------------------------------------------------------------ driver
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--switches", type=int, default=100, help="switches in the fit (at least two cycles)")
    p.add_argument("--every", type=int, default=1, help="optimizer steps between switches")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="the cycle, comma-separated (4 processes each)")
    p.add_argument("--switch-timeout", type=float, default=None,
                   help="DynaTrainStrategy(switch_timeout=...): every switch under a deadline watch (seconds)")
    p.add_argument("--quick", action="store_true", help=f"{QUICK_CYCLES} cycles only (a smoke run)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = p.parse_args(argv)
    args.layouts = tuple(s.strip() for s in args.layouts.split(",") if s.strip())
    if args.quick:
        args.switches = QUICK_CYCLES * len(args.layouts)
    if args.switches < 2 * len(args.layouts):
        p.error(f"--switches {args.switches}: growth after the first cycle needs at least two cycles "
                f"({2 * len(args.layouts)} switches)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("DYNATRAIN_NUM_THREADS", "1")  # read by every process, Lightning's children too
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import logging
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    start = time.perf_counter()
    rank, results = soak_fit(args.layouts, args.switches, args.every, switch_timeout=args.switch_timeout)
    if rank != 0:
        return 0
    summary = summarize(results, len(args.layouts))
    summary.update(layouts=list(args.layouts), every=args.every, switch_timeout=args.switch_timeout,
                   processes=len(results),
                   threads_per_process=torch.get_num_threads(), wall_seconds=round(time.perf_counter() - start, 1))
    print_table(summary, args.layouts, time.perf_counter() - start)
    if args.json:
        print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
