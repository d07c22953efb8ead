"""Telling a launcher's teardown from a notice to leave.

Under ``OnNodeChange`` SIGTERM means "this process will be taken away: hand the state off and
leave". But ``torchrun``'s agent also sends SIGTERM to every worker of its launch once one of them
exited (then SIGKILL after its timeout): for the siblings of a worker that died, the SIGTERM is
the launch going down, not a notice, and a leave would be a second change the agent cuts short.
``launch_torn_down`` tells the two apart: under torchrun, with more than one worker in the launch,
fewer of the agent's children are alive than the launch started. The sibling then ends at once,
with the dead worker, and the survivors recover from both in one recovery (``elastic/driver/recovery.py``).

Linux (``/proc``); elsewhere, and outside torchrun, every SIGTERM is a notice to leave.
"""

from __future__ import annotations

import os
from pathlib import Path


def ends_with_any_worker(environ: dict[str, str] | None = None) -> bool:
    """This process's launcher ends every worker of its launch once one of them ended: torchrun's
    agent does (it stops the worker group, then restarts it or fails the run), with more than one
    worker."""
    env = os.environ if environ is None else environ
    return "TORCHELASTIC_RUN_ID" in env and int(env.get("LOCAL_WORLD_SIZE", "1")) > 1


def launch_torn_down(environ: dict[str, str] | None = None, proc: Path = Path("/proc")) -> bool:
    """This process is a torchrun worker and a worker of its launch has exited (see the module docstring)."""
    env = os.environ if environ is None else environ
    if not ends_with_any_worker(env) or not proc.is_dir():  # not under torchrun's agent, or a launch of one
        return False
    return _live_children(os.getppid(), proc) < int(env["LOCAL_WORLD_SIZE"])


def _live_children(parent: int, proc: Path) -> int:
    """Processes whose parent is ``parent`` and that have not exited (zombies not counted)."""
    alive = 0
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
        state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
        if int(ppid) == parent and state not in ("Z", "X"):
            alive += 1
    return alive


__all__ = ["ends_with_any_worker", "launch_torn_down"]
