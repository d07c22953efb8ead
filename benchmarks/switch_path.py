"""Which of the package's files a reader follows along two paths: one layout switch, from the
strategy's ``reconfigure`` to the first ``batch_isend_irecv``, and an unannounced death, from the
collective a survivor saw fail to the step done.

    python benchmarks/switch_path.py            # the GPT preset and a ModelProvider, dp1-tp2 -> dp2
    python benchmarks/switch_path.py --death    # also a member SIGKILLed in a step of an elastic fit
    python benchmarks/switch_path.py --json

**The switch.** A 2-process gloo job builds the model at ``dp1-tp2-pp1`` through a ``TrainingRun``
(megatron DDP, Adam, one step), then switches to ``dp2-tp1-pp1`` through ``TrainingRun.switch`` (what
``reconfigure`` calls) on demand (each rank receives the other's tensor-parallel half) while rank 0
records, in order of first entry, every ``lightning_dynatrain`` file a call enters, until
``torch.distributed.batch_isend_irecv`` is first called, and the chain of calls that reached it:
``stack_files``, the files a reader follows from ``reconfigure`` to the transfer; ``one_hop_files``,
those and every file their code calls into directly on the way (what a reader opens to follow each
call of the chain once); ``files``, every file entered on the way, the target model's build included;
``collective_files``, the files on the chain of calls to every ``torch.distributed`` call before that
transfer too (the memory check's all-reduce, the preflight, group creation): what a reader follows
to see each message the switch sends. ``strategy/dynatrain.py`` (where
``DynaTrainStrategy.reconfigure`` is) and ``strategy/switch_requests.py`` (``SwitchRequests``, which
checks the target and calls ``TrainingRun.switch``) are counted as the first two files.

**The death** (``--death``; ``call_chains.DeathTrace``). An elastic fit of the tests' tiny GPT on
four processes (``dp2-tp2-pp1``, as a launch of four processes none of which ends another, a job
store); rank 3 SIGKILLs itself in the forward/backward of step 6 (``DYNATRAIN_STEP_FAULT``) and the
survivors go on at ``dp3-tp1-pp1``, each receiving the tensor-parallel halves it lacks. On a survivor: ``death_stack_files``, the files
on the chain from the frame that caught the failed collective down to where it failed, to the
recovery guard, to the recovery switch's first transfer and into the step computed again at the
survivors' layout; ``death_collective_files``, also the chains to every ``torch.distributed`` and
store call of the recovery (abandoning the old world, the store's record of the survivors, the new
world, the survivors' gather, the switch's checks); each with how often a reader following the files
in order changes folder. Imports are not calls and are not counted.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_dynatrain"
if str(ROOT) not in sys.path:  # ``benchmarks.baselines`` when run as a script
    sys.path.insert(0, str(ROOT))


#: the torch.distributed calls a switch makes before its transfers (``batch_isend_irecv`` is the transfer;
#: ``isend``/``irecv`` are only named in its ``P2POp``s)
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
                "broadcast_object_list", "barrier", "monitored_barrier", "new_group", "send", "recv", "all_to_all",
                "reduce_scatter_tensor", "gather_object", "scatter_object_list")


def _path_job(rank: int, world_size: int, model: str) -> dict:
    import torch
    import torch.distributed as dist

    from lightning_dynatrain.megatron.gpt import GPTShape, gpt_provider
    from lightning_dynatrain.runtime.recipe import AdamSettings, MegatronRecipe
    from lightning_dynatrain.runtime.settings import DynaTrainSettings
    from lightning_dynatrain.runtime.training_run import TrainingRun

    shape = GPTShape(hidden=32, layers=2, heads=4, ffn_hidden=64, vocab_size=256, seq_length=16)
    recipe = MegatronRecipe(model=gpt_provider(shape) if model == "provider" else shape, seed=1, global_batch_size=4,
                            micro_batch_size=1, params_dtype=torch.float32)
    run = TrainingRun(DynaTrainSettings(layout="dp1-tp2-pp1", staging_budget=2**20, promote_broadcasts=False))
    run.start(run.settings.layout, world_size=world_size, node_rank=0)
    recipe.model.spec()  # a provider's description is read at set-up, not in the switch
    run.build_model(recipe, rank=rank)
    run.set_optimizer(AdamSettings(lr=1e-3))
    run.install(run.build_state())
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    run.train_step({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}, lr=1e-3, weight_decay=0.0)
    callers = ["lightning_dynatrain/strategy/dynatrain.py", "lightning_dynatrain/strategy/switch_requests.py"]
    files: list[str] = list(callers)
    stack: list[str] = []
    done = False
    original = dist.batch_isend_irecv

    def first_transfer(*args, **kwargs):
        nonlocal done
        if not done:  # the chain of calls that reached it, outermost first
            for frame in reversed(inspect.stack()[1:]):
                path = Path(frame.filename)
                name = str(path.relative_to(ROOT)) if path.is_relative_to(PACKAGE) else None
                if name is not None and name not in stack:
                    stack.append(name)
            stack[:0] = [c for c in callers if c not in stack]
        done = True
        return original(*args, **kwargs)

    calls: set[tuple[str, str]] = set()  # (caller's file, callee's file)

    def profile(frame, event, arg):
        if event == "call" and not done:
            path = Path(frame.f_code.co_filename)
            if path.is_relative_to(PACKAGE) and frame.f_code.co_name != "<module>":
                name = str(path.relative_to(ROOT))
                if name not in files:
                    files.append(name)
                caller = Path(frame.f_back.f_code.co_filename) if frame.f_back is not None else None
                if caller is not None and caller.is_relative_to(PACKAGE):
                    calls.add((str(caller.relative_to(ROOT)), name))

    dist.batch_isend_irecv = first_transfer
    on_collective_chains: list[str] = []

    def chain_files() -> list[str]:  # the package files on the calling chain, outermost first
        chain = []
        for frame in reversed(inspect.stack()[2:]):
            path = Path(frame.filename)
            if path.is_relative_to(PACKAGE):
                chain.append(str(path.relative_to(ROOT)))
        return chain

    def recorded(fn):
        def call(*args, **kwargs):
            if not done:
                on_collective_chains.extend(f for f in chain_files() if f not in on_collective_chains)
            return fn(*args, **kwargs)
        return call

    collectives = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}
    for name, fn in collectives.items():
        setattr(dist, name, recorded(fn))
    try:
        if rank == 0:
            sys.setprofile(profile)
        run.switch(run.check("dp2-tp1-pp1"), step=1)
    finally:
        sys.setprofile(None)
        dist.batch_isend_irecv = original
        for name, fn in collectives.items():
            setattr(dist, name, fn)
        run.close()
    # what a reader opens following the chain: its files and every file they call into directly
    hop = stack + [f for f in files if f not in stack and any((c, f) in calls for c in stack)]
    collective = list(dict.fromkeys(callers + on_collective_chains + stack))
    return {"entered": files, "stack": stack, "one_hop": hop, "collective": collective}


def _death_path(workdir: str | None) -> dict:
    """The death's chains on a survivor (see the module docstring)."""
    import tempfile

    from benchmarks.elastic_job import ElasticJob

    step = 6
    out = Path(tempfile.mkdtemp(prefix="dynatrain-death-path-", dir=workdir))
    fault = {3: {"DYNATRAIN_STEP_FAULT": f"3:{step}:forward_backward"}}
    with ElasticJob(out, max_steps=step + 2, step_seconds=0.0, dead_after=10.0, suspect_after=2.0,
                    fit_args=("--trace-death", str(step))) as job:
        procs = job.start_launch(4, rank_env=fault)
        codes = [job.wait(p, timeout=600) for p in procs]
        results = job.results()
    traces = [r["death_path"] for r in results.values() if r.get("death_path")]
    if codes[:3] != [0, 0, 0] or not traces or not all(t["reached_guard"] for t in traces):
        raise RuntimeError(f"the traced fit did not recover as expected (exit codes {codes}); see {out / 'job.log'}")
    return traces[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--death", action="store_true", help="also trace a survivor's recovery from a killed member")
    p.add_argument("--workdir", default=None, help="the traced fit's files go to a fresh directory under it")
    p.add_argument("--json", action="store_true", help="one JSON object on the last line")
    args = p.parse_args(argv)
    from benchmarks.baselines.launch import spawn_job

    out = {}
    for model in ("preset", "provider"):
        found = spawn_job(_path_job, 2, model, timeout_s=300)[0]
        out[model] = found
        print(f"{model}: {len(found['stack'])} files on the call chain to the first transfer, "
              f"{len(found['one_hop'])} with the files it calls into directly, {len(found['entered'])} entered "
              f"on the way; {len(found['collective'])} on the chains to every collective before it: "
              + ", ".join(Path(f).relative_to("lightning_dynatrain").as_posix() for f in found["collective"]))
        for name in found["one_hop"]:
            print(f"  {name}")
    death = _death_path(args.workdir) if args.death else None
    if death is not None:
        print(f"death: {len(death['stack'])} files from the failed collective to the step done "
              f"({death['stack_folder_changes']} folder changes), {len(death['collective'])} with the chains to every "
              f"collective and store call of the recovery ({death['collective_folder_changes']} folder changes, "
              f"{death['events']} calls)")
        for name in death["collective"]:
            print(f"  {'*' if name in death['stack'] else ' '} {name}")
    if args.json:
        summary = {"stack_files": {k: len(v["stack"]) for k, v in out.items()},
                   "one_hop_files": {k: len(v["one_hop"]) for k, v in out.items()},
                   "collective_files": {k: len(v["collective"]) for k, v in out.items()},
                   "files": {k: len(v["entered"]) for k, v in out.items()}, "paths": out}
        if death is not None:
            summary.update(death_stack_files=len(death["stack"]), death_collective_files=len(death["collective"]),
                           death_stack_folder_changes=death["stack_folder_changes"],
                           death_collective_folder_changes=death["collective_folder_changes"], death_paths=death)
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
