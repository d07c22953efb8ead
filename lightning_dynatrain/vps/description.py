"""A ``ModelSpec`` read from megatron's description (``vps.derive``), and its check against a
description: whether a module at some layout holds, rank for rank, what the spec places there.

The logical axes of a derived spec are megatron's, but for a factory's chunk axis, which the spec
splits in two (which chunk, where in it): megatron's SwiGLU ``linear_fc1`` ``[2 * ffn, hidden]``,
two chunks per local tensor, is logically ``[2, ffn, hidden]`` with tp on ``ffn``. ``logical_box``
maps a described chunk onto those axes; ``description_problems`` compares every local parameter,
its shape and every chunk's box and element offset with the spec's; ``canonical_tensors`` puts two
specs that cut the same elements the same way in one form (the derived spec against the
hand-written one). Pure: no torch, no process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lightning_dynatrain.vps.box import Box, ravel
from lightning_dynatrain.vps.errors import ModelSpecError
from lightning_dynatrain.vps.names import local_parameters
from lightning_dynatrain.vps.shards import ModuleDescription, ShardRecord
from lightning_dynatrain.vps.spec import NONE, TP, ModelSpec

#: ``Chunking`` of a tensor megatron describes whole: no factory split.
WHOLE = None


@dataclass(frozen=True, slots=True)
class DerivedSpec:
    """A ``ModelSpec`` read from a description, and how megatron's shapes map onto its axes."""

    spec: ModelSpec
    chunking: dict[str, tuple[int, int] | None] = field(hash=False)
    """Per tensor: ``(megatron axis, chunks)`` when a factory cuts each local tensor into ``chunks``
    views along that (non-stack) axis of megatron's global shape, which the logical shape splits
    into ``(chunks, extent / chunks)``; ``None`` otherwise."""
    reads_globals: bool = False
    """``Probes.reads_globals``."""

    def logical_box(self, record: ShardRecord) -> Box:
        """The logical box of one described chunk (``ShardRecord``) in ``spec``'s coordinates."""
        return logical_box(record, self.chunking.get(record.key))


def logical_box(record: ShardRecord, chunking: tuple[int, int] | None) -> Box:
    """``record``'s box on the logical axes: its stack index, then each axis, a factory's chunk axis
    as two (which chunk, where in it). Raises ``ModelSpecError`` if a chunk straddles two."""
    p = record.stack_axes
    lo, hi = list(record.global_offset[:p]), [o + 1 for o in record.global_offset[:p]]
    for axis, (offset, size, extent) in enumerate(zip(record.global_offset[p:], record.local_shape,
                                                      record.global_shape[p:])):
        if chunking is not None and chunking[0] == axis:
            width = extent // chunking[1]
            chunk, inner = divmod(offset, width)
            if inner + size > width:
                raise ModelSpecError(f"{record.key}: a chunk of {record.param} at offset {offset} crosses the "
                                     f"boundary of its factory's chunks (width {width})")
            lo += [chunk, inner]
            hi += [chunk + 1, inner + size]
        else:
            lo.append(offset)
            hi.append(offset + size)
    return Box(tuple(lo), tuple(hi))


def description_problems(derived: DerivedSpec, description: ModuleDescription) -> list[str]:
    """Where ``description`` (one rank, one layout) differs from what ``derived.spec`` places there:
    empty when the spec's local parameters, their shapes and every chunk's box and position match."""
    spec, layout, rank = derived.spec, description.layout, description.rank
    problems = [f"{p} has no sharded description" for p in description.undescribed]
    expected = local_parameters(spec, layout, rank)
    shapes = {p.name: p.shape for p in description.params}
    records: dict[str, list[ShardRecord]] = {}
    for r in description.records:
        records.setdefault(r.param, []).append(r)
    for name in shapes.keys() - expected.keys():
        problems.append(f"{name} is on rank {rank} but the spec places no such parameter there")
    for name in expected.keys() - shapes.keys():
        problems.append(f"{name} ({expected[name].tensor}) is missing on rank {rank}")
    for name, local in expected.items():
        if name not in shapes:
            continue
        view = local.view_shape
        if math.prod(shapes[name]) != math.prod(view):
            problems.append(f"{name}: {tuple(shapes[name])} holds {math.prod(shapes[name])} elements, the spec "
                            f"{view}")
            continue
        whole = Box(local.stack + local.origin, tuple(s + 1 for s in local.stack) +
                    tuple(o + n for o, n in zip(local.origin, view)))
        covered = 0
        for r in records.get(name, []):
            if r.key != local.tensor:
                problems.append(f"{name} is described as {r.key}, the spec says {local.tensor}")
                break
            try:
                box = derived.logical_box(r)
            except ModelSpecError as err:
                problems.append(str(err))
                break
            inside = whole.intersect(box)
            start = ravel(tuple(l - o for l, o in zip(box.lo[len(local.stack):], local.origin)), view)
            if inside != box or start != r.start:
                problems.append(f"{name}: megatron places a chunk at {box} (element {r.start}), the spec at "
                                f"{whole} (element {start})")
                break
            covered += box.numel
        else:
            if covered != whole.numel:
                problems.append(f"{name}: the description covers {covered} of its {whole.numel} elements")
    return problems


def canonical_tensors(spec: ModelSpec) -> dict[str, tuple]:
    """Each tensor by its parameter-name pattern, with its axes in a canonical form: an unsplit axis
    merged into the axis before it (unless that is a stack or vocabulary axis), so two descriptions
    that cut the same elements the same way compare equal (megatron's fused QKV ``[rows, hidden]``
    split on rows is the hand-written ``[groups, q+2, head_dim, hidden]`` split on groups)."""
    out = {}
    for t in spec.tensors:
        shape, axes = [], []
        for i, (n, role) in enumerate(zip(t.shape, t.axes)):
            if i > t.stack_axes and role == NONE and axes[-1] in (TP, NONE):
                shape[-1] *= n
            else:
                shape.append(n)
                axes.append(role)
        out[t.megatron_name] = (tuple(shape), tuple(axes), t.group, t.place, t.last_stage_name, t.always_fp32)
    return out


__all__ = ["WHOLE", "DerivedSpec", "canonical_tensors", "description_problems", "logical_box"]
