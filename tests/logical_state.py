"""The full logical training state from every rank's local tensors, for bit-for-bit comparisons.

Each rank returns its local tensors' bits (an integer view, so bf16 and NaN compare exactly); the
parent assembles the whole logical tensors from the regions the VPS gives each rank at its layout,
requiring replicas to agree, and compares two layouts' states where both store them.
"""

from __future__ import annotations

import numpy as np

from lightning_dynatrain.transition.pieces import stored_shape
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.mapping import rank_regions
from lightning_dynatrain.vps.spec import Precision


def assemble(spec, layout: ParallelConfig, per_rank: list[dict], precision: Precision, kinds=None) -> dict:
    """The full logical state's bits from every rank's local tensors (replicas must agree bit for bit);
    of the state kinds in ``kinds`` only, when given."""
    from lightning_dynatrain.transition.local_state import box_pieces, box_view

    import torch

    full: dict = {}
    for rank, store in enumerate(per_rank):
        for (tensor, kind), regions in rank_regions(spec, layout, rank, precision).items():
            if kinds is not None and kind not in kinds:
                continue
            shape = spec.tensor(tensor).shape
            bits = np.dtype(np.int16 if regions[0].itemsize == 2 else np.int32)
            logical, seen = full.setdefault((tensor, kind), (np.zeros(shape, bits), np.zeros(shape, bool)))
            for region in regions:
                for key, box in box_pieces(tensor, kind, region, region.box):
                    values = box_view(torch.from_numpy(store[key]), region, box).numpy().reshape(box.shape)
                    where = box.relative_to((0,) * len(box.lo))
                    known = seen[where]
                    assert np.array_equal(logical[where][known], values[known]), f"replicas of {tensor}:{kind} {box} differ"
                    logical[where], seen[where] = values, True
    out = {}
    for key, (value, seen) in full.items():  # the vocabulary axis as far as the layout pads it
        stored = tuple(slice(0, n) for n in stored_shape(spec, key[0], layout))
        assert seen[stored].all(), f"{key}: some elements are held by no rank"
        out[key] = value[stored]
    return out


def common(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Both arrays cut to the rows both layouts store (a larger tp pads the vocabulary further)."""
    common = tuple(slice(0, min(x, y)) for x, y in zip(a.shape, b.shape))
    return a[common], b[common]


__all__ = ["assemble", "common"]
