"""The data side of a layout switch: global batches identical at every layout, the stdlib byte corpus."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dynatrain.data import GlobalBatchSampler, StdlibBytes, dp_share_bounds, stdlib_sources
from lightning_dynatrain.data.datamodule import GlobalBatchDataLoader, StdlibTextDataModule
from lightning_dynatrain.data.sampler import EvalBatchSampler


def test_global_batches_without_shuffle_wrap_around() -> None:
    sampler = GlobalBatchSampler(10, global_batch_size=4)
    assert len(sampler) == 2  # 10 // 4 steps per epoch
    assert list(sampler) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert list(sampler) == [[8, 9, 0, 1], [2, 3, 4, 5]]  # the next epoch continues the stream
    assert sampler.indices(5) == [0, 1, 2, 3]  # position 20 = 2 passes


@given(n=st.integers(1, 60), g=st.integers(1, 16), seed=st.integers(0, 5), step=st.integers(0, 40))
@settings(max_examples=60, deadline=None)
def test_step_k_reads_positions_k_times_g(n: int, g: int, seed: int, step: int) -> None:
    """Step k is positions [k*G, (k+1)*G) of the stream; with shuffle each pass is a permutation."""
    plain = GlobalBatchSampler(n, global_batch_size=g)
    assert plain.indices(step) == [p % n for p in range(step * g, (step + 1) * g)]
    shuffled = GlobalBatchSampler(n, global_batch_size=g, shuffle=True, seed=seed)
    again = GlobalBatchSampler(n, global_batch_size=g, shuffle=True, seed=seed)
    assert shuffled.indices(step) == again.indices(step)  # deterministic: every rank computes the same
    first_pass = [i for k in range(-(-n // g)) for i in shuffled.indices(k)][:n]
    assert sorted(first_pass) == list(range(n))  # each pass visits every sample once


def test_iteration_resumes_at_the_step_and_ends_at_the_epoch_boundary() -> None:
    sampler = GlobalBatchSampler(40, global_batch_size=4, shuffle=True, seed=3)  # 10 steps per epoch
    full = [sampler.indices(k) for k in range(20)]
    sampler.set_step(7)
    assert list(sampler) == full[7:10]  # the rest of epoch 0
    assert list(sampler) == full[10:20]  # then a whole epoch
    state = sampler.state_dict()
    other = GlobalBatchSampler(40, global_batch_size=4, shuffle=True, seed=3)
    other.load_state_dict(state)
    assert other.next_step == 20 and next(iter(other)) == sampler.indices(20)
    with pytest.raises(ValueError, match="saved global_batch_size=4, now 8"):
        GlobalBatchSampler(40, global_batch_size=8, shuffle=True, seed=3).load_state_dict(state)


def test_validation_batches_start_from_the_first_on_every_pass_however_far_the_last_one_read() -> None:
    sampler = EvalBatchSampler(10, global_batch_size=4)
    assert list(sampler) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    partial = iter(sampler)
    assert next(partial) == [0, 1, 2, 3]  # a validation that stops after one batch (limit_val_batches)
    assert list(sampler) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # the next one scores the same data
    data = StdlibTextDataModule(seq_length=8, global_batch_size=2, max_bytes=4000, val_samples=4)
    data.setup("fit")
    val = data.val_dataloader()
    assert isinstance(val.batch_sampler, EvalBatchSampler)
    first = next(iter(val))["tokens"]
    assert torch.equal(next(iter(val))["tokens"], first)


def test_dp_shares_tile_the_global_batch() -> None:
    """Whatever the dp size, the shares of all dp ranks are the global batch, in order."""
    for dp in (1, 2, 4, 8):
        rows = [r for d in range(dp) for r in range(*dp_share_bounds(16, d, dp))]
        assert rows == list(range(16))
    with pytest.raises(ValueError, match="does not split over 3"):
        dp_share_bounds(16, 0, 3)


def test_stdlib_sources_are_sorted_and_exclude_site_packages() -> None:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_sources()
    rel = [p.relative_to(root).as_posix() for p in files]
    assert rel == sorted(rel) and len(rel) > 100 and "os.py" in rel
    assert not any("site-packages" in r or "dist-packages" in r for r in rel)


def test_stdlib_bytes_samples_shift_by_one(tmp_path: Path) -> None:
    (tmp_path / "b.py").write_bytes(bytes(range(50, 90)))
    (tmp_path / "a.py").write_bytes(bytes(range(10)))
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "z.py").write_bytes(b"not stdlib")
    ds = StdlibBytes(8, root=tmp_path)
    assert len(ds) == (10 + 40 - 1) // 8
    first, second = ds[0], ds[1]
    assert first["tokens"].tolist() == list(range(8)) and first["labels"].tolist() == list(range(1, 9))
    assert second["tokens"].tolist() == [8, 9, 50, 51, 52, 53, 54, 55]  # a.py then b.py, sorted
    assert first["tokens"].dtype == torch.long
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_loader_serves_the_same_global_batches_on_any_layout(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_bytes(bytes(range(256)) * 4)
    ds = StdlibBytes(4, root=tmp_path)
    sampler = GlobalBatchSampler(ds, global_batch_size=8, shuffle=True, seed=1)
    loader = GlobalBatchDataLoader(ds, batch_sampler=sampler)
    batches = [b["tokens"] for _, b in zip(range(3), loader)]
    assert all(b.shape == (8, 4) for b in batches)
    assert torch.equal(batches[1], torch.stack([ds[i]["tokens"] for i in sampler.indices(1)]))
    assert loader.state_dict()["next_step"] == 3
