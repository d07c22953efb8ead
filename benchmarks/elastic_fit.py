"""An elastic ``trainer.fit`` as a user runs it: ``python elastic_fit.py OUT`` under torchrun, srun or alone.

With ``DYNATRAIN_STORE`` / ``DYNATRAIN_TOKEN`` set it is elastic (``OnNodeChange`` with the model's
layout map); ``--static`` runs the same model, data and global batch without it. Every process
writes ``OUT/<pid>.json``: its losses by step, its last global step, its world and layout at the
end, the changes it saw, a hash of its shard of the parameters (replicas compare equal), and when
it was ready to train (``ready_at``, wall-clock, at ``on_train_start``).

Models: ``tiny`` (worlds 1-4: ``dp2-tp1-pp1``, ``dp3-tp1-pp1``, ``dp2-tp2-pp1``; global batch 12),
``own`` (``examples/own_model.py``'s model of the user's at the tiny size, with megatron's
scheduler; worlds 2-4: ``dp1-tp1-pp2``, ``dp3-tp1-pp1``, ``dp1-tp2-pp2-vpp3``: three model chunks of
one layer per stage) and ``270m`` (the switch benchmark's GPT; worlds 2 and 4: ``dp1-tp2-pp1``,
``dp2-tp2-pp1``). Every process records the learning rate each step used (``lrs``).

Options for tests and benchmarks: ``--step-seconds`` stretches each step (the compute of a bigger
model) so that processes started later find the fit still running; ``--fingerprint-salt`` changes
the model's fingerprint without changing the model; ``--stop-in-store`` ends the fit at the step
the job's store names under ``bench/stop_at`` (every rank reads it: they stop at the same step);
``--rollout-every N`` enters a rollout phase (a few tokens sampled at ``dp<world>-tp1-pp1``) inside
every N-th step, ``--kill-in-rollout RANK:STEP[,RANK:STEP...]`` kills that rank inside step STEP's
phase, ``--rollout-frees-weights-from STEP`` frees the training shards of the weights in the phases
from step STEP on (``keep_weights=False``; ``tiny``);
``--switch-while-building`` asks for a layout switch while a world change is
built ahead (``tiny``; it must be refused); ``--resume`` resumes a checkpoint; ``--save`` writes one at the end; ``--log-dir`` adds a
``CSVLogger`` there (every step logged: its metrics file must continue whoever is rank 0);
``--on-demand`` builds each change's target in its pause (``OnNodeChange(ahead=False)``);
``--switch-safety keep_old`` holds the old state through each switch (a failed grow goes back);
``--switch-timeout`` sets every switch's deadline; ``--schedule STEP:LAYOUT`` adds a
``ScheduledReconfig`` of that one switch; ``--zero1`` shards the optimizer's state
(ZeRO-1) at every layout of the policy with data parallelism; ``--start LAYOUT`` starts the first
world at ``LAYOUT``; ``--snapshot-every N`` keeps in-memory snapshots (``OnNodeChange(snapshot_every=N)``),
``--snapshot-buffers 2`` in two buffers; ``--slow-layers RANKS:STEP:SECONDS`` slows those ranks' layers
in step STEP (a bigger model's compute); ``--trace-death STEP`` records, on a survivor, the call chains
of step ``STEP`` (the one ``DYNATRAIN_STEP_FAULT`` kills a member in), from its failed collective to
the step done (``call_chains.DeathTrace``; the result's ``death_path``). For the tests' bit-for-bit
checks, this rank's pieces of the whole training state as megatron-core describes them
(``tests/megatron_description.py``): ``--describe-at STEP[,STEP...]`` after each such step
(``OUT/<pid>.described.<STEP>.pkl``), ``--describe-recovered`` right after a recovery (or any state
installed during training) made its state, before the next step is computed on it
(``OUT/<pid>.recovered.pkl``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
import time
from pathlib import Path

STARTED_AT = time.time()

MODELS = {
    "tiny": dict(shape=dict(hidden=32, layers=6, heads=4, ffn_hidden=64, vocab_size=256, seq_length=32,
                            make_vocab_size_divisible_by=128),
                 global_batch=12, seq_length=32,
                 policy={1: "dp1-tp1-pp1", 2: "dp2-tp1-pp1", 3: "dp3-tp1-pp1", 4: "dp2-tp2-pp1"}),
    # examples/own_model.py's model of the user's (a ModelProvider, megatron's OptimizerParamScheduler)
    "own": dict(own=dict(layers=6, hidden=32, heads=4, ffn=64, seq=32), global_batch=12, seq_length=32,
                policy={1: "dp1-tp1-pp1", 2: "dp1-tp1-pp2", 3: "dp3-tp1-pp1", 4: "dp1-tp2-pp2-vpp3"}),
    "270m": dict(shape=dict(hidden=1024, layers=16, heads=16, ffn_hidden=4096, vocab_size=32000, seq_length=1024,
                            make_vocab_size_divisible_by=128),
                 global_batch=4, seq_length=128,
                 policy={1: "dp1-tp1-pp1", 2: "dp1-tp2-pp1", 4: "dp2-tp2-pp1"}),
}
SEED = 1234


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--static", action="store_true")
    parser.add_argument("--step-seconds", type=float, default=0.0)
    parser.add_argument("--fingerprint-salt", default="")
    parser.add_argument("--stop-in-store", action="store_true")
    parser.add_argument("--resume", default=None)
    parser.add_argument("--save", default=None)
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--on-demand", action="store_true", help="build each change's target in its pause")
    parser.add_argument("--switch-safety", default="fast", choices=["fast", "keep_old"])
    parser.add_argument("--switch-timeout", type=float, default=None, help="every switch's deadline (seconds)")
    parser.add_argument("--zero1", action="store_true", help="ZeRO-1 at every layout with dp > 1")
    parser.add_argument("--start", default=None, help="the first world's layout (instead of the policy's)")
    parser.add_argument("--snapshot-every", type=int, default=None, help="OnNodeChange(snapshot_every=N)")
    parser.add_argument("--snapshot-buffers", type=int, default=1, help="OnNodeChange(snapshot_buffers=1|2)")
    parser.add_argument("--schedule", default=None, help="STEP:LAYOUT: one scheduled layout switch")
    parser.add_argument("--leave", default=None, help="RANK:STEP: that rank asks to leave after that step")
    parser.add_argument("--slow-layers", default=None, metavar="RANKS:STEP:SECONDS",
                        help="those ranks (comma-separated) sleep SECONDS before each transformer layer in step STEP")
    parser.add_argument("--describe-at", default=None, metavar="STEP[,STEP...]",
                        help="after these steps, write megatron's description of this rank's state (tests)")
    parser.add_argument("--describe-recovered", action="store_true",
                        help="write megatron's description of the state a recovery made, before it trains (tests)")
    parser.add_argument("--trace-death", type=int, default=None, metavar="STEP",
                        help="trace the recovery in step STEP (the one DYNATRAIN_STEP_FAULT kills a member in)")
    parser.add_argument("--rollout-every", type=int, default=None, metavar="N",
                        help="a rollout phase at dp<world>-tp1-pp1 inside every N-th training step, before its update")
    parser.add_argument("--kill-in-rollout", default="", metavar="RANK:STEP[,RANK:STEP...]",
                        help="that rank kills itself (SIGKILL) inside step STEP's rollout phase")
    parser.add_argument("--rollout-frees-weights-from", type=int, default=None, metavar="STEP",
                        help="the rollout phases from step STEP on free the training shards (keep_weights=False)")
    parser.add_argument("--switch-while-building", action="store_true",
                        help="ask for a layout switch at the first boundary where a world change is built ahead")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR2, all_threads=True)  # `kill -USR2 PID`: every thread's stack in the log
    model = dict(MODELS[args.model])
    if args.zero1:
        model["policy"] = {n: f"{layout}-zero1" if not layout.startswith("dp1-") else layout
                           for n, layout in model["policy"].items()}
    if args.start:  # (the policy's own entry for that world applies to later changes to it)
        model["start"] = args.start

    if __package__ in (None, ""):  # run as a script: make the repository importable
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.stop_in_store import StopInStore

    import torch
    from lightning.pytorch import Callback, Trainer
    from lightning.pytorch.loggers import CSVLogger

    from lightning_dynatrain import DynaTrainStrategy, GPTLightningModule, OnNodeChange, ScheduledReconfig
    from lightning_dynatrain.data import StdlibTextDataModule
    from lightning_dynatrain.megatron.gpt import GPTShape

    torch.set_num_threads(1)

    class Pace(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            time.sleep(args.step_seconds)

    class SlowLayers(Callback):
        """``--slow-layers RANKS:STEP:SECONDS``: those ranks sleep SECONDS at the start of each transformer
        layer's forward in step STEP (the compute of a bigger model, in the step a member dies in)."""

        def __init__(self, spec: str) -> None:
            ranks, step, seconds = spec.split(":")
            self.ranks, self.step, self.seconds = {int(r) for r in ranks.split(",")}, int(step), float(seconds)
            self.handles: list = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            from megatron.core.transformer.transformer_layer import TransformerLayer

            if trainer.global_step + 1 == self.step and trainer.global_rank in self.ranks:
                for chunk in trainer.strategy.run.state.chunks:
                    self.handles += [m.register_forward_pre_hook(lambda *_: time.sleep(self.seconds))
                                     for m in chunk.modules() if isinstance(m, TransformerLayer)]

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            for handle in self.handles:
                handle.remove()
            self.handles = []

    class LeaveAt(Callback):
        """One rank asks to leave after a step, as a preemption notice would (the store sets the boundary)."""

        def __init__(self, spec: str) -> None:
            self.rank, self.step = map(int, spec.split(":"))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_rank == self.rank and trainer.global_step == self.step:
                trainer.strategy.elastic.leave(self.step)

    class SwitchWhileBuilding(Callback):
        """Ask for a layout switch (once, to a valid layout other than the tiny model's policy's)
        while a world change is built ahead: it must be refused before anything moves, and training go on."""

        OTHER = {2: "dp1-tp2-pp1", 3: "dp1-tp1-pp3", 4: "dp4-tp1-pp1"}

        answer: list[str] | None = None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            from lightning_dynatrain.transition.errors import was_refused

            if self.answer is None and trainer.strategy.elastic.preparing is not None:
                try:
                    trainer.strategy.reconfigure(self.OTHER[trainer.world_size])
                    self.answer = ["switched", ""]
                except Exception as err:  # noqa: BLE001 - recorded for the test, which expects a refusal
                    self.answer = [type(err).__name__, str(err), was_refused(err)]

    class Record(Callback):
        """What this process ends with (read before teardown releases megatron's state), and the
        learning rate each of its steps used."""

        ready_at: float | None = None

        def __init__(self) -> None:
            self.lrs: list[tuple[int, float]] = []
            self.ended: list[tuple[int, float]] = []  # (global step, wall time its batch ended)
            self.samples: list[tuple[int, str]] = []  # (global step, a digest of the global batch it trained on)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.lrs.append((trainer.global_step, float(trainer.callback_metrics["train/lr"])))
            self.ended.append((trainer.global_step, time.time()))
            self.samples.append((trainer.global_step, hashlib.sha256(batch["tokens"].numpy().tobytes()).hexdigest()[:16]))

        def on_train_start(self, trainer, pl_module):
            self.ready_at = time.time()

        def on_train_end(self, trainer, pl_module):
            strategy = trainer.strategy
            self.left = strategy.elastic is not None and strategy.elastic.left
            if args.save and not self.left:
                trainer.save_checkpoint(args.save)
            shard = hashlib.sha256()
            for name, p in sorted(strategy.megatron.model.named_parameters()):
                shard.update(name.encode())
                shard.update(p.detach().float().contiguous().numpy().tobytes())
            coord = strategy.layout.dense_coord(strategy.global_rank)
            self.result = {"world": None if self.left else strategy.world_size,
                           "rank": None if self.left else strategy.global_rank, "layout": str(strategy.layout),
                           "tp_pp": None if self.left else [coord.tp, coord.pp], "shard": shard.hexdigest()}

    if "own" in model:
        from examples.own_model import OwnGPT, own_provider

        module = OwnGPT(own_provider(**model["own"]), max_steps=args.max_steps, global_batch_size=model["global_batch"],
                        micro_batch_size=1, seed=SEED)
    else:
        class WithRollouts(GPTLightningModule):
            """Every ``--rollout-every``-th step samples a few tokens at ``dp<world>-tp1-pp1`` first."""

            def training_step(self, batch, batch_idx):
                strategy, step = self.trainer.strategy, self.trainer.global_step + 1
                if args.rollout_every and step % args.rollout_every == 0:
                    frees = args.rollout_frees_weights_from is not None and step >= args.rollout_frees_weights_from
                    with strategy.rollout(f"dp{strategy.world_size}-tp1-pp1", keep_weights=not frees) as policy:
                        if f"{strategy.global_rank}:{step}" in args.kill_in_rollout.split(","):
                            os.kill(os.getpid(), signal.SIGKILL)
                        policy.generate(batch["tokens"][:4, :8], max_new_tokens=2, seed=step)
                    self.rollouts.append(step)
                return super().training_step(batch, batch_idx)

        module = WithRollouts(GPTShape(**model["shape"]), lr=3e-3, weight_decay=0.01,
                              global_batch_size=model["global_batch"], micro_batch_size=1, warmup_steps=2,
                              max_steps=args.max_steps, seed=SEED, eps=1e-6)
        module.rollouts = []  # the steps whose rollout phase ended
    if args.fingerprint_salt:
        module.hparams["salt"] = args.fingerprint_salt
    # this launch's processes: torchrun's variables, else srun's (one node), else one process
    world = int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or 1)
    devices = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE") or 1)
    class TraceDeath(Callback):
        """The call chains of the step a member is killed in (``DYNATRAIN_STEP_FAULT``'s), on a survivor."""

        result: dict | None = None

        def __init__(self, step: int) -> None:
            from call_chains import DeathTrace

            self.trace, self.step = DeathTrace(), step

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step + 1 == self.step:
                self.trace.start()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == self.step and self.result is None:
                self.trace.stop()
                self.result = self.trace.result()

    from benchmarks.state_description import describe_recovered, write_description

    class Describe(Callback):
        """After each step of ``--describe-at``."""

        steps = {int(s) for s in (args.describe_at or "").split(",") if s}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            elastic = trainer.strategy.elastic
            if trainer.global_step in self.steps and not (elastic is not None and elastic.left):
                write_description(args.out, trainer.strategy.megatron, f"described.{trainer.global_step}")

    class DescribeRecovered(Callback):
        """``--describe-recovered``: the first state installed during training (a recovery's, the only
        one in the tests that ask) is described right before the run trains on it again."""

        training = False

        def setup(self, trainer, pl_module, stage):
            describe_recovered(trainer.strategy.run, args.out, lambda: self.training)

        def on_train_start(self, trainer, pl_module):
            self.training = True

    record = Record()
    callbacks: list = [record]
    if args.trace_death is not None:
        callbacks.insert(0, TraceDeath(args.trace_death))
    if args.describe_at is not None:
        callbacks.append(Describe())
    if args.describe_recovered:
        callbacks.append(DescribeRecovered())
    if args.step_seconds:
        callbacks.append(Pace())
    if args.stop_in_store:
        callbacks.append(StopInStore())
    if not args.static:
        callbacks.append(OnNodeChange(model["policy"], heartbeat=0.5, exit_after=20.0, ahead=not args.on_demand,
                                      snapshot_every=args.snapshot_every, snapshot_buffers=args.snapshot_buffers))
    if args.schedule:
        at, layout = args.schedule.split(":")
        callbacks.append(ScheduledReconfig({int(at): layout}))
    if args.leave:
        callbacks.append(LeaveAt(args.leave))
    if args.slow_layers:
        callbacks.append(SlowLayers(args.slow_layers))
    if args.switch_while_building:
        callbacks.append(SwitchWhileBuilding())  # after OnNodeChange: sees the change it started building
    logger = CSVLogger(args.log_dir, name="metrics") if args.log_dir else False
    trainer = Trainer(accelerator="cpu", devices=devices,
                      strategy=DynaTrainStrategy(model.get("start") or model["policy"][world], switch_safety=args.switch_safety,
                                                 switch_timeout=args.switch_timeout),
                      max_steps=args.max_steps,
                      callbacks=callbacks, logger=logger, log_every_n_steps=1, enable_checkpointing=False,
                      enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    data = StdlibTextDataModule(seq_length=model["seq_length"], global_batch_size=model["global_batch"], shuffle=True,
                                seed=0, max_bytes=300_000)
    trainer.fit(module, datamodule=data, ckpt_path=args.resume)
    node_change = next((c for c in callbacks if isinstance(c, OnNodeChange)), None)
    result = {"pid": os.getpid(), "losses": module.losses, "lrs": record.lrs, "ended": record.ended, "samples": record.samples,
              "global_step": trainer.global_step,
              "left": record.left,
              **record.result, "changes": node_change.changes if node_change else [],
              "rolled_back": node_change.rolled_back if node_change else [],
              "recoveries": node_change.recoveries if node_change else [], "started_at": STARTED_AT,
              "ready_at": record.ready_at, "rollouts": getattr(module, "rollouts", []),
              "switch_while_building": next((c.answer for c in callbacks if isinstance(c, SwitchWhileBuilding)), None),
              "death_path": next((c.result for c in callbacks if isinstance(c, TraceDeath)), None),
              # the library's background threads still running once the fit returned (each must end before
              # the interpreter does: lightning_dynatrain/thread_end.py)
              "threads_after_fit": sorted(t.name for t in threading.enumerate() if t.name.startswith("dynatrain-"))}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{os.getpid()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
