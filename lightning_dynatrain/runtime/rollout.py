"""A rollout phase as every front end sees it: ``RolloutPolicy`` scores and samples tokens with the
training weights at the rollout layout, in the same processes, between two optimizer steps.

``TrainingRun.rollout(layout, park=, keep_weights=)`` enters the phase (``megatron.rollout``: the
weights alone switched to ``layout``, the rest parked) and yields the policy; leaving the ``with``
block returns to the training layout with the training state as it was, bit for bit.

The policy runs megatron's forward at the rollout layout; across pipeline stages through megatron's
forward-only schedule (the activations passed from stage to stage by megatron's p2p; at virtual
stages its interleaved schedule over the rank's model chunks, the rows in ``pp`` micro-batches), the last
stage's output (the last position's logits while sampling) broadcast to the other stages. Rows are
split over the data-parallel ranks and gathered back, so every rank gets every row; the
tensor-parallel ranks of a row compute its full logits (gathered over the vocabulary) and every
rank of a replica samples alike (a rollout layout with ``cp > 1`` is refused: whole sequences).
Each prompt samples from its own generator, seeded from ``seed`` and the prompt's index, so the
tokens drawn do not depend on the layout or on how rows are split. Generation keeps the keys and
values in megatron's static inference context (its KV cache; on CPU processes the host adapter
turns its CUDA allocation into a host one): the prompt runs once, then each new token alone.

Log-probabilities are the model's own, at temperature 1 over megatron's padded vocabulary, as the
training loss computes them (``-cross_entropy``): what a policy-gradient loss compares with.

Example (every rank)::

    with run.rollout("dp4-tp1-pp1", park="host") as policy:
        out = policy.generate(prompts, max_new_tokens=8, temperature=1.0, seed=step)
        old_log_probs = out.log_probs             # [rows, 8], the same on every rank
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from lightning_dynatrain.devices import device_kind
from lightning_dynatrain.transition.report import SwitchReport
from lightning_dynatrain.vps.errors import DynaTrainError
from lightning_dynatrain.vps.spec import ModelSpec

if TYPE_CHECKING:  # megatron-core loads with the first model, not with the package
    from megatron.core.inference.contexts import StaticInferenceContext

    from lightning_dynatrain.megatron.rollout import RolloutWeights


class RolloutError(DynaTrainError):
    """A rollout asked for what the run cannot do now (inside a step, already in a rollout, a switch
    or world change during one, a layout the model or world cannot take, scoring at ``cp > 1``)."""


class RolloutInterrupted(RolloutError):
    """A member died during a rollout phase and the survivors went on without it (an elastic run):
    the phase's results are dropped, the training state is the one of the step boundary it began at,
    and the training step runs again from its start in the survivors' world (``DynaTrainStrategy``
    does that itself; a rollout layout there must fit the new world)."""


@dataclass(frozen=True, kw_only=True)
class Generation:
    """What ``RolloutPolicy.generate`` returns, the same on every rank."""

    tokens: torch.Tensor
    """``[rows, prompt + new]``: each prompt followed by its sampled tokens."""
    log_probs: torch.Tensor
    """``[rows, new]`` (fp32): each sampled token's log-probability under the model (temperature 1)."""


@dataclass(frozen=True, kw_only=True)
class RolloutFigures:
    """What the phase's transitions cost on this rank."""

    enter_seconds: float
    enter_report: SwitchReport
    parked_bytes: int
    leave_seconds: float | None = None
    leave_report: SwitchReport | None = None


class RolloutPolicy:
    """The training weights at the rollout layout, for scoring and sampling (see the module docstring)."""

    def __init__(self, weights: "RolloutWeights", spec: ModelSpec) -> None:
        from lightning_dynatrain.megatron.execution import ExecutionOptions

        self._weights = weights
        self.spec = spec
        self.layout = weights.layout
        self._execution = ExecutionOptions()  # as ``megatron.rollout`` builds the model: no recompute
        self.figures: RolloutFigures | None = None
        """What entering (and, once left, leaving) the phase cost on this rank."""

    @property
    def model(self) -> torch.nn.Module:
        """This rank's model shard at the rollout layout (megatron's own module)."""
        if self._weights.model is None:
            raise RolloutError("the rollout phase has ended: its model is gone",
                               hint="use the policy only inside the `with ...rollout(...)` block")
        return self._weights.model

    # ------------------------------------------------------------------------------ scoring
    def log_probs(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[rows, length - 1]``: the log-probability of each next token of ``tokens``
        (``[rows, length]``, the same on every rank), the same on every rank."""
        tokens = self._rows(tokens, "tokens")
        if tokens.shape[1] < 2:
            raise RolloutError(f"tokens of length {tokens.shape[1]} have no next token to score",
                               hint="pass sequences of at least 2 tokens")
        return self._gathered(tokens, lambda local: -self._forward(local[:, :-1], labels=local[:, 1:]).float())

    def generate(self, prompts: torch.Tensor, *, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, seed: int = 0, kv_cache: bool = True) -> Generation:
        """Sample ``max_new_tokens`` after each prompt (``[rows, length]``, the same on every rank).

        ``temperature`` 0 takes the most likely token; ``top_k`` samples among the k most likely.
        ``kv_cache``: keep each layer's keys and values in megatron's static inference context, so
        each new token runs alone through the model (``False``, or a model or layout that cannot:
        every token runs the whole sequence again).
        """
        prompts = self._rows(prompts, "prompts")
        if max_new_tokens < 1 or temperature < 0 or (top_k is not None and top_k < 1):
            raise RolloutError(f"max_new_tokens={max_new_tokens}, temperature={temperature}, top_k={top_k}",
                               hint="max_new_tokens >= 1, temperature >= 0, top_k None or >= 1")
        vocab = self.spec.vocab_size

        def sample(local: torch.Tensor, first_row: int) -> torch.Tensor:
            generators = [torch.Generator().manual_seed(seed * 1_000_003 + first_row + i) for i in range(len(local))]
            cache = self._kv_cache(len(local), local.shape[1] + max_new_tokens) if kv_cache else None
            picked, scores = local, []
            for step in range(max_new_tokens):
                if cache is None:
                    logits = self._full_logits(picked, last=True)[:, -1].float()
                else:  # the prompt once, then each new token alone
                    logits = self._cached_logits(picked if step == 0 else picked[:, -1:], cache).float()
                log_probs = torch.log_softmax(logits, dim=-1)  # the model's own, over the padded vocabulary
                choice = _choose(logits[:, :vocab], temperature, top_k, generators).to(picked.device)
                scores.append(log_probs.gather(1, choice[:, None]))
                picked = torch.cat([picked, choice[:, None]], dim=1)
            return torch.cat([picked.float(), torch.cat(scores, dim=1)], dim=1)

        both = self._gathered(prompts, sample, with_offset=True)
        length = prompts.shape[1] + max_new_tokens
        return Generation(tokens=both[:, :length].long(), log_probs=both[:, length:])

    # ---------------------------------------------------------------------------- the model
    def _rows(self, tokens: torch.Tensor, what: str) -> torch.Tensor:
        if self.layout.cp > 1:
            raise RolloutError(f"the rollout layout {self.layout} splits sequences over {self.layout.cp} "
                               "context-parallel ranks: scoring and sampling run on whole sequences",
                               hint="choose a rollout layout with cp1")
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype != torch.long:
            raise RolloutError(f"{what} must be a 2-D LongTensor [rows, length], got "
                               f"{getattr(tokens, 'dtype', type(tokens).__name__)} "
                               f"{tuple(getattr(tokens, 'shape', ()))}",
                               hint="pad prompts to one length (left-pad) and stack them")
        return tokens.to(next(self.model.parameters()).device)

    def _forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None, *, last: bool = False) -> torch.Tensor:
        """Megatron's forward (a loss per token with ``labels``, else this rank's vocabulary shard of
        the logits; ``last``: the last position's only), on every rank of the pipeline; the sequence
        right-padded where sequence parallelism splits it (causal: the padding changes no earlier
        position)."""
        length = tokens.shape[1]
        tp = self.layout.tp
        pad = -length % tp if self._execution.sequence_parallel_at(tp, is_moe=self.spec.num_experts > 0) else 0
        if pad:
            tokens = torch.nn.functional.pad(tokens, (0, pad))
            labels = torch.nn.functional.pad(labels, (0, pad)) if labels is not None else None
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
        out = self._run_model(tokens, input_ids=tokens, position_ids=positions, attention_mask=None, labels=labels)
        if out is not None:
            out = out[:, length - 1:length] if last else out[:, :length]
        return out if self.layout.pp == 1 else self._from_last_stage(out)

    def _run_model(self, tokens: torch.Tensor, **kwargs) -> torch.Tensor | None:
        """The model's forward on ``kwargs``; across pipeline stages megatron's forward-only schedule
        passes the activations from stage to stage (the output on the last stage, else ``None``). At
        virtual stages megatron's interleaved schedule runs at least ``pp`` micro-batches: the rows
        are split into ``pp`` of one size (the last row repeated to fill them, its copies dropped),
        each with its own KV cache (``inference_context`` is then a list, one per micro-batch)."""
        with device_kind(tokens.device).megatron_context(), torch.no_grad():
            if self.layout.pp == 1:
                return self.model(**kwargs)
            from lightning_dynatrain.megatron.model_chunks import chunk_list
            from lightning_dynatrain.megatron.train_step import pipeline_schedule

            rows, count = len(tokens), self._micro_batch_count
            size = -(-rows // count)
            micro = [{"tokens": part, "kwargs": {}} for part in _filled(tokens, count * size).split(size)]
            for name, value in kwargs.items():
                if isinstance(value, torch.Tensor) and value.dim() and len(value) == rows:
                    parts = _filled(value, count * size).split(size)
                elif isinstance(value, list):  # one per micro-batch: the KV caches at virtual stages
                    parts = value
                else:
                    parts = [value] * count
                for batch, part in zip(micro, parts, strict=True):
                    batch["kwargs"][name] = part
            outputs = pipeline_schedule(chunk_list(self.model), micro, _stage_forward, tokens.shape[1],
                                        forward_only=True)
        return torch.cat(outputs)[:rows] if outputs else None

    @property
    def _micro_batch_count(self) -> int:
        """Micro-batches per forward: 1, or ``pp`` at virtual stages (megatron's interleaved schedule
        runs whole groups of ``pp``)."""
        return self.layout.pp if self.layout.vpp > 1 else 1

    def _kv_cache(self, rows: int, length: int) -> "list[StaticInferenceContext] | StaticInferenceContext | None":
        """Megatron's static KV cache for ``rows`` sequences of up to ``length`` tokens (at virtual
        stages one per micro-batch), or ``None`` where it cannot serve: sequence parallelism pads
        single tokens (MoE layers at tp > 1), or a model whose forward takes no ``inference_context``."""
        import inspect

        from megatron.core.inference.contexts import StaticInferenceContext

        from lightning_dynatrain.megatron.model_chunks import chunk_list

        if self._execution.sequence_parallel_at(self.layout.tp, is_moe=self.spec.num_experts > 0) or \
                "inference_context" not in inspect.signature(chunk_list(self.model)[0].forward).parameters:
            return None
        count = self._micro_batch_count
        if count == 1:
            return StaticInferenceContext(max_batch_size=rows, max_sequence_length=length)
        return [StaticInferenceContext(max_batch_size=-(-rows // count), max_sequence_length=length)
                for _ in range(count)]

    def _cached_logits(self, tokens: torch.Tensor,
                       cache: "list[StaticInferenceContext] | StaticInferenceContext") -> torch.Tensor:
        """``[rows, padded vocabulary]``: the logits after ``tokens``, the tokens before them read
        from ``cache`` (megatron gathers the tensor-parallel shards itself), on every rank."""
        caches = cache if isinstance(cache, list) else [cache]
        start = caches[0].sequence_len_offset
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
        out = self._run_model(tokens, input_ids=tokens, position_ids=positions, attention_mask=None,
                              inference_context=cache, runtime_gather_output=True)
        for each in caches:
            each.sequence_len_offset += tokens.shape[1]
        out = out[:, -1] if out is not None else None
        return out if self.layout.pp == 1 else self._from_last_stage(out)

    def _from_last_stage(self, out: torch.Tensor | None) -> torch.Tensor:
        """The last pipeline stage's ``out`` (fp32) on every stage (``None`` off the last stage)."""
        group = self._weights.groups.pp
        device = next(self.model.parameters()).device
        shape = torch.zeros(4, dtype=torch.long, device=device)
        if out is not None:
            out = out.float().contiguous()
            shape[:out.dim() + 1] = torch.tensor([out.dim(), *out.shape])
        last = dist.get_global_rank(group, group.size() - 1)
        dist.broadcast(shape, src=last, group=group)
        if out is None:
            out = torch.empty(shape[1:1 + int(shape[0])].tolist(), dtype=torch.float32, device=device)
        dist.broadcast(out, src=last, group=group)
        return out

    def _full_logits(self, tokens: torch.Tensor, *, last: bool = False) -> torch.Tensor:
        """``[rows, length, padded vocabulary]`` (``last``: ``length`` 1): the shards of the
        tensor-parallel ranks joined."""
        shard = self._forward(tokens, last=last).contiguous()
        group = self._weights.groups.tp
        if group.size() == 1:
            return shard
        parts = [torch.empty_like(shard) for _ in range(group.size())]
        dist.all_gather(parts, shard, group=group)
        return torch.cat(parts, dim=-1)

    def _gathered(self, rows: torch.Tensor, compute, *, with_offset: bool = False) -> torch.Tensor:
        """``compute`` on this data-parallel rank's rows (contiguous, at most ``ceil(rows / dp)``),
        every rank's results gathered back in row order (every rank gets all)."""
        group = self._weights.groups.dp
        dp, me = group.size(), group.rank()
        each = -(-len(rows) // dp)
        start, end = min(me * each, len(rows)), min((me + 1) * each, len(rows))
        local = rows[start:end]
        if len(local):
            out = compute(local, start) if with_offset else compute(local)
        else:  # no rows here: the shape of a result, for the gather (the other ranks do compute)
            out = (compute(rows[:1], 0) if with_offset else compute(rows[:1]))[:0]
        if dp == 1:
            return out
        padded = torch.zeros((each, *out.shape[1:]), dtype=out.dtype, device=out.device)
        padded[:len(out)] = out
        parts = [torch.empty_like(padded) for _ in range(dp)]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([p[:max(0, min(each, len(rows) - r * each))] for r, p in enumerate(parts)])


def _stage_forward(data_iterator, model: torch.nn.Module):
    """A pipeline stage's forward for megatron's schedule: the raw output, no loss."""
    return model(**next(data_iterator)["kwargs"]), None


def _filled(rows: torch.Tensor, count: int) -> torch.Tensor:
    """``rows`` with its last row repeated up to ``count`` rows (micro-batches of one size)."""
    return torch.cat([rows, rows[-1:].expand(count - len(rows), *rows.shape[1:])]) if count > len(rows) else rows


def _choose(logits: torch.Tensor, temperature: float, top_k: int | None,
            generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row: the most likely at temperature 0, else sampled (from row ``i``'s generator)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.detach().cpu() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        cut = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < cut, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.stack([torch.multinomial(p, 1, generator=g)[0] for p, g in zip(probs, generators)])


__all__ = ["Generation", "RolloutError", "RolloutFigures", "RolloutInterrupted", "RolloutPolicy"]
