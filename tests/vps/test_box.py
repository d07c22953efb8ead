import math

import numpy as np
from hypothesis import given, strategies as st

from lightning_dynatrain.vps.box import Box, decompose_flat


@st.composite
def shape_and_range(draw):
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=4)))
    n = math.prod(shape)
    a = draw(st.integers(0, n))
    b = draw(st.integers(a, n))
    return shape, a, b


@given(shape_and_range())
def test_flat_range_decomposes_into_contiguous_boxes(case):
    shape, start, stop = case
    boxes = decompose_flat(shape, start, stop)
    assert len(boxes) <= 2 * len(shape) - 1
    covered = np.zeros(shape, dtype=int)
    flat = np.arange(math.prod(shape)).reshape(shape)
    position = start
    for box in boxes:
        assert not box.is_empty()
        covered[box.relative_to((0,) * len(shape))] += 1
        # each box is one contiguous run of the flattening, and boxes come in order
        values = flat[box.relative_to((0,) * len(shape))].ravel()
        assert list(values) == list(range(position, position + box.numel))
        position += box.numel
    assert position == stop
    expected = np.zeros(math.prod(shape), dtype=int)
    expected[start:stop] = 1
    assert (covered.ravel() == expected).all()


def test_matrix_range_is_at_most_three_boxes():
    assert [str(b) for b in decompose_flat((3, 4), 2, 11)] == ["[0:1, 2:4]", "[1:2, 0:4]", "[2:3, 0:3]"]
    assert decompose_flat((3, 4), 4, 8) == [Box((1, 0), (2, 4))]


def test_intersection_and_containment():
    a = Box((0, 0), (4, 4))
    b = Box((2, 3), (6, 5))
    assert a.intersect(b) == Box((2, 3), (4, 4))
    assert a.intersect(Box((4, 0), (5, 1))) is None
    assert a.contains(Box((1, 1), (2, 2))) and not a.contains(b)
    assert str(b) == "[2:6, 3:5]" and b.numel == 8
