"""Abandoning a world a member died in: every collective still waiting on it fails at once.

When a member dies, the survivors' collectives that include it fail at once (its connections close
as the kernel ends it). A survivor can also wait in a collective with another survivor that has
already given up on the old world (its own collective with the dead one failed first): that one
would wait until the group's timeout (minutes). So a survivor that gives up on the old world first
abandons it here: its peers' waits on it then fail at once too, and every survivor reaches the
recovery in seconds.

- NCCL: ``ProcessGroup.abort()`` aborts the communicators (torch's documented way).
- gloo: ``abort()`` and ``shutdown()`` leave the connections open (measured on torch 2.13: a peer
  waiting on the group still waits until this process exits), so the TCP connections this process
  holds are shut down (Linux: found under ``/proc/self``), except the connections to the job's
  stores (``keep_ports``). The peer's wait then fails with gloo's "Connection closed by peer", as
  for a member that died.

Nothing here builds or registers groups; the old groups are destroyed afterwards as any retired
world's (``world.retire``).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable

import torch.distributed as dist

from lightning_dynatrain.compat.torch_internals import backend_name

#: TCP states of a connection a peer may still wait on, in /proc/net/tcp: established, and close-wait
#: (the peer shut its side: this side's pending waits may not have seen it yet)
_OPEN = ("01", "08")


def abandon_world(groups: Iterable[dist.ProcessGroup], *, keep_ports: Iterable[int]) -> int:
    """Abort ``groups`` (an old world's, its default group included) so that every collective waiting
    on them, here or on a peer, fails now; returns how many gloo connections were shut down."""
    groups = list(groups)
    gloo = False
    for group in groups:
        gloo = gloo or backend_name(group) == "gloo"
        try:
            group.abort()
        except Exception:  # noqa: BLE001 - a backend without abort (or already aborted): nothing to stop
            pass
    return shut_connections(keep_ports=keep_ports) if gloo else 0


def connection_inodes(*, keep_ports: Iterable[int] = ()) -> frozenset[str]:
    """This process's open TCP connections (established or close-wait) now but those to or from
    ``keep_ports`` (their socket inodes; empty off Linux): taken before and after a gloo group is
    made, the difference is that group's connections (with ``keep_ports`` the stores' ports:
    another thread may connect to a store meanwhile)."""
    return frozenset(_open_inodes({int(p) for p in keep_ports if p}))


def store_ports(store: dist.Store) -> tuple[int, ...]:
    """The TCP port of the store under ``store`` (prefixes unwrapped), and the launcher's store
    (``MASTER_PORT``): the connections ``abandon_world`` and a switch's group drop must keep."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    port = store.port if isinstance(store, dist.TCPStore) else 0
    return tuple(p for p in (port, launcher_store_port()) if p)


def launcher_store_port() -> int:
    """The port of the launcher's store (torchrun's, Lightning's: ``MASTER_PORT``), 0 if none."""
    return int(os.environ.get("MASTER_PORT", "0") or 0)


def shut_connections(*, keep_ports: Iterable[int] = (), only: frozenset[str] | None = None) -> int:
    """Shut down every open TCP connection of this process whose local or remote port is
    not in ``keep_ports`` (``only``: of these, from ``connection_inodes``); the number shut. Linux
    only (0 elsewhere: waits end at the timeout)."""
    keep = {int(p) for p in keep_ports if p}
    inodes = _open_inodes(keep)
    if only is not None:
        inodes &= only
    if not inodes:
        return 0
    shut = 0
    for fd in _fds():
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if not (link.startswith("socket:[") and link[8:-1] in inodes):
            continue
        try:  # another thread may close the descriptor meanwhile, and the number be reused
            copy = os.dup(fd)  # shutdown acts on the connection, not the descriptor
        except OSError:
            continue
        if str(os.fstat(copy).st_ino) != link[8:-1]:  # reused for another file: not ours to shut
            os.close(copy)
            continue
        duplicate = socket.socket(fileno=copy)
        try:
            duplicate.shutdown(socket.SHUT_RDWR)
            shut += 1
        except OSError:  # already closed by the peer
            pass
        finally:
            duplicate.close()
    return shut


def _fds() -> list[int]:
    try:
        return [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return []


def _open_inodes(keep: set[int]) -> set[str]:
    """The socket inodes of this process's open TCP connections not to or from a port in ``keep``."""
    inodes: set[str] = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) < 10 or fields[3] not in _OPEN:
                continue
            local, remote = int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16)
            if local not in keep and remote not in keep:
                inodes.add(fields[9])
    return inodes


__all__ = ["abandon_world", "connection_inodes", "launcher_store_port", "shut_connections", "store_ports"]
