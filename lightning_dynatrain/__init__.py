"""lightning-dynatrain: hot-switch the parallel layout of Megatron-core GPT training in memory.

``import lightning_dynatrain`` registers ``DynaTrainStrategy`` in Lightning's ``StrategyRegistry``
as ``"dynatrain"`` (``Trainer(strategy="dynatrain")`` = pure data parallelism, layout ``auto``):
at once if ``lightning.pytorch`` is already imported, else right after it is. So importing this
package (or its ``vps``/``megatron`` layers, e.g. in the dry-run CLI or a spawned test worker)
imports neither Lightning nor megatron-core; the public classes load on first use. Importing it
installs the filters of the third-party warnings its runs cannot change (``warning_filters``)::

    from lightning_dynatrain import DynaTrainStrategy, GPTLightningModule, ScheduledReconfig
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

from lightning_dynatrain.warning_filters import quiet_third_party_warnings

# megatron-core announces at import that it runs without Transformer Engine and Apex (each notice is
# named, with why it is safe to hide, in warning_filters.THIRD_PARTY): hidden before any module of this
# package imports it. Those that are advice only on CPU wait until a strategy knows the device.
quiet_third_party_warnings(on_cpu=False)

_EXPORTS = {
    "DynaTrainStrategy": "lightning_dynatrain.strategy.dynatrain",
    "GPTLightningModule": "lightning_dynatrain.strategy.lightning_modules",
    "MegatronLightningModule": "lightning_dynatrain.strategy.lightning_modules",
    "DynaTrainOptimizer": "lightning_dynatrain.strategy.optimizer_handle",
    "ModelProvider": "lightning_dynatrain.megatron.provider",
    "padded_vocab_size": "lightning_dynatrain.megatron.provider",
    "AdamSettings": "lightning_dynatrain.runtime.recipe",
    "MegatronRecipe": "lightning_dynatrain.runtime.recipe",
    "ReconfigReport": "lightning_dynatrain.runtime.reconfig_report",
    "DynaTrainSettings": "lightning_dynatrain.runtime.settings",
    "ScheduledReconfig": "lightning_dynatrain.callbacks.scheduled",
    "LayoutProgressBar": "lightning_dynatrain.callbacks.progress",
    "OnNodeChange": "lightning_dynatrain.callbacks.node_change",
    "ElasticOptions": "lightning_dynatrain.elastic.driver.options",
    "RunRecorder": "lightning_dynatrain.callbacks.run_record",
    "GlobalBatchSampler": "lightning_dynatrain.data.sampler",
    "StdlibBytes": "lightning_dynatrain.data.stdlib_text",
    "StdlibTextDataModule": "lightning_dynatrain.data.datamodule",
    "ParallelConfig": "lightning_dynatrain.vps.layout",
    "SwitchMemoryError": "lightning_dynatrain.megatron.memory_check",
    "PolicyLoss": "lightning_dynatrain.megatron.policy_loss",
}
_STRATEGY_MODULE = "lightning_dynatrain.strategy.dynatrain"  # registers the strategy at its end


class _ThenRegister(importlib.abc.Loader):
    """Runs ``lightning.pytorch``'s own loader, then imports the strategy module (which registers)."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec):  # type: ignore[no-untyped-def]
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:  # type: ignore[no-untyped-def]
        self._loader.exec_module(module)
        importlib.import_module(_STRATEGY_MODULE)

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, ... of the real loader
        return getattr(self._loader, name)


class _RegisterAfterLightning(importlib.abc.MetaPathFinder):
    """Waits for ``import lightning.pytorch`` (imports nothing itself), then steps aside."""

    def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
        if fullname != "lightning.pytorch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenRegister(spec.loader)
        return spec


def _register_strategy() -> None:
    if "lightning.pytorch" in sys.modules:
        importlib.import_module(_STRATEGY_MODULE)
    elif not any(isinstance(f, _RegisterAfterLightning) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterLightning())


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'lightning_dynatrain' has no attribute {name!r}")


_register_strategy()

__all__ = sorted(_EXPORTS)
