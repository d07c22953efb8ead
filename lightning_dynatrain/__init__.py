"""lightning-dynatrain: hot-switch the parallel layout of Megatron-core GPT training in memory.

``import lightning_dynatrain`` registers ``DynaTrainStrategy`` in Lightning's ``StrategyRegistry``
as ``"dynatrain"`` (``Trainer(strategy="dynatrain")`` = pure data parallelism, layout ``auto``).
It imports Lightning, not megatron-core; the public classes load on first use::

    from lightning_dynatrain import DynaTrainStrategy, GPTLightningModule, ScheduledReconfig
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DynaTrainStrategy": "lightning_dynatrain.strategy.dynatrain",
    "GPTLightningModule": "lightning_dynatrain.strategy.module",
    "AdamSettings": "lightning_dynatrain.strategy.config",
    "MegatronRecipe": "lightning_dynatrain.strategy.config",
    "ReconfigReport": "lightning_dynatrain.strategy.report",
    "ScheduledReconfig": "lightning_dynatrain.callbacks.scheduled",
    "GlobalBatchSampler": "lightning_dynatrain.data.sampler",
    "StdlibBytes": "lightning_dynatrain.data.stdlib_text",
    "StdlibTextDataModule": "lightning_dynatrain.data.datamodule",
    "ParallelConfig": "lightning_dynatrain.vps.layout",
}


def _register_strategy() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_dynatrain.strategy.dynatrain import DynaTrainStrategy

    DynaTrainStrategy.register_strategies(StrategyRegistry)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'lightning_dynatrain' has no attribute {name!r}")


_register_strategy()

__all__ = sorted(_EXPORTS)
