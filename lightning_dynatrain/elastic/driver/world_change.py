"""One world change at its boundary, on the old members (``ElasticDriver.at_boundary`` calls it).

A leaver hands its state off over the old world and stops. For the members that stay, the new
world is installed first; then a grow runs the join's steps (1)-(4) for its joiners
(``joining.py``) and its switch over the new world; a shrink's switch runs over the old world,
where the leavers still are. A member lost in either switch goes to the one recovery guard
(``recovery.recover_or_raise``) with what it needs to go back: a grow's retained old world
(``GrowInFlight``), a shrink's old world and its groups (``ShrinkInFlight``). The result is the
change's ``ChangeReport``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch.distributed as dist

from lightning_dynatrain.elastic.driver.change_report import ChangeReport
from lightning_dynatrain.elastic.driver.joining import broadcast_object, join_header
from lightning_dynatrain.elastic.driver.layout_policy import moved_bytes
from lightning_dynatrain.elastic.driver.recovery import (
    FailedAt,
    GrowInFlight,
    RetainedWorld,
    ShrinkInFlight,
    recover_or_raise,
)
from lightning_dynatrain.elastic.session import WorldChange

if TYPE_CHECKING:
    from lightning_dynatrain.elastic.driver.ahead_change import AheadChange
    from lightning_dynatrain.elastic.driver.driver import ElasticDriver


def change_world(driver: "ElasticDriver", change: WorldChange, *, ahead: "AheadChange | None",
                 detected: float | None) -> ChangeReport | None:
    """Swap to ``change.new`` at this boundary and move the state (see the module docstring);
    ``ahead``: the change built ahead (``None``: on demand), ``detected``: when it was first seen."""
    from lightning_dynatrain.megatron.hot_switch import hot_switch, send_state
    from lightning_dynatrain.megatron.parallel_state_adapter import initialize_for_layout
    from lightning_dynatrain.megatron.state_bridge import adam_step, precision_of
    from lightning_dynatrain.runtime.world_topology import gather_topology

    session, run, front = driver.session, driver.run, driver.front
    assert session is not None
    start = time.perf_counter()
    detected = detected or start
    choice = ahead.choice if ahead is not None else driver.choose(change)
    src, target, step = run.layout, choice.layout, front.global_step
    old_world = dist.GroupMember.WORLD
    build_seconds = session.build_seconds()
    # a shrink's switch runs over the old world, under its switch watch (every old member, leavers too)
    old_watch = run.switcher.world_watch() if not change.grows else None
    if change.leaving:
        if session.rank == 0:  # written before the survivors can go on: the next rank 0 appends
            front.hand_off_logs()
        setup = run.switcher.world_change_setup(run.recipe, run.optimizer_settings)
        send_state(run.state, target, setup, members=change.members, group=old_world, watch=old_watch)
        driver.left = True
        front.stop()
        session.close()
        front.info(f"[dynatrain] this process left the job at step {step} ({change})")
        print(f"[dynatrain] process {session.me} handed its state off at step {step} and leaves", flush=True)
        return None
    prepared = ahead.prepared() if ahead is not None else None
    was_rank_zero = session.rank == 0
    kept = session.pending_kept  # a return to a kept world: its groups are all there
    left_world = session.swap(change, borrowed=ahead.borrowed if ahead is not None else None)
    old_caches = run.switcher.world_caches()
    if old_watch is not None:
        run.switcher.detach_watch()  # kept until the shrink's switch over the old world ends
    front.rank_changed()
    groups = run.switcher.new_world_groups(ahead.groups if ahead is not None else None,
                                           kept=kept.extra if kept is not None else None)
    if change.grows:  # the joiners wait for (1)-(4) in this order (see the module docstring)
        old_topology = run.switcher.topology
        if ahead is None:
            broadcast_object(join_header(driver, target) if session.rank == 0 else None)  # (1)
            initialize_for_layout(target, seed=run.seed, groups=groups)  # (2)
            run.switcher.new_world(gather_topology(driver.node_rank))
        else:  # (1), (2) and the switch watch came at the prepare boundary; the joiners wait for the Adam step
            run.switcher.new_world(ahead.topology)
            if ahead.watch is not None:
                run.switcher.adopt_watch(ahead.watch)
            broadcast_object({"adam_step": adam_step(run.state.optimizer) or 0} if session.rank == 0 else None)
        setup = ahead.setup if ahead is not None else \
            run.switcher.world_change_setup(run.recipe, run.optimizer_settings, grows=True)
        # (3) under the new world's switch watch (its deadline; a joiner that dies or stalls is named)
        try:
            result = hot_switch(run.state, target, setup, groups=groups, members=change.members,
                                prepared=prepared, watch=run.switcher.world_watch(), restore_source_groups=False)
        except Exception as err:  # back to the old world where its state is whole, else the error
            recover_or_raise(driver, err, FailedAt(grow=GrowInFlight(
                change, step, RetainedWorld(left_world, old_caches, old_topology))))
            return None
        session.confirm(change)
        session.retire(left_world, extra=old_caches)  # (kept until here: a failed switch goes back to it)
        run.install(result.state)
        try:
            broadcast_object(front.loop_state() if session.rank == 0 else None)  # (4)
        except Exception as err:  # a member died once the state had moved: recovered from in the new world
            recover_or_raise(driver, err)
            return None
    else:  # the leavers send over the old world; the survivors build the target on the new one
        if ahead is None:
            # the old world's topology
            setup = run.switcher.world_change_setup(run.recipe, run.optimizer_settings)
            initialize_for_layout(target, seed=run.seed, groups=groups)
        else:
            setup = ahead.setup
        try:
            result = hot_switch(run.state, target, setup, groups=groups, group=old_world,
                                members=change.members, prepared=prepared, watch=old_watch,
                                restore_source_groups=False)  # (the old layout's world is gone)
        except Exception as err:
            recover_or_raise(driver, err, FailedAt(shrink=ShrinkInFlight(change, left_world, old_caches,
                                                                        was_rank_zero=was_rank_zero)))
            return None
        finally:
            assert old_watch is not None
            old_watch.close()
        run.install(result.state)
        session.retire(left_world, extra=old_caches)
        run.switcher.new_world(ahead.topology if ahead is not None else gather_topology(driver.node_rank))
        if session.rank == 0 and not was_rank_zero:  # the old rank 0 left (its files are written)
            front.continue_logs()
    pause = time.perf_counter() - start
    moved = moved_bytes(setup.spec, src, target, precision_of(run.state.model, run.state.optimizer),
                        change.members)  # the plan's total: no collective (the joiners have gone on)
    return ChangeReport(step=step, change=str(change), src=str(src), dst=str(target), reason=choice.reason,
                        detect_to_swap_seconds=start - detected, pause_seconds=pause,
                        transfer_seconds=result.phases.get("engine", 0.0), build_seconds=build_seconds,
                        rebuild_seconds=result.rebuild_seconds, moved_bytes=moved,
                        ahead_build_seconds=result.ahead_build_seconds, kept_world=kept is not None)


__all__ = ["change_world"]
