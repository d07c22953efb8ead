"""One optimizer step, or one forward-only pass, through megatron's own pipeline schedules.

The local batch (this data-parallel rank's rows of the global batch) is cut into micro-batches
along dim 0, every tensor alike; megatron's schedule for the current pipeline (1F1B, or no
pipelining) calls the model's ``forward_step`` on each; gradients are finalized (all-reduced over
data parallelism, the tied embedding's copies summed) and the optimizer steps. The loss returned
is the one ``forward_step``'s ``loss_func`` reports, summed over micro-batches and data-parallel
ranks, the same float on every rank.

Example (2 ranks, ``dp2-tp1-pp1``)::

    ddp, opt = build_ddp_and_optimizer(model, layout, lr=1e-3)
    loss = run_train_step(ddp, opt, {"tokens": x, "labels": y}, layout, num_microbatches=2)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.process_groups_config import ProcessGroupCollection

from lightning_dynatrain.devices import device_kind
from lightning_dynatrain.megatron.model_chunks import chunk_list
from lightning_dynatrain.megatron.step_progress import StepProgress, checked_at_layers
from lightning_dynatrain.megatron.parallel_state_adapter import current_process_groups
from lightning_dynatrain.vps.errors import LayoutError
from lightning_dynatrain.vps.layout import ParallelConfig


def _microbatches(batch: Mapping[str, torch.Tensor], num_microbatches: int) -> list[dict[str, torch.Tensor]]:
    """``batch`` cut into ``num_microbatches`` along dim 0, every tensor alike."""
    rows = {k: v.shape[0] for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    tokens = batch.get("tokens")
    if not rows or any(n % num_microbatches for n in rows.values()) or (tokens is not None and tokens.dim() != 2):
        raise ValueError(
            f"a batch of {rows} rows cannot be split into {num_microbatches} micro-batches. "
            "HINT: pass [local_batch, ...] tensors with local_batch a multiple of num_microbatches "
            "(tokens [local_batch, seq])"
        )
    parts = {k: batch[k].chunk(num_microbatches) for k in rows}
    return [{k: parts[k][i] for k in parts} for i in range(num_microbatches)]


def run_train_step(
    ddp_model: DistributedDataParallel | Sequence[DistributedDataParallel],
    optimizer: MegatronOptimizer,
    batch: Mapping[str, torch.Tensor],
    layout: ParallelConfig,
    num_microbatches: int,
    *,
    forward_step: Callable | None = None,
    seq_length: int | None = None,
    pg_collection: ProcessGroupCollection | None = None,
    progress: StepProgress | None = None,
) -> float:
    """One optimizer step over this data-parallel rank's ``batch``; returns the global mean loss.

    Args:
        ddp_model: megatron's DDP around the model, or one per model chunk with virtual pipeline
            stages (megatron's interleaved schedule then runs over them).
        batch: tensors cut along dim 0 into micro-batches (the GPT preset's: ``tokens`` and ``labels``
            ``[local_batch, seq]``, optional ``loss_mask``). Every TP/PP rank of a data-parallel
            replica passes the same batch.
        num_microbatches: micro-batches the local batch is split into (1F1B schedule when pp > 1).
        forward_step: megatron's ``forward_step(data_iterator, model)`` (default: the GPT preset's).
        seq_length: tokens per sequence for the pipeline's buffers (default: ``tokens``' dim 1).
        progress: filled as the step goes (``step_progress``): what a recovery reads if it fails.

    Returns:
        The loss reported over all micro-batches and data-parallel ranks: the sum over their
        reported ``[sum, count]`` pairs' sums divided by their counts (the GPT preset: masked token
        losses over tokens); the same float on every rank.
    """
    chunks = chunk_list(ddp_model)
    pgs, device, micro = _micro_batches(chunks, batch, layout, num_microbatches, pg_collection)
    for chunk in chunks:
        chunk.train()
    with device_kind(device).megatron_context():
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        with checked_at_layers(chunks, progress.stop_if_lost if progress is not None else None):
            reports = pipeline_schedule(chunks, micro, forward_step, seq_length, forward_only=False)
        if progress is not None:
            progress.reached("forward_backward")
        finalize_model_grads(chunks, pg_collection=pgs)
        optimizer.step()
        if progress is not None:
            progress.reached("optimizer")
    loss = _global_mean_loss(reports, pgs, device)
    if progress is not None:
        progress.loss = loss
    return loss


def run_eval_step(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    batch: Mapping[str, torch.Tensor],
    layout: ParallelConfig,
    num_microbatches: int,
    *,
    forward_step: Callable | None = None,
    seq_length: int | None = None,
    pg_collection: ProcessGroupCollection | None = None,
) -> float:
    """``run_train_step``'s forward passes only (megatron's forward-only schedule across pipeline
    stages, no gradients, nothing updated); ``model`` is megatron's DDP or the bare model shard (or
    their model chunks).

    Returns:
        The global mean loss over this batch, the same float on every rank.
    """
    chunks = chunk_list(model)
    pgs, device, micro = _micro_batches(chunks, batch, layout, num_microbatches, pg_collection)
    was_training = [chunk.training for chunk in chunks]
    for chunk in chunks:
        chunk.eval()
    try:
        with device_kind(device).megatron_context(), torch.no_grad():
            reports = pipeline_schedule(chunks, micro, forward_step, seq_length, forward_only=True)
    finally:
        for chunk, training in zip(chunks, was_training):
            chunk.train(training)
    return _global_mean_loss(reports, pgs, device)


def _micro_batches(chunks: list[torch.nn.Module], batch: Mapping[str, torch.Tensor], layout: ParallelConfig,
                   num_microbatches: int, pg_collection: ProcessGroupCollection | None
                   ) -> tuple[ProcessGroupCollection, torch.device, list[dict[str, torch.Tensor]]]:
    """The groups (checked against ``layout``), the model's device and ``batch`` cut into micro-batches there."""
    pgs = pg_collection if pg_collection is not None else current_process_groups()
    if pgs.pp.size() != layout.pp:
        raise LayoutError(f"pipeline group of size {pgs.pp.size()} does not match layout {layout}",
                          hint="build the model (and DDP, optimizer) after initialize_for_layout(layout, ...)")
    if len(chunks) != layout.vpp:
        raise LayoutError(f"{len(chunks)} model chunk(s) for layout {layout}, which has {layout.vpp} virtual stage(s)",
                          hint="build the model at the layout it trains at")
    device = next(chunks[0].parameters()).device
    moved = {k: v.to(device) for k, v in batch.items() if isinstance(v, torch.Tensor)}
    return pgs, device, _microbatches(moved, num_microbatches)


def pipeline_schedule(chunks: list[torch.nn.Module], micro: list[dict[str, torch.Tensor]],
                      forward_step: Callable | None, seq_length: int | None, *, forward_only: bool) -> list:
    """Megatron's schedule for the current pipeline (interleaved 1F1B over several model chunks,
    1F1B, or no pipelining) over ``micro``: what the last stage's ``loss_func`` reports per
    micro-batch (its raw output where ``forward_step`` returns ``(output, None)``), ``[]`` on the
    other stages. Each chunk reads the micro-batches from an iterator of its own, as megatron's
    interleaved schedule asks."""
    if forward_step is None:
        from lightning_dynatrain.megatron.gpt import gpt_forward_step as forward_step
    first = micro[0]
    micro_batch_size = next(iter(first.values())).shape[0]
    if seq_length is None:
        if "tokens" not in first:
            raise ValueError("the pipeline needs the sequence length: the batch has no `tokens` [batch, seq]. "
                             "HINT: give the model's seq_length (ModelProvider(seq_length=...))")
        seq_length = first["tokens"].shape[1]
    data = [iter(micro) for _ in chunks] if len(chunks) > 1 else iter(micro)
    return get_forward_backward_func()(forward_step_func=forward_step, data_iterator=data, model=chunks,
                                       num_microbatches=len(micro), seq_length=seq_length,
                                       micro_batch_size=micro_batch_size, forward_only=forward_only)


def _loss_pair(report: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """One micro-batch's reported ``[sum, count]``: megatron's ``lm loss`` (or the first value
    reported); a single value counts once."""
    value = report["lm loss"] if "lm loss" in report else next(iter(report.values()))
    value = torch.as_tensor(value).detach().to(torch.float64).view(-1)
    return value[:2] if value.numel() >= 2 else torch.cat([value, value.new_ones(1)])


def _global_mean_loss(reports: list, pgs: ProcessGroupCollection, device: torch.device) -> float:
    """Sum the last stage's (loss sum, count) over the data-parallel ranks and hand the ratio to
    every pipeline stage: the same float on every rank."""
    total = torch.zeros(2, dtype=torch.float64, device=device)
    last_stage = pgs.pp.rank() == pgs.pp.size() - 1
    if last_stage:
        for report in reports:
            total += _loss_pair(report).to(device)
        dist.all_reduce(total, group=pgs.dp_cp)
    if pgs.pp.size() > 1:
        last_rank = dist.get_global_rank(pgs.pp, pgs.pp.size() - 1)
        dist.broadcast(total, src=last_rank, group=pgs.pp)
    return float(total[0] / total[1])


__all__ = ["pipeline_schedule", "run_eval_step", "run_train_step"]
