"""The Lightning strategy: ``DynaTrainStrategy``, its LightningModules and the optimizer Lightning sees.

Only what Lightning needs lives here; the run it drives is the Lightning-free training core
(``lightning_dynatrain.runtime``), and an elastic fit's driver is ``lightning_dynatrain.elastic.driver``.
Importing this package imports Lightning but not megatron-core; megatron is loaded when the strategy
first builds groups or a model.
"""

from lightning_dynatrain.strategy.dynatrain import DynaTrainStrategy
from lightning_dynatrain.runtime.recipe import warmup_cosine_lr
from lightning_dynatrain.strategy.lightning_modules import GPTLightningModule, MegatronLightningModule
from lightning_dynatrain.strategy.optimizer_handle import DynaTrainOptimizer

__all__ = ["DynaTrainOptimizer", "DynaTrainStrategy", "GPTLightningModule", "MegatronLightningModule",
           "warmup_cosine_lr"]
