"""A layout-independent fingerprint of the full logical training state, computed where it lives.

For every ``(tensor, kind)`` the fingerprint is ``(H, n)``: ``n`` elements held, and

    H = sum over elements x of  bits(x) * prod_axis u_axis[x_axis]   (mod 2**32)

with ``bits`` the element's bit pattern (a float32's 32 bits; a bf16's or fp16's 16, sign-extended) and ``u_axis`` fixed random odd 32-bit weights per logical
axis (seeded by the tensor's name). ``H`` is a sum over elements, so it does not depend on how the
tensor is cut into boxes: two layouts holding the same logical state give the same fingerprint, and
a moved, transposed or corrupted element changes it (but for a 2**-32 chance). Each piece is hashed
by its primary holder only (replicas once); one all-reduce adds the ranks' terms. The weighted sum
is a chain of int32 multiply-and-sum contractions (no copy of the state is made).

Example (every rank)::

    before = logical_fingerprint(store_a, spec, layout_a, rank)
    ...switch...
    after = logical_fingerprint(store_b, spec, layout_b, rank)
    assert before == after
"""

from __future__ import annotations

import math
import zlib
from functools import lru_cache

import torch
import torch.distributed as dist

from lightning_dynatrain.transition.pieces import layout_pieces
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.spec import ModelSpec, Precision, StateKind

Fingerprint = dict[tuple[str, str], tuple[int, int]]
_MASK = 0xFFFFFFFF
_CHUNK = 1 << 22  # elements per contraction chunk (16 MiB of int32 scratch)


@lru_cache(maxsize=4096)
def _weights(tensor: str, axis: int, size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(f"{tensor}/{axis}".encode()))
    return torch.randint(-2**31, 2**31 - 1, (size,), dtype=torch.int32, generator=generator) | 1


def _as_int32(view: torch.Tensor) -> torch.Tensor:
    """The elements' bit patterns as int32 (16-bit floats sign-extended)."""
    if view.dtype == torch.float32:
        return view.view(torch.int32)
    if view.dtype in (torch.bfloat16, torch.float16):
        return view.view(torch.int16).to(torch.int32)
    raise TypeError(f"the fingerprint covers fp32, bf16 and fp16 state, got {view.dtype}")


def hash_box(view: torch.Tensor, lo: tuple[int, ...], tensor: str, logical_shape: tuple[int, ...]) -> int:
    """``H`` of one box (``view`` has the box's shape, ``lo`` its logical start), mod 2**32."""
    bits = _as_int32(view)
    ws = [_weights(tensor, a, logical_shape[a])[lo[a]:lo[a] + bits.shape[a]] for a in range(bits.dim())]
    if bits.dim() == 0 or bits.numel() == 0:
        return 0
    rows = max(1, _CHUNK // max(1, math.prod(bits.shape[1:])))
    total = 0
    for start in range(0, bits.shape[0], rows):
        part = bits[start:start + rows]
        for axis in range(bits.dim() - 1, 0, -1):  # contract the last axes, one at a time
            part = (part * ws[axis]).sum(-1, dtype=torch.int32)
        total += int((part * ws[0][start:start + rows]).sum(dtype=torch.int32))
    return total & _MASK


def local_terms(store: dict, spec: ModelSpec, layout: ParallelConfig, rank: int,
                precision: Precision = Precision.FP32) -> dict[tuple[str, StateKind], tuple[int, int]]:
    """This rank's share: ``(H, n)`` over the pieces it is the primary holder of."""
    pieces = layout_pieces(spec, layout, precision)
    out: dict[tuple[str, StateKind], tuple[int, int]] = {}
    for (tensor, kind), mine in pieces.mine(rank, primary_only=True).items():
        shape = spec.tensor(tensor).shape
        h = sum(hash_box(p.view(store), p.box.lo, tensor, shape) for p in mine) & _MASK
        out[(tensor, kind)] = (h, sum(p.box.numel for p in mine))
    return out


def logical_fingerprint(store: dict, spec: ModelSpec, layout: ParallelConfig, rank: int,
                        precision: Precision = Precision.FP32, group: dist.ProcessGroup | None = None) -> Fingerprint:
    """The fingerprint of the full logical state (collective: every rank calls it; same result)."""
    keys = [(t.name, kind) for t in spec.tensors for kind, _ in precision.kinds_of(t)]
    terms = local_terms(store, spec, layout, rank, precision)
    table = torch.tensor([terms.get(k, (0, 0)) for k in keys], dtype=torch.int64)
    dist.all_reduce(table, group=group)
    return {(name, kind.value): (int(h) & _MASK, int(n)) for (name, kind), (h, n) in zip(keys, table.tolist()) if n}


def diff(a: Fingerprint, b: Fingerprint, limit: int = 3) -> list[str]:
    """What differs between two fingerprints (empty when they are equal)."""
    out = [f"{k}: {a.get(k)} != {b.get(k)}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])


__all__ = ["Fingerprint", "diff", "hash_box", "local_terms", "logical_fingerprint"]
