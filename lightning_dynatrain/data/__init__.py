"""Data that survives a layout switch: global batches on every rank, sliced by the strategy.

``GlobalBatchSampler`` yields the indices of step ``k``'s whole global batch; ``StdlibBytes`` is a
byte-level corpus present on every machine (the Python stdlib's sources); ``StdlibTextDataModule``
puts the two together for a ``Trainer``.
"""

from lightning_dynatrain.data.sampler import GlobalBatchSampler, dp_share_bounds
from lightning_dynatrain.data.stdlib_text import VOCAB_SIZE, StdlibBytes, stdlib_corpus, stdlib_sources


def __getattr__(name: str):  # the DataModule imports lightning; load it only when asked for
    if name in ("StdlibTextDataModule", "GlobalBatchDataLoader"):
        from lightning_dynatrain.data import datamodule

        return getattr(datamodule, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["GlobalBatchDataLoader", "GlobalBatchSampler", "StdlibBytes", "StdlibTextDataModule", "VOCAB_SIZE", "dp_share_bounds",
           "stdlib_corpus", "stdlib_sources"]
