"""Lightning's ``Trainer(precision=...)`` as megatron's mixed precision.

Lightning turns ``precision="bf16-mixed"`` into an autocast plugin. Megatron does mixed precision
itself: the model's params in bf16, fp32 main params in the optimizer, gradients reduced in fp32
(``build_ddp_and_optimizer``), and it casts where it needs to. Autocast on top of that would cast
megatron's fp32 paths (the norms, the router, the loss) down again. So ``DynaTrainStrategy`` swaps
whatever plugin Lightning made for a ``MegatronPrecision`` that only records the precision and
never autocasts; the model is then built with ``params_dtype`` from it.

| ``Trainer(precision=...)`` | params | main params (optimizer) |
| --- | --- | --- |
| ``"32-true"`` (Lightning's default) | fp32 | none (the optimizer updates the params) |
| ``"bf16-mixed"`` | bf16 (norms fp32, as megatron's local spec builds them) | fp32 |
| anything else | refused (``PrecisionError``) with what to use instead | |

``MegatronRecipe(params_dtype=...)`` (``GPTLightningModule(params_dtype=...)``) may say the same
thing; ``resolve_params_dtype`` refuses a recipe and a Trainer that disagree, but lets a recipe's
bf16 refine Lightning's default ``"32-true"`` (the way bf16 was asked for before).

Example::

    trainer = Trainer(accelerator="cpu", devices=4, precision="bf16-mixed",
                      strategy=DynaTrainStrategy("dp2-tp2-pp1"))
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from lightning.pytorch.plugins.precision import Precision

from lightning_dynatrain.vps.errors import DynaTrainError

#: the precisions megatron runs here, by Lightning's name, with the params dtype each builds
PARAMS_DTYPES = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16}

_REFUSALS = {
    "16-mixed": "fp16 needs megatron's dynamic loss scaler, whose state a switch does not carry yet",
    "16-true": "pure fp16 has no fp32 main params to train on",
    "bf16-true": "pure bf16 has no fp32 main params to train on",
    "64-true": "megatron does not train in fp64",
}


class PrecisionError(DynaTrainError):
    """``Trainer(precision=...)`` or ``MegatronRecipe(params_dtype=...)`` asks for what the strategy cannot run."""


class MegatronPrecision(Precision):
    """A Lightning precision plugin that leaves casting to megatron (no autocast, no scaler).

    Attributes:
        precision: Lightning's name, ``"32-true"`` or ``"bf16-mixed"``.
    """

    def __init__(self, precision: str = "32-true") -> None:
        if precision not in PARAMS_DTYPES:
            raise PrecisionError(f"Trainer(precision={precision!r}) is not supported by DynaTrainStrategy: "
                                 f"{_REFUSALS.get(precision, 'megatron does not run it here')}",
                                 hint='use precision="bf16-mixed" (bf16 params, fp32 main params) or "32-true"')
        super().__init__()
        self.precision = precision  # type: ignore[assignment]

    @property
    def params_dtype(self) -> torch.dtype:
        return PARAMS_DTYPES[self.precision]

    def forward_context(self) -> AbstractContextManager:
        return nullcontext()  # megatron casts; no autocast on top of it

    def __repr__(self) -> str:
        return f"MegatronPrecision({self.precision!r})"


def megatron_precision(plugin: Precision | None) -> MegatronPrecision:
    """The ``MegatronPrecision`` for the plugin Lightning made from ``Trainer(precision=...)``.

    Raises:
        PrecisionError: a precision megatron does not run here, or a plugin the strategy cannot
            replace (quantization, Transformer Engine, a user's own): named, with what to use.
    """
    if plugin is None:
        return MegatronPrecision()
    if isinstance(plugin, MegatronPrecision):
        return plugin
    name = str(getattr(plugin, "precision", "32-true"))
    allowed = type(plugin).__module__.startswith("lightning.pytorch.plugins.precision") and \
        type(plugin).__name__ in ("Precision", "MixedPrecision", "HalfPrecision", "DoublePrecision")
    if not allowed:
        raise PrecisionError(f"DynaTrainStrategy runs megatron's own mixed precision; it cannot use "
                             f"{type(plugin).__name__}", hint='pass Trainer(precision="bf16-mixed" or "32-true") '
                             "and no precision plugin")
    return MegatronPrecision(name)


def resolve_params_dtype(recipe_dtype: torch.dtype | None, plugin: MegatronPrecision) -> torch.dtype:
    """The dtype to build the params in, from the recipe and the Trainer's precision.

    ``recipe_dtype=None`` follows the Trainer. A recipe's bf16 under Lightning's default ``"32-true"``
    is taken (bf16 asked for through the recipe); any other difference is refused.

    Raises:
        PrecisionError: the two disagree, or the recipe asks for a dtype megatron does not train in here.
    """
    if recipe_dtype is None or recipe_dtype == plugin.params_dtype:
        return plugin.params_dtype
    if recipe_dtype not in PARAMS_DTYPES.values():
        raise PrecisionError(f"MegatronRecipe(params_dtype={recipe_dtype}) is not supported",
                             hint='use params_dtype=torch.bfloat16 or None with Trainer(precision="bf16-mixed")')
    if plugin.precision == "32-true" and recipe_dtype == torch.bfloat16:
        return recipe_dtype
    raise PrecisionError(f"Trainer(precision={plugin.precision!r}) and MegatronRecipe(params_dtype={recipe_dtype}) "
                         "disagree", hint="set one of them: params_dtype=None follows the Trainer's precision")


def precision_name(params_dtype: torch.dtype) -> str:
    """Lightning's name for the precision a model built with ``params_dtype`` trains at."""
    return next(name for name, dtype in PARAMS_DTYPES.items() if dtype == params_dtype)


__all__ = ["MegatronPrecision", "PARAMS_DTYPES", "PrecisionError", "megatron_precision", "precision_name",
           "resolve_params_dtype"]
