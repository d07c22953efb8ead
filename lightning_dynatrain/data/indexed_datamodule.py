"""A ``LightningDataModule`` over a megatron indexed corpus, in global batches that survive switches.

Megatron's ``GPTDataset`` (``data.indexed``) fixes *what* sample ``i`` is; the project's
``GlobalBatchSampler`` fixes *when* it is read: optimizer step ``k`` reads dataset positions
``[k*G, (k+1)*G)`` on every rank, and ``DynaTrainStrategy`` cuts the current layout's data-parallel
share out of that global batch at each step. Nothing in the pipeline knows the layout, so a switch
rebuilds no dataloader, and the data position is ``trainer.global_step * G``, which a resumed run
restores (the strategy aligns the sampler at train start; the loader's ``state_dict`` carries it too).

The sampler reads positions in order by default: megatron's dataset already shuffles (its
document and sample orders, seeded by ``seed``), and with ``num_samples`` past one pass it
repeats the corpus in new orders itself. ``shuffle=True`` adds the sampler's own seeded order on top.

Example::

    write_indexed_corpus(texts, "/data/corpus")                  # once, before training
    dm = IndexedDataModule("/data/corpus", seq_length=128, global_batch_size=16, seed=0)
    trainer.fit(GPTLightningModule(...), datamodule=dm)
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
from megatron.core.tokenizers import MegatronTokenizerBase

from lightning_dynatrain.data.datamodule import GlobalBatchDataLoader
from lightning_dynatrain.data.indexed import IndexedSamples, gpt_dataset
from lightning_dynatrain.data.sampler import GlobalBatchSampler


class IndexedDataModule(pl.LightningDataModule):
    """Megatron's ``GPTDataset`` over ``path_prefix`` (``.bin``/``.idx``), served as global batches.

    Args:
        path_prefix: the corpus (``write_indexed_corpus`` or Megatron-LM's ``preprocess_data.py``).
        seq_length: tokens per sample; the model's ``seq_length``.
        global_batch_size: samples per optimizer step over all data-parallel ranks.
        seed: megatron's seed for its document and sample orders (and the sampler's, with ``shuffle``).
        tokenizer: the tokenizer the corpus was written with (default ``ByteTokenizer``); megatron
            reads its ``eod`` and ``pad``.
        num_samples: samples megatron draws (its corpus repeats); ``None``: one pass.
        shuffle: the sampler's own order on top of megatron's (off by default, see module docstring).
        cache_dir: megatron's index cache; ``None``: beside the corpus.
        num_workers: DataLoader workers.

    Each batch is ``{"tokens", "labels", "loss_mask", "sample"}`` with ``G`` rows, ``"sample"`` the
    dataset index of each row.

    Raises:
        IndexedCorpusError: (at ``setup``) the corpus is missing or has no whole sample.
    """

    def __init__(self, path_prefix: str | Path, *, seq_length: int, global_batch_size: int, seed: int = 0,
                 tokenizer: MegatronTokenizerBase | None = None, num_samples: int | None = None,
                 shuffle: bool = False, cache_dir: str | Path | None = None, num_workers: int = 0) -> None:
        super().__init__()
        self.path_prefix = str(path_prefix)
        self.seq_length = seq_length
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.tokenizer = tokenizer
        self.num_samples = num_samples
        self.shuffle = shuffle
        self.cache_dir = cache_dir
        self.num_workers = num_workers
        self.dataset: IndexedSamples | None = None
        self.sampler: GlobalBatchSampler | None = None

    def setup(self, stage: str) -> None:
        if self.dataset is None:  # collective (megatron builds its indices on rank 0 first): every rank runs it
            self.dataset = IndexedSamples(gpt_dataset(self.path_prefix, seq_length=self.seq_length, seed=self.seed,
                                                      tokenizer=self.tokenizer, num_samples=self.num_samples,
                                                      cache_dir=self.cache_dir))

    def train_dataloader(self) -> GlobalBatchDataLoader:
        assert self.dataset is not None, "setup() runs before train_dataloader()"
        self.sampler = GlobalBatchSampler(self.dataset, global_batch_size=self.global_batch_size,
                                          shuffle=self.shuffle, seed=self.seed)
        return GlobalBatchDataLoader(self.dataset, batch_sampler=self.sampler, num_workers=self.num_workers)


__all__ = ["IndexedDataModule"]
