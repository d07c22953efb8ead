"""Which layout a world of a new size trains at: a user's map, or ``auto`` by a throughput model.

A **map** says it: ``{2: "dp2-tp1-pp1", 4: "dp2-tp2-pp1"}`` in Python, or the same in an OmegaConf
YAML file (``layouts: {2: dp2-tp1-pp1, 4: dp2-tp2-pp1}``). A size the map does not name is refused
with the sizes it does name.

**auto** takes every layout of the new size that the model and the global batch allow (``tp``
divides the heads, ``pp`` the layers, the global batch splits into micro-batches at that ``dp``;
the global batch itself never changes), keeps those whose state fits ``memory_per_rank`` when
given, and picks the one with the shortest modelled step time; layouts within 1% of the best are a
tie, broken by the fewest bytes the switch moves. The model of a step (``StepModel``):

- compute: ``6 * parameters * tokens / (world * peak_flops)``, stretched by the pipeline bubble
  ``(pp - 1) / (vpp * microbatches)`` (two virtual stages halve it);
- tensor parallel: four all-reduces of each layer's activations per micro-batch (forward and
  backward), ``2 (tp-1)/tp`` of the bytes each, over the intra-node links;
- pipeline: each micro-batch's activations sent on, and their gradients back, between stages
  (``vpp`` times as often with virtual stages: each chunk hands on to the next);
- data parallel: the gradient all-reduce, ``2 (dp-1)/dp`` of the rank's gradient bytes.

It ranks layouts; it does not predict seconds. Where no layout of the new size is valid, the
policy refuses with the reason (``LayoutError``); it never changes the global batch. Every layout
with a pipeline is also weighed with two virtual stages (``-vpp2``, where the layers and the
micro-batches allow it): the state a rank holds is the same with or without them, so the memory
filter never prefers them; only the modelled bubble against the transfers decides. Uneven splits
(``-firstN``/``-lastN``) are never proposed: the model counts parameters per rank, not per stage.

Example::

    choice = choose_layout("auto", world=4, source=shape, global_batch_size=16, micro_batch_size=2,
                           current=ParallelConfig.parse("dp2-tp1-pp1"))
    choice.layout, choice.reason
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Union

from lightning_dynatrain.vps.dryrun import LinkModel
from lightning_dynatrain.vps.errors import DynaTrainError, LayoutError
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.members import Members
from lightning_dynatrain.vps.spec import ModelSpec, Precision

if TYPE_CHECKING:
    from lightning_dynatrain.megatron.model_source import ModelSource

Policy = Union[str, Mapping[int, "str | ParallelConfig"], Path]
"""``"auto"``, a map from world size to layout, or the path of a YAML file holding such a map."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepModel:
    """The hardware ``auto`` ranks layouts for (see the module docstring)."""

    peak_flops: float = 400e12
    """Sustained FLOP/s of one device."""
    links: LinkModel = LinkModel()
    """Link bandwidths (bytes/s per rank and direction)."""


@dataclass(frozen=True, slots=True)
class LayoutChoice:
    """The layout a policy chose for a world, and why (for the log)."""

    layout: ParallelConfig
    reason: str


def parse_policy(policy: Policy) -> "str | dict[int, ParallelConfig]":
    """``"auto"``, or the map with every layout parsed (a YAML path read with OmegaConf).

    Raises:
        LayoutError: a layout that does not parse, a size that is not its layout's world size, a
            string that is neither ``auto`` nor a file.
    """
    if isinstance(policy, str) and policy.strip().lower() == "auto":
        return "auto"
    if isinstance(policy, (str, Path)):
        from omegaconf import OmegaConf

        if not Path(policy).is_file():
            raise LayoutError(f"the layout policy {str(policy)!r} is not 'auto', a map or a YAML file that exists",
                              hint="pass 'auto', a map such as '{2: dp2-tp1-pp1, 4: dp2-tp2-pp1}' (a space after "
                              "each colon, in YAML) or the path of a YAML file")
        loaded = OmegaConf.to_container(OmegaConf.load(policy))
        policy = loaded.get("layouts", loaded) if isinstance(loaded, dict) else loaded
    if not isinstance(policy, Mapping) or not policy:
        raise LayoutError(f"cannot read a layout policy from {policy!r}",
                          hint="pass 'auto', a map {world size: layout}, or a YAML file with 'layouts: {2: dp2-tp1-pp1}'")
    parsed = {int(size): ParallelConfig.parse(layout) for size, layout in policy.items()}
    wrong = {size: str(layout) for size, layout in parsed.items() if layout.world_size != size}
    if wrong:
        raise LayoutError(f"the layout policy maps world sizes to layouts of other sizes: {wrong}",
                          hint="give each world size a layout whose dp*tp*pp*cp is that size")
    return parsed


def choose_layout(policy: "str | dict[int, ParallelConfig]", *, world: int, source: "ModelSource", global_batch_size: int,
                  micro_batch_size: int, current: ParallelConfig, precision: Precision = Precision.FP32,
                  members: Members | None = None, memory_per_rank: int | None = None,
                  model: StepModel = StepModel()) -> LayoutChoice:
    """The layout for a world of ``world`` processes (``policy`` from ``parse_policy``).

    Raises:
        LayoutError: the map has no layout for ``world``, its layout does not fit the model or the
            batch, or (auto) no layout of that size does.
    """
    from lightning_dynatrain.runtime.layout_checks import validate_target

    def check(layout: ParallelConfig) -> ParallelConfig:
        return validate_target(layout, world_size=world, model=source, global_batch_size=global_batch_size,
                               micro_batch_size=micro_batch_size)

    if policy != "auto":
        assert isinstance(policy, dict)
        if world not in policy:
            raise LayoutError(f"the layout policy has no layout for a world of {world} processes "
                              f"(it has {sorted(policy)})", hint=f"add {world}: <layout> to OnNodeChange's map")
        return LayoutChoice(check(policy[world]), f"the policy's map gives {policy[world]} for {world} processes")
    return _auto(world, source, global_batch_size, micro_batch_size, current, precision, members, memory_per_rank,
                 model, check)


def candidate_layouts(world: int, current: ParallelConfig) -> list[ParallelConfig]:
    """Dense layouts of ``world`` processes (``tp * pp * dp``), keeping ``current``'s ZeRO stage
    where data parallelism remains; each with a pipeline also with two virtual stages."""
    out = []
    for tp in _divisors(world):
        for pp in _divisors(world // tp):
            dp = world // (tp * pp)
            for vpp in (1, 2) if pp > 1 else (1,):
                out.append(ParallelConfig(dp=dp, tp=tp, pp=pp, vpp=vpp, zero=current.zero if dp > 1 else 0))
    return out


def step_seconds(layout: ParallelConfig, spec: ModelSpec, shape: "ModelSource", *, global_batch_size: int,
                 micro_batch_size: int, precision: Precision, model: StepModel) -> float:
    """The modelled step time of ``layout`` (see the module docstring): for ranking only."""
    tokens = global_batch_size * shape.seq_length
    microbatches = global_batch_size // (layout.dp * micro_batch_size)
    compute = 6 * spec.parameters * tokens / (layout.world_size * model.peak_flops)
    bubble = (layout.pp - 1) / (layout.vpp * microbatches)
    act_bytes = 2 if precision.params == "bf16" else 4
    tp_bytes = (shape.layers / layout.pp) * 4 * 2 * (layout.tp - 1) / layout.tp * \
        (global_batch_size / layout.dp) * shape.seq_length * shape.hidden * act_bytes
    pp_bytes = 2 * layout.vpp * microbatches * micro_batch_size * shape.seq_length * shape.hidden * act_bytes \
        if layout.pp > 1 else 0
    dp_bytes = 2 * (layout.dp - 1) / layout.dp * spec.parameters / (layout.tp * layout.pp) * 4
    return compute * (1 + bubble) + (tp_bytes + pp_bytes + dp_bytes) / model.links.intra_node


def rank_state_bytes(layout: ParallelConfig, spec: ModelSpec, precision: Precision) -> int:
    """A rank's params, gradients and optimizer state at ``layout`` (even split; for the memory filter)."""
    shard = spec.parameters / (layout.tp * layout.pp)
    param, optim = precision.kinds[0][1], sum(b for _, b in precision.kinds[1:])
    grads = 4  # megatron accumulates gradients in fp32
    return int(shard * (param + grads) + shard * optim / (layout.dp if layout.zero else 1))


def moved_bytes(spec: ModelSpec, src: ParallelConfig, dst: ParallelConfig, precision: Precision,
                members: Members | None) -> int:
    """Bytes every process receives in the switch ``src -> dst`` (the planner's exact plans)."""
    from lightning_dynatrain.vps.planner import plan_rank

    members = members or Members.same(src.world_size, dst.world_size)
    total = 0
    for process in range(members.size):
        plan = plan_rank(spec, src, dst, process, precision=precision, members=members)
        total += plan.bytes(plan.recvs, spec, precision)
    return total


def _auto(world, shape, global_batch_size, micro_batch_size, current, precision, members, memory_per_rank, model,
          check) -> LayoutChoice:
    if shape.seq_length is None:
        raise LayoutError("policy='auto' models each layout's step from the sequence length, which the model does "
                          "not give", hint="pass ModelProvider(seq_length=...), or a {world_size: layout} map")
    spec = shape.spec()
    valid, refused = [], []
    for layout in candidate_layouts(world, current):
        try:
            valid.append(check(layout))
        except DynaTrainError as err:
            if layout.vpp == 1:  # (a refused virtual-stage variant says what its plain layout says, or less)
                refused.append(f"{layout}: {str(err).split('. HINT')[0]}")
    if memory_per_rank is not None:
        fits = [lay for lay in valid if rank_state_bytes(lay, spec, precision) <= memory_per_rank]
        refused += [f"{lay}: its state takes {rank_state_bytes(lay, spec, precision) / 2**30:.2f} GiB a rank"
                    for lay in valid if lay not in fits]
        valid = fits
    if not valid:
        raise LayoutError(f"no layout of {world} processes fits the model and the global batch of "
                          f"{global_batch_size}: {'; '.join(refused)}",
                          hint="change the world size, or the global and micro batch sizes")
    timed = {lay: step_seconds(lay, spec, shape, global_batch_size=global_batch_size,
                               micro_batch_size=micro_batch_size, precision=precision, model=model) for lay in valid}
    best = min(timed.values())
    tied = [lay for lay in valid if timed[lay] <= best * 1.01]
    moves = {lay: moved_bytes(spec, current, lay, precision, members) for lay in tied} if len(tied) > 1 else {}
    chosen = min(tied, key=lambda lay: (moves.get(lay, 0), timed[lay], str(lay)))
    others = ", ".join(f"{lay} {timed[lay] / best:.2f}x" for lay in sorted(valid, key=timed.get) if lay != chosen)
    why = f"auto: {chosen} has the shortest modelled step of the {len(valid)} valid layouts of {world} processes"
    if len(tied) > 1:
        why += f" (tied within 1% with {len(tied) - 1}; it moves the fewest bytes, {moves[chosen] / 2**20:.1f} MiB)"
    return LayoutChoice(chosen, why + (f"; others: {others}" if others else ""))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


__all__ = ["LayoutChoice", "Policy", "StepModel", "candidate_layouts", "choose_layout", "moved_bytes", "parse_policy",
           "rank_state_bytes", "step_seconds"]
