"""A ``LightningDataModule`` that serves global batches of the stdlib byte corpus.

Every rank gets the same ``[G, S]`` batch for each optimizer step (``GlobalBatchSampler``); the
``DynaTrainStrategy`` slices the current layout's data-parallel share at train time.

Example::

    dm = StdlibTextDataModule(seq_length=128, global_batch_size=16, seed=0)
    trainer.fit(GPTLightningModule(...), datamodule=dm)
"""

from __future__ import annotations

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from lightning_dynatrain.data.sampler import GlobalBatchSampler
from lightning_dynatrain.data.stdlib_text import StdlibBytes


class GlobalBatchDataLoader(DataLoader):
    """A ``DataLoader`` over a ``GlobalBatchSampler`` that Lightning treats as resumable.

    ``state_dict``/``load_state_dict`` carry the sampler's state. Under ``DynaTrainStrategy`` the
    authoritative data position is ``trainer.global_step * G``: the strategy re-aligns the sampler at
    train start (the sampler's own count runs ahead by the batches prefetched).
    """

    def state_dict(self) -> dict:
        return self.batch_sampler.state_dict() if isinstance(self.batch_sampler, GlobalBatchSampler) else {}

    def load_state_dict(self, state: dict) -> None:
        if state and isinstance(self.batch_sampler, GlobalBatchSampler):
            self.batch_sampler.load_state_dict(state)


class StdlibTextDataModule(pl.LightningDataModule):
    """Byte-level stdlib text, in global batches.

    Args:
        seq_length: tokens per sample.
        global_batch_size: samples per optimizer step over all data-parallel ranks.
        shuffle: seeded shuffling, a new order per pass over the data (same on every rank).
        seed: seed of that order.
        max_bytes: cap on the corpus size (``None``: the whole stdlib, ~31 MB).
        num_workers: DataLoader workers; 0 keeps the sampler in the training process.
    """

    def __init__(self, *, seq_length: int, global_batch_size: int, shuffle: bool = True, seed: int = 0,
                 max_bytes: int | None = None, num_workers: int = 0) -> None:
        super().__init__()
        self.seq_length = seq_length
        self.global_batch_size = global_batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.max_bytes = max_bytes
        self.num_workers = num_workers
        self.dataset: StdlibBytes | None = None
        self.sampler: GlobalBatchSampler | None = None

    def setup(self, stage: str) -> None:
        if self.dataset is None:
            self.dataset = StdlibBytes(self.seq_length, max_bytes=self.max_bytes)

    def train_dataloader(self) -> GlobalBatchDataLoader:
        assert self.dataset is not None, "setup() runs before train_dataloader()"
        self.sampler = GlobalBatchSampler(self.dataset, global_batch_size=self.global_batch_size,
                                          shuffle=self.shuffle, seed=self.seed)
        return GlobalBatchDataLoader(self.dataset, batch_sampler=self.sampler, num_workers=self.num_workers)


__all__ = ["GlobalBatchDataLoader", "StdlibTextDataModule"]
