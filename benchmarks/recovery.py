"""A node lost without notice, in a running fit: the survivors' recovery against a restart, on this machine.

The elastic run (``elastic_job.ElasticJob``: ``dynatrain store`` and two launches of two processes,
each process its own child as ``srun`` starts them) trains the model of ``elastic_fit.py`` at
world 4 (``dp2-tp2-pp1``). After a few steps both processes of the second launch are killed
(SIGKILL: a node lost); the store names them within ``--suspect-after`` seconds of the survivors'
failed collectives and the two survivors rebuild the state from the replicas they hold at
``dp1-tp2-pp1`` and train on (``strategy/recovery.py``). Figures:

- ``pause_seconds``: from the kill to the survivors' state installed at the new layout (the latest
  ``RecoveryReport.finished_at`` of the survivors, wall clock), ready for the next step;
- ``detect_seconds``: from the kill to the failure noticed (a collective of the step in flight
  failed) on the survivor that finished last; then ``agree_seconds`` (the store names the dead),
  ``world_seconds``, ``rebuild_seconds``, ``transfer_seconds``, as that survivor logs them;
- ``steps_redone``: completed steps whose result was lost (0 with replicas);
- ``restart_seconds``: fresh processes started by torchrun at the new world size until they are
  ready to train, resuming a checkpoint of the source (``benchmarks/elastic.py``'s cold path; the
  restart's own detection and scheduling not counted, so the ratio favours the restart);
- ``pause_over_restart = pause / restart``.

``snapshot_every`` and ``snapshot_step_overhead`` are ``null``: in-memory snapshots (for ZeRO-1
shards and tp/pp shards at dp1, which have no replica) are not built yet, so this measures the
layout the survivors can recover without them.

Run::

    python benchmarks/recovery.py            # the 270M GPT of benchmarks/switch_vs_checkpoint.py
    python benchmarks/recovery.py --quick    # the tests' tiny GPT
    python benchmarks/recovery.py --json     # ... and one JSON object on the last line
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.elastic import _save_source, _torchrun  # noqa: E402
from benchmarks.elastic_fit import STOP_KEY  # noqa: E402
from benchmarks.elastic_job import ElasticJob  # noqa: E402

GOALS = {"pause_over_restart": ("<=", 0.15), "steps_redone": ("<=", 0)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the tiny GPT of the tests instead of the 270M one")
    p.add_argument("--steps-before", type=int, default=3, help="steps at world 4 before the kill")
    p.add_argument("--suspect-after", type=float, default=4.0, help="the store's bound once a collective failed")
    p.add_argument("--workdir", default=None, help="checkpoints and logs go to a fresh directory under it")
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    return p.parse_args(argv)


def _recovery_run(model: str, out: Path, steps_before: int, suspect_after: float) -> tuple[dict, float]:
    """World 4 from two launches of two; the second launch killed; the survivors' report and the kill's time."""
    with ElasticJob(out / "recovery", max_steps=100_000, step_seconds=0.0, dead_after=30.0,
                    suspect_after=suspect_after, fit_args=("--model", model, "--stop-in-store")) as job:
        job.start_launch(2)
        job.wait_for(lambda: job.step() >= 1, what="the first world to train", timeout=1800)
        second = job.start_launch(2)
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
    return max(reports, key=lambda r: r["finished_at"]), killed_at


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    model = "tiny" if args.quick else "270m"
    out = Path(tempfile.mkdtemp(prefix="dynatrain-recovery-", dir=args.workdir))
    try:
        report, killed_at = _recovery_run(model, out, args.steps_before, args.suspect_after)
        ckpt = _save_source(model, out, out / "source.ckpt")
        restart = _torchrun(2, out / "restart", model, "--max-steps", "3", "--resume", str(ckpt))
    except BaseException:
        print(f"kept {out} for its logs (job.log in each run's directory)", file=sys.stderr)
        raise
    shutil.rmtree(out, ignore_errors=True)
    pause = report["finished_at"] - killed_at
    figures = {"change": f"world {report['old_world']} -> {report['new_world']}", "src": report["src"],
               "dst": report["dst"], "pause_seconds": pause,
               "detect_seconds": pause - report["pause_seconds"], "agree_seconds": report["agree_seconds"],
               "world_seconds": report["world_seconds"], "rebuild_seconds": report["rebuild_seconds"],
               "transfer_seconds": report["transfer_seconds"], "steps_redone": report["steps_redone"],
               "restart_seconds": restart, "pause_over_restart": pause / restart,
               "suspect_after": args.suspect_after, "snapshot_every": None, "snapshot_step_overhead": None}
    goals = {k: {"goal": g, "value": figures[k], "met": figures[k] <= g} for k, (_, g) in GOALS.items()}
    print(f"model {model}, 2 cores, gloo; {time.perf_counter() - started:.0f} s")
    print(f"{figures['change']} ({figures['src']} -> {figures['dst']}), a node of 2 processes killed")
    for k, v in figures.items():
        if isinstance(v, float):
            print(f"  {k.replace('_seconds', ' s'):<22}{v:>10.3f}")
    print("goals: " + ", ".join(f"{k} <= {g['goal']}: {'met' if g['met'] else 'MISSED'}" for k, g in goals.items()))
    if args.json:
        print(json.dumps(dict(model=model, **figures, goals=goals, wall_seconds=time.perf_counter() - started)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
