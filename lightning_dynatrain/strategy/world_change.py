"""One world change at its boundary, on the old members (``ElasticDriver.at_boundary`` calls it).

A leaver hands its state off over the old world and stops. For the members that stay, the new
world is installed first; then a grow runs the join's steps (1)-(4) for its joiners
(``strategy/elastic.py``'s module docstring) and its switch over the new world, going back to the
old world when that switch fails with the old state whole (``go_back``); a shrink's switch runs
over the old world, where the leavers still are, and a member lost in it is recovered from
(``_shrink_failed``). The result is the change's ``ChangeReport``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_dynatrain.compat.lightning_internals import checkpoint_connector
from lightning_dynatrain.elastic.policy import moved_bytes
from lightning_dynatrain.elastic.session import WorldChange
from lightning_dynatrain.elastic.world import retire
from lightning_dynatrain.elastic.world_cache import KeptWorld
from lightning_dynatrain.engine.errors import was_refused
from lightning_dynatrain.strategy.change_report import ChangeReport
from lightning_dynatrain.strategy.elastic_environment import set_rank_zero
from lightning_dynatrain.strategy.loggers import continue_loggers, flush_loggers
from lightning_dynatrain.strategy.recovery import retire_world
from lightning_dynatrain.strategy.switching import WorldGroupCaches

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_dynatrain.strategy.elastic import ElasticDriver
    from lightning_dynatrain.strategy.elastic_ahead import AheadChange
    from lightning_dynatrain.vps.topology import Topology


def change_world(driver: "ElasticDriver", change: WorldChange, trainer: "pl.Trainer", *,
                 ahead: "AheadChange | None", detected: float | None) -> ChangeReport | None:
    """Swap to ``change.new`` at this boundary and move the state (see the module docstring);
    ``ahead``: the change built ahead (``None``: on demand), ``detected``: when it was first seen."""
    from lightning_dynatrain.megatron.hot_switch import hot_switch, send_state
    from lightning_dynatrain.megatron.parallel_state_adapter import initialize_for_layout
    from lightning_dynatrain.megatron.state_bridge import adam_step, precision_of
    from lightning_dynatrain.strategy.joining import join_header
    from lightning_dynatrain.strategy.topology import gather_topology

    session = driver.session
    assert session is not None
    strategy, start = driver.strategy, time.perf_counter()
    detected = detected or start
    choice = ahead.choice if ahead is not None else driver.choose(change)
    src, target, step = strategy.layout, choice.layout, trainer.global_step
    old_world = dist.GroupMember.WORLD
    build_seconds = session.build_seconds()
    # a shrink's switch runs over the old world, under its switch watch (every old member, leavers too)
    old_watch = strategy.switcher.world_watch() if not change.grows else None
    if change.leaving:
        if strategy.global_rank == 0:  # written before the survivors can go on: the next rank 0 appends
            flush_loggers(trainer.loggers)
        setup = strategy.switcher.world_change_setup(strategy.recipe, strategy.optimizer_settings)
        send_state(strategy.megatron, target, setup, members=change.members, group=old_world, watch=old_watch)
        driver.left = True
        trainer.should_stop = True
        session.close()
        rank_zero_info(f"[dynatrain] this process left the job at step {step} ({change})")
        print(f"[dynatrain] process {session.me} handed its state off at step {step} and leaves",
              flush=True)
        return None
    prepared = ahead.prepared() if ahead is not None else None
    was_rank_zero = strategy.global_rank == 0
    kept = session.pending_kept  # a return to a kept world: its groups are all there
    left_world = session.swap(change, borrowed=ahead.borrowed if ahead is not None else None)
    old_caches = strategy.switcher.world_caches()
    if old_watch is not None:
        strategy.switcher.detach_watch()  # kept until the shrink's switch over the old world ends
    set_rank_zero(session.rank)
    groups = strategy.switcher.new_world_groups(ahead.groups if ahead is not None else None,
                                                kept=kept.extra if kept is not None else None)
    if change.grows:  # the joiners wait for (1)-(4) in this order (see the module docstring)
        old_topology = strategy.switcher.topology
        if ahead is None:
            broadcast_object(join_header(driver, trainer, target) if session.rank == 0 else None)  # (1)
            initialize_for_layout(target, seed=strategy.seed, groups=groups)  # (2)
            strategy.switcher.new_world(gather_topology(strategy.cluster_environment))
        else:  # (1), (2) and the switch watch came at the prepare boundary; the joiners wait for the Adam step
            strategy.switcher.new_world(ahead.topology)
            if ahead.watch is not None:
                strategy.switcher.adopt_watch(ahead.watch)
            broadcast_object({"adam_step": adam_step(strategy.megatron.optimizer) or 0}
                              if session.rank == 0 else None)
        setup = ahead.setup if ahead is not None else \
            strategy.switcher.world_change_setup(strategy.recipe, strategy.optimizer_settings, grows=True)
        # (3) under the new world's switch watch (its deadline; a joiner that dies or stalls is named)
        try:
            result = hot_switch(strategy.megatron, target, setup, groups=groups, members=change.members,
                                prepared=prepared, watch=strategy.switcher.world_watch(),
                                restore_source_groups=False)
        except Exception as err:
            refused = was_refused(err)
            if not refused and not _joiners_lost_with_a_snapshot(driver, change, err):
                raise  # the state of this step is lost (or a rank holding it is gone)
            go_back(driver, change, step, err, RetainedWorld(left_world, old_caches, old_topology))
            if not refused:  # the switch freed old state: the snapshot's state, and the steps since again
                snapshot_step, seconds = driver.snapshots.back_in_place(strategy, step)
                rank_zero_warn(f"[dynatrain] step {step}: the state went back to the in-memory snapshot of step "
                               f"{snapshot_step}; {step - snapshot_step} step(s) redone in {seconds:.2f} s")
            return None
        session.confirm(change)
        session.retire(left_world, extra=old_caches)  # (kept until here: a failed switch goes back to it)
        strategy._install(result.state)
        try:
            broadcast_object(trainer_state(trainer) if session.rank == 0 else None)  # (4)
        except Exception as err:  # a member died once the state had moved: recovered from in the new world
            driver.recover_or_raise(trainer, err)
            return None
    else:  # the leavers send over the old world; the survivors build the target on the new one
        if ahead is None:
            # the old world's topology
            setup = strategy.switcher.world_change_setup(strategy.recipe, strategy.optimizer_settings)
            initialize_for_layout(target, seed=strategy.seed, groups=groups)
        else:
            setup = ahead.setup
        try:
            result = hot_switch(strategy.megatron, target, setup, groups=groups, group=old_world,
                                members=change.members, prepared=prepared, watch=old_watch,
                                restore_source_groups=False)  # (the old layout's world is gone)
        except Exception as err:
            if not driver.recovers(err):
                raise
            _shrink_failed(driver, change, trainer, err, left_world, old_caches, was_rank_zero=was_rank_zero)
            return None
        finally:
            assert old_watch is not None
            old_watch.close()
        strategy._install(result.state)
        session.retire(left_world, extra=old_caches)
        strategy.switcher.new_world(ahead.topology if ahead is not None
                                    else gather_topology(strategy.cluster_environment))
        if session.rank == 0 and not was_rank_zero:  # the old rank 0 left (its files are written)
            continue_loggers(trainer.loggers)
    pause = time.perf_counter() - start
    moved = moved_bytes(setup.spec, src, target, precision_of(strategy.megatron.model, strategy.megatron.optimizer),
                        change.members)  # the plan's total: no collective (the joiners have gone on)
    return ChangeReport(step=step, change=str(change), src=str(src), dst=str(target), reason=choice.reason,
                        detect_to_swap_seconds=start - detected, pause_seconds=pause,
                        transfer_seconds=result.phases.get("engine", 0.0), build_seconds=build_seconds,
                        rebuild_seconds=result.rebuild_seconds, moved_bytes=moved,
                        ahead_build_seconds=result.ahead_build_seconds, kept_world=kept is not None)

def go_back(driver: "ElasticDriver", change: WorldChange, step: int, err: Exception, old: "RetainedWorld") -> None:
    """A grow's switch failed with the old state whole on every old member (a joiner went
    missing or stalled, under ``switch_safety="keep_old"`` or before anything moved; or the
    switch was refused), or after freeing some of it with only joiners lost (the caller then puts
    the snapshot's state back, ``SnapshotKeeper.back_in_place``): the old world, its groups and
    its layout's megatron groups come back, the new world's groups are destroyed, and training
    goes on. The joiners fail; the store,
    which was not told of the new world, cancels the change once their heartbeats stop."""
    from lightning_dynatrain.megatron.parallel_state_adapter import initialize_for_layout

    session = driver.session
    assert session is not None and old.world is not None
    strategy = driver.strategy
    new_world = session.swap_back(change, old.world)
    strategy.switcher.new_world_groups(kept=old.caches)  # the new world's watch and subgroups go
    retire(new_world.groups)
    initialize_for_layout(strategy.layout, seed=strategy.seed, groups=old.caches.groups)  # cached: makes none
    assert old.topology is not None
    strategy.switcher.new_world(old.topology)
    set_rank_zero(session.rank)
    driver.rolled_back.append({"step": step, "change": str(change), "layout": str(strategy.layout),
                             "error": f"{type(err).__name__}: {err}"})
    how = "with the old state whole" if was_refused(err) else "after freeing old state (only joiners were lost)"
    rank_zero_warn(f"[dynatrain] step {step}: {change} failed {how}, so it was rolled back: "
                   f"training goes on at {strategy.layout} on the world of {len(change.old.members)} "
                   f"({type(err).__name__}: {err})")


def _shrink_failed(driver: "ElasticDriver", change: WorldChange, trainer: "pl.Trainer", err: Exception,
                   left_world: "KeptWorld | None", old_caches: "WorldGroupCaches", *, was_rank_zero: bool) -> None:
    """A shrink's switch lost a member (``driver.recovers(err)``): when only leavers went missing, the
    running world (the survivors, installed) is whole and the state is rebuilt in it from what the old
    world's survivors hold (``recovery.recover_in_world``); when a member that stays went missing too,
    the survivors agree on a world without it first (``recovery.recover``). Either reads the state
    as the old world's ranks held it, and the old world's groups go."""
    assert left_world is not None
    leavers = {change.old.rank_of(m) for m in change.old.members if m not in change.new.members}
    missing = set(getattr(err, "missing", ()))
    old_groups = (old_caches.subgroups, old_caches.groups, left_world.groups.groups)
    if missing and missing <= leavers:
        driver.recover(trainer, error=err, state_world=change.old, retired=old_groups, was_rank_zero=was_rank_zero)
        return
    driver.recover(trainer, error=err, state_world=change.old)
    retire_world(old_groups)


def _joiners_lost_with_a_snapshot(driver: "ElasticDriver", change: WorldChange, err: Exception) -> bool:
    """A grow's switch freed old state and lost only joiners (ranks of the new world), with snapshots
    on: the old members, all alive, go back to their world and to the snapshot."""
    joiners = {change.new.rank_of(m) for m in change.new.members if m not in change.old.members}
    missing = set(getattr(err, "missing", ()))
    return bool(missing) and missing <= joiners and driver.snapshots is not None and driver.recovers(err)


def trainer_state(trainer: "pl.Trainer") -> dict:
    """Lightning's checkpoint dict: loops, callbacks, data module, schedulers; no tensors (the
    strategy's holds the optimizer's scalars only, the weights go under logical keys)."""
    return checkpoint_connector(trainer).dump_checkpoint(weights_only=False)


@dataclass(frozen=True)
class RetainedWorld:
    """What a grow's old members keep of their world until its switch succeeded (``go_back``)."""

    world: KeptWorld | None  # its default group and groups (``ElasticSession.swap`` returned them)
    caches: WorldGroupCaches  # the strategy's caches of its megatron and switch groups
    topology: "Topology | None"


def broadcast_object(obj: Any) -> Any:
    """One object from rank 0 of the world to every rank (a real collective, whatever the strategy's
    collectives do while catching up)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


__all__ = ["RetainedWorld", "broadcast_object", "change_world", "go_back", "trainer_state"]
