"""Which worlds are kept for a return to the same members, and which groups are destroyed when
(``elastic.world_cache``; the groups here are plain objects: the cache only keeps track of them)."""

from __future__ import annotations

import pytest

from lightning_dynatrain.callbacks.node_change import OnNodeChange
from lightning_dynatrain.elastic.world_cache import KeptWorld, WorldCache, WorldGroups


def _world(members: str, generation: int) -> KeptWorld:
    default, other = object(), object()
    return KeptWorld(members=tuple(members), generation=generation,
                     groups=WorldGroups(default=default, groups=(default, other), group_count=100))


def test_a_world_left_for_a_larger_one_is_kept_and_found_by_its_members_in_rank_order():
    cache, ab = WorldCache(2), _world("ab", 0)
    assert cache.keep(ab, running=tuple("abc")) == []
    assert cache.find(tuple("ab")) is ab and cache.find(tuple("ba")) is None and cache.find(tuple("abc")) is None
    assert cache.groups() == frozenset(ab.groups.groups)
    assert cache.take(tuple("ab")) is ab and len(cache) == 0 and cache.take(tuple("ab")) is None


def test_a_world_with_a_process_that_left_is_destroyed_at_once_or_when_that_process_leaves():
    cache, abc, ab = WorldCache(2), _world("abc", 1), _world("ab", 0)
    assert cache.keep(abc, running=tuple("ab")) == list(abc.groups.groups)  # c left: never usable again
    assert len(cache) == 0
    assert cache.keep(ab, running=tuple("abd")) == []
    assert cache.prune(running=tuple("bd")) == list(ab.groups.groups)  # a left later
    assert len(cache) == 0


def test_the_oldest_kept_world_goes_beyond_the_capacity_and_none_is_kept_at_zero():
    cache = WorldCache(1)
    first, second = _world("ab", 0), _world("abc", 1)
    assert cache.keep(first, running=tuple("abcd")) == []
    assert cache.keep(second, running=tuple("abcd")) == list(first.groups.groups)
    assert cache.find(tuple("abc")) is second and cache.find(tuple("ab")) is None
    none = WorldCache(0)
    assert none.keep(first, running=tuple("abcd")) == list(first.groups.groups) and len(none) == 0


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_a_keep_worlds_that_is_not_a_count_is_refused_at_construction(bad):
    with pytest.raises(ValueError, match="keep_worlds"):
        OnNodeChange({2: "dp2-tp1-pp1"}, keep_worlds=bad)


def test_a_cache_of_negative_capacity_is_refused():
    with pytest.raises(ValueError, match="keep_worlds must be >= 0"):
        WorldCache(-1)
