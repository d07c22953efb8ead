"""What one process knows of members that failed, and the watchdog that acts when its main thread cannot.

The store process records a member that stopped without leaving in a generation of its own
(``server.StoreServer``): its ``failed`` names the dead, its ``members`` the survivors
(``Membership.survived``), or, when nobody survived, the old world (the job is over). This process
reads such a record at a step boundary (``ElasticSession.poll``), after one of its collectives
failed (``await_survivors``), or in the watchdog thread: at once when the store says it recorded a
failure (``notice``, over this member's liveness connection: ``liveness.py``), else every second:

- a survivors' world with this process in it and recovery on: ``lost`` holds it until the main
  thread ``take``s it (``elastic/driver/recovery.py`` rebuilds the state there). The main thread may be
  computing toward a collective with the dead (which fails at once: the dead's connections are
  closed), or waiting in one that will not end (with a member that hangs, or with a survivor that
  gave up on the old world already): after ``grace`` seconds the watchdog abandons the old world
  (``abandon.abandon_world``), and again at each pass until the main thread takes the recovery,
  which makes that wait fail at once. (Abandoning at once, while the main thread computes, was
  tried: in 4 of about 80 elastic test jobs a survivor then stayed in a tensor-parallel all-reduce
  with a live peer whose connections were shut, until ``exit_after``.)
  Not taken within ``exit_after`` seconds, the process ends (``EXIT_MEMBER_FAILED``);
- otherwise (no survivors, recovery off, or this process itself was recorded as failed: it hung
  and came back too late) the job cannot go on here: ``failure`` holds the message, raised as
  ``MemberFailedError`` by the main thread, and the watchdog ends the process after
  ``exit_after`` seconds if the main thread is stuck.

A survivor that dies too while the others build the survivors' world (they wait for it in the
store's rendezvous, not in a collective) is found by ``survivors_group``: after ``SLOW_WORLD_BUILD``
seconds it reports a suspected failure, the store records a world without that member too, and
the recovery starts again into it.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch.distributed as dist

from lightning_dynatrain.elastic.client import JobStore
from lightning_dynatrain.elastic.records import Membership
from lightning_dynatrain.thread_end import join_before_exit
from lightning_dynatrain.vps.errors import DynaTrainError

if TYPE_CHECKING:
    from lightning_dynatrain.elastic.world import NextWorld

#: exit status of a process the watchdog ends (a member failed and a collective would hang)
EXIT_MEMBER_FAILED = 75

#: seconds a survivors' world may take to build before the store is told a member may be gone
SLOW_WORLD_BUILD = 2.0


class MemberFailedError(DynaTrainError):
    """A member of the running world stopped without leaving and the job cannot go on here."""


class MemberLostError(DynaTrainError):
    """A member of the running world stopped without leaving; the survivors go on in ``record``'s world."""

    def __init__(self, record: Membership) -> None:
        super().__init__(f"member(s) {', '.join(record.failed)} stopped answering; the survivors go on in "
                         f"generation {record.generation}", hint="recovered by the strategy at this boundary")
        self.record = record


#: what gloo and NCCL say when a peer is gone or a collective cannot complete
_TRANSPORT_FAILURES = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused",
                       "NCCL communicator was aborted", "NCCL error", "ncclRemoteError", "Socket Timeout",
                       "Timed out waiting", "timed out")


def is_communication_failure(err: BaseException) -> bool:
    """``err`` (or an error it was raised from) is a collective that failed: torch's ``DistError``
    family, or the transport's own message (gloo raises a plain ``RuntimeError``)."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, dist.DistError):
            return True
        if isinstance(current, RuntimeError) and any(m in str(current) for m in _TRANSPORT_FAILURES):
            return True
        current = current.__cause__ or current.__context__
    return False


class FailureWatch:
    """This process's account of failed members (see the module docstring).

    Args:
        store: the job's store client (the watchdog uses a connection of its own).
        me: this process's member id.
        recover: survivors go on (``False``: any failure ends the job, as before recovery existed).
        abandon: abandons the old world (``grace`` seconds after each failure was read, and again at
            each pass until the main thread takes it); the number of connections it shut.
        exit_after: seconds to wait for the main thread before ending the process.
        grace: seconds the main thread has to take the recovery on its own before ``abandon`` (its
            collectives with the dead fail at once on their own; see the module docstring).
    """

    def __init__(self, store: JobStore, *, me: str, recover: bool, abandon: Callable[[], int],
                 exit_after: float, grace: float) -> None:
        self.store, self.me, self.recover = store, me, recover
        self.abandon_world, self.exit_after, self.grace = abandon, exit_after, grace
        self.failure: str | None = None
        self.lost: Membership | None = None
        self.known_at: dict[int, float] = {}
        """Wall-clock time (``time.time()``) this process first read each failure record (the figures'
        detection: from the death to a survivor knowing)."""
        self.world: Membership | None = None  # the world this process runs in (for the ranks in messages)
        self._taken = -1
        self._abandoned = -1
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------ reading
    def read(self, record: Membership) -> None:
        """Take note of ``record`` when it is a failure record this process has not recovered from."""
        if not record.failed or record.generation <= self._taken:
            return
        self.known_at.setdefault(record.generation, time.time())
        if self.recover and record.survived and self.me in record.members:
            self.lost = record
            return
        if self.failure is None:
            self.failure = self.describe(record)

    def describe(self, record: Membership) -> str:
        """What ``record`` means for this process, in words."""
        if self.me in record.failed:
            return (f"this process ({self.me}) was recorded as failed (it stopped answering for too long, or a "
                    "process of its launch ended: the store's log says which) and is out of the job; the others "
                    "went on without it")
        world = self.world or record
        names = ", ".join(f"{m} (rank {world.rank_of(m)})" for m in record.failed)
        if record.survived:
            return f"member(s) {names} stopped answering without leaving; this process could not go on without them"
        return f"member(s) {names} stopped answering without leaving (no heartbeat); the job cannot go on"

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise MemberFailedError(self.failure, hint="see the failed process's log; restart the job from its last "
                                    "checkpoint (a member that leaves on SIGTERM hands its state off instead)")

    def await_survivors(self, timeout: float, *, cause: str) -> Membership | None:
        """After a collective failed (``cause``): the survivors' world to go on in, if the store names
        one within ``timeout`` s (``None``: it did not, or this process cannot go on: ``failure``).
        The store process is told first, so that it names the silent in seconds."""
        try:
            self.store.suspect_failure(cause)
        except Exception:  # noqa: BLE001 - the store itself is gone: nothing more to learn
            return None
        deadline = time.monotonic() + timeout
        while self.lost is None and self.failure is None and time.monotonic() < deadline:
            try:
                self.read(self.store.membership(self.store.generation()))
            except Exception:  # noqa: BLE001 - the store itself is gone
                return None
            if self.lost is None and self.failure is None:
                time.sleep(0.1)
        return self.lost if self.failure is None else None

    def survivors_group(self, nxt: "NextWorld", record: Membership, *, timeout: float) -> dist.ProcessGroup:
        """``record``'s world, once every survivor took part in its build (``nxt``, building in a
        thread) within ``timeout`` seconds.

        Raises:
            MemberLostError: a survivor of ``record`` died too before the world was built: the store
                recorded the world without it, to recover into next (a slow build is reported as a
                suspected failure, so the store names the silent in ``suspect_after``, not ``dead_after``).
            AdmissionError: the build failed or timed out and the store named nobody.
        """
        start, reported = time.monotonic(), False
        while not nxt.wait(0.25) and time.monotonic() - start < timeout:
            newer = self.lost
            if newer is not None and newer.generation > record.generation:
                raise MemberLostError(newer)  # (the build's thread waits out its timeout, unused)
            if not reported and time.monotonic() - start > SLOW_WORLD_BUILD:
                self.store.suspect_failure(f"the survivors' world of generation {record.generation} was not built "
                                           f"in {SLOW_WORLD_BUILD:.0f} s")
                reported = True
        if not nxt.ready:  # failed (a peer vanished in the build) or timed out: the store may say who
            newer = self.await_survivors(SLOW_WORLD_BUILD * 10, cause="the survivors' world was not built")
            if newer is not None and newer.generation > record.generation:
                raise MemberLostError(newer)
        return nxt.group(timeout=0)

    def take(self, record: Membership) -> bool:
        """The main thread recovers into ``record`` now (the watchdog no longer abandons or ends)."""
        with self._lock:
            if record.generation <= self._taken:
                return False
            self._taken = record.generation
            if self.lost is not None and self.lost.generation <= record.generation:
                self.lost = None
            return True

    def abandon(self, record: Membership, *, again: bool = False) -> None:
        """Abandon the old world for ``record``'s failure, unless the main thread took it: once, or
        ``again`` (each watchdog pass until the main thread takes it: a connection that was between
        states the first time is shut then)."""
        with self._lock:
            if record.generation <= self._taken or record.generation <= self._abandoned and not again:
                return
            first = record.generation > self._abandoned
            self._abandoned = record.generation
            shut = self.abandon_world()
        if first or shut:
            print(f"[dynatrain] member(s) {', '.join(record.failed)} failed (generation {record.generation}): "
                  f"{'abandoned' if first else 'abandoning'} the old world ({shut} connection(s) shut)",
                  file=sys.stderr, flush=True)

    # ----------------------------------------------------------------------------- watchdog
    def start(self) -> None:
        store = self.store.for_thread()  # never queued behind the main thread's store waits
        self._thread = threading.Thread(target=self._watch, args=(store,), name="dynatrain-watchdog", daemon=True)
        self._thread.start()

    def notice(self, generation: int) -> None:
        """The store recorded a failure in generation ``generation`` (it said so over this member's
        liveness connection): the watchdog reads the record now, not at its next poll."""
        self._wake.set()

    def _watch(self, store: JobStore) -> None:
        noticed: dict[int, float] = {}
        while True:
            self._wake.wait(1.0)
            self._wake.clear()
            if self._closed.is_set():
                return
            if self.failure is None:  # (a step that failed may have learnt it first)
                try:
                    self.read(store.membership(store.generation()))
                except Exception:  # noqa: BLE001 - the store went away: the job is over
                    return
            lost = self.lost
            if lost is not None and self.failure is None:
                waited = time.monotonic() - noticed.setdefault(lost.generation, time.monotonic())
                try:  # the main thread may wait in a collective with a survivor that gave up on the old world
                    if waited > self.grace:
                        self.abandon(lost, again=waited > self.grace + 0.5)
                except Exception as err:  # noqa: BLE001 - the watchdog must go on (it ends the process if need be)
                    print(f"[dynatrain] abandoning the old world failed: {type(err).__name__}: {err}", file=sys.stderr,
                          flush=True)
                if waited > self.exit_after:
                    self._end(f"member(s) {', '.join(lost.failed)} failed and this process did not take up the "
                              f"recovery in {self.exit_after:.0f} s")
                continue
            if self.failure is not None:
                print(f"[dynatrain] {self.failure}", file=sys.stderr, flush=True)
                # still running after exit_after (stuck in a collective, or in teardown's): end it
                if not self._closed.wait(self.exit_after):
                    self._end(self.failure)
                return

    def _end(self, why: str) -> None:
        print(f"[dynatrain] ending this process ({EXIT_MEMBER_FAILED}): {why}; where its threads were:",
              file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os._exit(EXIT_MEMBER_FAILED)

    def close(self) -> None:
        """Stop the watchdog and wait for it (a store call it is in ends within the store's timeout):
        it must not outlive the interpreter (``thread_end``)."""
        self._closed.set()
        self._wake.set()
        join_before_exit(self._thread, timeout=self.store.call_seconds + 1.0, what="the failure watchdog")


__all__ = ["EXIT_MEMBER_FAILED", "FailureWatch", "MemberFailedError", "MemberLostError", "is_communication_failure"]
