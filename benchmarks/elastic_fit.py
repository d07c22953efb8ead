"""An elastic ``trainer.fit`` as a user runs it: ``python elastic_fit.py OUT`` under torchrun or alone.

With ``DYNATRAIN_STORE`` / ``DYNATRAIN_TOKEN`` set it is elastic (``OnNodeChange`` with a layout map
for worlds 2, 3 and 4); ``--static`` runs the same model, data and global batch without it. Every
process writes ``OUT/<pid>.json``: its losses by step, its last global step, its world and layout
at the end, the changes it saw, and a hash of its shard of the parameters (replicas compare equal).

``--step-seconds`` stretches each step (the compute of a bigger model) so that processes started
later find the fit still running. ``--fingerprint-salt`` changes the model's fingerprint (a process
of another model) without changing the model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

SHAPE = dict(hidden=32, layers=6, heads=4, ffn_hidden=64, vocab_size=256, seq_length=32,
             make_vocab_size_divisible_by=128)
GLOBAL_BATCH, SEED = 12, 1234
POLICY = {1: "dp1-tp1-pp1", 2: "dp2-tp1-pp1", 3: "dp3-tp1-pp1", 4: "dp2-tp2-pp1"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--static", action="store_true")
    parser.add_argument("--step-seconds", type=float, default=0.0)
    parser.add_argument("--fingerprint-salt", default="")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import torch
    from lightning.pytorch import Callback, Trainer

    from lightning_dynatrain import DynaTrainStrategy, GPTLightningModule, OnNodeChange
    from lightning_dynatrain.data import StdlibTextDataModule
    from lightning_dynatrain.megatron.gpt import GPTShape

    torch.set_num_threads(1)

    class Pace(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            time.sleep(args.step_seconds)

    class Record(Callback):
        """What this process ends with (read before teardown releases megatron's state)."""

        def on_train_end(self, trainer, pl_module):
            strategy = trainer.strategy
            self.left = strategy.elastic is not None and strategy.elastic.left
            shard = hashlib.sha256()
            for name, p in sorted(strategy.megatron.model.named_parameters()):
                shard.update(name.encode())
                shard.update(p.detach().float().contiguous().numpy().tobytes())
            coord = strategy.layout.dense_coord(strategy.global_rank)
            self.result = {"world": None if self.left else strategy.world_size,
                           "rank": None if self.left else strategy.global_rank, "layout": str(strategy.layout),
                           "tp_pp": None if self.left else [coord.tp, coord.pp], "shard": shard.hexdigest()}

    module = GPTLightningModule(GPTShape(**SHAPE), lr=3e-3, weight_decay=0.01, global_batch_size=GLOBAL_BATCH,
                                micro_batch_size=1, warmup_steps=2, max_steps=args.max_steps, seed=SEED, eps=1e-6)
    if args.fingerprint_salt:
        module.hparams["salt"] = args.fingerprint_salt
    world = int(os.environ.get("WORLD_SIZE", "1"))
    record = Record()
    callbacks = [record, Pace()] if args.step_seconds else [record]
    if not args.static:
        callbacks.append(OnNodeChange(POLICY, heartbeat=0.5, exit_after=20.0))
    trainer = Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                      strategy=DynaTrainStrategy(POLICY[world]), max_steps=args.max_steps, callbacks=callbacks,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    data = StdlibTextDataModule(seq_length=SHAPE["seq_length"], global_batch_size=GLOBAL_BATCH, shuffle=True, seed=0,
                                max_bytes=300_000)
    trainer.fit(module, datamodule=data)
    node_change = next((c for c in callbacks if isinstance(c, OnNodeChange)), None)
    result = {"pid": os.getpid(), "losses": module.losses, "global_step": trainer.global_step, "left": record.left,
              **record.result, "changes": node_change.changes if node_change else []}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{os.getpid()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
