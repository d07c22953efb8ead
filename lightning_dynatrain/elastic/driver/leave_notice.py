"""``LeaveNotice``: SIGTERM (a preemption notice) or SLURM's SIGUSR1 warning marks this process to leave.

A leave signal only marks the process: it leaves at the next step boundary, where the front end asks
the driver to (``ElasticDriver.leave``), hands its state off and ends its loop. The handler replaces
the one in place (Python's default ends the process; Lightning's broadcasts from inside the handler
and would hang a process whose peers are elsewhere); ``restore`` puts the first ones back. A torchrun
worker whose launch lost a worker ends at once instead (torchrun's agent stops the launch; the
others recover its state as a dead worker's: ``elastic/launch_teardown.py``).
"""

from __future__ import annotations

import os
import signal
from typing import Any

from lightning_dynatrain.elastic.launch_teardown import launch_torn_down

#: the signals that mean "this process will be taken away": leave
LEAVE_SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGUSR1", None)) if s is not None)


class LeaveNotice:
    """Whether a leave signal came (see the module docstring). Main thread only (Python's signals)."""

    def __init__(self) -> None:
        self._noticed = False
        self._previous: dict[int, Any] = {}

    def listen(self) -> None:
        """From now on a leave signal marks this process (the handlers it replaces are kept, once)."""
        for sig in LEAVE_SIGNALS:
            self._previous.setdefault(sig, signal.getsignal(sig))
            signal.signal(sig, self._on_signal)

    def take(self) -> bool:
        """A leave signal came since the last call."""
        noticed, self._noticed = self._noticed, False
        return noticed

    def restore(self) -> None:
        """The handlers in place before ``listen`` again."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        if launch_torn_down():  # torchrun stops the launch a worker of died: not a notice, the launch's end
            print(f"[dynatrain] a worker of this torchrun launch exited and torchrun stops the launch: process "
                  f"{os.getpid()} ends with it (the others recover its state as the dead worker's)", flush=True)
            os._exit(128 + signum)
        self._noticed = True


__all__ = ["LEAVE_SIGNALS", "LeaveNotice"]
