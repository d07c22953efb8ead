"""Data that survives a layout switch: global batches on every rank, sliced by the strategy.

``GlobalBatchSampler`` yields the indices of step ``k``'s whole global batch; ``StdlibBytes`` is a
byte-level corpus present on every machine (the Python stdlib's sources); ``StdlibTextDataModule``
puts the two together for a ``Trainer``, ``GlobalBatchDataModule`` any dataset. ``IndexedDataModule``
serves megatron's ``GPTDataset`` over an indexed corpus (``.bin``/``.idx``, written by
``write_indexed_corpus`` with the ``ByteTokenizer`` or by Megatron-LM's tools) the same way.
"""

from lightning_dynatrain.data.sampler import GlobalBatchSampler, dp_share_bounds
from lightning_dynatrain.data.stdlib_text import VOCAB_SIZE, StdlibBytes, stdlib_corpus, stdlib_sources


#: what imports lightning or megatron-core, loaded only when asked for
_LAZY = {
    "StdlibTextDataModule": "datamodule",
    "GlobalBatchDataLoader": "datamodule",
    "GlobalBatchDataModule": "datamodule",
    "IndexedDataModule": "indexed_datamodule",
    "ByteTokenizer": "byte_tokenizer",
    "IndexedSamples": "indexed",
    "gpt_dataset": "indexed",
    "write_indexed_corpus": "indexed",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ByteTokenizer", "GlobalBatchDataLoader", "GlobalBatchDataModule", "GlobalBatchSampler", "IndexedDataModule",
           "IndexedSamples",
           "StdlibBytes", "StdlibTextDataModule", "VOCAB_SIZE", "dp_share_bounds", "gpt_dataset", "stdlib_corpus",
           "stdlib_sources", "write_indexed_corpus"]
