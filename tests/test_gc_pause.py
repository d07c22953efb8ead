"""``automatic_gc_paused``: the collector is off inside, restored after, also on error and when nested."""

from __future__ import annotations

import gc

import pytest

from lightning_dynatrain.gc_pause import automatic_gc_paused


def test_the_collector_is_paused_inside_and_restored_after():
    assert gc.isenabled()
    with automatic_gc_paused():
        assert not gc.isenabled()
        with automatic_gc_paused():  # nested: the outer pause stays
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with automatic_gc_paused():
            raise RuntimeError("a switch failed")
    assert gc.isenabled()


def test_a_collector_disabled_before_stays_disabled():
    gc.disable()
    try:
        with automatic_gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_as_a_decorator_each_call_pauses_the_collector():
    @automatic_gc_paused()
    def inside() -> bool:
        return gc.isenabled()

    assert inside() is False and inside() is False and gc.isenabled()
