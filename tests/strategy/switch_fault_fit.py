"""One rank of a 4-process ``trainer.fit`` whose scheduled switch loses a rank: ``python switch_fault_fit.py OUT``.

Started by ``test_switch_fault_fit.py`` as one process per rank with Lightning's variables
(``LOCAL_RANK``, ``NODE_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``: no launcher runs),
and ``DYNATRAIN_SWITCH_FAULT`` naming the rank that dies. A ``ModelCheckpoint`` saves every step;
the switch after step 2 loses the rank. Each survivor writes ``OUT/rank{r}.json`` with what
``trainer.fit`` raised, then raises it again (the process ends with it, as a user's script would).
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
    args = parser.parse_args()

    from lightning.pytorch import Trainer, seed_everything
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_dynatrain.callbacks import ScheduledReconfig
    from lightning_dynatrain.data import StdlibTextDataModule
    from lightning_dynatrain.engine.errors import SwitchFailedError
    from lightning_dynatrain.megatron.gpt import GPTShape
    from lightning_dynatrain.strategy import DynaTrainStrategy, GPTLightningModule

    seed_everything(0)
    shape = GPTShape(hidden=32, layers=2, heads=4, ffn_hidden=64, vocab_size=256, seq_length=32,
                     make_vocab_size_divisible_by=128)
    module = GPTLightningModule(shape, lr=3e-3, global_batch_size=8, micro_batch_size=2, seed=1234)
    data = StdlibTextDataModule(seq_length=32, global_batch_size=8, seed=0, max_bytes=200_000)
    strategy = DynaTrainStrategy("dp4-tp1-pp1-zero1", switch_timeout=args.switch_timeout)
    checkpoints = ModelCheckpoint(dirpath=Path(args.out, "ckpt"), every_n_train_steps=1, save_top_k=-1)
    trainer = Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=4, logger=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[ScheduledReconfig({2: "dp1-tp2-pp2"}), checkpoints])
    rank = int(os.environ["LOCAL_RANK"])
    try:
        trainer.fit(module, datamodule=data)
    except SwitchFailedError as err:
        Path(args.out, f"rank{rank}.json").write_text(json.dumps(dict(
            rank=rank, t_error=time.time(), missing=err.rank, phase=err.phase, lost_state=err.lost_state,
            resume_from=err.resume_from, message=str(err), dist_after=__import__("torch").distributed.is_initialized())))
        raise
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(dict(rank=rank, finished=True)))


if __name__ == "__main__":
    main()
