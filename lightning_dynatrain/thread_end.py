"""Background threads end before the interpreter does.

The library's background threads (the failure watchdog, the heartbeat, a next world's build, a
switch built ahead) spend most of their time inside torch's C++ code with the GIL released: a
store call, a group's rendezvous, a tensor operation. A daemon thread still there when the main
thread finishes comes back while the interpreter is finalizing and asks for the GIL; CPython 3.10
to 3.13 then end that thread with ``pthread_exit``, whose unwinding meets a C++ ``noexcept``
frame and aborts the whole process ("terminate called without an active exception", SIGABRT),
after the fit had finished and written its results (CPython 3.14 leaves such a thread waiting
instead: python/cpython gh-87135). A launcher reports the abort as a failed run.

So whoever owns such a thread joins it when it closes: ``join_before_exit`` waits for it (bounded:
its own timeout ends every call it makes) and says so when it is still running after the bound.

Example::

    self._stop.set()
    join_before_exit(self._thread, timeout=store_timeout + 1, what="the failure watchdog")
"""

from __future__ import annotations

import sys
import threading

#: seconds a closing process waits for a build still running (a next world's rendezvous, a switch built
#: ahead): with every member closing too it ends in seconds; one waiting for a member that is gone
#: fails at its own timeout, which can be far longer: the process then goes on closing and says so
BUILD_END_WAIT = 30.0


def join_before_exit(thread: threading.Thread | None, *, timeout: float, what: str) -> bool:
    """Wait up to ``timeout`` seconds for ``thread`` (told to stop already) to end; whether it did.

    Not ended in time, a line on stderr names it: the process may then abort at exit. ``None``, a
    thread never started, or the calling thread itself (a thread that closes its own owner) is
    nothing to wait for.
    """
    if thread is None or thread.ident is None or thread is threading.current_thread():
        return True
    thread.join(timeout)
    if thread.is_alive():
        print(f"[dynatrain] {what} ({thread.name}) is still running {timeout:.0f} s after it was told to stop: "
              f"if it is still inside torch when this process exits, the exit may abort", file=sys.stderr, flush=True)
        return False
    return True


__all__ = ["BUILD_END_WAIT", "join_before_exit"]
