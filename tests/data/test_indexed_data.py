"""Megatron's indexed corpora in one process: the byte tokenizer, writing ``.bin``/``.idx`` with
megatron's builder, megatron's ``GPTDataset`` over them, and the data module's global batches."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dynatrain.data.byte_tokenizer import EOD_ID, PAD_ID, ByteTokenizer
from lightning_dynatrain.data.indexed import IndexedCorpusError, IndexedSamples, gpt_dataset, write_indexed_corpus
from tests.strategy.texts import generated_documents


@given(st.text(max_size=200))
@settings(max_examples=200, deadline=None)
def test_bytes_round_trip_and_never_collide_with_eod_or_pad(text: str) -> None:
    """UTF-8 never uses the bytes 0xFE and 0xFF, so no text tokenizes to ``eod`` or ``pad``."""
    tok = ByteTokenizer()
    ids = tok.tokenize(text)
    assert EOD_ID not in ids and PAD_ID not in ids and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.detokenize(ids + [tok.eod, tok.pad]) == text


def test_the_tokenizer_implements_megatrons_interface() -> None:
    from megatron.core.tokenizers import MegatronTokenizerBase

    tok = ByteTokenizer()
    assert isinstance(tok, MegatronTokenizerBase)
    assert (tok.vocab_size, tok.eod, tok.pad, len(tok.vocab)) == (256, 0xFF, 0xFE, 256)
    assert tok.unique_identifiers["class"].endswith("ByteTokenizer")
    with pytest.raises(NotImplementedError, match="no chat template"):
        tok.apply_chat_template([])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, list[str]]:
    docs = generated_documents(60, seed=3)
    info = write_indexed_corpus(["", *docs], tmp_path_factory.mktemp("indexed") / "corpus" / "text")
    assert info.documents == len(docs)  # the empty one is skipped
    return info.path_prefix, docs


def test_the_corpus_is_megatrons_indexed_format(corpus) -> None:
    """Megatron's own reader gives each document back, followed by ``eod``, in the smallest dtype."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix, docs = corpus
    indexed = IndexedDataset(prefix)
    assert len(indexed) == len(docs) and indexed.index.dtype == np.uint16
    for i in (0, 17, len(docs) - 1):
        assert indexed[i].tolist() == [*docs[i].encode(), EOD_ID]


def test_gpt_dataset_samples_are_shifted_windows_of_the_corpus(corpus, tmp_path: Path) -> None:
    """Each sample is ``seq_length + 1`` consecutive tokens of megatron's document order, split into
    tokens and labels; no loss is masked (no padding in a training sample); the order is the seed's."""
    prefix, docs = corpus
    stream = np.concatenate([np.asarray([*d.encode(), EOD_ID]) for d in docs])
    with warnings.catch_warnings():
        # megatron warns when the tokenizer's pad collides with eod
        warnings.filterwarnings("error", message="The pad token id", category=UserWarning)
        ds = gpt_dataset(prefix, seq_length=16, seed=0, cache_dir=tmp_path / "cache")
    samples = IndexedSamples(ds)
    assert len(samples) == (stream.size - 1) // 16
    first = samples[0]
    assert set(first) == {"tokens", "labels", "loss_mask", "sample"} and int(first["sample"]) == 0
    assert torch.equal(first["tokens"][1:], first["labels"][:-1]) and first["loss_mask"].sum() == 16
    again = IndexedSamples(gpt_dataset(prefix, seq_length=16, seed=0, cache_dir=tmp_path / "cache"))
    other = IndexedSamples(gpt_dataset(prefix, seq_length=16, seed=1, cache_dir=tmp_path / "cache"))
    assert all(torch.equal(samples[i]["tokens"], again[i]["tokens"]) for i in range(len(samples)))
    assert any(not torch.equal(samples[i]["tokens"], other[i]["tokens"]) for i in range(8))
    # sample i is window shuffle_index[i] of the documents in megatron's (seeded) document order
    ordered = np.concatenate([np.asarray([*docs[d].encode(), EOD_ID]) for d in ds.document_index])
    for i in range(len(samples)):
        start = int(ds.shuffle_index[i]) * 16
        assert samples[i]["tokens"].tolist() == ordered[start:start + 16].tolist()
        assert samples[i]["labels"].tolist() == ordered[start + 1:start + 17].tolist()


def test_what_cannot_be_read_is_refused_with_a_hint(tmp_path: Path) -> None:
    with pytest.raises(IndexedCorpusError, match="lacks .*missing.bin.*HINT: write it with write_indexed_corpus"):
        gpt_dataset(tmp_path / "missing", seq_length=16, seed=0)
    with pytest.raises(IndexedCorpusError, match="no document"):
        write_indexed_corpus(["", ""], tmp_path / "empty")
    short = write_indexed_corpus(["tiny"], tmp_path / "short").path_prefix
    with pytest.raises(IndexedCorpusError, match="no sample of 65 tokens.*HINT"):
        gpt_dataset(short, seq_length=64, seed=0)


def test_the_data_module_serves_global_batches_of_dataset_positions(corpus, tmp_path: Path) -> None:
    """Step ``k``'s batch is positions ``[k*G, (k+1)*G)`` (megatron shuffled already), whole, with their indices."""
    from lightning_dynatrain.data import IndexedDataModule

    prefix, _ = corpus
    dm = IndexedDataModule(prefix, seq_length=16, global_batch_size=4, seed=0, cache_dir=tmp_path / "cache")
    dm.setup("fit")
    loader = dm.train_dataloader()
    batches = [b for _, b in zip(range(3), loader)]
    assert [b["sample"].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert batches[2]["tokens"].shape == (4, 16) and batches[2]["tokens"].dtype == torch.long
    assert torch.equal(batches[1]["tokens"][2], dm.dataset[6]["tokens"])
    assert loader.state_dict()["next_step"] == 3
