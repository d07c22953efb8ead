"""A switch that loses a rank ends on every survivor with ``SwitchFailedError``, within its deadline.

A rank that dies (or stalls) in the middle of a switch leaves its peers waiting in collectives that
can never complete, by default for the process groups' long timeout, and with errors that name
addresses, not ranks. ``SwitchWatch`` bounds and explains that:

- **the switch's own group**: the engine's transfers, its checks and its broadcasts' subgroups run
  on a group made once per world with the switch's deadline as its own timeout (gloo and NCCL then
  fail a wait past it themselves; ``Work.wait(timeout)`` would leave the operation pending);
- **every other group** (WORLD, megatron's) gets the deadline as its timeout while a switch runs,
  and megatron's groups made for a new layout are created under it; the groups' own timeout (the
  strategy's ``timeout``) comes back when the switch ends;
- **a heartbeat**: while a switch runs, a daemon thread stamps ``beat/{rank}`` in the job's store
  (the default group's) every ``interval`` with the switch number and the phase the rank is in. A
  rank whose stamp stops moving is the one that went missing (SIGKILL and SIGSTOP both stop it).
  Between switches the thread sleeps: training steps put no traffic on the store;
- **an abort flag**: the first rank that fails writes ``{switch}/abort`` (rank, phase, cause). A
  survivor waiting on the store (``confirm``: every rank holds its new state) reads it and fails at
  once; the heartbeat thread aborts the switch's groups when it appears (NCCL's waits return then;
  gloo's fail when a peer's connections close, or at the deadline);
- **the error**: ``failure`` names the rank(s) whose heartbeat stopped and the phase each was in,
  says whether the state of this step is lost, and which checkpoint to resume from.

A failed switch breaks the switch's group: the next switch (if training goes on) makes a new one.

Test hook: ``DYNATRAIN_SWITCH_FAULT="RANK:PHASE:SIGNAL[:SWITCH]"`` (e.g. ``2:transfer:KILL``,
``1:transfer:STOP``, ``2:transfer:KILL:2``) makes rank ``RANK`` send itself ``SIGNAL`` as it enters
``PHASE`` of switch ``SWITCH`` (default 1) of its first watch; read once, where the watch is made.

Example (every rank)::

    watch = SwitchWatch.start(training_timeout=timedelta(minutes=30))
    result = hot_switch(state, target, setup, groups=groups, watch=watch)   # raises SwitchFailedError
    watch.close()
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from lightning_dynatrain.engine.collectives import LinkCosts
from lightning_dynatrain.engine.deadline import DEFAULT_FLOOR_S, SwitchDeadline
from lightning_dynatrain.engine.errors import SwitchFailedError, mark_refused
from lightning_dynatrain.engine.program import SwitchProgram
from lightning_dynatrain.vps.errors import DynaTrainError

FAULT_ENV = "DYNATRAIN_SWITCH_FAULT"
#: phases of a switch, in order (``SwitchFailedError.phase``); ``groups``: making the switch's own
#: group, at the first switch of a world (``SwitchWatch.start``)
PHASES = ("groups", "plan", "memory_check", "rebuild", "preflight", "transfer", "confirm")


@dataclass(frozen=True, slots=True)
class FaultInjection:
    """Rank ``rank`` sends itself ``signal`` when it enters ``phase`` of switch number ``switch`` of
    its first watch (tests)."""

    rank: int
    phase: str
    signal: int
    switch: int = 1

    @classmethod
    def parse(cls, text: str) -> "FaultInjection":
        """``"RANK:PHASE:SIGNAL"`` or ``"RANK:PHASE:SIGNAL:SWITCH"``, e.g. ``"2:transfer:KILL"``
        (``SWITCH`` counts the watch's switches from 1, the default).

        Raises:
            DynaTrainError: not of that form, or an unknown phase or signal.
        """
        parts = text.strip().split(":")
        names = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP, "TERM": signal.SIGTERM}
        if len(parts) not in (3, 4) or not parts[0].isdigit() or parts[1] not in PHASES \
                or parts[2].upper() not in names or (len(parts) == 4 and not parts[3].isdigit()):
            raise DynaTrainError(f"{FAULT_ENV}={text!r} is not RANK:PHASE:SIGNAL[:SWITCH]",
                                 hint=f"e.g. 2:transfer:KILL; phases {', '.join(PHASES)}; signals {', '.join(names)}")
        return cls(int(parts[0]), parts[1], int(names[parts[2].upper()]), int(parts[3]) if len(parts) == 4 else 1)

    @classmethod
    def from_environment(cls) -> "FaultInjection | None":
        text = os.environ.get(FAULT_ENV)
        return cls.parse(text) if text else None


@dataclass(frozen=True, slots=True)
class _Beat:
    count: int
    switch: int
    phase: str

    @classmethod
    def parse(cls, raw: bytes) -> "_Beat":
        count, switch, phase = raw.decode().split(" ", 2)
        return cls(int(count), int(switch), phase)


class SwitchWatch:
    """What bounds and explains a world's switches (see the module docstring). One per world: made
    collectively (``start``) at its first switch, closed with it.

    Args:
        training_timeout: the groups' timeout outside switches (restored after each switch).
        timeout: every switch's deadline; ``None``: derived from each switch's bytes (``SwitchDeadline.derive``).
        resume_from: says the run's last checkpoint, for the error (``None``: none known).
        interval: seconds between heartbeats (default 0.25 s, longer past 256 ranks: the store takes
            ``size / interval`` writes a second); a rank silent for ``stale_after`` seconds (at least
            8 heartbeats) is missing.
        fault: the test hook (``FaultInjection.from_environment()``).
    """

    def __init__(self, group: dist.ProcessGroup, store: dist.Store, *, training_timeout: timedelta,
                 timeout: SwitchDeadline | None = None, resume_from: Callable[[], str | None] = lambda: None,
                 interval: float | None = None, stale_after: float = 2.0, fault: FaultInjection | None = None) -> None:
        self.group: dist.ProcessGroup | None = group
        self.store = store
        self.rank, self.size = group.rank(), group.size()
        self.training_timeout, self.timeout, self.resume_from = training_timeout, timeout, resume_from
        interval = interval if interval is not None else 0.25 * max(1.0, self.size / 256)
        self.interval, self.stale_after, self.fault = interval, max(stale_after, 8 * interval), fault
        self.switch = 0
        self.phase = "idle"
        self.broken = False
        self._abort_seen = threading.Event()
        self._stop = threading.Event()
        self._active = threading.Event()  # set from ``begin`` to ``end``: the heartbeat runs
        self._beats = 0
        self._lock = threading.Lock()
        self._beat()
        self._thread = threading.Thread(target=self._run, name="dynatrain-switch-heartbeat", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, *, training_timeout: timedelta, timeout: SwitchDeadline | None = None,
              resume_from: Callable[[], str | None] = lambda: None, fault: FaultInjection | None = None,
              **kwargs) -> "SwitchWatch":
        """Make the switch's group over the whole world (collective over WORLD, created under
        ``timeout`` or the derived deadline's floor) and start the heartbeat.

        Raises:
            SwitchFailedError: a rank did not come to make the group within the deadline (dead or
                stalled; phase ``groups``): it is named, and the state of the step counts as lost.
        """
        deadline = timeout or SwitchDeadline(DEFAULT_FLOOR_S, "the derived deadline's floor")
        rank, world = dist.get_rank(), dist.get_world_size()
        base = c10d._get_default_store()
        # a namespace of its own per watch on this store: every rank makes watches equally often
        serial = base.add(f"dynatrain_switch/watches/{rank}", 1)
        if fault is not None and fault.rank == rank and fault.phase == "groups":
            os.kill(os.getpid(), fault.signal)
        base.set(f"dynatrain_switch/{serial}/came/{rank}", "1")
        try:
            group = dist.new_group(list(range(world)), timeout=deadline.timedelta)
        except Exception as err:  # torch's timeout names no rank: the ones that did not say they came
            missing = [r for r in range(world) if not base.check([f"dynatrain_switch/{serial}/came/{r}"])]
            cause = " ".join(f"{type(err).__name__}: {err}".split())[:300]
            checkpoint = resume_from()
            who = f"rank(s) {missing} did not come (dead or stalled)" if missing else "every rank came"
            lost = "; the state of this step is lost" if missing else ""
            hint = (f"see rank {missing[0]}'s log; resume from {checkpoint or 'the last checkpoint'}" if missing
                    else "raise switch_timeout")
            raise SwitchFailedError(f"the switch's group could not be made within {deadline.seconds:.0f} s "
                                    f"({deadline.why}): {who}{lost} ({cause})", hint=hint,
                                    rank=missing[0] if missing else None, phase="groups", lost_state=bool(missing),
                                    resume_from=checkpoint) from err
        store = dist.PrefixStore(f"dynatrain_switch/{serial}/", base)
        return cls(group, store, training_timeout=training_timeout, timeout=timeout, resume_from=resume_from,
                   fault=fault, **kwargs)

    # -------------------------------------------------------------------------- heartbeat
    def _beat(self) -> None:
        with self._lock:
            self._beats += 1
            self.store.set(f"beat/{self.rank}", f"{self._beats} {self.switch} {self.phase}")

    def _run(self) -> None:
        while True:
            self._active.wait()  # between switches: no beats
            if self._stop.wait(self.interval):
                return
            if not self._active.is_set():
                continue
            try:
                self._beat()
                if self.phase not in ("idle", "failed") and not self._abort_seen.is_set() \
                        and self.store.check([f"{self.switch}/abort"]):
                    self._abort_seen.set()
                    self._abort_groups()
            except Exception:  # noqa: BLE001 - the store went away: the job is over
                return

    def _abort_groups(self) -> None:
        """Make pending waits on the switch's group return (NCCL: at once; gloo: no effect)."""
        try:
            if self.group is not None:
                self.group.abort()
        except Exception:  # noqa: BLE001 - a backend without abort
            pass

    def _drop_group(self) -> None:
        """Destroy the switch's group and let it go: its connections close, so a peer blocked on this
        rank fails now, not at the deadline (gloo's ``abort`` does not wake it). The caller must
        hold no reference to it (``hot_switch`` clears the failed walk's frames first)."""
        group, self.group = self.group, None
        if group is not None and dist.is_initialized() and group in c10d._world.pg_map:
            dist.destroy_process_group(group)
        del group
        gc.collect()

    def read_beat(self, rank: int) -> _Beat | None:
        key = f"beat/{rank}"
        return _Beat.parse(self.store.get(key)) if self.store.check([key]) else None

    # ----------------------------------------------------------------------------- switches
    def begin(self, program: SwitchProgram, costs: LinkCosts | None, what: str, *,
              holders: frozenset[int] | None = None) -> "SwitchAttempt":
        """A switch starts on every rank: its deadline on every group (see the module docstring).
        ``holders``: the ranks of the watch's group that hold the old state (default all; a grow's
        joiners hold none, so losing one loses no state)."""
        if self.broken:
            raise RuntimeError("a failed switch broke this SwitchWatch's group: make a new watch")
        deadline = self.timeout or SwitchDeadline.derive(program, costs)
        self.switch += 1
        self._abort_seen.clear()
        set_timeouts(deadline.timedelta)
        attempt = SwitchAttempt(self, deadline, what, holders)  # its first phase is stamped at once
        self._active.set()
        return attempt

    def end(self) -> None:
        """The switch ended: the groups get their own timeout back (the switch's group keeps the deadline)."""
        set_timeouts(self.training_timeout, but=self.group)  # (a failed switch dropped its group)
        self._active.clear()
        if self.phase != "failed":
            self.phase = "idle"
            self._beat()

    def close(self) -> None:
        """Stop the heartbeat and destroy the switch's group (local)."""
        self._stop.set()
        self._active.set()  # wake the thread to end it
        self._thread.join(timeout=5)
        if self.group is not None and dist.is_initialized() and self.group in c10d._world.pg_map:
            dist.destroy_process_group(self.group)
        self.group = None


class SwitchPeerFailedError(RuntimeError):
    """Another rank reported a failure of the running switch (its abort flag)."""


class SwitchAttempt:
    """One switch on one rank under a ``SwitchWatch``: its phases, the final agreement, its failure."""

    def __init__(self, watch: SwitchWatch, deadline: SwitchDeadline, what: str,
                 holders: frozenset[int] | None = None) -> None:
        self.watch, self.deadline, self.what = watch, deadline, what
        self.holders = holders if holders is not None else frozenset(range(watch.size))
        """The ranks that hold the old state: a missing one takes its part with it."""
        self.started = time.monotonic()
        self.phase("plan")

    @property
    def _key(self) -> str:
        return str(self.watch.switch)

    def phase(self, name: str) -> None:
        """This rank enters phase ``name`` (published with its next heartbeat)."""
        watch = self.watch
        watch.phase = name
        watch._beat()  # the phase is known at once (a rank that dies next is named in it)
        fault = watch.fault
        if fault is not None and fault.rank == watch.rank and fault.phase == name and watch.switch == fault.switch:
            os.kill(os.getpid(), fault.signal)

    def confirm(self) -> None:
        """Every rank holds its new state (store counter); else the abort flag, a rank that has not
        confirmed and whose heartbeat stopped, or the deadline ends the wait.

        Raises:
            SwitchPeerFailedError: another rank failed, or stopped answering before confirming.
            TimeoutError: not every rank confirmed within the deadline.
        """
        self.phase("confirm")
        watch, key = self.watch, self._key
        store = watch.store
        store.set(f"{key}/done/{watch.rank}", "1")
        if store.add(f"{key}/done", 1) == watch.size:
            store.set(f"{key}/all", "1")
        end = self.started + self.deadline.seconds
        seen: dict[int, tuple[int | None, float]] = {}  # rank -> (heartbeat count, when it last moved)
        look = time.monotonic() + watch.stale_after / 2  # heartbeats are read only if the wait lasts
        while True:
            try:
                store.wait([f"{key}/all"], timedelta(seconds=watch.interval))
                return
            except Exception:  # noqa: BLE001 - the wait's own timeout: look for a failure, then wait on
                pass
            if store.check([f"{key}/abort"]):
                rank, phase, cause = store.get(f"{key}/abort").decode().split("|", 2)
                raise SwitchPeerFailedError(f"rank {rank} reported a failure in phase {phase!r}: {cause}")
            now = time.monotonic()
            for r in range(watch.size) if now > look else ():
                if r == watch.rank or store.check([f"{key}/done/{r}"]):
                    continue
                beat = watch.read_beat(r)
                count = beat.count if beat is not None else None
                if r not in seen or seen[r][0] != count:
                    seen[r] = (count, now)
                elif now - seen[r][1] > watch.stale_after:
                    raise SwitchPeerFailedError(f"rank {r} stopped answering before it confirmed its new state")
            if now > end:
                raise TimeoutError(f"not every rank confirmed its new state within the deadline ({self.deadline})")

    def failure(self, err: BaseException, *, lost_state: bool) -> SwitchFailedError:
        """This rank's switch failed with ``err``: tell the others (abort flag), find the rank(s) that
        went missing (heartbeats; the first rank's verdict is shared), wait until every other
        survivor has its verdict too (rank 0 may host the store: it must not end before the others
        have read it), and the error to raise. Takes about ``stale_after`` seconds.

        ``lost_state``: this rank freed some of its old state. The state counts as lost on every
        rank when one of them did, or when a rank holding a part of it (``holders``) is missing."""
        watch, key = self.watch, self._key
        phase, elapsed = watch.phase, time.monotonic() - self.started
        cause = " ".join(f"{type(err).__name__}: {err}".split())[:300]
        try:
            watch.store.compare_set(f"{key}/abort", "", f"{watch.rank}|{phase}|{cause}")
        except Exception:  # noqa: BLE001 - the store is gone: nobody is left to tell
            pass
        watch.phase = "failed"
        watch.broken = True
        watch._abort_groups()
        watch._drop_group()  # peers blocked on this rank fail at once (gloo: their connections close)
        try:
            if lost_state:
                watch.store.set(f"{key}/lost", str(watch.rank))
        except Exception:  # noqa: BLE001
            pass
        missing = self._verdict()
        self._leave(missing)
        try:  # a survivor that freed old state said so before it left
            lost_state = lost_state or watch.store.check([f"{key}/lost"])
        except Exception:  # noqa: BLE001
            lost_state = True
        error = self._error(missing, phase, elapsed, cause,
                            lost_state=lost_state or any(r in self.holders for r in missing))
        if not error.lost_state:
            mark_refused(error)  # training can go on at the old layout
        return error

    def _verdict(self) -> dict[int, str]:
        """The missing ranks: the first failing rank's verdict if there is one, else this rank's (shared)."""
        store, key = self.watch.store, f"{self._key}/missing"
        try:
            if store.check([key]):
                return _decode_missing(store.get(key))
        except Exception:  # noqa: BLE001 - the store is gone: name nobody
            return {}
        missing = self._missing()
        try:
            return _decode_missing(store.compare_set(key, "", _encode_missing(missing)))
        except Exception:  # noqa: BLE001
            return missing

    def _leave(self, missing: dict[int, str]) -> None:
        """Say this rank has its verdict, and wait (bounded) until every rank not missing says so."""
        watch = self.watch
        end = max(time.monotonic() + watch.stale_after, self.started + self.deadline.seconds + watch.stale_after)
        try:
            watch.store.set(f"{self._key}/left/{watch.rank}", watch.phase)
            waiting = [r for r in range(watch.size) if r != watch.rank and r not in missing]
            while waiting and time.monotonic() < end:
                waiting = [r for r in waiting if not watch.store.check([f"{self._key}/left/{r}"])]
                if waiting:
                    time.sleep(watch.interval)
        except Exception:  # noqa: BLE001 - the store is gone: nobody is left to wait for
            pass

    def _missing(self) -> dict[int, str]:
        """Ranks whose heartbeat does not move for ``stale_after`` seconds (and did not report
        leaving), with the phase of their last heartbeat."""
        watch = self.watch
        others = [r for r in range(watch.size) if r != watch.rank]
        try:
            first = {r: watch.read_beat(r) for r in others}
            end = time.monotonic() + watch.stale_after
            moved: set[int] = set()
            while time.monotonic() < end and len(moved) < len(others):
                time.sleep(watch.interval)
                for r in others:
                    if r not in moved:
                        beat, before = watch.read_beat(r), first[r]
                        if beat is not None and (before is None or beat.count != before.count) \
                                or watch.store.check([f"{self._key}/left/{r}"]):
                            moved.add(r)
        except Exception:  # noqa: BLE001 - the store is gone: name nobody
            return {}
        missing = {}
        for r in others:
            if r not in moved:
                beat = first[r]
                missing[r] = (beat.phase if beat is not None and beat.switch == watch.switch
                              else "before the switch started")
        return missing

    def _error(self, missing: dict[int, str], phase: str, elapsed: float, cause: str, *,
               lost_state: bool) -> SwitchFailedError:
        watch = self.watch
        if missing:
            who = "; ".join(f"rank {r} stopped answering in phase {p!r}" for r, p in missing.items())
            head = f"layout switch {self.what} failed: {who} (no heartbeat for {watch.stale_after:.1f} s)"
        else:
            head = f"layout switch {self.what} failed in phase {phase!r} with every rank still alive"
        message = (f"{head}; rank {watch.rank} was in phase {phase!r}, {elapsed:.1f} s into the switch "
                   f"(deadline {self.deadline}): {cause}")
        resume = watch.resume_from()
        if lost_state:
            message += (". The training state of this step is lost (the switch frees the old state as it moves it"
                        + (", and a missing rank's part is gone)" if self.holders & set(missing) else ")"))
            hint = (f"resume the job from the last checkpoint, {resume}" if resume else
                    "no checkpoint of this run is known: restart it from the beginning (a ModelCheckpoint bounds "
                    "what a failed switch costs)")
            if missing:
                hint += f", after finding why rank {min(missing)} stopped (its log, the node)"
        else:
            message += ". No rank freed any of its old state: the old layout's state is whole on every rank"
            hint = ("training can go on at the old layout; if the switch needs longer than its deadline, raise "
                    "switch_timeout")
        first = min(missing) if missing else None
        return SwitchFailedError(message, hint=hint, rank=first, phase=missing.get(first, phase) if missing else phase,
                                 lost_state=lost_state, resume_from=resume)


def _encode_missing(missing: dict[int, str]) -> str:
    return ";".join(f"{r}={p}" for r, p in sorted(missing.items())) or "none"


def _decode_missing(raw: bytes) -> dict[int, str]:
    text = raw.decode()
    return {} if text == "none" else {int(r): p for r, p in (item.split("=", 1) for item in text.split(";"))}


def set_timeouts(timeout: timedelta, *, but: dist.ProcessGroup | None = None) -> None:
    """Every registered process group's own timeout (its waits fail past it), except ``but``."""
    for group in list(c10d._world.pg_map):
        if group is not None and group is not but:
            c10d._set_pg_timeout(timeout, group)


__all__ = ["FAULT_ENV", "FaultInjection", "PHASES", "SwitchAttempt", "SwitchPeerFailedError", "SwitchWatch",
           "set_timeouts"]
