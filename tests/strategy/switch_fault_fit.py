"""One rank of a 4-process ``trainer.fit`` whose scheduled switch loses a rank: ``python switch_fault_fit.py OUT``.

Started by ``test_switch_fault_fit.py`` as one process per rank with Lightning's variables
(``LOCAL_RANK``, ``NODE_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``: no launcher runs),
and ``DYNATRAIN_SWITCH_FAULT`` naming the rank that dies or stalls. A ``ModelCheckpoint`` saves
every step and a ``CSVLogger`` logs every step (rank 0 writes ``OUT/logs/metrics/version_0/metrics.csv``);
the switch after step 2 meets the fault. Each rank writes ``OUT/rank{r}.json``: what
``trainer.fit`` raised (then raises it again: the process ends with it, as a user's script would),
or, when the fit finished, its losses and switches.

``--keep-old``: ``switch_safety="keep_old"``, so a failed switch rolls back and the fit goes on at
the old layout; ``--no-switch``: the same fit without the schedule (the run that never tried).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--switch-timeout", type=float, default=20.0)
    parser.add_argument("--keep-old", action="store_true", help='switch_safety="keep_old"')
    parser.add_argument("--no-switch", action="store_true", help="no schedule: the run that never tried")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    from lightning.pytorch import Trainer, seed_everything
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_dynatrain.callbacks import ScheduledReconfig
    from lightning_dynatrain.transition.errors import SwitchFailedError
    from lightning_dynatrain.strategy import DynaTrainStrategy
    from tiny_fit import tiny_module_and_data

    seed_everything(0)
    module, data = tiny_module_and_data()
    strategy = DynaTrainStrategy("dp4-tp1-pp1-zero1", switch_timeout=args.switch_timeout,
                                 switch_safety="keep_old" if args.keep_old else "fast")
    checkpoints = ModelCheckpoint(dirpath=Path(args.out, "ckpt"), every_n_train_steps=1, save_top_k=-1)
    schedule = [] if args.no_switch else [ScheduledReconfig({2: "dp1-tp2-pp2"}, on_refused="continue")]
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(Path(args.out, "logs"), name="metrics", version=0)
    trainer = Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=args.steps, logger=logger,
                      log_every_n_steps=1,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[*schedule, checkpoints])
    rank = int(os.environ["LOCAL_RANK"])
    try:
        trainer.fit(module, datamodule=data)
    except SwitchFailedError as err:
        Path(args.out, f"rank{rank}.json").write_text(json.dumps(dict(
            rank=rank, t_error=time.time(), missing=err.rank, phase=err.phase, lost_state=err.lost_state,
            resume_from=err.resume_from, message=str(err), dist_after=__import__("torch").distributed.is_initialized())))
        raise
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(dict(
        rank=rank, finished=True, losses=module.losses, layout=str(strategy.layout),
        switches=[str(h.dst) for h in strategy.switch_history])))


if __name__ == "__main__":
    main()
