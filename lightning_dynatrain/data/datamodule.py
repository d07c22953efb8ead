"""A ``LightningDataModule`` that serves global batches of the stdlib byte corpus.

Every rank gets the same ``[G, S]`` batch for each optimizer step (``GlobalBatchSampler``); the
``DynaTrainStrategy`` slices the current layout's data-parallel share at train time.

Example::

    dm = StdlibTextDataModule(seq_length=128, global_batch_size=16, seed=0)
    trainer.fit(GPTLightningModule(...), datamodule=dm)
"""

from __future__ import annotations

import lightning.pytorch as pl
from torch.utils.data import DataLoader, Dataset, Subset

from lightning_dynatrain.data.sampler import EvalBatchSampler, GlobalBatchSampler
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


class GlobalBatchDataModule(pl.LightningDataModule):
    """Any map-style dataset in global batches: the same ``G`` samples on every rank at each
    optimizer step (``GlobalBatchSampler``), the strategy slicing the data-parallel share.

    Args:
        dataset: training samples (each a dict of tensors; the default collation stacks them).
        global_batch_size: samples per optimizer step over all data-parallel ranks.
        val_dataset: validation samples, served in order in global batches (``None``: no validation).
        shuffle, seed: seeded shuffling, a new order per pass over the data (same on every rank).
        num_workers: DataLoader workers; 0 keeps the sampler in the training process.
    """

    def __init__(self, dataset: Dataset, *, global_batch_size: int, val_dataset: Dataset | None = None,
                 shuffle: bool = True, seed: int = 0, num_workers: int = 0) -> None:
        super().__init__()
        self.dataset, self.val_dataset = dataset, val_dataset
        self.global_batch_size, self.shuffle, self.seed, self.num_workers = global_batch_size, shuffle, seed, num_workers
        self.sampler: GlobalBatchSampler | None = None

    def train_dataloader(self) -> GlobalBatchDataLoader:
        self.sampler = GlobalBatchSampler(self.dataset, global_batch_size=self.global_batch_size,
                                          shuffle=self.shuffle, seed=self.seed)
        return GlobalBatchDataLoader(self.dataset, batch_sampler=self.sampler, num_workers=self.num_workers)

    def val_dataloader(self) -> GlobalBatchDataLoader | list:
        if self.val_dataset is None:
            return []
        sampler = EvalBatchSampler(self.val_dataset, global_batch_size=self.global_batch_size)
        return GlobalBatchDataLoader(self.val_dataset, batch_sampler=sampler, num_workers=self.num_workers)


class StdlibTextDataModule(pl.LightningDataModule):
    """Byte-level stdlib text, in global batches.

    Args:
        seq_length: tokens per sample.
        global_batch_size: samples per optimizer step over all data-parallel ranks.
        shuffle: seeded shuffling, a new order per pass over the data (same on every rank).
        seed: seed of that order.
        max_bytes: cap on the corpus size (``None``: the whole stdlib, ~31 MB).
        num_workers: DataLoader workers; 0 keeps the sampler in the training process.
        val_samples: samples held out at the end of the corpus for validation, in global batches
            in order (0: no validation data).
    """

    def __init__(self, *, seq_length: int, global_batch_size: int, shuffle: bool = True, seed: int = 0,
                 max_bytes: int | None = None, num_workers: int = 0, val_samples: int = 0) -> None:
        super().__init__()
        self.seq_length = seq_length
        self.global_batch_size = global_batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.max_bytes = max_bytes
        self.num_workers = num_workers
        if val_samples < 0 or val_samples % global_batch_size:
            raise ValueError(f"val_samples={val_samples} is not a whole number of global batches of "
                             f"{global_batch_size}; pass a multiple of global_batch_size (0: no validation)")
        self.val_samples = val_samples
        self.dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self.sampler: GlobalBatchSampler | None = None

    def setup(self, stage: str) -> None:
        if self.dataset is None:
            corpus = StdlibBytes(self.seq_length, max_bytes=self.max_bytes)
            train = len(corpus) - self.val_samples
            if train < self.global_batch_size:
                raise ValueError(f"{len(corpus)} samples leave {train} for training after val_samples="
                                 f"{self.val_samples}: fewer than one global batch; hold out fewer")
            self.dataset = Subset(corpus, range(train)) if self.val_samples else corpus
            self.val_dataset = Subset(corpus, range(train, len(corpus))) if self.val_samples else None

    def train_dataloader(self) -> GlobalBatchDataLoader:
        assert self.dataset is not None, "setup() runs before train_dataloader()"
        self.sampler = GlobalBatchSampler(self.dataset, global_batch_size=self.global_batch_size,
                                          shuffle=self.shuffle, seed=self.seed)
        return GlobalBatchDataLoader(self.dataset, batch_sampler=self.sampler, num_workers=self.num_workers)

    def val_dataloader(self) -> GlobalBatchDataLoader | list:
        """The held-out samples in global batches, in order (the same at every layout); ``[]``
        (Lightning runs no validation) without ``val_samples``."""
        if self.val_dataset is None:
            return []
        sampler = EvalBatchSampler(self.val_dataset, global_batch_size=self.global_batch_size)
        return GlobalBatchDataLoader(self.val_dataset, batch_sampler=sampler, num_workers=self.num_workers)


__all__ = ["GlobalBatchDataLoader", "GlobalBatchDataModule", "StdlibTextDataModule"]
