"""Per-rank checkpoint files of earlier versions (``checkpoint.legacy``) hold the state, not the old
storages a switch left it in (real files)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from lightning_dynatrain.checkpoint.legacy import compact_storages, load_rank_checkpoint, save_rank_checkpoint
from lightning_dynatrain.vps.errors import LayoutError
from lightning_dynatrain.vps.layout import ParallelConfig

MiB = 2**20


def _state() -> tuple[dict, dict]:
    """A checkpoint dict as a switch leaves it: a slice kept of an old 8 MiB tensor, two tensors
    carved from one old storage with its tail unused, a zero1-like buffer whose views cover it, a
    tensor named twice (tied), and what each must read back as."""
    old = torch.arange(2 * MiB, dtype=torch.float32)  # 8 MiB
    kept = old[MiB // 2: MiB]  # 2 MiB slice
    arena = torch.full((2 * MiB,), 3.0)  # 8 MiB, 2 MiB of it carved
    a, b = arena[:MiB // 4], arena[MiB // 4: MiB // 2]
    buffer = torch.arange(MiB, dtype=torch.float32)
    views = OrderedDict((f"layer{i}", buffer[i * MiB // 4:(i + 1) * MiB // 4]) for i in range(4))
    views._metadata = {"": {"version": 1}}
    small = torch.ones(3)
    checkpoint = {"state_dict": views, "kept": kept, "carved": [a, b], "tied": (small, small), "step": 7}
    expected = {"kept": kept.clone(), "a": a.clone(), "b": b.clone(), "views": {k: v.clone() for k, v in views.items()}}
    return checkpoint, expected


def test_loose_tensors_are_copied_and_covering_views_are_passed_through():
    checkpoint, expected = _state()
    out = compact_storages(checkpoint)
    assert out["kept"].untyped_storage().nbytes() == 2 * MiB and torch.equal(out["kept"], expected["kept"])
    a, b = out["carved"]
    assert a.untyped_storage().nbytes() == MiB and torch.equal(a, expected["a"]) and torch.equal(b, expected["b"])
    assert all(out["state_dict"][k] is v for k, v in checkpoint["state_dict"].items())  # they cover their buffer
    assert out["state_dict"]._metadata == {"": {"version": 1}} and type(out["state_dict"]) is OrderedDict
    assert out["tied"][0] is out["tied"][1] and out["step"] == 7
    assert checkpoint["kept"].untyped_storage().nbytes() == 8 * MiB, "the caller's dict is left as it was"


def test_a_checkpoint_file_holds_the_state_not_the_old_storages(tmp_path):
    checkpoint, expected = _state()
    layout = ParallelConfig.parse("dp2")
    path = save_rank_checkpoint(checkpoint, tmp_path / "step=3.ckpt", rank=1, layout=layout, world_size=2)
    state_bytes = (2 + 1 + 1 + 4) * MiB  # the slice, the two carved tensors, the buffer
    assert state_bytes < path.stat().st_size < state_bytes + MiB // 4, path.stat().st_size
    loaded = load_rank_checkpoint(tmp_path / "step=3.ckpt", rank=1, layout=layout, world_size=2)
    assert torch.equal(loaded["kept"], expected["kept"]) and torch.equal(loaded["carved"][1], expected["b"])
    assert all(torch.equal(loaded["state_dict"][k], v) for k, v in expected["views"].items())
    with pytest.raises(LayoutError, match="resume with DynaTrainStrategy"):
        load_rank_checkpoint(tmp_path / "step=3.ckpt", rank=1, layout=ParallelConfig.parse("tp2"), world_size=2)
