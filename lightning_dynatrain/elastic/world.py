"""Worlds with a life cycle: the next world's default group built in the background, installed at a
step boundary, the old one destroyed after the first step of the new one.

``torch.distributed`` has one default group (WORLD), made by ``init_process_group`` and torn down by
``destroy_process_group``, which on gloo costs about as much as building a new one and must run
with every member present. Changing the world in a running job instead:

1. ``NextWorld``: every member of the next world builds its group in a background thread (joiners
   in their main thread) over ``PrefixStore(f"gen{g}/", store)``, *unregistered*, while training
   steps on the old group;
2. ``install``: at the boundary, registered under its own name as WORLD, made the default group,
   with ``group_count`` set to a value every member agrees on (``new_group`` names unnamed groups
   by that counter and uses the name as a store prefix: joiners and old members must count alike);
3. ``retire``: the old world's groups destroyed one by one once the first collective of the new
   world has run (destroying the old WORLD first would shut every backend down on the critical path),
   or kept for a return to the same members (``world_cache.WorldCache``): ``install`` then puts a
   kept world back with the ``group_count`` its members had reached in it, and builds nothing.

Between 1 and 2, ``BorrowedWorld`` makes the built group the default for a moment on the training
thread, between two steps: the next world's megatron groups, its topology and its joiners' header
are made there, ahead of the swap, and the old world is the default again before the next step.

The c10d internals this takes (the registry of groups, the default group, the group counter, a
default group built outside ``init_process_group``) are ``compat/torch_internals.py``'s.

Example::

    nxt = NextWorld(store, generation=1, rank=2, size=4)      # starts building at once
    ...training steps on the old world...
    old = install(nxt.group(timeout=60), store, generation=1)  # at the step boundary
    dist.all_reduce(torch.ones(1))                             # the new world's first collective
    retire(old.groups)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_dynatrain.compat.torch_internals import (
    backend_name,
    build_default_group,
    default_group,
    group_count,
    is_registered,
    register_default_group,
    registered_groups,
    set_default_group,
    set_group_count,
)
from lightning_dynatrain.elastic.records import AdmissionError
from lightning_dynatrain.elastic.world_cache import WorldGroups
from lightning_dynatrain.thread_end import join_before_exit

#: ``group_count`` of generation ``g``'s world: identical on every member, far from the counts any
#: earlier generation's ``new_group`` calls reach
GROUP_COUNT_STRIDE = 100_000


def _group_name(generation: int) -> str:
    return f"dynatrain_world_gen{generation}"


def _prefix(store: dist.Store, generation: int) -> dist.Store:
    """Generation ``generation``'s own key space: its WORLD and every group made on it."""
    return dist.PrefixStore(f"{_group_name(generation)}/", dist.PrefixStore(f"gen{generation}/", store))


def build_group(store: dist.Store, *, generation: int, rank: int, size: int, backend: str = "gloo",
                timeout: timedelta = timedelta(minutes=5), device: torch.device | None = None) -> dist.ProcessGroup:
    """Generation ``generation``'s default group, built and connected but not registered (collective
    over the ``size`` members of that generation, through ``store``)."""
    return build_default_group(_prefix(store, generation), name=_group_name(generation), rank=rank, size=size,
                               backend=backend, timeout=timeout, device=device)


class NextWorld:
    """The next generation's group, built in a background thread from construction on."""

    def __init__(self, store: dist.Store, *, generation: int, rank: int, size: int, backend: str = "gloo",
                 timeout: timedelta = timedelta(minutes=5), device: torch.device | None = None,
                 background: bool = True) -> None:
        self.generation, self.rank, self.size, self.backend = generation, rank, size, backend
        self._store = store
        self._result: dist.ProcessGroup | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self.seconds = 0.0
        """How long the build took (the members' rendezvous included)."""
        self._args = dict(generation=generation, rank=rank, size=size, backend=backend, timeout=timeout, device=device)
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._build, name=f"dynatrain-world-gen{generation}", daemon=True)
            self._thread.start()
        else:
            self._build()

    def _build(self) -> None:
        start = time.perf_counter()
        try:
            self._result = build_group(self._store, **self._args)
        except BaseException as err:  # reported to whoever waits for the group
            self._error = err
        finally:
            self.seconds = time.perf_counter() - start
            self._done.set()

    @classmethod
    def kept(cls, pg: dist.ProcessGroup, *, generation: int, rank: int) -> "NextWorld":
        """A next world that needs no build: a kept world's group (``world_cache``)."""
        world = cls.__new__(cls)
        world.generation, world.rank, world.size, world.backend = generation, rank, pg.size(), backend_name(pg)
        world._result, world._error, world.seconds, world._thread = pg, None, 0.0, None
        world._done = threading.Event()
        world._done.set()
        return world

    @property
    def ready(self) -> bool:
        return self._done.is_set() and self._error is None

    def wait(self, timeout: float) -> bool:
        """Whether the build ended (built or failed) within ``timeout`` seconds."""
        return self._done.wait(timeout)

    def end(self, timeout: float) -> bool:
        """The process closes with this world not installed: wait up to ``timeout`` seconds for a
        background build to end (it is in torch's rendezvous: ``thread_end``); whether it did."""
        return join_before_exit(self._thread, timeout=timeout,
                                what=f"the build of generation {self.generation}'s world")

    def group(self, timeout: float | None = None) -> dist.ProcessGroup:
        """The built group (waits for the build).

        Raises:
            AdmissionError: the build failed or did not finish in ``timeout`` seconds.
        """
        if not self._done.wait(timeout):
            raise AdmissionError(f"the world of generation {self.generation} was not built in {timeout} s",
                                 hint="a member of the next world is missing; see its log")
        if self._error is not None:
            raise AdmissionError(f"building the world of generation {self.generation} failed: {self._error}",
                                 hint="a member of the next world stopped or is unreachable") from self._error
        assert self._result is not None
        return self._result


def _register(pg: dist.ProcessGroup, store: dist.Store, generation: int) -> None:
    register_default_group(pg, _prefix(store, generation), name=_group_name(generation))


def install(pg: dist.ProcessGroup, store: dist.Store, *, generation: int, borrowed: "BorrowedWorld | None" = None,
            kept: WorldGroups | None = None, keep: frozenset[dist.ProcessGroup] = frozenset()) -> WorldGroups:
    """Make ``pg`` (built by ``build_group`` over ``store``) the default group (WORLD). Returns the
    groups of the world it replaces, to ``retire`` once the new world's first collective has run
    (or to keep: ``world_cache``).

    Groups made later (``new_group``, megatron's) live under the generation's prefix of ``store``:
    every member, joiner or not, names them alike (``group_count``). ``borrowed``: the
    ``BorrowedWorld`` that made groups on ``pg`` already (they stay; the count goes on from them).
    ``kept``: ``pg`` is a kept world's, registered when it was built (its groups stay; the count
    goes on from where its members left it). ``keep``: the groups of other kept worlds (not the
    replaced world's)."""
    made = set(borrowed.made if borrowed is not None else []) | set(kept.groups if kept is not None else ())
    default = default_group()
    old = tuple(g for g in registered_groups() if g is not pg and g not in made and g not in keep)
    replaced = WorldGroups(default=default if default is not pg else None, groups=old, group_count=group_count())
    if borrowed is None and kept is None:
        _register(pg, store, generation)
    set_default_group(pg)
    set_group_count(borrowed.group_count if borrowed is not None else
                    kept.group_count if kept is not None else GROUP_COUNT_STRIDE * (generation + 1))
    return replaced


class BorrowedWorld:
    """The next world's group as the default for moments before its install (``with borrowed:``):
    what runs inside makes groups and runs collectives on the next world, as its joiners do after
    their install. Training thread only, between steps (the running step reads the default group).

    Example::

        borrowed = BorrowedWorld(nxt.group(), store, generation=1)
        with borrowed:
            pgs = initialize_for_layout(target, seed=seed, groups=next_cache)
        ...training steps on the old world...
        old = install(borrowed.group, store, generation=1, borrowed=borrowed)
    """

    def __init__(self, pg: dist.ProcessGroup, store: dist.Store, *, generation: int,
                 kept: WorldGroups | None = None) -> None:
        self.group, self.generation, self.kept = pg, generation, kept
        if kept is None:
            _register(pg, store, generation)
        self.group_count = kept.group_count if kept is not None else GROUP_COUNT_STRIDE * (generation + 1)
        self.made: list[dist.ProcessGroup] = []
        """The groups made on the next world while borrowed (``install`` keeps them)."""
        self._saved: tuple[dist.ProcessGroup, int] | None = None

    def __enter__(self) -> dist.ProcessGroup:
        assert self._saved is None, "not reentrant"
        before = set(registered_groups())
        self._saved = (default_group(), group_count())
        set_default_group(self.group)
        set_group_count(self.group_count)
        self._before = before
        return self.group

    def __exit__(self, *exc) -> None:
        assert self._saved is not None
        self.made += [g for g in registered_groups() if g not in self._before and g is not self.group]
        self.group_count = group_count()
        default, count = self._saved
        set_default_group(default)
        set_group_count(count)
        self._saved = None

    def forget(self) -> None:
        """The swap will not come (the change was cancelled): destroy what was made on the next world
        (a kept world's own groups are its keeper's)."""
        retire(self.made)
        self.made = []
        if self.kept is None and is_registered(self.group):
            dist.destroy_process_group(self.group)


def retire(groups: "Iterable[dist.ProcessGroup]") -> None:
    """Destroy an old world's groups (local; after the new world's first collective)."""
    for group in groups:
        if is_registered(group):
            dist.destroy_process_group(group)


__all__ = ["BorrowedWorld", "GROUP_COUNT_STRIDE", "NextWorld", "build_group", "install", "retire"]
