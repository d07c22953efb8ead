"""Steady-state step time of the demo under each launcher a user starts it with: python, torchrun, fabric run, srun.

Each run is the real demo (``examples/train_gpt.py``: Lightning ``Trainer``, ``DynaTrainStrategy``,
megatron on CPU, gloo) with no switch, started the way a user would start it, with no thread
setting of ours in the environment (``OMP_NUM_THREADS`` and ``DYNATRAIN_NUM_THREADS`` removed), so
each launcher's own choice reaches the strategy:

- ``python``: ``python examples/train_gpt.py ...`` (Lightning's subprocess launcher);
- ``torchrun``: ``python -m torch.distributed.run --standalone --nproc-per-node N ...``;
- ``fabric``: ``fabric run --accelerator cpu --devices N ...`` (sets OMP_NUM_THREADS to every core);
- ``srun``: ``srun -n N ...`` on a one-node SLURM cluster that ``tests/slurm/cluster.sh`` starts for
  the benchmark in a temporary directory and stops afterwards (skipped, with the reason, where it
  cannot start: no root, no slurm-wlm/munge; ``tests/slurm/cluster.sh install`` installs them).

A step's time is the difference of consecutive ``seconds`` in the run's ``metrics.csv`` (rank 0's
wall clock at each step's end); the first ``--warmup`` steps are dropped and a run's figure is the
median of the rest. Launchers take turns within each round (the order rotates every round), so
load from elsewhere on the machine falls on all of them alike. Goal: the slowest launcher's
median within 10% of the fastest's.

    python benchmarks/launchers.py                       # 4 processes, dp2-tp2-pp1, 3 runs each
    python benchmarks/launchers.py --runs 5 --steps 40 --json

Prints a table; with ``--json`` the last line is one JSON object: per launcher ``median_step_s``
(median over runs), ``run_medians_s``, ``threads`` (per process, from the demo's summary line),
``wall_s``, ``busy_before`` (the machine's busy CPU share just before the run: each run waits, up
to ``--wait-idle`` seconds, for it to fall under 15%) and ``load_before`` (the 1-minute load
average then; a shared machine's other jobs make the figures noisy, and these say how much);
``skipped`` ({launcher: reason}); ``paired_vs_python`` (per launcher, the median over rounds of its
median over python's in the same round, which cancels load that drifts between rounds);
``max_over_min`` and ``within_goal``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "train_gpt.py"
CLUSTER = ROOT / "tests" / "slurm" / "cluster.sh"
LAUNCHERS = ("python", "torchrun", "fabric", "srun")
GOAL = 1.10
_DROP = ("SLURM_", "SBATCH_", "SRUN_", "TORCHELASTIC_", "LOCAL_RANK", "MASTER_", "WORLD_SIZE", "RANK", "GROUP_RANK",
         "OMP_NUM_THREADS", "DYNATRAIN_NUM_THREADS", "LT_", "PL_")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=4, help="processes per run")
    p.add_argument("--layout", default="dp2-tp2-pp1", help="the (static) layout every run trains at")
    p.add_argument("--steps", type=int, default=30, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps at the start of each run")
    p.add_argument("--runs", type=int, default=3, help="runs per launcher")
    p.add_argument("--launchers", default=",".join(LAUNCHERS), help=f"comma-separated subset of {LAUNCHERS}")
    p.add_argument("--timeout", type=float, default=600, help="seconds one run may take")
    p.add_argument("--wait-idle", type=float, default=120,
                   help="before each run, wait up to this many seconds for the machine to be idle (under 15%% of "
                   "its CPUs busy over 2 s), so a run does not start on top of another job; 0: do not wait")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = p.parse_args(argv)
    args.launchers = [x.strip() for x in args.launchers.split(",") if x.strip()]
    unknown = set(args.launchers) - set(LAUNCHERS)
    if unknown:
        p.error(f"unknown launcher(s) {sorted(unknown)}; choose from {LAUNCHERS}")
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_DROP)}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


def _fabric() -> str | None:
    beside = Path(sys.executable).with_name("fabric")
    return str(beside) if beside.exists() else shutil.which("fabric")


@contextmanager
def slurm_cluster(workdir: Path):
    """A one-node SLURM cluster for the benchmark; yields its ``slurm.conf`` or the reason it has none."""
    root = workdir / "slurm"
    start = subprocess.run(["bash", str(CLUSTER), "start", str(root)], capture_output=True, text=True, timeout=180,
                           env=_env())
    if start.returncode != 0:
        reason = (start.stderr.strip().splitlines() or [f"exit {start.returncode}"])[-1]
        try:
            yield None, f"cluster.sh start failed: {reason} (tests/slurm/cluster.sh install sets SLURM up)"
        finally:
            subprocess.run(["bash", str(CLUSTER), "stop", str(root)], capture_output=True, timeout=180)
        return
    try:
        yield root / "slurm.conf", None
    finally:
        subprocess.run(["bash", str(CLUSTER), "stop", str(root)], capture_output=True, timeout=180)


def command(launcher: str, args: argparse.Namespace, out: Path, slurm_conf: Path | None) -> tuple[list[str], dict]:
    """The command line and environment of one run under ``launcher``."""
    n = str(args.devices)
    demo = [str(DEMO), "fit", "--config", str(ROOT / "examples" / "configs" / "demo.yaml"), "--schedule", "null",
            "--trainer.devices", n, "--trainer.max_steps", str(args.warmup + args.steps),
            "--trainer.strategy.init_args.layout", args.layout, "--out", str(out)]
    if launcher == "python":
        return [sys.executable, *demo], _env()
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", n, *demo], _env()
    if launcher == "fabric":
        return [_fabric() or "fabric", "run", "--accelerator", "cpu", "--devices", n,
                "--main-port", str(_free_port()), *demo], _env()
    assert launcher == "srun" and slurm_conf is not None
    return (["srun", "-n", n, "--ntasks-per-node", n, "--oversubscribe", sys.executable, *demo],
            _env(SLURM_CONF=str(slurm_conf), MASTER_PORT=str(_free_port())))


def step_times(metrics: Path, warmup: int) -> list[float]:
    """Seconds per step after ``warmup`` steps, from rank 0's ``metrics.csv``."""
    with open(metrics, newline="") as f:
        ends = [float(r["seconds"]) for r in csv.DictReader(f)]
    return [b - a for a, b in zip(ends, ends[1:])][max(0, warmup - 1):]


def _busy_fraction(seconds: float = 2.0) -> float:
    """Share of the machine's CPU time spent busy over the next ``seconds`` (Linux ``/proc/stat``)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            values = [int(x) for x in f.readline().split()[1:]]
        idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
        return sum(values), idle

    total0, idle0 = sample()
    time.sleep(seconds)
    total1, idle1 = sample()
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def wait_until_idle(limit_s: float, threshold: float = 0.15) -> float:
    """Wait (at most ``limit_s``) until under ``threshold`` of the CPUs are busy; the last busy share seen."""
    if limit_s <= 0 or not Path("/proc/stat").exists():
        return float("nan")
    deadline = time.monotonic() + limit_s
    busy = _busy_fraction()
    while busy > threshold and time.monotonic() < deadline:
        busy = _busy_fraction()
    return busy


def run_once(launcher: str, args: argparse.Namespace, out: Path, slurm_conf: Path | None) -> dict:
    cmd, env = command(launcher, args, out, slurm_conf)
    busy = wait_until_idle(args.wait_idle)
    load = os.getloadavg()[0]  # before our processes start: what else keeps the machine busy
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - start
    text = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"{launcher} run failed ({proc.returncode}): {' '.join(cmd)}\n{text[-4000:]}")
    times = step_times(out / "metrics.csv", args.warmup)
    threads = re.search(r"\((\d+) threads each", text)
    return {"median_step_s": statistics.median(times), "wall_s": wall, "load_before": load, "busy_before": busy,
            "threads": int(threads.group(1)) if threads else None}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    skipped: dict[str, str] = {}
    runs: dict[str, list[dict]] = {name: [] for name in args.launchers}
    if "fabric" in runs and _fabric() is None:
        skipped["fabric"] = "no `fabric` executable (lightning installs one)"
    with tempfile.TemporaryDirectory(prefix="dynatrain-launchers-") as tmp:
        work = Path(tmp)
        with (slurm_cluster(work) if "srun" in runs else _no_cluster()) as (slurm_conf, why):
            if "srun" in runs and why:
                skipped["srun"] = why
            active = [name for name in args.launchers if name not in skipped]
            for r in range(args.runs):
                order = active[r % len(active):] + active[:r % len(active)] if active else []
                for name in order:
                    result = run_once(name, args, work / f"{name}-{r}", slurm_conf)
                    runs[name].append(result)
                    print(f"[launchers] round {r + 1}/{args.runs} {name}: median step {result['median_step_s']:.4f} s, "
                          f"{result['threads']} threads, {result['wall_s']:.1f} s wall, "
                          f"load {result['load_before']:.1f}, CPUs {100 * result['busy_before']:.0f}% busy before",
                          file=sys.stderr, flush=True)
    report = summarize(args, runs, skipped)
    print_table(report)
    if args.json:
        print(json.dumps(report))
    return report


@contextmanager
def _no_cluster():
    yield None, None


def summarize(args: argparse.Namespace, runs: dict[str, list[dict]], skipped: dict[str, str]) -> dict:
    launchers = {}
    for name, results in runs.items():
        if not results:
            continue
        medians = [x["median_step_s"] for x in results]
        launchers[name] = {"median_step_s": statistics.median(medians), "run_medians_s": medians,
                           "threads": sorted({x["threads"] for x in results if x["threads"] is not None}),
                           "wall_s": [round(x["wall_s"], 1) for x in results],
                           "load_before": [round(x["load_before"], 2) for x in results],
                           "busy_before": [round(x["busy_before"], 3) for x in results]}
    base = runs.get("python") or []
    for name, v in launchers.items():
        pairs = [x["median_step_s"] / b["median_step_s"] for x, b in zip(runs[name], base)]
        v["paired_vs_python"] = statistics.median(pairs) if pairs else None
    figures = [v["median_step_s"] for v in launchers.values()]
    ratio = max(figures) / min(figures) if figures else None
    return {"devices": args.devices, "layout": args.layout, "steps": args.steps, "warmup": args.warmup,
            "runs": args.runs, "launchers": launchers, "skipped": skipped, "max_over_min": ratio, "goal": GOAL,
            "within_goal": ratio is not None and ratio <= GOAL}


def print_table(report: dict) -> None:
    print(f"demo step time by launcher: {report['devices']} processes, {report['layout']}, median of "
          f"{report['steps']} steps after {report['warmup']}, {report['runs']} runs each")
    base = report["launchers"].get("python", {}).get("median_step_s")
    print(f"{'launcher':<10} {'median step':>12} {'vs python':>10} {'paired':>7} {'threads':>8}  per run (s)")
    for name, v in report["launchers"].items():
        rel = f"{v['median_step_s'] / base:.2f}x" if base else "-"
        paired = f"{v['paired_vs_python']:.2f}x" if v.get("paired_vs_python") else "-"
        runs = " ".join(f"{x:.4f}" for x in v["run_medians_s"])
        print(f"{name:<10} {v['median_step_s']:>10.4f} s {rel:>10} {paired:>7} {','.join(map(str, v['threads'])):>8}  "
              f"{runs}")
    for name, why in report["skipped"].items():
        print(f"{name:<10} skipped: {why}")
    if report["max_over_min"] is not None:
        verdict = "within" if report["within_goal"] else "NOT within"
        print(f"slowest / fastest launcher: {report['max_over_min']:.3f} ({verdict} the goal of {report['goal']:.2f})")


if __name__ == "__main__":
    main()
