"""A node lost without notice, in a running fit: the survivors' recovery against a restart, on this machine.

The elastic run (``elastic_job.ElasticJob``: ``dynatrain store`` and two launches of two processes
with node ranks 0 and 1, each process its own child as ``srun`` starts them: two failure domains)
trains the model of ``elastic_fit.py`` at world 4, ``dp2-tp2-pp1-zero1`` with in-memory snapshots
every ``--snapshot-every`` steps (``OnNodeChange(snapshot_every=N)``; ``--snapshot-buffers 2`` keeps
two). After a few steps both
processes of the second launch are killed (SIGKILL: a node lost, with its ZeRO-1 optimizer shards);
the store names them within ``--suspect-after`` seconds of the survivors' failed collectives, and
the two survivors go back to the snapshot (their own copies, the lost shards from the copies they
keep for the other node), switch to ``dp1-tp2-pp1``, compute the steps since the snapshot again
and train on (``elastic/driver/recovery.py``, ``elastic/driver/snapshots.py``). ``--replicas`` measures
``dp2-tp2-pp1`` without ZeRO-1 and without snapshots instead (the replicas hold everything).

The store knows a killed process at once (its liveness connection closes: ``elastic/liveness.py``)
and tells the survivors, whose step in flight fails at its next collective with the dead. Figures
(wall clock, the second launch's kill at 0):

- ``detect_seconds``: until the first survivor knows (it read the store's record, or a collective
  of its step failed: ``RecoveryReport.noticed_at``);
- ``agree_seconds``, ``world_seconds``, ``rebuild_seconds``, ``transfer_seconds``: the parts the
  survivor that finished last logs (from its own noticing on);
- ``replay_seconds``: computing again the ``steps_redone`` steps whose result was lost (from a
  snapshot; 0 with replicas);
- ``pause_seconds``: until every survivor holds the new layout's state with the lost steps computed
  again (the latest ``RecoveryReport.finished_at``); ``pause_without_replay_seconds``: the same
  without the replay;
- ``next_step_seconds``: until every survivor finished its next step (training moves again), and
  ``step_seconds``, a step at world 4 before the kill;
- ``restart_seconds``, on the same terms: fresh processes started by torchrun at the survivors'
  world size, from a checkpoint taken at a step as far back as the snapshot the survivors went
  back to, until they computed those ``steps_redone`` steps again (ready to train, with replicas:
  nothing to redo). The restart's own detection and scheduling are not counted (a launcher must
  notice the death too): the ratios favour the restart;
- ``pause_over_restart`` and ``pause_without_replay_over_restart``;
- ``snapshot_step_overhead``: the mean step time of fits of four processes (one launch, the same
  layout) with snapshots every ``snapshot_every`` steps over that without, the geometric mean of
  ``--overhead-runs`` pairs (run alternately; the first two steps of each left out).

Goals (``goals`` in the JSON): the tiny GPT, ``next_step_seconds`` at most 1 s plus a step; the 270M
GPT with replicas, ``pause_without_replay_over_restart`` at most 0.15; with ZeRO-1 and snapshots,
``pause_over_restart`` below 0.5 and ``snapshot_step_overhead`` at most 1.03.

Run::

    python benchmarks/recovery.py                       # the 270M GPT of benchmarks/switch_vs_checkpoint.py
    python benchmarks/recovery.py --replicas            # ... dp2-tp2-pp1, no ZeRO-1, no snapshots
    python benchmarks/recovery.py --quick [--replicas]  # the tests' tiny GPT
    python benchmarks/recovery.py --json                # ... and one JSON object on the last line
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.elastic import _save_source, _torchrun  # noqa: E402
from benchmarks.stop_in_store import STOP_KEY  # noqa: E402
from benchmarks.elastic_job import ElasticJob  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the tiny GPT of the tests instead of the 270M one")
    p.add_argument("--steps-before", type=int, default=3, help="steps at world 4 before the kill")
    p.add_argument("--suspect-after", type=float, default=4.0, help="the store's bound once a collective failed")
    p.add_argument("--snapshot-every", type=int, default=10, help="OnNodeChange(snapshot_every=N)")
    p.add_argument("--snapshot-buffers", type=int, default=1, choices=(1, 2), help="OnNodeChange(snapshot_buffers=)")
    p.add_argument("--replicas", action="store_true", help="dp2-tp2-pp1 without ZeRO-1 and without snapshots")
    p.add_argument("--overhead-runs", type=int, default=3, help="pairs of fits with and without snapshots")
    p.add_argument("--workdir", default=None, help="checkpoints and logs go to a fresh directory under it")
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    return p.parse_args(argv)


def _recovery_run(model: str, out: Path, steps_before: int, suspect_after: float,
                  fit_args: tuple[str, ...]) -> tuple[list[dict], dict, float]:
    """World 4 from two launches of two; the second launch killed; each survivor's recovery report,
    the survivors' results and the kill's time."""
    with ElasticJob(out / "recovery", max_steps=100_000, step_seconds=0.0, dead_after=30.0,
                    suspect_after=suspect_after, fit_args=("--model", model, "--stop-in-store", *fit_args)) as job:
        job.start_launch(2)
        job.wait_for(lambda: job.step() >= 1, what="the first world to train", timeout=1800)
        second = job.start_launch(2, node_rank=1)
        job.wait_for(lambda: job.installed_size() == 4, what="the grow to 4", timeout=1800)
        grown_at = job.step()
        job.wait_for(lambda: job.step() >= grown_at + steps_before, what="steps at world 4", timeout=1800)
        killed_at = time.time()
        for proc in second:
            proc.send_signal(signal.SIGKILL)
        job.wait_for(lambda: job.installed_size() == 2, what="the survivors' world", timeout=600)
        recovered_at = job.step()
        job.wait_for(lambda: job.step() >= recovered_at + 2, what="steps at world 2", timeout=1800)
        job.client.store.set(STOP_KEY, str(job.step() + 1))
        codes = [job.wait(p, timeout=1800) for p in job.procs if p not in second]
        results = job.results()
    if any(codes):
        raise RuntimeError(f"the survivors failed (exit codes {codes}); see {job.log_path}")
    reports = [r["recoveries"][-1] for r in results.values() if r.get("recoveries")]
    if len(reports) != 2:
        raise RuntimeError(f"{len(reports)} survivors reported a recovery; see {job.log_path}")
    return reports, results, killed_at


def _restart_seconds(model: str, out: Path, redo: int) -> float:
    """Fresh processes (torchrun, 2) from a checkpoint of step 2 until they computed ``redo`` steps
    again (``redo`` 0: until ready to train)."""
    ckpt = _save_source(model, out, out / "source.ckpt")
    launched = time.time()
    _torchrun(2, out / "restart", model, "--max-steps", str(2 + max(redo, 1)), "--resume", str(ckpt))
    results = [json.loads(p.read_text()) for p in (out / "restart").glob("*.json")]
    if redo == 0:
        return max(r["ready_at"] for r in results) - launched
    return max(dict(map(tuple, r["ended"]))[2 + redo] for r in results) - launched


def _step_seconds(model: str, out: Path, steps: int, fit_args: tuple[str, ...]) -> float:
    """The mean step time of a fit of four processes of one launch (the first two steps left out)."""
    with ElasticJob(out, max_steps=steps, step_seconds=0.0, dead_after=60.0,
                    fit_args=("--model", model, *fit_args)) as job:
        procs = job.start_launch(4)
        codes = [job.wait(p, timeout=3600) for p in procs]
        results = job.results()
    if any(codes):
        raise RuntimeError(f"a fit failed (exit codes {codes}); see {job.log_path}")
    ended = [t for step, t in sorted(next(iter(results.values()))["ended"]) if step >= 2]
    return (ended[-1] - ended[0]) / (len(ended) - 1)


def _snapshot_overhead(model: str, out: Path, every: int, runs: int, fit_args: tuple[str, ...]) -> float:
    """Step time with snapshots every ``every`` steps over without: the geometric mean of ``runs`` pairs."""
    steps = 2 * every + 1
    ratios = []
    for run in range(runs):
        without = _step_seconds(model, out / f"plain{run}", steps, fit_args)
        with_snapshots = _step_seconds(model, out / f"snap{run}", steps, (*fit_args, "--snapshot-every", str(every)))
        ratios.append(with_snapshots / without)
        print(f"  pair {run + 1}: {with_snapshots:.3f} s / {without:.3f} s a step", flush=True)
    return math.prod(ratios) ** (1 / len(ratios))


def _figures(reports: list[dict], results: dict, killed_at: float, restart: float) -> dict:
    last = max(reports, key=lambda r: r["finished_at"])
    pause = last["finished_at"] - killed_at
    replay = last["replay_seconds"]
    after = [min(t for _, t in r["ended"] if t > last["finished_at"] - 1e-6) for r in results.values()
             if any(t > last["finished_at"] - 1e-6 for _, t in r["ended"])]
    before = sorted(t for _, t in next(iter(results.values()))["ended"] if t < killed_at)[-4:]
    return {"change": f"world {last['old_world']} -> {last['new_world']}", "src": last["src"], "dst": last["dst"],
            "detect_seconds": min(r["noticed_at"] for r in reports) - killed_at,
            "agree_seconds": last["agree_seconds"], "world_seconds": last["world_seconds"],
            "rebuild_seconds": last["rebuild_seconds"], "transfer_seconds": last["transfer_seconds"],
            "replay_seconds": replay, "steps_redone": last["steps_redone"], "snapshot_step": last.get("snapshot_step"),
            "pause_seconds": pause, "pause_without_replay_seconds": pause - replay,
            "next_step_seconds": max(after) - killed_at if len(after) == len(results) else None,
            "step_seconds": (before[-1] - before[0]) / (len(before) - 1) if len(before) > 1 else None,
            "restart_seconds": restart, "pause_over_restart": pause / restart,
            "pause_without_replay_over_restart": (pause - replay) / restart}


def _goals(model: str, replicas: bool, figures: dict, limit: int) -> dict:
    """The issue's goals for this case (see the module docstring); steps redone: none with replicas,
    at most N from a snapshot (N + 1 with two buffers: the previous one)."""
    goals = {"steps_redone": (limit, figures["steps_redone"])}
    if model == "tiny" and figures["next_step_seconds"] is not None and figures["step_seconds"] is not None:
        goals["next_step_seconds_over_a_step"] = (1.0, figures["next_step_seconds"] - figures["step_seconds"])
    if model == "270m" and replicas:
        goals["pause_without_replay_over_restart"] = (0.15, figures["pause_without_replay_over_restart"])
    if model == "270m" and not replicas:
        goals["pause_over_restart"] = (0.5, figures["pause_over_restart"])
        goals["snapshot_step_overhead"] = (1.03, figures["snapshot_step_overhead"])
    return {k: {"goal": g, "value": v, "met": v <= g} for k, (g, v) in goals.items() if v is not None}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    model = "tiny" if args.quick else "270m"
    out = Path(tempfile.mkdtemp(prefix="dynatrain-recovery-", dir=args.workdir))
    layout_args = () if args.replicas else ("--zero1",)
    buffers = ("--snapshot-buffers", str(args.snapshot_buffers))
    snapshots = () if args.replicas else ("--snapshot-every", str(args.snapshot_every), *buffers)
    try:
        reports, results, killed_at = _recovery_run(model, out, args.steps_before, args.suspect_after,
                                                    (*layout_args, *snapshots))
        overhead = None if args.replicas else _snapshot_overhead(model, out / "overhead", args.snapshot_every,
                                                                 args.overhead_runs, (*layout_args, *buffers))
        redone = max(r["steps_redone"] for r in reports)
        restart = _restart_seconds(model, out, redone)
    except BaseException:
        print(f"kept {out} for its logs (job.log in each run's directory)", file=sys.stderr)
        raise
    shutil.rmtree(out, ignore_errors=True)
    figures = {**_figures(reports, results, killed_at, restart), "suspect_after": args.suspect_after,
               "snapshot_every": None if args.replicas else args.snapshot_every,
               "snapshot_buffers": None if args.replicas else args.snapshot_buffers, "snapshot_step_overhead": overhead}
    limit = 0 if args.replicas else args.snapshot_every + (args.snapshot_buffers == 2)
    goals = _goals(model, args.replicas, figures, limit)
    print(f"model {model}, 2 cores, gloo; {time.perf_counter() - started:.0f} s")
    print(f"{figures['change']} ({figures['src']} -> {figures['dst']}), a node of 2 processes killed"
          + (f"; snapshots every {args.snapshot_every} steps, back to step {figures['snapshot_step']}"
             if not args.replicas else ""))
    for k, v in figures.items():
        if isinstance(v, float):
            print(f"  {k.replace('_seconds', ' s'):<36}{v:>10.3f}")
    print("goals: " + ", ".join(f"{k} <= {g['goal']}: {'met' if g['met'] else 'MISSED'}" for k, g in goals.items()))
    if args.json:
        print(json.dumps(dict(model=model, **figures, goals=goals, wall_seconds=time.perf_counter() - started)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
