"""A training process's view of the job's store: ask to join or leave, read the world, publish liveness.

The store is a ``TCPStore`` served by a process no trainer owns (``server.py``, ``dynatrain
store``), found through one address (``DYNATRAIN_STORE=host:port``). Everything lives under the
prefix ``dynatrain/``; each generation's process group gets its own prefix (``gen{g}/``) when it is
built. Reads a trainer makes every step cost one store ``get`` (about 0.1 ms on a LAN).

Keys (all but the liveness stamps signed, ``records.py``):

- ``requests`` (a queue): join and leave requests, each with a nonce; ``verdict/{nonce}``: the
  store process's answer;
- ``gen``: the latest generation; ``membership/{g}``: its ``Membership`` (store process only);
- ``step``: the last optimizer step the job finished (rank 0 publishes it); ``installed``: the
  last generation whose world runs (its rank 0 says so after the swap);
- ``alive/{member}``: the time a member last said it is alive (a background thread, every second);
- ``liveness``: the port of the store process's liveness listener, which each member also holds a
  connection to, so that the store knows at once when its process ended (``liveness.py``);
- ``suspect/{member}``, ``suspects``: a member's collective failed (the time and the cause; a count):
  the store process then names the silent in seconds (``server.py``).

Example::

    store = JobStore.connect("node1:29400", token)
    verdict = store.ask(JoinRequest(member=store.member_id, fingerprint=fp), timeout=60)
    world = store.membership(verdict["generation"])
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from lightning_dynatrain.elastic.liveness import LIVENESS_KEY, LivenessLink, read_port
from lightning_dynatrain.elastic.records import AdmissionError, JoinRequest, LeaveRequest, Membership, Signer
from lightning_dynatrain.thread_end import join_before_exit

PREFIX = "dynatrain/"
STORE_ENV, TOKEN_ENV = "DYNATRAIN_STORE", "DYNATRAIN_TOKEN"


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` -> ``("host", port)``.

    Raises:
        AdmissionError: not ``host:port``.
    """
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise AdmissionError(f"cannot read a store address from {address!r}",
                             hint=f"set {STORE_ENV}=host:port (the address `dynatrain store` prints)")
    return host, int(port)


class JobStore:
    """A client of the job's store (see the module docstring). One per process."""

    def __init__(self, store: dist.Store, signer: Signer, member_id: str | None = None,
                 host: str | None = None) -> None:
        self.raw = store
        self.store = dist.PrefixStore(PREFIX, store)
        self.signer = signer
        self.member_id = member_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.host = host or str(getattr(store, "host", "127.0.0.1"))
        """The store's host (its liveness listener is there too)."""
        self._alive: threading.Thread | None = None
        self._link: LivenessLink | None = None
        self._stop = threading.Event()

    @property
    def port(self) -> int:
        """The store's port (its connections are not a world's: ``abandon.abandon_world`` keeps them)."""
        return int(getattr(self.raw, "port", 0))

    @property
    def call_seconds(self) -> float:
        """How long one store call may wait before it fails (the client's timeout): what bounds the
        wait for a thread of this client to end."""
        return self.raw.timeout.total_seconds()

    @property
    def liveness_port(self) -> int:
        """The store's liveness listener's port while this member holds a connection to it (0: none);
        like ``port``, ``abandon.abandon_world`` keeps it (a survivor's closed connection would say
        it died)."""
        return self._link.port if self._link is not None else 0

    @classmethod
    def connect(cls, address: str, token: bytes | str, *, timeout: float = 60.0) -> "JobStore":
        host, port = parse_address(address)
        try:
            store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
        except Exception as err:  # torch raises DistNetworkError, RuntimeError, TimeoutError here
            raise AdmissionError(f"no job store answers at {address}: {err}",
                                 hint="start it with `dynatrain store --port PORT` and pass its address") from err
        return cls(store, Signer(token), host=host)

    @classmethod
    def from_environment(cls) -> "JobStore":
        address, token = os.environ.get(STORE_ENV), os.environ.get(TOKEN_ENV)
        if not address or not token:
            raise AdmissionError(f"an elastic job needs {STORE_ENV} and {TOKEN_ENV}",
                                 hint="start `dynatrain store --port PORT --token TOKEN` (or with the token in "
                                 f"{TOKEN_ENV}) and give every process both variables")
        return cls.connect(address, token)

    # ---------------------------------------------------------------------------- requests
    def send(self, request: JoinRequest | LeaveRequest) -> str:
        """Queue ``request`` for the store process; its nonce (``verdict(nonce)`` reads the answer)."""
        nonce = uuid.uuid4().hex
        self.store.queue_push("requests", self.signer.sign({**request.to_dict(), "nonce": nonce}))
        return nonce

    def verdict(self, nonce: str) -> dict | None:
        """The store process's signed answer to request ``nonce``, once there (``None`` before)."""
        key = f"verdict/{nonce}"
        if not self.store.check([key]):
            return None
        verdict = self.signer.verify(self.store.get(key))
        return verdict if verdict is not None else {"admitted": False,
                                                    "reason": "the verdict is not signed with this job's token"}

    def ask(self, request: JoinRequest | LeaveRequest, *, timeout: float = 600.0) -> dict:
        """Send ``request`` and wait for the store process's verdict.

        Raises:
            AdmissionError: refused (the reason is the store process's), or no answer in ``timeout``.
        """
        nonce = self.send(request)
        deadline = time.monotonic() + timeout
        while (verdict := self.verdict(nonce)) is None:
            if time.monotonic() > deadline:
                raise AdmissionError(f"the job's store did not answer {request.kind} request {nonce} in {timeout:.0f} s",
                                     hint="is `dynatrain store` running for this job? (A join also waits while "
                                          "the job's layout policy has no layout for a world with it: the store's "
                                          "log says so.)")
            time.sleep(0.02)
        if not verdict.get("admitted"):
            raise AdmissionError(f"the job refused this process's {request.kind} request: {verdict.get('reason')}",
                                 hint="use the job's token and the same model, recipe and package version")
        return verdict

    # ---------------------------------------------------------------------------- the world
    def generation(self) -> int:
        """The latest generation (-1 before the first world formed)."""
        return int(self.store.get("gen")) if self.store.check(["gen"]) else -1

    def membership(self, generation: int) -> Membership:
        """Generation ``generation``'s world, as the store process signed it.

        Raises:
            AdmissionError: the record is missing or not signed with the job's token.
        """
        key = f"membership/{generation}"
        payload = self.signer.verify(self.store.get(key)) if self.store.check([key]) else None
        if payload is None:
            raise AdmissionError(f"no signed membership record for generation {generation}",
                                 hint="someone without the job's token wrote to the store, or it was restarted")
        return Membership.from_dict(payload)

    def publish_step(self, step: int) -> None:
        """The job finished optimizer step ``step`` (rank 0, every step: one store ``set``)."""
        self.store.set("step", str(step))

    def mark_installed(self, generation: int) -> None:
        """Generation ``generation``'s world runs (its rank 0, once): the next change may come."""
        self.store.set("installed", str(generation))

    def suspect_failure(self, cause: str) -> None:
        """A collective of this member failed (``cause``): a peer may be gone. The store process then
        records a member silent for ``suspect_after`` seconds as failed, not ``dead_after``."""
        self.store.set(f"suspect/{self.member_id}", f"{time.time()!r} {cause[:500]}")
        self.store.add("suspects", 1)

    # ---------------------------------------------------------------------------- liveness
    def for_thread(self) -> "JobStore":
        """This client over a connection of its own (``Store.clone``), for a thread of its own.

        A TCPStore client runs one operation at a time: while another thread blocks in ``wait`` on
        it (gloo's rendezvous for the next world waits there for every member's address), a
        heartbeat or a watchdog on the same client would wait too, and a live member would look dead.
        """
        return JobStore(self.raw.clone(), self.signer, self.member_id, self.host)

    def start_alive(self, interval: float = 1.0, *, on_notice: Callable[[int], None] | None = None) -> None:
        """Say every ``interval`` seconds that this member is alive (a daemon thread, on a connection
        of its own: ``for_thread``), and hold a connection to the store process's liveness listener
        where it has one (``liveness.py``): ``on_notice(generation)`` runs when the store records a
        failure."""
        if self._alive is not None:
            return
        store = self.for_thread().store

        def beat() -> None:
            while not self._stop.wait(interval):
                try:
                    store.set(f"alive/{self.member_id}", repr(time.time()))
                except Exception:  # the store went away: the job is over
                    return

        store.set(f"alive/{self.member_id}", repr(time.time()))
        self._alive = threading.Thread(target=beat, name="dynatrain-alive", daemon=True)
        self._alive.start()
        port = read_port(self.signer, self.store.get(LIVENESS_KEY)) if self.store.check([LIVENESS_KEY]) else None
        if port is not None:
            self._link = LivenessLink(self.host, port, self.signer, self.member_id, on_notice or (lambda _: None))

    def stop_alive(self, *, finished: bool = True) -> None:
        """Stop saying this member is alive. ``finished``: it ended on purpose (its fit ended, it
        left): the store is told so over the liveness connection; otherwise the connection just
        closes, and the store records this member as failed at once, as if its process had ended."""
        self._stop.set()
        if self._link is not None:
            self._link.close(bye=finished)
            self._link = None
        join_before_exit(self._alive, timeout=self.call_seconds + 1.0, what="the heartbeat")
        self._alive = None


__all__ = ["JobStore", "PREFIX", "STORE_ENV", "TOKEN_ENV", "parse_address"]
