"""One process's part in an elastic job: entering it, noticing changes, building the next world,
agreeing when to swap, leaving, and noticing a member that failed.

Every step boundary costs one store ``get`` (``poll``): the latest generation number. When a new
generation appears, every member of its world starts building that world's default group in a
background thread (``world.NextWorld``) while training steps on. From the generation's
``effective_step`` on (every rank has read it by then: the store process sets it a few steps
ahead), each boundary adds one tiny all-reduce over the running world, the *vote*: "I have built
the next world" (a leaver votes yes at once). At the first boundary where every member voted, the
world changes (``WorldChange``); until then nothing waits on a slow joiner.

A joiner enters in ``enter``: its request admitted, it builds the world of its generation in the
background, polling the store meanwhile (a change cancelled because another joiner died makes it
ask again), and installs it; the old members install theirs at the voted boundary.

Liveness: this member holds a connection to the store process (``liveness.py``), which its kernel
closes the moment its process ends; the store then records it failed at once, in a generation
whose members are the survivors, and tells them over theirs. A daemon thread also says every
``heartbeat`` seconds that this member is alive, for what closes nothing: the store records a
member silent for ``dead_after`` seconds (``suspect_after`` once a collective failed) as failed
too. A watchdog thread reads the generation when the store tells it, and every second
(``failure_watch.FailureWatch``): a survivor recovers into that world
(``recover_into``, called by the strategy, ``elastic/driver/recovery.py``); when the job cannot go on the
watchdog records ``failure`` (the callback raises ``MemberFailedError`` with it) and, when the main
thread is stuck in a collective that will never complete, ends the process after ``exit_after``
seconds with that message, so a job never hangs silently.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_dynatrain.compat.torch_internals import registered_groups
from lightning_dynatrain.transition.abandon import abandon_world, launcher_store_port
from lightning_dynatrain.elastic.client import JobStore
from lightning_dynatrain.elastic.failure_watch import (
    EXIT_MEMBER_FAILED,
    FailureWatch,
    MemberFailedError,
    MemberLostError,
)
from lightning_dynatrain.elastic.records import AdmissionError, JoinRequest, LeaveRequest, Membership
from lightning_dynatrain.elastic.world import BorrowedWorld, NextWorld, install, retire
from lightning_dynatrain.elastic.world_cache import KeptWorld, WorldCache, WorldGroups
from lightning_dynatrain.thread_end import BUILD_END_WAIT
from lightning_dynatrain.vps.members import Members

#: test hook: ``DYNATRAIN_JOIN_FAULT=STOP`` stops a joiner (SIGSTOP) right after it is admitted, before
#: the world that admits it is built, so that the change must be cancelled; ``STOP_IN_BUILD`` once its
#: peers build the target ahead, before its own build; ``STOP_IN_SWITCH`` once they swapped to the new
#: world and started the switch that fills it (built ahead; ``elastic.driver.driver``)
JOIN_FAULT_ENV = "DYNATRAIN_JOIN_FAULT"

#: test hook: ``DYNATRAIN_RECOVERY_FAULT=KILL_IN_WORLD`` kills this process (SIGKILL) as it starts
#: building the survivors' world of a recovery, while the others wait for it there
RECOVERY_FAULT_ENV = "DYNATRAIN_RECOVERY_FAULT"


@dataclass(frozen=True, slots=True)
class WorldChange:
    """From world ``old`` to world ``new``, as process ``me`` sees it."""

    old: Membership
    new: Membership
    me: str

    @property
    def joining(self) -> bool:
        return self.me not in self.old.members

    @property
    def leaving(self) -> bool:
        return self.me not in self.new.members

    @property
    def grows(self) -> bool:
        """Processes join (the state moves over the new world); else they leave (over the old one)."""
        return len(self.new.members) > len(self.old.members)

    @property
    def members(self) -> Members:
        """Which process of the switch's group holds each old and each new rank: the new world's
        processes when it grows, the old world's when it shrinks."""
        over = self.new if self.grows else self.old
        return Members(src=tuple(over.rank_of(m) for m in self.old.members),
                       dst=tuple(over.rank_of(m) for m in self.new.members), size=len(over.members))

    def __str__(self) -> str:
        what = f"+{len(self.new.joined)}" if self.grows else f"-{len(self.new.left)}"
        return (f"world {len(self.old.members)} -> {len(self.new.members)} ({what}, generation "
                f"{self.new.generation})")


class ElasticSession:
    """This process's membership of an elastic job (see the module docstring).

    Args:
        store: the job's store client (``JobStore.from_environment()``).
        backend: the worlds' backend (``gloo`` / ``nccl``).
        device: on NCCL, the device whose communicator each world connects eagerly.
        timeout: collectives' timeout in every world; also how long a world's build may take.
        heartbeat, exit_after: see the module docstring.
        recover: survivors of a member that died go on (``False``: the job ends, ``MemberFailedError``).
    """

    def __init__(self, store: JobStore, *, backend: str, device: torch.device | None = None,
                 timeout: timedelta = timedelta(minutes=30), heartbeat: float = 1.0, exit_after: float = 30.0,
                 keep_worlds: int = 2, recover: bool = True) -> None:
        self.store, self.backend, self.device, self.timeout = store, backend, device, timeout
        self.kept = WorldCache(keep_worlds)
        """Worlds left for one whose members are all still in the job (``world_cache``)."""
        self.heartbeat, self.exit_after = heartbeat, exit_after
        self.world: Membership | None = None
        self.joined_change: WorldChange | None = None
        self.failures = FailureWatch(store, me=self.me, recover=recover, abandon=self.abandon_world,
                                     exit_after=exit_after, grace=max(2.0, 2 * heartbeat))
        self.leave_requested = False
        self._leave_nonce: str | None = None
        self._seen = -1
        self._pending: Membership | None = None
        self._cancel: Membership | None = None
        self._next: NextWorld | None = None

    @property
    def me(self) -> str:
        return self.store.member_id

    @property
    def rank(self) -> int:
        assert self.world is not None, "enter() first"
        rank = self.world.rank_of(self.me)
        assert rank is not None, "this process left the job"
        return rank

    @property
    def size(self) -> int:
        assert self.world is not None, "enter() first"
        return len(self.world.members)

    # ------------------------------------------------------------------------------ entering
    def enter(self, fingerprint: str, *, launch_rank: int, launch_size: int, launch_id: str,
              ends_with_launch: bool = False, world_sizes: tuple[int, ...] | None = None) -> Membership:
        """Become a member and install this process's first world; its membership.

        The processes the first launch started (one ``torchrun``, one ``srun`` step: ``launch_id``,
        ``launch_size`` processes, this one at ``launch_rank``) form the first world; a process of a
        later launch joins the running job, with the others of its launch: ``joined_change`` says from
        which world (the state then comes from the old members). ``world_sizes``: the sizes its
        layout policy has a layout for (``None``: any); a join waits for room in one of them.

        Raises:
            AdmissionError: refused (token, model), no store, or the world could not be built.
        """
        while True:
            request = JoinRequest(member=self.me, fingerprint=fingerprint, launch_rank=launch_rank,
                                  launch_size=launch_size, launch_id=launch_id, ends_with_launch=ends_with_launch,
                                  world_sizes=world_sizes)
            verdict = self.store.ask(request, timeout=self.timeout.total_seconds())
            self.store.start_alive(self.heartbeat, on_notice=self.failures.notice)
            world = self.store.membership(int(verdict["generation"]))
            if os.environ.get(JOIN_FAULT_ENV) == "STOP" and world.generation > 0:
                os.kill(os.getpid(), signal.SIGSTOP)  # test hook: admitted, its world not yet built
            nxt = NextWorld(self.store.for_thread().raw, generation=world.generation, rank=world.rank_of(self.me),
                            size=len(world.members), backend=self.backend, timeout=self.timeout, device=self.device)
            if self._wait_built(nxt, world):
                break
            print(f"[dynatrain] the change that admitted {self.me} was cancelled (a joiner with it stopped); "
                  "asking again", file=sys.stderr, flush=True)
        install(nxt.group(), self.store.raw, generation=world.generation)
        if world.generation > 0:
            # the store publishes a change only once the world before it runs (or a cancelled
            # change's record, with the running world's members)
            self.joined_change = WorldChange(old=self.store.membership(world.generation - 1), new=world, me=self.me)
        self.world, self._seen = world, world.generation
        self.failures.world = world
        if self.rank == 0:
            self.store.mark_installed(world.generation)
        self.failures.start()
        return world

    def _wait_built(self, nxt: NextWorld, world: Membership) -> bool:
        """Wait for this joiner's world; ``False`` when a later generation cancelled it."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not nxt.wait(timeout=0.2):
            latest = self.store.generation()
            if latest > world.generation:
                later = self.store.membership(latest)
                if self.me not in later.members:
                    return False
            if time.monotonic() > deadline:
                raise AdmissionError(f"the world of generation {world.generation} was not built in "
                                     f"{self.timeout.total_seconds():.0f} s",
                                     hint="a member of it is missing; see its log")
        return True

    # -------------------------------------------------------------------------- every step
    def poll(self, step: int) -> WorldChange | None:
        """At the boundary after optimizer step ``step``: the change to make now, if any.

        Costs one store ``get`` while nothing changes; from a pending change's effective step on,
        one small all-reduce (the vote) per boundary, on every rank alike.

        Raises:
            MemberLostError: a member of the running world failed; this process goes on in the
                survivors' world (``recover_into``).
            MemberFailedError: a member of the running world failed and the job cannot go on.
        """
        self.failures.raise_failure()
        if self.failures.lost is not None:
            raise MemberLostError(self.failures.lost)
        if self._leave_nonce is not None and (verdict := self.store.verdict(self._leave_nonce)) is not None:
            self._leave_nonce = None
            if not verdict.get("admitted"):
                self.leave_requested = False
                print(f"[dynatrain] the job refused {self.me}'s leave: {verdict.get('reason')}", file=sys.stderr,
                      flush=True)
        latest = self.store.generation()
        if latest > self._seen:
            self._seen = latest
            record = self.store.membership(latest)
            if record.failed:
                self.failures.read(record)
                self.failures.raise_failure()
                if self.failures.lost is not None:
                    raise MemberLostError(self.failures.lost)
                return None  # a failure this process recovered from already
            self._consider(record)
        self._apply_cancel(step)
        pending = self._pending
        if pending is None or step < pending.effective_step:
            return None
        ready = self._next.ready if self._next is not None else True  # a leaver has nothing to build
        votes = torch.tensor([float(ready)], device=self.device or torch.device("cpu"))
        dist.all_reduce(votes)
        if int(votes.item()) < self.size:
            return None
        assert self.world is not None
        return WorldChange(old=self.world, new=pending, me=self.me)

    def _consider(self, record: Membership) -> None:
        assert self.world is not None
        if record.members == self.world.members:  # a change cancelled (a joiner died): at its step
            self._cancel = record
            return
        self._pending, self._cancel = record, None
        rank = record.rank_of(self.me)
        kept = self.kept.find(record.members)
        if rank is None:
            self._next = None
        elif kept is not None:  # a return to a kept world: nothing to build
            self._next = NextWorld.kept(kept.groups.default, generation=record.generation, rank=rank)
        else:  # on a connection of its own: its build waits
            self._next = NextWorld(self.store.for_thread().raw, generation=record.generation, rank=rank,
                                   size=len(record.members), backend=self.backend, timeout=self.timeout,
                                   device=self.device)

    def _apply_cancel(self, step: int) -> None:
        """From a cancel record's effective step on (every rank has read it; until then every rank
        still votes for the cancelled change), the change is dropped and training goes on."""
        if self._cancel is None or step < self._cancel.effective_step:
            return
        if self._pending is not None:
            print(f"[dynatrain] generation {self._pending.generation} cancelled: {list(self._cancel.dropped)} "
                  "stopped before joining", file=sys.stderr, flush=True)
        self.world, self._pending, self._next, self._cancel = self._cancel, None, None, None

    @property
    def pending(self) -> Membership | None:
        """The next generation, read but not yet in effect."""
        return self._pending

    def build_seconds(self) -> float:
        """How long the pending world's background build took (0 for a leaver: it builds none)."""
        return self._next.seconds if self._next is not None else 0.0

    def next_world(self) -> NextWorld:
        """The pending world's build (a member of it only)."""
        assert self._next is not None, "no pending world of this process's"
        return self._next

    @property
    def pending_kept(self) -> KeptWorld | None:
        """The kept world the pending change returns to (its groups are all there), if it does."""
        return self.kept.find(self._pending.members) if self._pending is not None and self._next is not None else None

    def borrow(self) -> BorrowedWorld:
        """The pending world's group (built: after a vote), to borrow before the swap (``world.BorrowedWorld``)."""
        assert self._pending is not None
        kept = self.pending_kept
        return BorrowedWorld(self.next_world().group(timeout=self.timeout.total_seconds()), self.store.raw,
                             generation=self._pending.generation, kept=kept.groups if kept is not None else None)

    def swap(self, change: WorldChange, *, borrowed: BorrowedWorld | None = None) -> KeptWorld | None:
        """Install ``change.new``'s world (its members; a leaver keeps the old one). Returns the old
        world, to ``retire`` after the new world's first collective (a grow's: after its switch,
        ``swap_back`` may need it). ``borrowed``: that world's group, borrowed before (``borrow``;
        the groups made on it stay). The store learns of a shrink's world now, of a grow's once
        its state arrived (``confirm``): until then a joiner that dies only cancels the change."""
        old = None
        if not change.leaving:
            assert self._next is not None and self.world is not None
            kept = self.kept.take(change.new.members)
            groups = install(self._next.group(timeout=self.timeout.total_seconds()), self.store.raw,
                             generation=change.new.generation, borrowed=borrowed,
                             kept=kept.groups if kept is not None else None, keep=self.kept.groups())
            old = KeptWorld(members=self.world.members, generation=self.world.generation, groups=groups)
            self.world = change.new
            if not change.grows:
                self.confirm(change)
        self._pending, self._next = None, None
        return old

    def confirm(self, change: WorldChange) -> None:
        """``change.new``'s world runs with its state (its rank 0 tells the store: the next change may
        come, and its members' liveness now counts as the running world's)."""
        if self.rank == 0:
            self.store.mark_installed(change.new.generation)

    def swap_back(self, change: WorldChange, old: KeptWorld) -> WorldGroups:
        """A grow whose switch failed with the old state whole: the old world (``swap`` returned it)
        is the default group again, with its groups and its ``group_count``; the store was not told
        of the new one (``confirm``), so a joiner that went missing only cancels the change there.
        Returns the new world's groups, to ``retire``."""
        assert change.grows and old.groups.default is not None
        replaced = install(old.groups.default, self.store.raw, generation=old.generation, kept=old.groups,
                           keep=self.kept.groups())
        self.world = change.old
        return replaced

    def retire(self, old: KeptWorld | None, *, extra: object = None) -> None:
        """After the new world's first collective: keep the world ``swap`` replaced, with ``extra``
        (the strategy's caches of its groups), for a return to its members (``keep_worlds``), or
        destroy its groups; destroy those of kept worlds that can no longer be returned to."""
        assert self.world is not None
        if old is None:
            retire(self.kept.prune(self.world.members))
            return
        kept = KeptWorld(members=old.members, generation=old.generation, groups=old.groups, extra=extra)
        retire(self.kept.keep(kept, self.world.members))

    def publish_step(self, step: int) -> None:
        """Rank 0 tells the store the job finished ``step`` (one store ``set``)."""
        if self.rank == 0:
            self.store.publish_step(step)

    # ------------------------------------------------------------------------------ leaving
    def request_leave(self, step: int = -1) -> None:
        """Ask to leave (a preemption notice) at the boundary after optimizer step ``step``: the
        change comes like any other; the state is handed off at its boundary. Once; it does not wait
        (the others must keep stepping)."""
        if not self.leave_requested:
            self.leave_requested = True
            self._leave_nonce = self.store.send(LeaveRequest(member=self.me, step=step))
            print(f"[dynatrain] {self.me} asked to leave; it hands its state off at the change's boundary",
                  file=sys.stderr, flush=True)

    # ------------------------------------------------------------------------------ failures
    @property
    def failure(self) -> str | None:
        """Why the job cannot go on in this process (a member failed), once known."""
        return self.failures.failure

    def wait_for_failure(self, timeout: float, *, cause: str = "") -> str | None:
        """After a collective failed where the strategy does not recover (``cause``): the store's
        account of who failed, if it comes in ``timeout`` s."""
        record = self.failures.await_survivors(timeout, cause=cause)
        return self.failures.describe(record) if record is not None else self.failures.failure

    def abandon_world(self) -> int:
        """Make every collective still waiting on this process's worlds fail at once, here and on
        its peers (``abandon.abandon_world``; the job's stores stay connected); the connections shut."""
        stores = (self.store.port, self.store.liveness_port, launcher_store_port())
        return abandon_world(registered_groups(), keep_ports=stores)

    def raise_if_lost(self) -> None:
        """``MemberLostError`` now if the watchdog read the store's record of a member that died and
        this process goes on without it (a step's layers call this: ``StepProgress.stop_if_lost``)."""
        lost = self.failures.lost
        if lost is not None:
            raise MemberLostError(lost)

    def recover_into(self, record: Membership) -> WorldGroups:
        """Install the survivors' world ``record`` (a failure record this process is a member of),
        built now over the store by every survivor; returns the old world's groups, to ``retire``
        (abandoned: they must not communicate). Every kept world goes too (its connections were
        shut with the old world's), and so does a change that was pending."""
        self.failures.take(record)  # (the caller abandoned the old world first)
        rank = record.rank_of(self.me)
        assert rank is not None, "only a survivor recovers"
        if os.environ.get(RECOVERY_FAULT_ENV) == "KILL_IN_WORLD":  # test hook
            os.kill(os.getpid(), signal.SIGKILL)
        nxt = NextWorld(self.store.for_thread().raw, generation=record.generation, rank=rank,
                        size=len(record.members), backend=self.backend, timeout=self.timeout, device=self.device)
        group = self.failures.survivors_group(nxt, record, timeout=self.timeout.total_seconds())
        retire(self.kept.prune(()))
        old = install(group, self.store.raw, generation=record.generation)
        self.world, self._seen = record, max(self._seen, record.generation)
        self.failures.world = record
        self._pending, self._next, self._cancel = None, None, None
        if self.rank == 0:
            self.store.mark_installed(record.generation)
        return old

    def close(self, *, finished: bool = True) -> None:
        """Stop the heartbeat and the watchdog, and wait for a next world's build still running: at the
        end of the fit, after leaving (``finished``), or on an error this process stops on (the store
        then records it failed at once; nothing is waited for). The kept worlds' groups go."""
        self.failures.close()
        if self._next is not None and finished:
            self._next.end(BUILD_END_WAIT)
        self._next = None
        retire(self.kept.prune(()))
        self.store.stop_alive(finished=finished)


__all__ = ["EXIT_MEMBER_FAILED", "ElasticSession", "MemberFailedError", "MemberLostError", "WorldChange"]
