"""A model's logical tensors read from megatron's own description of its shards, not hand-written.

Any megatron module says, for distributed checkpointing, which part of which layout-free tensor each
of its local tensors is (``vps.shards``). Read at a few *probe* layouts, that description says
everything the Virtual Parameter Space needs:

- at ``dp1-tp1-pp1`` (one rank holds everything): each tensor's key, global shape, stack axes (the
  layer axis, then the expert axis), the chunks a factory cuts a parameter into (megatron's SwiGLU
  ``linear_fc1`` is two chunks: logically ``[2, ffn, hidden]``), the parameter-name pattern, which
  parameters stay fp32 under bf16, and megatron's registration order;
- at a ``tp > 1`` layout (tp ranks 0 and 1): which axis tensor parallelism cuts (none: replicated),
  and which axis grows with tp (a vocabulary, padded per tp by the declared ``VocabPadding``);
- at a ``pp > 1`` layout (first and last stage): where each tensor lives (a stage's layers, the
  first stage, the last, or both: a tied embedding, with its name on the last stage);
- at an ``ep > 1`` layout: that the expert axis is the one expert parallelism cuts (checked).

``derive_spec`` turns the probes into a ``ModelSpec`` (a ``vps.description.DerivedSpec``) and
checks the spec's prediction against every probe, rank for rank (``description_problems``; the same
check runs on the live model the run starts with), so a module whose shards do not follow these
rules is refused by name before training starts. Pure: no torch, no process.

Example (``probes`` from ``megatron.probe.probe_module``)::

    derived = derive_spec("my-gpt", probes, vocab=VocabPadding(50257, 128))
    derived.spec.tensor("decoder.layers.mlp.linear_fc1.weight").axes   # ('layer', '', 'tp', '')
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_dynatrain.vps.description import WHOLE, DerivedSpec, description_problems, logical_box
from lightning_dynatrain.vps.errors import ModelSpecError
from lightning_dynatrain.vps.shards import ModuleDescription, ShardRecord, VocabPadding
from lightning_dynatrain.vps.spec import EXPERT, LAYER, NONE, TP, VOCAB, Group, LogicalTensor, ModelSpec, Place

@dataclass(frozen=True, slots=True)
class Probes:
    """The descriptions a derivation reads (``megatron.probe.probe_module`` makes them).

    ``base``: rank 0 of ``dp1-tp1-pp1`` (built in bf16, so that fp32-kept parameters show);
    ``tp``, ``pp``, ``ep``: two ranks of a layout where that size is > 1 (tp coordinate 0 and 1;
    first and last pipeline stage; expert coordinate 0 and 1), or ``None`` where no such layout
    builds (the model never uses it). ``reads_globals``: some module takes its process groups from
    megatron's parallel-state globals instead of the ones it is given (it is then built only where
    those globals are the layout's: no build beside training).
    """

    base: ModuleDescription
    tp: tuple[ModuleDescription, ModuleDescription] | None = None
    pp: tuple[ModuleDescription, ModuleDescription] | None = None
    ep: tuple[ModuleDescription, ModuleDescription] | None = None
    reads_globals: bool = False

    def all(self) -> list[ModuleDescription]:
        return [self.base, *(d for pair in (self.tp, self.pp, self.ep) if pair is not None for d in pair)]


# ------------------------------------------------------------------------------------ derivation
class _Tensor:
    """What the base probe says of one key (mutable while deriving)."""

    def __init__(self, key: str, records: list[ShardRecord], params: dict) -> None:
        self.key = key
        first = records[0]
        self.stack = first.stack_axes
        self.global_shape = first.global_shape
        if any(r.stack_axes != self.stack or r.global_shape != self.global_shape for r in records):
            raise ModelSpecError(f"{key}: its parameters describe different global shapes or stack axes "
                                 f"({sorted({(r.global_shape, r.stack_axes) for r in records})})",
                                 hint="describe every part of one tensor with the same global shape")
        if self.stack > 2:
            raise ModelSpecError(f"{key}: {self.stack} leading stack axes (megatron's prepend_axis_num); "
                                 "the layer and the expert axis are supported",
                                 hint="describe the tensor with at most a layer and an expert offset")
        per_param: dict[str, list[ShardRecord]] = {}
        for r in records:
            per_param.setdefault(r.param, []).append(r)
        self.params = list(per_param)  # in description order
        self.stacks: dict[str, tuple[int, ...]] = {}
        chunk_counts = {len(v) for v in per_param.values()}
        if len(chunk_counts) != 1:
            raise ModelSpecError(f"{key}: its parameters are cut into different numbers of chunks {sorted(chunk_counts)}")
        self.chunks = chunk_counts.pop()
        self.chunk_axis: int | None = None
        tail = self.global_shape[self.stack:]
        for name, chunks in per_param.items():
            stacks = {c.global_offset[:self.stack] for c in chunks}
            if len(stacks) != 1:
                raise ModelSpecError(f"{key}: the chunks of {name} lie at different layers or experts {sorted(stacks)}")
            self.stacks[name] = stacks.pop()
            shape = params[name].shape
            if math.prod(shape) != math.prod(tail):
                raise ModelSpecError(
                    f"{key}: parameter {name} {tuple(shape)} is not the whole tensor {tail} at dp1-tp1-pp1",
                    hint="at tp1 pp1 ep1 every rank holds every tensor whole; describe the parameter's "
                         "global shape as its own shape there")
            self._check_chunks(name, sorted(chunks, key=lambda c: c.start), tail)
        self.chunking = (self.chunk_axis, self.chunks) if self.chunks > 1 else WHOLE
        self._check_stack_coverage()

    def _check_chunks(self, name: str, chunks: list[ShardRecord], tail: tuple[int, ...]) -> None:
        m = len(chunks)
        if m == 1:
            if chunks[0].local_shape != tail or any(chunks[0].global_offset[self.stack:]):
                raise ModelSpecError(f"{self.key}: {name} describes a part {chunks[0].local_shape} of {tail} "
                                     "at dp1-tp1-pp1", hint="at tp1 pp1 ep1 a parameter is its tensor, whole")
            return
        offsets = [c.global_offset[self.stack:] for c in chunks]
        moving = {a for a in range(len(tail)) if len({o[a] for o in offsets}) > 1}
        if len(moving) != 1:
            raise ModelSpecError(f"{self.key}: the {m} chunks of {name} differ on axes {sorted(moving)}; one "
                                 "axis is supported (as megatron's SwiGLU factory cuts linear_fc1)")
        axis = moving.pop()
        if self.chunk_axis not in (None, axis) or tail[axis] % m:
            raise ModelSpecError(f"{self.key}: chunks of {name} along axis {axis} do not cut {tail} evenly")
        self.chunk_axis = axis
        width, numel = tail[axis] // m, math.prod(tail) // m
        for j, c in enumerate(chunks):
            expected = tuple(j * width if a == axis else 0 for a in range(len(tail)))
            shape = tuple(width if a == axis else n for a, n in enumerate(tail))
            if c.global_offset[self.stack:] != expected or c.local_shape != shape or c.start != j * numel:
                raise ModelSpecError(f"{self.key}: chunk {j} of {name} is not block {j} of {m} along axis {axis} "
                                     f"(offset {c.global_offset}, shape {c.local_shape}, starts at element {c.start})")

    def _check_stack_coverage(self) -> None:
        extents = self.global_shape[:self.stack]
        seen = sorted(self.stacks.values())
        everything = sorted(_product(extents))
        if seen != everything:
            missing = sorted(set(everything) - set(seen))[:4]
            raise ModelSpecError(
                f"{self.key}: dp1-tp1-pp1 holds it at {len(seen)} of {len(everything)} (layer, expert) places "
                f"(missing e.g. {missing})",
                hint="every layer (and expert) must hold the same tensors: stacks of different layers are not "
                     "supported yet")

    def logical_tail(self) -> list[int]:
        return _logical_tail(self.global_shape[self.stack:], self.chunking)

    def template(self) -> str:
        """The parameter-name pattern, ``{layer}``/``{expert}`` where the stack indices are."""
        found = {_template(name, self.stacks[name]) for name in self.params}
        if len(found) != 1:
            raise ModelSpecError(f"{self.key}: its parameter names {self.params[:3]} do not follow one pattern "
                                 "with the layer (and expert) index as a path component")
        return found.pop()


def _logical_tail(tail: tuple[int, ...], chunking: tuple[int, int] | None) -> list[int]:
    """Megatron's non-stack extents on the logical axes (a factory's chunk axis as two)."""
    out = list(tail)
    if chunking is not None:
        axis, m = chunking
        out[axis:axis + 1] = [m, out[axis] // m]
    return out


def _product(extents: tuple[int, ...]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for n in extents:
        out = [o + (i,) for o in out for i in range(n)]
    return out


def _template(name: str, stack: tuple[int, ...]) -> str:
    parts = name.split(".")
    start = 0
    for index, placeholder in zip(stack, ("{layer}", "{expert}")):
        for i in range(start, len(parts)):
            if parts[i] == str(index):
                parts[i] = placeholder
                start = i + 1
                break
        else:
            return f"<no {placeholder} in {name}>"
    return ".".join(parts)


def _tp_split(key: str, tensor: _Tensor, probe: tuple[ModuleDescription, ModuleDescription],
              vocab: VocabPadding | None) -> tuple[int | None, str]:
    """Which logical axis tensor parallelism cuts (``None``: replicated) and its role (tp or vocab)."""
    first, second = (p.by_key().get(key) for p in probe)
    tp = probe[0].layout.tp
    if tensor.stack > 1 and probe[0].layout.etp == 1:
        return None, NONE  # megatron refused etp = tp for this model: expert tensors are never tp-split
    if not first or not second:
        raise ModelSpecError(f"{key}: tp ranks 0 and 1 of {probe[0].layout} do not both hold it",
                             hint="a tensor held on some tensor-parallel ranks only is not supported")
    r0 = min(first, key=lambda r: (r.param, r.start))
    r1 = next((r for r in second if r.global_offset[:r.stack_axes] == r0.global_offset[:r0.stack_axes]
               and r.start == r0.start), None)
    if r1 is None:
        raise ModelSpecError(f"{key}: tp ranks 0 and 1 of {probe[0].layout} hold it at different layers")
    base_tail = tensor.logical_tail()
    chunking = tensor.chunking
    box0, box1 = logical_box(r0, chunking), logical_box(r1, chunking)
    p = tensor.stack
    grown = [a for a in range(len(tensor.global_shape) - p) if r0.global_shape[p + a] != tensor.global_shape[p + a]]
    extents = [h - l for l, h in zip(box0.lo[p:], box0.hi[p:])]
    full = _logical_tail(r0.global_shape[p:], chunking)
    chunk_outer = chunking[0] if chunking is not None else None
    split = [a for a in range(len(full)) if extents[a] < full[a] and a != chunk_outer]
    if len(split) > 1:
        raise ModelSpecError(f"{key}: tensor parallelism cuts {len(split)} of its axes at {probe[0].layout}",
                             hint="one axis per tensor may be split by tensor parallelism")
    if not split:
        if grown:
            raise ModelSpecError(f"{key}: its shape changes with tp ({tensor.global_shape} at tp1, "
                                 f"{r0.global_shape} at tp{tp}) but tensor parallelism does not cut it")
        return None, NONE
    axis = split[0]
    if box0.lo[p + axis] != 0 or box1.lo[p + axis] != extents[axis] or full[axis] != extents[axis] * tp:
        raise ModelSpecError(f"{key}: tp rank r does not hold part r of {tp} on its split axis at {probe[0].layout}")
    mega_axis = axis if chunk_outer is None or axis < chunk_outer else axis - 1
    if any(r.param in probe[0].vocab_params for r in first):
        if vocab is None or not (_follows_padding(vocab, tensor.global_shape[p + mega_axis], 1)
                                 and _follows_padding(vocab, r0.global_shape[p + mega_axis], tp)):
            padding = (f"the declared vocabulary pads to {vocab.padded(1)} at tp1 and {vocab.padded(tp)} at tp{tp}"
                       if vocab is not None else "no vocabulary was declared")
            raise ModelSpecError(
                f"{key}: its vocabulary axis is {tensor.global_shape[p + mega_axis]} rows at tp1 and "
                f"{r0.global_shape[p + mega_axis]} at tp{tp}, and {padding}",
                hint="declare the vocabulary size and make_vocab_size_divisible_by the model provider pads with "
                     "(it should pass padded_vocab_size(vocab_size, config, divisible_by) to megatron)")
        return axis, VOCAB
    if grown:
        raise ModelSpecError(f"{key}: its axis {mega_axis} is {tensor.global_shape[p + mega_axis]} at tp1 and "
                             f"{r0.global_shape[p + mega_axis]} at tp{tp}; only a vocabulary axis may grow with tp")
    if base_tail[axis] != full[axis]:
        raise ModelSpecError(f"{key}: logical axis {axis} is {base_tail[axis]} at tp1 and {full[axis]} at tp{tp}")
    return axis, TP


def _follows_padding(vocab: VocabPadding, rows: int, tp: int) -> bool:
    return rows == vocab.padded(tp)


def _places(keys: list[str], tensors: dict[str, _Tensor], probe: tuple[ModuleDescription, ModuleDescription] | None
            ) -> dict[str, tuple[Place, str | None]]:
    """Where each tensor lives, and a tied tensor's parameter name on the last stage."""
    out: dict[str, tuple[Place, str | None]] = {}
    if probe is None:
        return {k: (Place.LAYERS if tensors[k].stack else Place.FIRST, None) for k in keys}
    first, last = (p.by_key() for p in probe)
    for key in keys:
        here, there = key in first, key in last
        if tensors[key].stack:
            if not (here and there):
                raise ModelSpecError(f"{key}: a stacked tensor held by one end of {probe[0].layout} only",
                                     hint="layer tensors belong to every pipeline stage's layers")
            out[key] = (Place.LAYERS, None)
        elif here and there:
            name = last[key][0].param
            out[key] = (Place.FIRST_AND_LAST, name if name != first[key][0].param else None)
        elif here:
            out[key] = (Place.FIRST, None)
        elif there:
            out[key] = (Place.LAST, None)
        else:
            raise ModelSpecError(f"{key}: neither the first nor the last stage of {probe[0].layout} holds it")
    return out


def derive_spec(name: str, probes: Probes, *, vocab: VocabPadding | None = None,
                sizes: dict[str, int] | None = None) -> DerivedSpec:
    """The ``ModelSpec`` megatron's description at ``probes`` says (see the module docstring), checked
    against every probe.

    Args:
        vocab: the vocabulary padding the model provider uses (``None``: the model has no axis whose
            extent grows with tp).
        sizes: informative sizes for messages and checkpoint summaries (``hidden``, ``num_heads``,
            ``num_query_groups``, ``head_dim``, ``ffn_hidden``, ``moe_ffn_hidden``).

    Raises:
        ModelSpecError: a parameter without a description, floating state outside parameters, or a
            description that does not follow the layer/expert/tp rules; it names the tensor.
    """
    base = probes.base
    _refuse_unreadable(base)
    params = {p.name: p for p in base.params}
    by_key = base.by_key()
    tensors = {key: _Tensor(key, records, params) for key, records in by_key.items()}
    order = []  # keys by first parameter, in megatron's registration order
    for p in base.params:
        key = next(r.key for r in base.records if r.param == p.name)
        if key not in order:
            order.append(key)
    splits = {k: (None, NONE) for k in order}
    if probes.tp is not None:
        splits = {k: _tp_split(k, tensors[k], probes.tp, vocab) for k in order}
    info = dict(sizes or {})
    # the largest tp: it divides every split axis (and, for a transformer, the heads and query groups)
    tp_extents = [tensors[k].logical_tail()[axis] for k, (axis, role) in splits.items() if role == TP]
    tp_extents += [info[k] for k in ("num_heads", "num_query_groups") if info.get(k)]
    max_tp = math.gcd(*tp_extents) if tp_extents and probes.tp is not None else 1
    places = _places(order, tensors, probes.pp)
    layer_counts = {tensors[k].global_shape[0] for k in order if tensors[k].stack}
    expert_counts = {tensors[k].global_shape[1] for k in order if tensors[k].stack > 1}
    if len(layer_counts) > 1 or len(expert_counts) > 1:
        raise ModelSpecError(f"model {name}: stacked tensors disagree on the number of layers {sorted(layer_counts)} "
                             f"or experts {sorted(expert_counts)}")
    rows = vocab.padded(max_tp) if vocab is not None else 0
    logical = []
    for key in order:
        t = tensors[key]
        tail = t.logical_tail()
        axes = [LAYER, EXPERT][:t.stack] + [NONE] * len(tail)
        axis, role = splits[key]
        if axis is not None:
            axes[t.stack + axis] = role
            if role == VOCAB:
                tail[axis] = rows
        place, last_name = places[key]
        dtypes = {params[p].dtype for p in t.params}
        logical.append(LogicalTensor(
            key, tuple(t.global_shape[:t.stack]) + tuple(tail), tuple(axes),
            Group.EXPERT if t.stack > 1 else Group.DENSE, place, t.template(), last_name,
            always_fp32=dtypes == {"float32"} and base_is_bf16(base)))
    spec = ModelSpec(
        name=name, num_layers=layer_counts.pop() if layer_counts else 0, hidden=info.get("hidden", 0),
        num_heads=info.get("num_heads", 0), num_query_groups=info.get("num_query_groups", 0),
        head_dim=info.get("head_dim", 0), ffn_hidden=info.get("ffn_hidden", 0),
        vocab_size=vocab.size if vocab is not None else 0,
        make_vocab_size_divisible_by=vocab.divisible_by if vocab is not None else 1,
        num_experts=expert_counts.pop() if expert_counts else 0, moe_ffn_hidden=info.get("moe_ffn_hidden", 0),
        tensors=tuple(logical), max_tp=max_tp)
    derived = DerivedSpec(spec, {k: tensors[k].chunking for k in order}, probes.reads_globals)
    for description in probes.all():
        problems = description_problems(derived, description)
        if problems:
            raise ModelSpecError(
                f"model {name}: its description at {description.layout} (rank {description.rank}) does not follow "
                f"the layer/expert/tp rules read at dp1-tp1-pp1: {'; '.join(problems[:3])}",
                hint="every tensor must be cut by pipeline stages along its layer axis, by expert parallelism "
                     "along its expert axis and by tensor parallelism along at most one axis, as megatron's "
                     "parallel layers are")
    return derived


def base_is_bf16(base: ModuleDescription) -> bool:
    """The base probe was built with bf16 params (then an fp32 parameter is one megatron keeps fp32)."""
    return any(p.dtype == "bfloat16" for p in base.params)


def _refuse_unreadable(description: ModuleDescription) -> None:
    if description.undescribed:
        names = ", ".join(description.undescribed[:5])
        raise ModelSpecError(
            f"parameter{'s' if len(description.undescribed) > 1 else ''} {names} "
            f"{'have' if len(description.undescribed) > 1 else 'has'} no sharded description: the module's "
            "sharded_state_dict() does not cover it, so no layout can place it",
            hint="build it from megatron's parallel layers, or give its module a sharded_state_dict() that "
                 "returns a ShardedTensor for it (megatron.core.transformer.utils.make_sharded_tensors_for_checkpoint)")
    if description.buffers:
        raise ModelSpecError(
            f"the model keeps training state outside its parameters ({', '.join(description.buffers[:5])}); "
            "a layout switch moves parameters and optimizer state only",
            hint="turn the option that adds it off (a router's expert bias: moe_router_enable_expert_bias=False), "
                 "or keep it as a parameter")
    if description.unsupported:
        raise ModelSpecError(f"descriptions this project cannot read: {'; '.join(description.unsupported[:3])}")


__all__ = ["Probes", "derive_spec"]
