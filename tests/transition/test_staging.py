"""Staging: byte counts, deterministic box splitting, and stages that fit the budget."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from lightning_dynatrain.transition.errors import StagingBudgetError
from lightning_dynatrain.transition.staging import (
    check_budget,
    format_bytes,
    high_offset,
    parse_bytes,
    plan_stages,
    smallest_unit_bytes,
    split_box,
)
from lightning_dynatrain.vps.box import Box

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


@pytest.mark.parametrize("text, value", [
    ("256MiB", 256 * 2**20), ("1GB", 10**9), ("512KiB", 512 * 1024), (4096, 4096), ("4096", 4096),
    (" 2 gib ", 2 * 2**30), ("1.5KiB", 1536), ("3kb", 3000), ("7B", 7), ("1M", 2**20),
])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("bad", ["", "abc", "-1", "12XB", "MiB", 0, -5, True, 1.5, None, "0KiB"])
def test_parse_bytes_rejects_with_a_hint(bad):
    with pytest.raises(StagingBudgetError) as info:
        parse_bytes(bad)
    assert "HINT" in str(info.value)


def test_format_bytes():
    assert [format_bytes(n) for n in (0, 1023, 1536, 3 * 2**20, 5 * 2**30)] == ["0 B", "1023 B", "1.5 KiB", "3.0 MiB", "5.0 GiB"]


boxes = st.lists(st.tuples(st.integers(0, 5), st.integers(1, 6)), min_size=1, max_size=4).map(
    lambda axes: Box(tuple(lo for lo, _ in axes), tuple(lo + n for lo, n in axes)))


@settings(max_examples=300, **SETTINGS)
@given(boxes, st.sampled_from([1, 2, 4, 8]), st.integers(1, 400))
def test_split_box_tiles_the_box_within_the_limit(box, itemsize, limit):
    parts = split_box(box, itemsize, limit)
    assert parts == split_box(box, itemsize, limit), "deterministic"
    cover = np.zeros(box.shape, dtype=int)
    for part in parts:
        assert box.contains(part)
        is_row = all(e == 1 for e in part.shape[:-1])
        assert part.numel * itemsize <= limit or is_row, f"{part} over the limit and not a row"
        if is_row and part.numel * itemsize > limit:
            assert part.shape[-1] == box.shape[-1], "rows are never cut"
        cover[part.relative_to(box.lo)] += 1
    assert (cover == 1).all(), "sub-boxes tile the box exactly once"
    starts = [p.lo for p in parts]
    assert starts == sorted(starts), "sub-boxes come in row-major order"


def test_split_box_example():
    assert [str(b) for b in split_box(Box((0, 0), (6, 4)), 4, 40)] == ["[0:2, 0:4]", "[2:4, 0:4]", "[4:6, 0:4]"]
    assert smallest_unit_bytes(Box((0, 0), (6, 4)), 4) == 16


items = st.lists(st.tuples(boxes, st.sampled_from([2, 4])), max_size=8)


@settings(max_examples=300, **SETTINGS)
@given(items, items, st.integers(1, 600))
def test_stages_fit_the_budget_and_carry_every_chunk_once(low, high, budget):
    rows = max([smallest_unit_bytes(b, s) for b, s in low + high], default=0)
    if rows > budget:
        with pytest.raises(StagingBudgetError):
            check_budget(budget, rows)
        return
    stages = plan_stages(low, high, budget)
    assert stages == plan_stages(low, high, budget), "both sides compute the same stages"
    for side, src, attr in ((0, low, "low"), (1, high, "high")):
        covered = [np.zeros(b.shape, dtype=int) for b, _ in src]
        for stage in stages:
            end = 0
            for chunk, offset in getattr(stage, attr):
                assert offset >= end and offset % chunk.itemsize == 0, "chunks aligned and not overlapping"
                end = offset + chunk.nbytes
                box, size = src[chunk.item]
                assert chunk.itemsize == size
                covered[chunk.item][chunk.box.relative_to(box.lo)] += 1
            assert end == (stage.low_bytes if side == 0 else stage.high_bytes)
        assert all((c == 1).all() for c in covered), "every element travels exactly once"
    for stage in stages:
        assert stage.nbytes <= budget, f"stage of {stage.nbytes} bytes over a budget of {budget}"
        assert stage.low or stage.high
        assert stage.nbytes == (high_offset(stage.low_bytes) + stage.high_bytes if stage.high_bytes else stage.low_bytes)


def test_both_directions_share_a_stage():
    low = [(Box((0, 0), (4, 4)), 4)]  # 64 bytes each way
    high = [(Box((0, 0), (4, 4)), 4)]
    stages = plan_stages(low, high, 128)
    assert len(stages) == 1 and stages[0].low and stages[0].high
    assert len(plan_stages(low, high, 64)) == 2  # each direction split to half the budget


def test_check_budget_names_budget_and_minimum():
    with pytest.raises(StagingBudgetError) as info:
        check_budget(8, 32, what=" of w:param")
    text = str(info.value)
    assert "staging budget 8 B (8 bytes)" in text and "32 bytes" in text and "w:param" in text
    assert "raise staging_budget to at least 32 bytes" in text
    check_budget(32, 32)
