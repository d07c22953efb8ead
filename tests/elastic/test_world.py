"""Worlds with a life cycle on real processes: the next world built in the background while the old
one keeps stepping, groups made on it before its install (borrowed), installed at a step boundary,
the old one retired; joiners started later; a leaver that hands off over the old world; megatron's
groups on each new world.

Plain torch here (the world adapter alone). The protocol is the strategy's: every step's collective
carries a vote ("I have built the next world", or "I am leaving"); the world changes at the first
step where every old member voted.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.elastic.processes import Processes

pytestmark = pytest.mark.slow


def _connect(address: str) -> dist.Store:
    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60))


def _step(vote: bool = False) -> tuple[float, float]:
    """One training step's collective over the world, with a vote riding along: (members, votes)."""
    t = torch.tensor([1.0, float(vote)])
    dist.all_reduce(t)
    time.sleep(0.01)  # the step's compute
    return t[0].item(), t[1].item()


def _megatron_sizes(layout: str) -> tuple[int, int]:
    """(tp, dp) sizes of megatron's groups built for ``layout`` on the current world."""
    from lightning_dynatrain.megatron.parallel_state_adapter import destroy, initialize_for_layout
    from lightning_dynatrain.vps.layout import ParallelConfig

    pgs = initialize_for_layout(ParallelConfig.parse(layout), seed=0)
    sizes = (pgs.tp.size(), pgs.dp.size())
    destroy()
    return sizes


def _old_member(name: str, address: str, rank: int) -> dict:
    """In generation 0 (2 ranks); generation 1: 4 ranks (two joiners); generation 2: ``b`` leaves."""
    from lightning_dynatrain.elastic.world import BorrowedWorld, NextWorld, build_group, install, retire

    store = _connect(address)
    install(build_group(store, generation=0, rank=rank, size=2), store, generation=0)
    out = {"gen0": _step()[0], "gen0_sizes": _megatron_sizes("dp1-tp2-pp1")}
    store.add("members_up", 1)
    grow = NextWorld(store, generation=1, rank=rank, size=4)  # waits in the background for the joiners
    steps = 1
    while _step(grow.ready)[1] < 2:
        steps += 1
    # groups of the next world made before its install, as the joiners make them after theirs
    borrowed = BorrowedWorld(grow.group(timeout=30), store, generation=1)
    with borrowed:
        pair, borrowed_size = _pair_group(), dist.get_world_size()
    out.update(borrowed_size=borrowed_size, old_world_after_borrowing=_step()[0])
    old = install(borrowed.group, store, generation=1, borrowed=borrowed)
    out.update(steps_while_building=steps, gen1=_step()[0], rank1=dist.get_rank())
    retire(old.groups)
    out.update(pair_sum=_sum_over(pair), gen1_sizes=_megatron_sizes("dp2-tp2-pp1"),
               subgroup=dist.get_world_size(_pair_group()))
    out.update(_shrink(name, store))
    return out


def _pair_group() -> dist.ProcessGroup:
    """``new_group`` on the new world, joiners and old members alike: ranks {0, 1} and {2, 3}."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return pairs[dist.get_rank() // 2]


def _sum_over(group: dist.ProcessGroup) -> float:
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    return t.item()


def _joiner(name: str, address: str, rank: int) -> dict:
    from lightning_dynatrain.elastic.world import NextWorld, install

    store = _connect(address)
    install(NextWorld(store, generation=1, rank=rank, size=4, background=False).group(), store, generation=1)
    pair = _pair_group()  # the old members made theirs on this world before installing it
    out = {"gen1": _step()[0], "rank1": dist.get_rank()}
    out.update(pair_sum=_sum_over(pair), gen1_sizes=_megatron_sizes("dp2-tp2-pp1"),
               subgroup=dist.get_world_size(_pair_group()))
    out.update(_shrink(name, store))
    return out


def _shrink(name: str, store: dist.Store) -> dict:
    """``b`` (rank 1) leaves: the others build generation 2 meanwhile; at the step every member
    voted, ``b`` hands off over generation 1 and stops; the survivors install generation 2."""
    from lightning_dynatrain.elastic.world import NextWorld, install, retire

    survivors = ["a", "c", "d"]
    nxt = NextWorld(store, generation=2, rank=survivors.index(name), size=3) if name in survivors else None
    while _step(nxt is None or nxt.ready)[1] < 4:
        pass
    handoff = torch.full((4,), 7.0) if name == "b" else torch.zeros(4)
    dist.broadcast(handoff, src=1)  # over generation 1, still the default group
    if nxt is None:
        return {"left": True}
    old = install(nxt.group(timeout=30), store, generation=2)
    out = {"gen2": _step()[0], "rank2": dist.get_rank(), "handoff": handoff.tolist()}
    retire(old.groups)
    out["gen2_sizes"] = _megatron_sizes("dp3-tp1-pp1")
    dist.barrier()
    return out


def _first_world(member) -> tuple[Processes, dist.TCPStore, str]:
    """``a`` and ``b`` run ``member`` over a master store (keep it alive) at the returned address;
    returns once generation 0 steps."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    address = f"127.0.0.1:{master.port}"
    procs = Processes()
    procs.start("a", member, address, 0)
    procs.start("b", member, address, 1)
    master.wait(["members_up"], timedelta(seconds=120))  # generation 0 is up and stepping
    return procs, master, address


def test_a_world_grows_with_joiners_and_shrinks_with_a_leaver_while_the_old_one_steps():
    procs, _master, address = _first_world(_old_member)
    time.sleep(1.0)
    procs.start("c", _joiner, address, 2)
    procs.start("d", _joiner, address, 3)
    out = procs.collect(timeout_s=180)

    assert out["a"]["gen0"] == out["b"]["gen0"] == 2 and out["a"]["gen0_sizes"] == (2, 1)
    # the old members stepped while the joiners started (interpreters, imports, the build)
    assert out["a"]["steps_while_building"] > 10 and out["a"]["steps_while_building"] == out["b"]["steps_while_building"]
    # borrowed, the next world was the default (4 ranks); then the old one again (2)
    assert out["a"]["borrowed_size"] == 4 and out["a"]["old_world_after_borrowing"] == 2
    for name, rank in zip("abcd", range(4)):
        assert out[name]["gen1"] == 4 and out[name]["rank1"] == rank
        assert out[name]["pair_sum"] == 2  # a group made while borrowed works after the install
        assert out[name]["gen1_sizes"] == (2, 2) and out[name]["subgroup"] == 2
    assert out["b"] == {**out["b"], "left": True} and "gen2" not in out["b"]
    for name, rank in zip("acd", range(3)):
        assert out[name]["gen2"] == 3 and out[name]["rank2"] == rank
        assert out[name]["handoff"] == [7.0] * 4 and out[name]["gen2_sizes"] == (1, 3)


def _returning_member(name: str, address: str, rank: int) -> dict:
    """Generation 0: ``a`` and ``b``; generation 1: ``c`` joins, and generation 0 is kept (its members
    are all still there); generation 2: ``c`` leaves, and ``a`` and ``b`` install the kept world."""
    import torch.distributed.distributed_c10d as c10d

    from lightning_dynatrain.elastic.world import NextWorld, build_group, install, retire
    from lightning_dynatrain.elastic.world_cache import KeptWorld, WorldCache

    store, cache = _connect(address), WorldCache(capacity=2)
    install(build_group(store, generation=0, rank=rank, size=2), store, generation=0)
    gen0, pair = dist.GroupMember.WORLD, dist.new_group([0, 1])  # a group made on generation 0
    store.add("members_up", 1)
    grow = NextWorld(store, generation=1, rank=rank, size=3)
    while _step(grow.ready)[1] < 2:
        pass
    old = install(grow.group(timeout=30), store, generation=1, keep=cache.groups())
    out = {"gen1": _step()[0]}
    destroyed = cache.keep(KeptWorld(members=("a", "b"), generation=0, groups=old), running=("a", "b", "c"))
    out.update(kept_after_grow=len(cache), destroyed_at_grow=len(destroyed), kept_default=old.default is gen0)
    retire(destroyed)
    while _step(False)[1] < 1:  # c votes to leave
        pass
    kept = cache.take(("a", "b"))
    back = NextWorld.kept(kept.groups.default, generation=2, rank=rank)
    old = install(back.group(), store, generation=2, kept=kept.groups, keep=cache.groups())
    retire(cache.keep(KeptWorld(members=("a", "b", "c"), generation=1, groups=old), running=("a", "b")))
    out.update(gen2=_step()[0], same_group=dist.GroupMember.WORLD is gen0, build_seconds=back.seconds,
               kept_after_return=len(cache), old_pair=_sum_over(pair), groups=len(c10d._world.pg_map))
    new_pair = dist.new_group([0, 1])  # named from the count the members reached in generation 0, alike
    out["new_pair"] = _sum_over(new_pair)
    dist.barrier()
    return out


def _leaving_joiner(name: str, address: str, rank: int) -> dict:
    from lightning_dynatrain.elastic.world import NextWorld, install

    store = _connect(address)
    install(NextWorld(store, generation=1, rank=rank, size=3, background=False).group(), store, generation=1)
    out = {"gen1": _step()[0]}
    _step(True)  # leaves at once
    return out


def test_a_return_to_a_kept_world_installs_its_groups_and_builds_none():
    procs, _master, address = _first_world(_returning_member)
    procs.start("c", _leaving_joiner, address, 2)
    out = procs.collect(timeout_s=180)

    assert out["c"] == {"gen1": 3}
    for name in "ab":
        o = out[name]
        assert o["gen1"] == 3 and o["gen2"] == 2
        # generation 0 was kept at the grow (nothing destroyed), generation 1 not at the return (c left)
        assert (o["kept_default"], o["kept_after_grow"], o["destroyed_at_grow"], o["kept_after_return"]) == \
            (True, 1, 0, 0)
        # the return installed generation 0's own group, built nothing, and its groups still work
        assert o["same_group"] and o["build_seconds"] == 0.0 and o["old_pair"] == 2 and o["new_pair"] == 2
        assert o["groups"] == 2  # generation 0's WORLD and pair; generation 1's were destroyed
