"""The collectives of a megatron build that runs beside training, in another thread.

``megatron.ahead`` builds a switch's model, DDP and optimizer in a background thread while the
training thread runs its step's collectives. Two threads issuing collectives on one group can pair
one rank's first call with another rank's second (gloo and NCCL match calls by order): a hang, or
one tensor summed into another. So, inside ``build_collectives(group)`` and on that thread only:

- ``dist.all_gather_object`` without a group (megatron's optimizer gathers its param-group keys over
  the default group, ``optimizer._get_param_groups``) runs on ``group``, a group of the same
  processes that only such builds use;
- any other collective, or one on another group, raises ``BuildCollectiveError`` at once (the build
  then fails on that rank, every rank switches on demand), rather than meeting training's calls.

A build that fails on one rank before that all-gather (any error: the others' builds wait in it
for this rank) joins it with nothing (``BuildSession.join_missed``): the others' megatron then
fails on the missing keys, every rank's build has ended, and they agree to switch on demand.

A world change's build (``build_collectives(group, next_world=True)``) runs for the next world
while the default group is still the running one: there ``group`` is the next world's default
group, and ``dist.get_rank()`` / ``dist.get_world_size()`` without a group answer for it (megatron
sizes its gather and finds a rank's place in its groups with them).

The wrappers are installed once, process-wide; a thread outside ``build_collectives`` calls torch's
functions as they are.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

#: the collectives guarded in a build thread (not the point-to-point calls: torch's ``P2POp`` knows
#: ``isend``/``irecv`` by identity, and megatron builds nothing with them)
_GUARDED = ("all_gather_object", "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
            "broadcast", "broadcast_object_list", "barrier", "reduce", "gather", "scatter", "all_to_all",
            "all_to_all_single")

_local = threading.local()
_lock = threading.Lock()
_installed = False


class BuildCollectiveError(RuntimeError):
    """A build beside training called a collective on a group training may use."""


def _guard(name: str, original):
    @functools.wraps(original)
    def guarded(*args, **kwargs):
        route = getattr(_local, "group", None)
        if route is None:  # not a build thread
            return original(*args, **kwargs)
        if name == "all_gather_object" and kwargs.get("group", args[2] if len(args) > 2 else None) is None:
            _local.joined = True
            args[0][:] = [None] * route.size()  # megatron sized it by the default group
            out = original(*args[:2], group=route)
            failed = [rank for rank, got in enumerate(args[0]) if got is None]
            if failed:
                raise BuildCollectiveError(f"the build failed on rank(s) {failed} (see their log): every rank "
                                           "switches on demand")
            return out
        raise BuildCollectiveError(
            f"dist.{name} in a background build: it could meet a collective of the training thread. HINT: "
            "build this switch on demand (without prepare); please report the megatron version")
    return guarded


def _next_world(original, answer):
    @functools.wraps(original)
    def answered(group=None):
        route = getattr(_local, "group", None)
        if group is None and route is not None and getattr(_local, "next_world", False):
            return answer(route)
        return original(group) if group is not None else original()
    return answered


def _install() -> None:
    global _installed
    with _lock:
        if not _installed:
            for name in _GUARDED:
                setattr(dist, name, _guard(name, getattr(dist, name)))
            dist.get_rank = _next_world(dist.get_rank, lambda g: g.rank())
            dist.get_world_size = _next_world(dist.get_world_size, lambda g: g.size())
            _installed = True


class BuildSession:
    """One build's collectives (``build_collectives``)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def join_missed(self) -> None:
        """After a failure: take part in the build's all-gather with nothing, unless it ran."""
        if not getattr(_local, "joined", False):
            _local.joined = True
            _local.group = None  # the call below is this module's own, not the build's
            dist.all_gather_object([None] * self.group.size(), None, group=self.group)


@contextmanager
def build_collectives(group: dist.ProcessGroup, *, next_world: bool = False) -> Iterator[BuildSession]:
    """On this thread, inside: the default group's object all-gather runs on ``group``; any other
    collective raises ``BuildCollectiveError``; with ``next_world``, ``group`` is the next world's
    default group and the world's rank and size are its own (see the module docstring)."""
    _install()
    _local.group, _local.joined, _local.next_world = group, False, next_world
    try:
        yield BuildSession(group)
    finally:
        _local.group, _local.next_world = None, False


__all__ = ["BuildCollectiveError", "BuildSession", "build_collectives"]
