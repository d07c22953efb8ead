"""One switch on one rank under a ``SwitchWatch`` (``transition/watch.py``): its phases, stamped with
the heartbeat; the final agreement that every rank holds its new state (``confirm``); and, when it
fails, the error every survivor raises (``failure``): the rank(s) whose heartbeat stopped, the phase
each was in, whether the state of this step is lost (a rank freed old state, or a missing rank held
part of it: ``holders``), and the checkpoint to resume from."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import TYPE_CHECKING

from lightning_dynatrain.transition.deadline import SwitchDeadline
from lightning_dynatrain.transition.errors import SwitchFailedError, mark_refused

if TYPE_CHECKING:
    from lightning_dynatrain.transition.watch import SwitchWatch


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
    def holds_old_state(self) -> bool:
        """This rank holds a part of the old state (a grow's joiner does not)."""
        return self.watch.rank in self.holders

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
                # (each timed-out wait logs a c10d warning: every quarter ``stale_after``, not every heartbeat)
                store.wait([f"{key}/all"], timedelta(seconds=max(watch.interval, watch.stale_after / 4)))
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
        survivor has its verdict too and has read whether any survivor freed old state (rank 0 may
        host the store: it must not end before the others have read it), and the error to raise.
        Takes about ``stale_after`` seconds.

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
        missing = self._verdict()
        lost_state = self._leave(missing, freed=lost_state)
        error = self._error(missing, phase, elapsed, cause, freed=lost_state,
                            gone=sorted(self.holders & missing.keys()))
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

    def _leave(self, missing: dict[int, str], *, freed: bool) -> bool:
        """Say this rank has its verdict and whether it ``freed`` old state, wait (bounded) until every
        rank not missing said so, then until each of them is done reading: the store may live in a
        survivor's process (rank 0's), which must not end while another still reads from it. Whether
        any survivor freed old state (``True`` when the store went away before every survivor's
        word was read: it cannot be known then)."""
        watch, key = self.watch, self._key
        end = max(time.monotonic() + watch.stale_after, self.started + self.deadline.seconds + watch.stale_after)
        others = [r for r in range(watch.size) if r != watch.rank and r not in missing]
        try:
            watch.store.set(f"{key}/left/{watch.rank}", "freed" if freed else "kept")
            said = self._wait_for(f"{key}/left", others, end)
            freed = freed or any(watch.store.get(f"{key}/left/{r}") == b"freed" for r in said)
        except Exception:  # noqa: BLE001 - the store is gone: what the others freed is not known
            return True
        try:
            watch.store.set(f"{key}/read/{watch.rank}", "1")
            self._wait_for(f"{key}/read", others, end)
        except Exception:  # noqa: BLE001 - the store is gone: nobody is left to wait for
            pass
        return freed

    def _wait_for(self, prefix: str, ranks: list[int], end: float) -> list[int]:
        """Poll until ``prefix/<rank>`` is set for each of ``ranks``, or ``end``; the ranks that set it."""
        waiting = list(ranks)
        while waiting and time.monotonic() < end:
            waiting = [r for r in waiting if not self.watch.store.check([f"{prefix}/{r}"])]
            if waiting:
                time.sleep(self.watch.interval)
        return [r for r in ranks if r not in waiting]

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
               freed: bool, gone: list[int]) -> SwitchFailedError:
        """``freed``: a rank freed old state as it moved it; ``gone``: missing ranks that held a part of it.
        The state of the step counts as lost with either."""
        lost_state = freed or bool(gone)
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
            many = len(gone) > 1
            parts = (f"the part{'s' * many} rank{'s' * many} {', '.join(map(str, gone))} held went with "
                     f"{'them' if many else 'it'}")
            why = ("the switch frees the old state as it moves it" + (f", and {parts}" if gone else "")) if freed \
                else f"no rank freed its old state, but {parts}"
            message += f". The training state of this step is lost ({why})"
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
                                 lost_state=lost_state, resume_from=resume, freed=freed,
                                 missing=tuple(sorted(missing)))


def _encode_missing(missing: dict[int, str]) -> str:
    return ";".join(f"{r}={p}" for r, p in sorted(missing.items())) or "none"


def _decode_missing(raw: bytes) -> dict[int, str]:
    text = raw.decode()
    return {} if text == "none" else {int(r): p for r, p in (item.split("=", 1) for item in text.split(";"))}


__all__ = ["SwitchAttempt", "SwitchPeerFailedError"]
