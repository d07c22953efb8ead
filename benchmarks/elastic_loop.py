"""An elastic loop under Lightning Fabric as a user writes one: ``python elastic_loop.py OUT`` under torchrun, srun or alone.

With ``DYNATRAIN_STORE`` / ``DYNATRAIN_TOKEN`` set it is elastic (``DynaTrainFabricStrategy(elastic=ElasticOptions(...))``
with the tiny GPT's layout map of ``elastic_fit.py``: worlds 1-4, a constant global batch of 12);
``--static`` runs the same model and data without it. The loop is Fabric's: ``model(batch)``,
``fabric.backward``, ``optimizer.step()``, and it ends where ``engine.should_stop`` says (this
process left) or at the step the job's store names under ``bench/stop_at`` (``--stop-in-store``),
the same on every rank. Every process writes ``OUT/<pid>.json``: its loss and a digest of the
global batch by step, its last step, its world, rank and layout at the end, whether it left, the
recoveries and world changes its driver saw, a hash of its shard of the parameters.

For the tests' bit-for-bit checks (``state_description.py``): ``--describe-at STEP[,STEP...]``
writes megatron's description of this rank's state after each such step, ``--describe-recovered``
the state a recovery made, before the next step is computed on it. ``--step-seconds`` stretches each
step; ``--snapshot-every N`` keeps in-memory snapshots; ``--rollout-every N`` samples a few tokens in a
rollout phase at ``dp<world>-tp1-pp1`` before every N-th step (``engine.rollout``; a member lost in
the phase: ``RolloutInterrupted``, and the survivors sample again); with ``--stop-in-store`` the
process at rank R kills itself inside step S's phase once the store holds ``R:S`` under ``KILL_KEY``.
``DYNATRAIN_STEP_FAULT`` kills a rank in a step.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

#: the store key a test writes ``RANK:STEP`` under: that rank kills itself inside that step's rollout phase
KILL_KEY = "bench/kill_in_rollout"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--static", action="store_true")
    parser.add_argument("--step-seconds", type=float, default=0.0)
    parser.add_argument("--stop-in-store", action="store_true")
    parser.add_argument("--snapshot-every", type=int, default=None)
    parser.add_argument("--describe-at", default="", metavar="STEP[,STEP...]")
    parser.add_argument("--describe-recovered", action="store_true")
    parser.add_argument("--rollout-every", type=int, default=None, metavar="N",
                        help="a rollout phase at dp<world>-tp1-pp1 before every N-th step")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if __package__ in (None, ""):  # run as a script: make the repository importable
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

    import torch
    from lightning.fabric import Fabric

    from benchmarks.elastic_fit import MODELS, SEED
    from benchmarks.state_description import describe_recovered, write_description
    from benchmarks.stop_in_store import STOP_KEY
    from lightning_dynatrain.data import StdlibBytes
    from lightning_dynatrain.fabric import DynaTrainEngine, DynaTrainFabricStrategy, ElasticOptions
    from lightning_dynatrain.megatron.gpt import GPTShape
    from lightning_dynatrain.runtime.recipe import AdamSettings, MegatronRecipe
    from lightning_dynatrain.runtime.rollout import RolloutInterrupted

    torch.set_num_threads(1)
    model = MODELS["tiny"]
    world = int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or 1)
    devices = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE") or 1)
    elastic = None if args.static else ElasticOptions(model["policy"], heartbeat=0.5, exit_after=20.0,
                                                      snapshot_every=args.snapshot_every)
    fabric = Fabric(accelerator="cpu", devices=devices,
                    strategy=DynaTrainFabricStrategy(layout=model["policy"][world], elastic=elastic))
    fabric.launch()
    recipe = MegatronRecipe(model=GPTShape(**model["shape"]), seed=SEED, global_batch_size=model["global_batch"],
                            micro_batch_size=1)
    engine = DynaTrainEngine(fabric, recipe=recipe, adam=AdamSettings(lr=3e-3, weight_decay=0.01, eps=1e-6))
    training = [False]
    if args.describe_recovered:
        describe_recovered(engine.run, args.out, lambda: training[0], once=True)
    model_view, optimizer = fabric.setup(engine.model, engine.optimizer)
    loader = fabric.setup_dataloaders(engine.dataloader(StdlibBytes(model["seq_length"], max_bytes=300_000),
                                                        shuffle=True, seed=0))
    store = None
    if args.stop_in_store:
        from lightning_dynatrain.elastic.client import JobStore

        store = JobStore.from_environment().store
    describe_at = {int(s) for s in args.describe_at.split(",") if s}
    losses, samples, rollouts, interrupted = [], [], [], []
    training[0] = True
    done = False
    while not done:
        for batch in loader:
            digest = hashlib.sha256(batch["tokens"].numpy().tobytes()).hexdigest()[:16]
            if args.rollout_every and (engine.step + 1) % args.rollout_every == 0:  # sample, then train
                while True:  # a member lost in the phase: the survivors sample again at their world's layout
                    try:
                        with engine.rollout(f"dp{engine.world_size}-tp1-pp1") as policy:
                            if store is not None and store.check([KILL_KEY]) and \
                                    store.get(KILL_KEY).decode() == f"{engine.rank}:{engine.step + 1}":
                                os.kill(os.getpid(), signal.SIGKILL)
                            policy.generate(batch["tokens"][:4, :8], max_new_tokens=2, seed=engine.step)
                        break
                    except RolloutInterrupted as err:
                        interrupted.append((engine.step + 1, str(err)))
                rollouts.append(engine.step + 1)
            loss = model_view(batch)  # the whole megatron step, then the elastic boundary
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append((engine.step, loss.item()))
            samples.append((engine.step, digest))
            time.sleep(args.step_seconds)
            if engine.should_stop:  # this process left the job
                done = True
                break
            if engine.step in describe_at:
                write_description(args.out, engine.run.state, f"described.{engine.step}")
            stop = int(store.get(STOP_KEY)) if store is not None and store.check([STOP_KEY]) else args.max_steps
            if engine.step >= min(stop, args.max_steps):
                done = True
                break
    left = engine.should_stop
    shard = hashlib.sha256()
    for name, p in sorted(engine.run.state.model.named_parameters()):
        shard.update(name.encode())
        shard.update(p.detach().float().contiguous().numpy().tobytes())
    driver = engine.elastic
    result = {"pid": os.getpid(), "losses": losses, "samples": samples, "rollouts": rollouts,
              "interrupted": interrupted,
              "global_step": engine.step, "left": left,
              "world": None if left else engine.world_size, "rank": None if left else engine.rank,
              "fabric": None if left else [fabric.world_size, fabric.global_rank],
              "layout": str(engine.layout), "shard": shard.hexdigest(),
              "changes": [asdict(c) for c in driver.history] if driver is not None else [],
              "recoveries": [asdict(r) for r in driver.recoveries] if driver is not None else []}
    engine.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{os.getpid()}.json").write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
