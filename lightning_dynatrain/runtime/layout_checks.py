"""Checks a target layout must pass before any state moves; each error names the rule and a fix.

Used at three places: the strategy's initial layout (``setup_environment``/``configure_model``), a
``reconfigure(target)`` request, and every entry of a ``ScheduledReconfig`` schedule at ``setup``
(so a bad layout at step 5000 fails at step 0).

Example::

    validate_target("dp1-tp3-pp1", model=shape, world_size=4)
    # LayoutError: layout dp1-tp3-pp1 does not fit gpt: ... dp*tp*pp*cp = 3 must equal the world size 4 ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_dynatrain.megatron.execution import ExecutionOptions
from lightning_dynatrain.vps.errors import DynaTrainError, LayoutError
from lightning_dynatrain.vps.layout import ParallelConfig

if TYPE_CHECKING:
    from megatron.core.optimizer import OptimizerConfig

    from lightning_dynatrain.megatron.model_source import ModelSource
    from lightning_dynatrain.vps.spec import ModelSpec


class WorldSizeError(LayoutError):
    """A target layout needs a different number of processes than the job has."""


class BatchSizeError(DynaTrainError):
    """The global batch does not split into whole micro-batches at a layout."""


def num_microbatches(global_batch_size: int, dp: int, micro_batch_size: int) -> int:
    """Micro-batches per optimizer step: ``global // (dp * micro)``, exact or an error.

    >>> num_microbatches(16, 2, 4)
    2
    """
    if global_batch_size < 1 or micro_batch_size < 1:
        raise BatchSizeError(f"global_batch_size={global_batch_size} and micro_batch_size={micro_batch_size} "
                             "must be positive", hint="pick e.g. global_batch_size=16, micro_batch_size=2")
    per_step = dp * micro_batch_size
    if global_batch_size % per_step:
        raise BatchSizeError(
            f"global batch {global_batch_size} is not a multiple of dp * micro_batch_size = {dp} * "
            f"{micro_batch_size} = {per_step}",
            hint=f"use a global batch that is a multiple of {per_step}, or a micro-batch size dividing "
            f"{global_batch_size // dp if global_batch_size % dp == 0 else 'global_batch / dp'}",
        )
    return global_batch_size // per_step


def layout_microbatches(global_batch_size: int, micro_batch_size: int, layout: ParallelConfig) -> int:
    """Micro-batches per optimizer step at ``layout`` (``num_microbatches`` over its dp), a multiple of
    pp where the layout interleaves (megatron's interleaved schedule runs them in groups of pp).

    >>> layout_microbatches(6, 1, ParallelConfig.parse("dp1-tp1-pp2-vpp2"))
    6
    >>> layout_microbatches(3, 1, ParallelConfig.parse("dp1-tp1-pp2-vpp2"))
    Traceback (most recent call last):
    ...
    lightning_dynatrain.runtime.layout_checks.BatchSizeError: layout dp1-tp1-pp2-vpp2 interleaves its pipeline: megatron runs micro-batches in groups of pp = 2, and a step has 3. HINT: use a global batch of 2 or 4 (a multiple of dp * micro_batch_size * pp = 2), or vpp1
    """
    count = num_microbatches(global_batch_size, layout.dp * layout.cp, micro_batch_size)
    if layout.vpp > 1 and count % layout.pp:
        unit = layout.dp * layout.cp * micro_batch_size * layout.pp
        below, above = max(unit, global_batch_size // unit * unit), -(-global_batch_size // unit) * unit
        raise BatchSizeError(f"layout {layout} interleaves its pipeline: megatron runs micro-batches in groups of "
                             f"pp = {layout.pp}, and a step has {count}",
                             hint=f"use a global batch of {below} or {above} (a multiple of dp * micro_batch_size * "
                                  f"pp = {unit}), or vpp1")
    return count


def validate_target(
    target: "str | ParallelConfig",
    *,
    world_size: int,
    model: "ModelSource | None" = None,
    global_batch_size: int | None = None,
    micro_batch_size: int | None = None,
    current: ParallelConfig | None = None,
    execution: ExecutionOptions | None = None,
) -> ParallelConfig:
    """Parse ``target`` and check it against the world, the model and the batch; return the layout.

    Args:
        world_size: processes in the job; a layout of another size is refused (world changes go
            through the Elastic Device Manager, not a layout switch).
        model: the model (``GPTShape`` or ``ModelProvider``); ``None`` skips the model rules.
        global_batch_size, micro_batch_size: ``None`` skips the batch rule.
        current: the layout now running; only used to word the world-size error.
        execution: sequence parallelism and recompute (``MegatronRecipe.execution``); ``None``: defaults.

    Raises:
        LayoutError: malformed, or breaks a model rule (the message names each rule broken).
        WorldSizeError: ``dp*tp*pp*cp`` differs from ``world_size``.
        BatchSizeError: the global batch does not split into micro-batches at this dp.
    """
    layout = ParallelConfig.parse(target)
    if layout.world_size != world_size:
        now = f" (now {current})" if current is not None else ""
        raise WorldSizeError(
            f"layout {layout} needs dp*tp*pp*cp = {layout.world_size} processes but the job runs {world_size}{now}; "
            "a layout switch keeps the world, growing/shrinking the world needs the Elastic Device Manager",
            hint=f"choose a layout whose dp*tp*pp*cp is {world_size}",
        )
    if model is not None:
        model.validate(layout, execution or ExecutionOptions())
    if global_batch_size is not None and micro_batch_size is not None:
        layout_microbatches(global_batch_size, micro_batch_size, layout)
    return layout


def validate_optimizer(config: "OptimizerConfig", layout: ParallelConfig) -> None:
    """Megatron-core's distributed optimizer (``zero1``) takes Adam only (its checkpointing asserts).

    Raises:
        LayoutError: ``zero1`` with another optimizer.
    """
    if layout.zero and config.optimizer != "adam":
        raise LayoutError(f"layout {layout}: megatron's distributed optimizer (zero1) takes Adam only, and this run "
                          f"trains with {config.optimizer}", hint="drop -zero1 from the layout, or train with Adam")


def padded_vocab_sizes(spec: "ModelSpec", layouts: list[ParallelConfig]) -> dict[int, int]:
    """Megatron's padded vocabulary at each TP size of ``layouts`` (``{tp: padded}``).

    They must agree for a switch to keep the model: padded rows take part in the softmax.
    """
    return {layout.tp: spec.padded_vocab(layout.tp) for layout in layouts}


def vocab_divisor_for(vocab_size: int, tp_sizes: list[int]) -> int:
    """A ``make_vocab_size_divisible_by`` that gives the same padded vocabulary at every TP size given.

    With ``L = lcm(tp_sizes)`` the padded size is ``ceil(vocab / L) * L`` everywhere, e.g. vocab 256
    and tp 1, 2, 4 -> divisor 64 (padded 256, no padding at all).

    >>> vocab_divisor_for(256, [1, 2, 4])
    64
    """
    import math

    lcm = math.lcm(*tp_sizes) if tp_sizes else 1
    divisor = -(-vocab_size // lcm)
    target = divisor * lcm
    for tp in tp_sizes:  # (lcm - 1)^2 < vocab suffices; check rather than assume
        multiple = divisor * tp
        if -(-vocab_size // multiple) * multiple != target:
            raise ValueError(f"no common vocabulary padding for vocab {vocab_size} at tp sizes {tp_sizes}")
    return divisor


__all__ = ["BatchSizeError", "WorldSizeError", "layout_microbatches", "num_microbatches", "padded_vocab_sizes",
           "validate_optimizer", "validate_target", "vocab_divisor_for"]
