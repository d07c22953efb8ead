"""The Lightning side: ``DynaTrainStrategy``, ``GPTLightningModule`` and their plain helper functions.

Importing this package imports Lightning but not megatron-core; megatron is loaded when the strategy
first builds groups or a model (``megatron_step``).
"""

from lightning_dynatrain.strategy.config import AdamSettings, MegatronRecipe
from lightning_dynatrain.strategy.dynatrain import DynaTrainStrategy
from lightning_dynatrain.strategy.lightning_module import MegatronLightningModule
from lightning_dynatrain.strategy.module import GPTLightningModule, warmup_cosine_lr
from lightning_dynatrain.strategy.optimizer_handle import DynaTrainOptimizer
from lightning_dynatrain.strategy.report import ReconfigReport
from lightning_dynatrain.strategy.validation import (
    BatchSizeError,
    WorldSizeError,
    num_microbatches,
    validate_target,
    vocab_divisor_for,
)

__all__ = [
    "AdamSettings",
    "BatchSizeError",
    "DynaTrainOptimizer",
    "DynaTrainStrategy",
    "GPTLightningModule",
    "MegatronLightningModule",
    "MegatronRecipe",
    "ReconfigReport",
    "WorldSizeError",
    "num_microbatches",
    "validate_target",
    "vocab_divisor_for",
    "warmup_cosine_lr",
]
