"""The data side of a loop run: global batches on every rank, which Accelerate and Fabric leave alone.

A layout switch changes who is a data-parallel replica of whom, so the loader must not know the
layout: every rank reads the same GLOBAL batch of step ``k`` (``GlobalBatchSampler``: positions
``[k*G, (k+1)*G)``) and the engine cuts the current layout's data-parallel share. Accelerate's
``prepare`` would shard a ``DataLoader`` by world size (every ``num_processes``-th batch per rank,
or a slice of each): wrong under tensor and pipeline parallelism, where the ranks of one replica
need the same rows. The loader made here carries the mark Accelerate's ``prepare_data_loader`` reads
to return a loader unchanged (``compat.accelerate_internals.mark_prepared``), so it can go through
``prepare`` with the rest of the loop's objects. Under Fabric, ``DynaTrainFabricStrategy`` has no
``distributed_sampler_kwargs``, so ``fabric.setup_dataloaders`` adds no sampler either.

Example::

    loader = global_batch_loader(StdlibBytes(128), global_batch_size=16, shuffle=True, seed=0)
    loader = accelerator.prepare(loader)     # the same object: [16, 128] batches on every rank
"""

from __future__ import annotations

from torch.utils.data import Dataset

from lightning_dynatrain.compat.accelerate_internals import mark_prepared
from lightning_dynatrain.data.datamodule import GlobalBatchDataLoader
from lightning_dynatrain.data.sampler import EvalBatchSampler, GlobalBatchSampler


def global_batch_loader(dataset: Dataset, *, global_batch_size: int, shuffle: bool = True, seed: int = 0,
                        num_workers: int = 0, for_eval: bool = False) -> GlobalBatchDataLoader:
    """A ``DataLoader`` of whole global batches (the same on every rank) that ``accelerator.prepare``
    and ``fabric.setup_dataloaders`` return unsharded; ``DynaTrainEngine.dataloader`` makes one at
    the engine's data position. ``for_eval``: the batches in order, from the first on every pass
    (``EvalBatchSampler``; ``shuffle`` and ``seed`` are ignored).

    Raises:
        ValueError: an empty dataset or a non-positive batch size (``GlobalBatchSampler``).
    """
    sampler = (EvalBatchSampler(dataset, global_batch_size=global_batch_size) if for_eval else
               GlobalBatchSampler(dataset, global_batch_size=global_batch_size, shuffle=shuffle, seed=seed))
    loader = GlobalBatchDataLoader(dataset, batch_sampler=sampler, num_workers=num_workers)
    mark_prepared(loader)
    return loader


__all__ = ["global_batch_loader"]
