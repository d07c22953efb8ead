"""How the model runs, apart from what it is and how it is split: sequence parallelism and
activation recompute.

Neither changes a parameter or an optimizer value, so neither appears in the logical state: a
switch carries the options over unchanged, and the rebuilt model runs the way the old one did.
Sequence parallelism applies wherever ``tp > 1`` (a tp1 layout has no sequence to split), so a
switch between tp1 and tp2 turns it off and on with the layout.

Context parallelism is not an option here: megatron-core 0.16's attention without Transformer
Engine asserts a context-parallel size of 1 (``check_trainable`` refuses ``cp > 1``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_dynatrain.vps.errors import LayoutError
from lightning_dynatrain.vps.layout import ParallelConfig

Recompute = Literal["none", "selective", "full"]
RECOMPUTE_CHOICES: tuple[str, ...] = ("none", "selective", "full")


@dataclass(frozen=True, kw_only=True, slots=True)
class ExecutionOptions:
    """Megatron's sequence parallelism and activation recompute, for every layout of a run.

    >>> ExecutionOptions(sequence_parallel=True, recompute="selective")
    ExecutionOptions(sequence_parallel=True, recompute='selective')
    >>> ExecutionOptions(recompute="some")
    Traceback (most recent call last):
    ...
    ValueError: recompute='some' is not one of none, selective, full
    """

    sequence_parallel: bool = False
    """Split the activations of norms and dropout along the sequence over the TP ranks wherever
    ``tp > 1`` (megatron's ``sequence_parallel``; MoE layers with ``tp > 1`` always use it)."""
    recompute: Recompute = "none"
    """``"selective"`` recomputes core attention in the backward pass; ``"full"`` recomputes every
    transformer layer from its input (megatron's ``recompute_granularity``, uniform, one layer
    per chunk); ``"none"`` keeps every activation."""

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE_CHOICES:
            raise ValueError(f"recompute={self.recompute!r} is not one of {', '.join(RECOMPUTE_CHOICES)}")

    def sequence_parallel_at(self, tp: int, *, is_moe: bool) -> bool:
        """Whether megatron runs sequence parallel at tensor-parallel size ``tp``."""
        return tp > 1 and (self.sequence_parallel or is_moe)

    def check(self, layout_text: str, *, tp: int, seq_length: int, is_moe: bool) -> None:
        """Raise ``LayoutError`` where the layout cannot run these options.

        >>> ExecutionOptions(sequence_parallel=True).check("dp1-tp3-pp1", tp=3, seq_length=16, is_moe=False)
        Traceback (most recent call last):
        ...
        lightning_dynatrain.vps.errors.LayoutError: layout dp1-tp3-pp1: sequence parallelism splits the sequence of 16 tokens over tp=3, which does not divide it. HINT: pick a tp that divides the sequence length, or sequence_parallel=False
        """
        if self.sequence_parallel_at(tp, is_moe=is_moe) and seq_length % tp:
            raise LayoutError(f"layout {layout_text}: sequence parallelism splits the sequence of {seq_length} tokens "
                              f"over tp={tp}, which does not divide it",
                              hint="pick a tp that divides the sequence length"
                              + ("" if is_moe else ", or sequence_parallel=False"))

    def config_kwargs(self, tp: int, *, is_moe: bool) -> dict[str, object]:
        """``TransformerConfig``'s keyword arguments for these options at tensor-parallel size ``tp``.

        >>> ExecutionOptions(recompute="full").config_kwargs(1, is_moe=False)
        {'sequence_parallel': False, 'recompute_granularity': 'full', 'recompute_method': 'uniform', 'recompute_num_layers': 1}
        """
        kwargs: dict[str, object] = {"sequence_parallel": self.sequence_parallel_at(tp, is_moe=is_moe)}
        if self.recompute == "selective":
            kwargs.update(recompute_granularity="selective", recompute_modules=["core_attn"])
        elif self.recompute == "full":
            kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        return kwargs


def check_trainable(layout: ParallelConfig) -> None:
    """Refuse what a layout can state and ``dynatrain plan`` can plan but training does not run:
    context parallelism (megatron's attention without Transformer Engine has none).

    Raises:
        LayoutError: naming it, with the layout to use instead.
    """
    if layout.cp != 1:
        raise LayoutError(f"layout {layout}: context parallelism needs Transformer Engine attention",
                          hint=f"use cp1, e.g. {layout.replace(cp=1, dp=layout.dp * layout.cp)}")


__all__ = ["RECOMPUTE_CHOICES", "ExecutionOptions", "Recompute", "check_trainable"]
