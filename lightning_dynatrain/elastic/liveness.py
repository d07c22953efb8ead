"""Liveness by connection: a member's process that ends is known to the store process at once.

A process that dies (SIGKILL, the OOM killer, a segfault, an exit) has its sockets closed by its
kernel the moment it ends. torch's ``TCPStore`` server does not say when a client went away, so
the store process listens on a socket of its own beside it (``LivenessListener``), and every
member holds one connection to it open for as long as it runs (``LivenessLink``): the store sees
the close in milliseconds and records the member as failed (``server.py``) without waiting for
its heartbeats to stop. Only a process that hangs and a host that vanishes (power, network: no
kernel left to close anything) need the heartbeat bound, ``dead_after``, which stays.

What travels over the connection, and nothing else:

- the member's hello, once: ``{"member": id}`` signed with the job's token (``records.Signer``) on
  one line. The first connection to say a member's name is that member's; another that says it
  later is closed unheard, so nobody without the token can register a member, and nobody can close
  one's connection but its own process;
- ``bye``, when the member closes it on purpose (its fit ended, or it left): not a death, and its
  heartbeats stopping then is none either (``ended``); a fit that ends on an error says no ``bye``:
  the others recover without it;
- from the store, a line with a generation number each time it records a failure: the survivors'
  watchdogs read that record at once (``failure_watch.FailureWatch.notice``) instead of at their
  next poll, and stop waiting on the dead.

The listener's address is in the store under ``liveness`` (signed, the port; the host is the
store's). A store without it (a test's bare ``StoreServer``) leaves the members on heartbeats alone.
"""

from __future__ import annotations

import selectors
import socket
import sys
import threading
from collections.abc import Callable

from lightning_dynatrain.elastic.records import Signer
from lightning_dynatrain.thread_end import join_before_exit

#: the store key of the listener's port (signed)
LIVENESS_KEY = "liveness"
_MAX_LINE = 4096


class LivenessListener:
    """The store process's end: accepts members' connections and notes when each one closes.

    Non-blocking: ``poll`` (the store's loop calls it every pass) accepts, reads hellos and sees
    closes; ``closed`` maps a member to ``clock()`` at the pass that saw its connection close.
    """

    def __init__(self, host: str, signer: Signer, *, clock: Callable[[], float], port: int = 0,
                 log: Callable[[str], None] = print) -> None:
        self.signer, self.clock, self.log = signer, clock, log
        self.server = socket.create_server((host, port))
        self.server.setblocking(False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.server, selectors.EVENT_READ)
        self.member_of: dict[socket.socket, str | None] = {}
        self._pending: dict[socket.socket, bytes] = {}
        self.connected: dict[str, socket.socket] = {}
        self.closed: dict[str, float] = {}
        self.ended: set[str] = set()
        """Members that closed their connection with ``bye``: their fit ended (or they left); their
        heartbeats stopping is not a death either."""

    @property
    def port(self) -> int:
        return int(self.server.getsockname()[1])

    def advertise(self) -> bytes:
        """The signed record members read under ``LIVENESS_KEY``."""
        return self.signer.sign({"port": self.port})

    def poll(self, timeout: float = 0.0) -> bool:
        """Accept new connections, read hellos, note the connections that closed; waits up to
        ``timeout`` seconds for one of these (the store's loop: none). Whether anything came."""
        events = self.selector.select(timeout=timeout)
        for key, _ in events:
            conn = key.fileobj
            if conn is self.server:
                self._accept()
            else:
                self._read(conn)  # type: ignore[arg-type]
        return bool(events)

    def notify(self, generation: int) -> None:
        """Tell every member still connected that generation ``generation`` records a failure."""
        line = f"{generation}\n".encode()
        for member, conn in list(self.connected.items()):
            try:
                conn.sendall(line)
            except OSError:  # closed meanwhile: the next poll notes it
                pass

    def forget(self, members: tuple[str, ...]) -> None:
        """Members recorded as failed, or no members any more: their closes are accounted for."""
        for member in members:
            self.closed.pop(member, None)
            self.ended.discard(member)

    def close(self) -> None:
        for conn in list(self.member_of):
            self._drop(conn, closed=False)
        self.selector.close()
        self.server.close()

    # ---------------------------------------------------------------------------------- parts
    def _accept(self) -> None:
        try:
            conn, _ = self.server.accept()
        except BlockingIOError:
            return
        conn.setblocking(False)
        self.member_of[conn] = None
        self._pending[conn] = b""
        self.selector.register(conn, selectors.EVENT_READ)

    def _read(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(_MAX_LINE)
        except BlockingIOError:
            return
        except OSError:  # reset: the process is gone
            data = b""
        if not data:
            self._drop(conn, closed=True)
            return
        if self.member_of[conn] is not None:
            if b"bye" in data:  # closed on purpose: not a death
                self.ended.add(self.member_of[conn])
                self._drop(conn, closed=False)
            return
        buffered = self._pending[conn] + data
        if b"\n" not in buffered:
            if len(buffered) > _MAX_LINE:
                self._drop(conn, closed=False)
            else:
                self._pending[conn] = buffered
            return
        hello = self.signer.verify(buffered.split(b"\n", 1)[0])
        member = hello.get("member") if hello else None
        if not isinstance(member, str) or member in self.connected or member in self.closed:
            why = "its hello is not signed with the job's token" if not isinstance(member, str) else \
                f"member {member} has its connection already"
            self.log(f"[dynatrain store] refused a liveness connection: {why}")
            self._drop(conn, closed=False)
            return
        self.member_of[conn] = member
        self.connected[member] = conn
        self._pending.pop(conn, None)

    def _drop(self, conn: socket.socket, *, closed: bool) -> None:
        member = self.member_of.pop(conn, None)
        self._pending.pop(conn, None)
        try:
            self.selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()
        if member is not None and self.connected.get(member) is conn:
            del self.connected[member]
            if closed:
                self.closed[member] = self.clock()


class LivenessLink:
    """A member's end: its one connection to the listener, held open while the process runs, and a
    daemon thread that hands each failure notice to ``on_notice(generation)``."""

    def __init__(self, host: str, port: int, signer: Signer, member: str,
                 on_notice: Callable[[int], None], *, timeout: float = 10.0) -> None:
        self.member, self.on_notice, self.port = member, on_notice, port
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.settimeout(None)
        self.sock.sendall(signer.sign({"member": member}) + b"\n")
        self._closing = False
        self._thread = threading.Thread(target=self._listen, name="dynatrain-liveness", daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        buffered = b""
        while True:
            try:
                data = self.sock.recv(_MAX_LINE)
            except OSError:
                data = b""
            if not data:
                if not self._closing:
                    print("[dynatrain] the job's store closed this member's liveness connection (the store "
                          "process ended, or it refused the hello); heartbeats alone say this member is alive",
                          file=sys.stderr, flush=True)
                return
            buffered += data
            while b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
                if line.strip().isdigit():
                    self.on_notice(int(line))

    def close(self, *, bye: bool = True) -> None:
        """Close the connection; ``bye``: on purpose (the store does not count it as a death),
        else as a process that ended would (the store records the member failed at once)."""
        self._closing = True
        try:
            if bye:
                self.sock.sendall(b"bye\n")
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        join_before_exit(self._thread, timeout=5.0, what="the liveness link")


def read_port(signer: Signer, blob: bytes) -> int | None:
    """The listener's port from its signed record (``None``: not signed with the job's token)."""
    record = signer.verify(blob)
    port = record.get("port") if record else None
    return port if isinstance(port, int) and 0 < port < 65536 else None


__all__ = ["LIVENESS_KEY", "LivenessLink", "LivenessListener", "read_port"]
