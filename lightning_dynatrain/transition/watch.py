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

A failed switch breaks the switch's group: each rank that fails drops it and shuts down the gloo
connections it made (recorded when the group was made, the stores' excluded), so a survivor still
waiting on that rank fails at once instead of at the deadline; the next switch (if training goes
on) makes a new group.

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
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from lightning_dynatrain.compat.torch_internals import (backend_name, default_store, is_registered, registered_groups,
                                                       set_group_timeout)
from lightning_dynatrain.thread_end import join_before_exit
from lightning_dynatrain.transition.abandon import connection_inodes, shut_connections, store_ports
from lightning_dynatrain.transition.collectives import LinkCosts
from lightning_dynatrain.transition.deadline import DEFAULT_FLOOR_S, SwitchDeadline
from lightning_dynatrain.transition.errors import SwitchFailedError
from lightning_dynatrain.transition.program import SwitchProgram
from lightning_dynatrain.transition.switch_attempt import SwitchAttempt
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
                 interval: float | None = None, stale_after: float = 2.0, fault: FaultInjection | None = None,
                 connections: frozenset[str] = frozenset()) -> None:
        self.group: dist.ProcessGroup | None = group
        self._connections = connections  # the group's gloo connections (socket inodes), shut when it is dropped
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
        base = default_store()
        # a namespace of its own per watch on this store: every rank makes watches equally often
        serial = base.add(f"dynatrain_switch/watches/{rank}", 1)
        if fault is not None and fault.rank == rank and fault.phase == "groups":
            os.kill(os.getpid(), fault.signal)
        base.set(f"dynatrain_switch/{serial}/came/{rank}", "1")
        try:
            stores = store_ports(base)
            before = connection_inodes(keep_ports=stores)
            group = dist.new_group(list(range(world)), timeout=deadline.timedelta)
            connections = connection_inodes(keep_ports=stores) - before if backend_name(group) == "gloo" \
                else frozenset()
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
                                    resume_from=checkpoint, freed=False) from err
        store = dist.PrefixStore(f"dynatrain_switch/{serial}/", base)
        return cls(group, store, training_timeout=training_timeout, timeout=timeout, resume_from=resume_from,
                   fault=fault, connections=connections, **kwargs)

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
        """Destroy the switch's group and close its connections, so a peer blocked on this rank fails
        now, not at the deadline (gloo's ``abort`` does not wake it, and the group's memory, with its
        connections, goes only with the last reference, which a failed collective's objects may hold):
        the gloo connections the group made (``connections``) are shut down here."""
        group, self.group = self.group, None
        if is_registered(group):
            dist.destroy_process_group(group)
        del group
        gc.collect()
        if self._connections:
            shut_connections(only=self._connections)
            self._connections = frozenset()

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
        join_before_exit(self._thread, timeout=5.0, what="the switch heartbeat")
        if is_registered(self.group):
            dist.destroy_process_group(self.group)
        self.group = None


def set_timeouts(timeout: timedelta, *, but: dist.ProcessGroup | None = None) -> None:
    """Every registered process group's own timeout (its waits fail past it), except ``but``."""
    for group in registered_groups():
        if group is not but:
            set_group_timeout(group, timeout)


__all__ = ["FAULT_ENV", "FaultInjection", "PHASES", "SwitchWatch", "set_timeouts"]
