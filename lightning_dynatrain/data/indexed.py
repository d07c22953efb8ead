"""Megatron's indexed corpora: write one (``.bin``/``.idx``) and read it as megatron's ``GPTDataset``.

``write_indexed_corpus`` tokenizes documents and writes them with megatron's own
``IndexedDatasetBuilder`` (each document followed by the tokenizer's ``eod``), the format
Megatron-LM's ``preprocess_data.py`` writes. ``gpt_dataset`` builds megatron's ``GPTDataset`` over
it through ``BlendedMegatronDatasetBuilder``: samples of ``seq_length + 1`` tokens cut across
document boundaries, in an order megatron shuffles with ``seed`` (its document, sample and shuffle
indices, cached as ``.npy`` files beside the corpus; rank 0 builds them, the others read them).

``IndexedSamples`` adds each sample's index to its item (``"sample"``), so the data a step trained
on can be named: the strategy's slicing of the global batch keeps it with its rows.

Example::

    write_indexed_corpus(["first document", "second one"], "/data/corpus")   # corpus.bin, corpus.idx
    ds = IndexedSamples(gpt_dataset("/data/corpus", seq_length=128, seed=0))
    ds[3]   # {"tokens": int64[128], "labels": int64[128], "loss_mask": float[128], "sample": 3}
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder, get_bin_path, get_idx_path
from megatron.core.tokenizers import MegatronTokenizerBase
from torch.utils.data import Dataset

from lightning_dynatrain.data.byte_tokenizer import ByteTokenizer
from lightning_dynatrain.vps.errors import DynaTrainError


class IndexedCorpusError(DynaTrainError):
    """An indexed corpus is missing, empty, or too small for what was asked of it."""


@dataclass(frozen=True, slots=True)
class CorpusInfo:
    """What ``write_indexed_corpus`` wrote."""

    path_prefix: str
    """The prefix of ``.bin`` and ``.idx`` (megatron's ``blend`` takes it)."""
    documents: int
    tokens: int
    """Tokens written, ``eod`` after each document included."""


def write_indexed_corpus(documents: Iterable[str], path_prefix: str | Path,
                         tokenizer: MegatronTokenizerBase | None = None) -> CorpusInfo:
    """Tokenize ``documents`` and write them as megatron's indexed dataset at ``path_prefix``.

    Token ids are stored in the smallest dtype megatron picks for the vocabulary (``uint16`` below
    65500 ids). An empty document is skipped.

    Raises:
        IndexedCorpusError: no document had any text.
    """
    tokenizer = tokenizer or ByteTokenizer()
    prefix = str(path_prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=dtype)
    count = tokens = 0
    for text in documents:
        ids = tokenizer.tokenize(text)
        if not ids:
            continue
        ids = np.asarray([*ids, tokenizer.eod], dtype=dtype)
        builder.add_document(ids, lengths=[ids.size])
        count, tokens = count + 1, tokens + ids.size
    builder.finalize(get_idx_path(prefix))
    if count == 0:
        raise IndexedCorpusError(f"no document to write at {prefix}", hint="pass at least one non-empty text")
    return CorpusInfo(path_prefix=prefix, documents=count, tokens=tokens)


def gpt_dataset(path_prefix: str | Path, *, seq_length: int, seed: int,
                tokenizer: MegatronTokenizerBase | None = None, num_samples: int | None = None,
                cache_dir: str | Path | None = None) -> GPTDataset:
    """Megatron's ``GPTDataset`` (the training split: all of the corpus) over ``path_prefix``.

    Collective when ``torch.distributed`` is initialised (rank 0 builds the indices first, then the
    others read them after a barrier): call it on every rank.

    Args:
        seq_length: tokens per sample (each sample reads ``seq_length + 1``: tokens and shifted labels).
        seed: megatron's seed for the order of documents and samples.
        num_samples: samples to draw (megatron repeats the corpus in new orders as often as needed);
            ``None``: one pass over the corpus.
        cache_dir: where megatron caches its indices; ``None``: megatron's default beside the corpus.

    Raises:
        IndexedCorpusError: the ``.bin``/``.idx`` files are missing, or the corpus holds no whole sample.
    """
    prefix = str(path_prefix)
    missing = [p for p in (get_bin_path(prefix), get_idx_path(prefix)) if not Path(p).is_file()]
    if missing:
        raise IndexedCorpusError(f"indexed corpus {prefix!r} lacks {', '.join(missing)}",
                                 hint="write it with write_indexed_corpus (or Megatron-LM's preprocess_data.py)")
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=([prefix], None), split="1,0,0",
        tokenizer=tokenizer or ByteTokenizer(), reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, create_attention_mask=False,  # the model builds its causal mask itself
        path_to_cache=None if cache_dir is None else str(cache_dir),
    )
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [num_samples, None, None], lambda: True, config).build()
    if train is None or len(train) == 0:
        raise IndexedCorpusError(f"indexed corpus {prefix!r} holds no sample of {seq_length + 1} tokens",
                                 hint="write more text or use a shorter seq_length")
    return train


class IndexedSamples(Dataset):
    """A ``GPTDataset``'s samples as training items, each with its own index.

    Each item is ``{"tokens": int64[S], "labels": int64[S], "loss_mask": float32[S], "sample": int64}``;
    megatron's ``position_ids`` are left out (the step makes them).
    """

    def __init__(self, dataset: GPTDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        item = self.dataset[index]
        return {"tokens": item["tokens"], "labels": item["labels"], "loss_mask": item["loss_mask"],
                "sample": torch.tensor(index, dtype=torch.long)}


__all__ = ["CorpusInfo", "IndexedCorpusError", "IndexedSamples", "gpt_dataset", "write_indexed_corpus"]
