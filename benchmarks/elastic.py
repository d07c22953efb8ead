"""World changes in a running fit against the cold path, on this machine: a grow (2 -> 4) and a
shrink (4 -> 2) in the same elastic run.

The elastic run (``elastic_job.ElasticJob``: ``dynatrain store``, ``torchrun`` for the first two
processes and again for the two that join) trains the model of ``elastic_fit.py``; each change's
figures come from ``OnNodeChange``'s report on the processes that stay. It runs twice: with the
target built ahead (the default, ``OnNodeChange(ahead=True)``) and on demand (``ahead=False``):

- ``pause_seconds``: what training saw between two steps (the whole change at the boundary),
  built ahead; ``pause_on_demand_seconds`` the same built on demand;
- ``transfer_seconds``: the part of the pause that moved state (the engine), built ahead;
- ``rebuild_seconds``: what the on-demand run's pause spent outside its transfer (its pause minus
  its transfer): the target's groups, the joiners' model, DDP and optimizer (the old members wait
  for them), the old members' own rebuild, and what both runs do at the boundary (the joiners'
  Adam step and Lightning state, the memory check); ``rebuild_in_switch_seconds``: the old
  members' own rebuild alone (``hot_switch``'s phases); ``bind_seconds``: what the run built
  ahead did in its switch instead (groups from the cache, memory bound); ``ahead_build_seconds``:
  its background build;
- ``build_seconds``: the next world's process group, built in the background meanwhile;
  ``kept_world``: the new world was kept from before (the shrink gives the first world back: no
  group built, in either run).

The cold path, per case, at the new world size: ``cold_init_seconds`` is fresh processes started
by torchrun until they are ready to train (interpreters, imports, the world, megatron's state and
the model); ``cold_total_seconds`` the same resuming a checkpoint the run wrote at the source (its
loading included). Then ``init_masked = 1 - (pause - transfer) / cold_init`` and
``pause_over_cold = pause / cold_total``; per case and as geometric means under ``geomean``.

Run::

    python benchmarks/elastic.py            # the 270M GPT of benchmarks/switch_vs_checkpoint.py
    python benchmarks/elastic.py --quick    # the tests' tiny GPT
    python benchmarks/elastic.py --json     # ... and one JSON object on the last line
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.stop_in_store import STOP_KEY  # noqa: E402
from benchmarks.elastic_job import REPO, SCRIPT, ElasticJob  # noqa: E402

GOALS = {"init_masked": (">=", 0.93), "pause_over_cold": ("<=", 0.25), "outside_transfer_over_rebuild": ("<=", 0.10)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the tiny GPT of the tests instead of the 270M one")
    p.add_argument("--steps-between", type=int, default=3, help="steps at each world before the next change")
    p.add_argument("--workdir", default=None, help="checkpoints and logs go to a fresh directory under it")
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    return p.parse_args(argv)


def _elastic_run(model: str, out: Path, steps_between: int, *, ahead: bool) -> tuple[dict, dict]:
    """The grow and the shrink in one run; each change's report (from rank 0 of the new world)."""
    fit_args = ("--model", model, "--stop-in-store") + (() if ahead else ("--on-demand",))
    with ElasticJob(out / f"elastic_{'ahead' if ahead else 'on_demand'}", max_steps=100_000, step_seconds=0.0,
                    dead_after=30.0, fit_args=fit_args) as job:
        job.start_torchrun(2)
        job.wait_for(lambda: job.step() >= steps_between, what="the first world to train", timeout=1800)
        job.start_torchrun(2)
        job.wait_for(lambda: job.installed_size() == 4, what="the grow to 4", timeout=1800)
        grown_at = job.step()
        job.wait_for(lambda: job.step() >= grown_at + steps_between, what="steps at world 4", timeout=1800)
        for rank in (3, 2):  # the two that joined get the preemption notice together
            job.signal_member(rank, signal.SIGTERM)
        job.wait_for(lambda: job.installed_size() == 2, what="the shrink to 2", timeout=1800)
        shrunk_at = job.step()
        job.wait_for(lambda: job.step() >= shrunk_at + 1, what="a step at world 2", timeout=1800)
        job.client.store.set(STOP_KEY, str(job.step() + 2))
        codes = [job.wait(p, timeout=1800) for p in job.procs]
        results = job.results()
    if any(codes):
        raise RuntimeError(f"the elastic run failed (exit codes {codes}); see {job.log_path}")
    changes = max((r["changes"] for r in results.values() if not r["left"]), key=len)
    grow = next(c for c in changes if c["change"].startswith("world 2 -> 4"))
    shrink = [c for c in changes if " -> " in c["change"] and int(c["change"].split(" -> ")[1].split()[0]) < 4]
    if len(shrink) != 1:
        raise RuntimeError(f"the shrink ran as {len(shrink)} changes ({[c['change'] for c in shrink]}); rerun")
    return grow, shrink[0]


def _save_source(model: str, out: Path, ckpt: Path) -> Path:
    """A checkpoint of the source world's training state (2 processes, a few steps) for the cold path."""
    _torchrun(2, out / "save", model, "--max-steps", "2", "--save", str(ckpt))
    return ckpt


def _torchrun(nproc: int, out: Path, model: str, *extra: str) -> float:
    """A static fit on ``nproc`` fresh processes; seconds from launch until every one was ready."""
    launched = time.time()
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop("DYNATRAIN_STORE", None)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                    str(SCRIPT), str(out), "--model", model, "--static", *extra], check=True, env=env, cwd=REPO,
                   stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    ready = [json.loads(p.read_text())["ready_at"] for p in out.glob("*.json")]
    return max(ready) - launched


def _case(change: dict, on_demand: dict, world: int, model: str, ckpt: Path, out: Path) -> dict:
    """One change's figures: ``change`` built ahead, ``on_demand`` the same change built in its pause."""
    if (change["src"], change["dst"]) != (on_demand["src"], on_demand["dst"]):
        raise RuntimeError(f"the two runs changed between other layouts: {change['src']} -> {change['dst']} and "
                           f"{on_demand['src']} -> {on_demand['dst']}")
    cold_init = _torchrun(world, out / f"cold_init_{world}", model, "--max-steps", "1")
    cold_total = _torchrun(world, out / f"cold_total_{world}", model, "--max-steps", "3", "--resume", str(ckpt))
    pause, transfer = change["pause_seconds"], change["transfer_seconds"]
    rebuild = on_demand["pause_seconds"] - on_demand["transfer_seconds"]
    return dict(change=change["change"], src=change["src"], dst=change["dst"], pause_seconds=pause,
                transfer_seconds=transfer, rebuild_seconds=rebuild,
                rebuild_in_switch_seconds=on_demand["rebuild_seconds"], bind_seconds=change["rebuild_seconds"],
                ahead_build_seconds=change["ahead_build_seconds"], pause_on_demand_seconds=on_demand["pause_seconds"],
                transfer_on_demand_seconds=on_demand["transfer_seconds"], build_seconds=change["build_seconds"],
                moved_bytes=change["moved_bytes"], kept_world=change["kept_world"], cold_init_seconds=cold_init,
                cold_total_seconds=cold_total,
                init_masked=1 - (pause - transfer) / cold_init, pause_over_cold=pause / cold_total,
                outside_transfer_over_rebuild=(pause - transfer) / rebuild if rebuild else None)


def _geomean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None and v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    model = "tiny" if args.quick else "270m"
    out = Path(tempfile.mkdtemp(prefix="dynatrain-elastic-", dir=args.workdir))
    try:
        grow, shrink = _elastic_run(model, out, args.steps_between, ahead=True)
        grow_on_demand, shrink_on_demand = _elastic_run(model, out, args.steps_between, ahead=False)
        ckpt = _save_source(model, out, out / "source.ckpt")
        cases = {"grow_2_to_4": _case(grow, grow_on_demand, 4, model, ckpt, out),
                 "shrink_4_to_2": _case(shrink, shrink_on_demand, 2, model, ckpt, out)}
    except BaseException:
        print(f"kept {out} for its logs (job.log in each run's directory)", file=sys.stderr)
        raise
    shutil.rmtree(out, ignore_errors=True)
    keys = ("pause_seconds", "transfer_seconds", "pause_on_demand_seconds", "rebuild_seconds",
            "rebuild_in_switch_seconds", "bind_seconds",
            "ahead_build_seconds", "cold_init_seconds", "cold_total_seconds", "init_masked", "pause_over_cold",
            "outside_transfer_over_rebuild")
    geomean = {k: _geomean([c[k] for c in cases.values()]) for k in keys}
    goals = {k: {"goal": g, "better": "higher" if op == ">=" else "lower", "value": geomean[k],
                 "met": geomean[k] is not None and (geomean[k] >= g if op == ">=" else geomean[k] <= g)}
             for k, (op, g) in GOALS.items()}
    print(f"model {model}, 2 cores, gloo; {time.perf_counter() - started:.0f} s")
    columns = {**cases, "geomean": geomean}
    print(f"{'':<30}" + "".join(f"{name:>15}" for name in columns))
    for k in keys:
        print(f"{k.replace('_seconds', ' s'):<30}" + "".join(
            f"{'-' if c[k] is None else format(c[k], '.3f'):>15}" for c in columns.values()))
    print("goals: " + ", ".join(f"{k} {GOALS[k][0]} {g['goal']}: {'met' if g['met'] else 'MISSED'}"
                                for k, g in goals.items()))
    if args.json:
        print(json.dumps(dict(model=model, cases=cases, geomean=geomean, goals=goals,
                              wall_seconds=time.perf_counter() - started)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
