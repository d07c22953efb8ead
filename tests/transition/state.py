"""Synthetic rank state for engine tests, built without the engine's own view code.

Every element of every local tensor holds the *bit pattern* of its global logical index (tensor
offset + row-major index, shifted per state kind; wrapped to the dtype's width), written through an
integer view of the float tensor, so a check compares bits, not values. Padding (vocabulary rows
beyond the real vocabulary, in a local tensor or a zero1 shard) holds ``PAD``.

The local tensor of a key is computed directly from its region's ``origin``/``view_shape``/``flat``
with numpy index arithmetic, independently of ``transition/local_state.py``, so the two check each other.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.mapping import rank_regions
from lightning_dynatrain.vps.spec import LogicalTensor, ModelSpec, Precision, StateKind

PAD = -7
_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def dtype_of(kind: StateKind, precision: Precision, tensor: LogicalTensor) -> torch.dtype:
    """bf16 params at bf16 precision, except tensors megatron keeps in fp32 (``always_fp32``)."""
    return torch.bfloat16 if precision.of(tensor).params == "bf16" and kind is StateKind.PARAM else torch.float32


def offsets(spec: ModelSpec, precision: Precision) -> dict[tuple[str, StateKind], int]:
    out, base = {}, 1
    for k, _ in precision.kinds:
        for t in spec.tensors:
            out[(t.name, k)] = base
            base += t.numel
    return out


def _encode(values: np.ndarray, itemsize: int) -> np.ndarray:
    bits = 8 * itemsize
    half = 1 << (bits - 1)
    return ((values + half) % (1 << bits)) - half


def local_state(spec: ModelSpec, layout: ParallelConfig | str, rank: int, precision: Precision,
                *, filled_from: int | None = None) -> dict:
    """``{(tensor, kind, stack): tensor}`` of ``rank`` in ``layout``, values = logical index bits.

    ``filled_from``: vocabulary rows from this one on hold zeros, as the engine leaves the padding
    rows a switch's source layout did not have (the plan's ``fills``).
    """
    layout = ParallelConfig.parse(layout)
    if rank >= layout.world_size:
        return {}
    base = offsets(spec, precision)
    store: dict = {}
    for (name, kind), regions in rank_regions(spec, layout, rank, precision).items():
        logical = spec.tensor(name).shape
        for region in regions:
            n = len(region.origin) - len(region.view_shape)
            if region.flat is None:
                stacks = list(np.ndindex(*[region.box.hi[a] - region.box.lo[a] for a in range(n)]))
                stacks = [tuple(s + l for s, l in zip(st, region.box.lo[:n])) for st in stacks]
                flat = np.arange(math.prod(region.view_shape))
            else:
                stacks = [region.box.lo[:n]]
                flat = np.arange(region.flat[0], region.flat[1])
            local = np.stack(np.unravel_index(flat, region.view_shape), axis=-1) if region.view_shape else None
            for stack in stacks:
                key = (name, kind, tuple(int(s) for s in stack))
                if key in store:
                    continue  # several zero1 regions share one shard
                coords = np.concatenate(
                    [np.broadcast_to(np.array(stack, dtype=np.int64), (flat.size, n)), local + np.array(region.origin[n:])],
                    axis=1,
                )
                valid = (coords < np.array(logical)).all(axis=1)
                index = np.ravel_multi_index(tuple(np.minimum(coords, np.array(logical) - 1).T), logical)
                dtype = dtype_of(kind, precision, spec.tensor(name))
                values = np.where(valid, _encode(base[(name, kind)] + index, dtype.itemsize), PAD)
                vocab = spec.tensor(name).axis_of("vocab")
                if filled_from is not None and vocab is not None:
                    values = np.where(valid & (coords[:, vocab] >= filled_from), 0, values)
                ints = torch.from_numpy(values.astype(np.int64)).to(_INT[dtype.itemsize])
                store[key] = ints.view(dtype).clone()
    return store


def padded_empty(key, numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """An allocator for ``execute_switch`` that fills new tensors with ``PAD`` bits."""
    return torch.full((numel,), PAD, dtype=_INT[dtype.itemsize], device=device).view(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT[t.dtype.itemsize])


def compare(got: dict, want: dict, what: str) -> None:
    """Assert two stores hold the same keys and bit-identical tensors."""
    assert set(got) == set(want), f"{what}: keys differ: missing {set(want) - set(got)}, extra {set(got) - set(want)}"
    for key, tensor in want.items():
        g = got[key].cpu()
        tensor = tensor.cpu()
        assert g.dtype == tensor.dtype and g.numel() == tensor.numel(), f"{what}: {key} is {g.dtype}/{g.numel()}"
        diff = (bits(g).reshape(-1) != bits(tensor).reshape(-1)).nonzero()
        assert diff.numel() == 0, (
            f"{what}: {key}: {diff.numel()} of {tensor.numel()} elements differ, first at {diff[0].item()}: "
            f"{bits(g).reshape(-1)[diff[0]].item()} != {bits(tensor).reshape(-1)[diff[0]].item()}"
        )
