"""A 3-step run of DynaTrainStrategy, started by the launcher tests as a user would start it.

``python launch_script.py OUT --devices 2`` (Lightning's subprocess launcher), under ``torchrun`` or
``fabric run``, or one process per rank with SLURM's variables; ``--schedule 2:dp1-tp2-pp1`` adds a
switch. Each rank writes ``OUT/rank{global_rank}.json`` with what Lightning and the strategy saw
(environment class, ranks, layout, data-parallel share, intra-op threads, losses, switches).

The script leaves torch's thread count alone: whatever the launcher set, the strategy must fit it
to the cores (``runtime/threads.py``), and the tests check that it did.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--layout", default="dp2-tp1-pp1")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--registry-name", action="store_true", help="Trainer(strategy='dynatrain')")
    parser.add_argument("--schedule", default=None, help="ScheduledReconfig's schedule, e.g. 2:dp1-tp2-pp1")
    args = parser.parse_args()

    from lightning.pytorch import Trainer, seed_everything

    import lightning_dynatrain  # noqa: F401  (registers "dynatrain")
    from lightning_dynatrain.callbacks import ScheduledReconfig
    from lightning_dynatrain.strategy import DynaTrainStrategy
    from tiny_fit import tiny_module_and_data

    seed_everything(0)
    module, data = tiny_module_and_data()
    strategy = "dynatrain" if args.registry_name else DynaTrainStrategy(args.layout)
    trainer = Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[ScheduledReconfig(args.schedule)])
    seen = {}

    def probe() -> None:
        s = trainer.strategy
        seen.update(layout=str(s.layout), sampler=s.distributed_sampler_kwargs, dp=s.megatron.dp_size,
                    env=type(s.cluster_environment).__name__, global_rank=trainer.global_rank,
                    world_size=trainer.world_size, local_rank=trainer.local_rank, node_rank=trainer.node_rank,
                    strategy=type(s).__name__, launcher=type(s.launcher).__name__ if s.launcher else None,
                    dist_rank=torch.distributed.get_rank(), dist_world=torch.distributed.get_world_size(),
                    threads=torch.get_num_threads())

    module.on_train_start = probe  # read while the process group is up
    trainer.fit(module, datamodule=data)
    seen.update(losses=[loss for _, loss in module.losses], global_step=trainer.global_step,
                final_layout=str(trainer.strategy.run.layout_or_none),
                switches=[(r.step, r.src, r.dst) for r in trainer.strategy.switch_history],
                dist_after=torch.distributed.is_initialized(), pid=os.getpid(), argv=sys.argv,
                slurm_procid=os.environ.get("SLURM_PROCID"))
    Path(args.out, f"rank{trainer.global_rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main()
