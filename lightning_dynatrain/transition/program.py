"""A switch as a program: the frozen list of steps one rank runs, printable and cacheable.

``compile_switch`` (``compiler.py``) turns a rank's plan and regions into a ``SwitchProgram``; the
walker (``walker.py``) executes it with a process group and a memory policy; ``memory_fold.py``
replays it for the memory it takes. Nothing here touches a process group or a tensor.

Steps, in the order every rank runs them (the order is what keeps a switch free of deadlocks):

- ``Drop``: source tensors the switch never reads, given back at once;
- ``Fill``: zero a destination box no source holds (vocabulary padding only the new layout has);
- ``Broadcast``: one stage of a promoted broadcast, in the global order of every member;
- ``Exchange``: one stage with one peer of the XOR schedule: messages both ways at once;
- ``Keep``: a destination local tensor the plan retains whole: kept in place (the old tensor, or a
  contiguous slice of it) where the memory policy accepts, else its ``copies`` run;
- ``Copy``: one retained box inside one local tensor, copied from old to new storage.

Every step names the local tensors it writes first (``writes_first``: allocated before it runs;
``writes_after``: allocated after its reads are released, before unpacking) and those it reads
for the last time (``reads_last``: released once its I/O is done), so a policy can allocate new
state late and free old state early without counting anything at run time.

A message is what one ``isend``/``irecv`` carries: packed parts of a stage buffer, or one part
``direct`` (a chunk of at least ``direct_min_bytes`` that is contiguous in its local tensor goes
straight from or into the state's storage). Both sides cut a stage into the same messages; each
side decides ``direct`` for its own storage.

Example (one line; ``program.describe()`` gives a line per step)::

    rank 1 dp2-tp2-pp1->dp1-tp4-pp1: 2 exchanges with [0] in 2 stages (4 msgs, 2 direct), 18 copies,
    12 keeps, staging 1.0 MiB (budget 256.0 MiB)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple, Union

from lightning_dynatrain.transition.staging import format_bytes
from lightning_dynatrain.vps.box import Box
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.mapping import Region
from lightning_dynatrain.vps.spec import StateKind
from lightning_dynatrain.vps.topology import Topology

StoreKey = tuple[str, StateKind, tuple[int, ...]]


class Part(NamedTuple):
    """A box of one tensor's state in a message: where it lives on this side, and where it sits in
    the stage buffer. A packed part may span several local tensors (layers); a direct one is one."""

    tensor: str
    kind: StateKind
    box: Box
    region: Region
    offset: int

    @property
    def nbytes(self) -> int:
        return self.box.numel * self.region.itemsize

    def __str__(self) -> str:
        return f"{self.tensor}:{self.kind.value}{self.box}"


class Message(NamedTuple):
    """What one ``isend``/``irecv`` carries: parts packed in the stage buffer, or one ``direct`` part."""

    parts: tuple[Part, ...]
    direct: bool

    @property
    def start(self) -> int:
        return self.parts[0].offset

    @property
    def nbytes(self) -> int:
        return self.parts[-1].offset + self.parts[-1].nbytes - self.parts[0].offset

    def __str__(self) -> str:
        how = "direct" if self.direct else f"packed at {self.start}"
        return f"{len(self.parts)} part(s) {format_bytes(self.nbytes)} {how}"


class Drop(NamedTuple):
    """Source tensors the switch never reads: given back before anything else."""

    reads_last: tuple[StoreKey, ...]
    writes_first: tuple[StoreKey, ...] = ()
    writes_after: tuple[StoreKey, ...] = ()

    def __str__(self) -> str:
        return f"drop {len(self.reads_last)} unread tensors"


class Fill(NamedTuple):
    """Zero ``box`` inside the destination local tensor ``key`` (padding rows only the new layout has)."""

    key: StoreKey
    box: Box
    region: Region
    writes_first: tuple[StoreKey, ...]
    reads_last: tuple[StoreKey, ...] = ()
    writes_after: tuple[StoreKey, ...] = ()

    def __str__(self) -> str:
        return f"fill {self.key[0]}:{self.key[1].value}{self.box}"


class Copy(NamedTuple):
    """Copy ``box`` of local tensor ``key`` from its old storage (``source``) to its new (``dest``)."""

    key: StoreKey
    box: Box
    source: Region
    dest: Region
    writes_first: tuple[StoreKey, ...]
    reads_last: tuple[StoreKey, ...]
    writes_after: tuple[StoreKey, ...] = ()

    @property
    def nbytes(self) -> int:
        return self.box.numel * self.dest.itemsize

    def __str__(self) -> str:
        return f"copy {self.key[0]}:{self.key[1].value}{self.box}"


class Keep(NamedTuple):
    """Destination local tensor ``key``, retained whole: the old tensor (``span`` None) or the
    contiguous run ``span`` (elements) of it becomes the new one, if the memory policy accepts;
    otherwise ``copies`` run."""

    key: StoreKey
    span: tuple[int, int] | None
    copies: tuple[Copy, ...]
    reads_last: tuple[StoreKey, ...]
    source_numel: int
    writes_first: tuple[StoreKey, ...] = ()
    writes_after: tuple[StoreKey, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.copies)

    def __str__(self) -> str:
        what = "whole" if self.span is None else f"slice {self.span[0]}:{self.span[1]}"
        return f"keep {self.key[0]}:{self.key[1].value} stack {self.key[2]} {what} ({len(self.copies)} copies else)"


class Exchange(NamedTuple):
    """One stage with ``peer``: post every send and receive at once, wait, unpack."""

    peer: int
    stage: int
    sends: tuple[Message, ...]
    recvs: tuple[Message, ...]
    buffer_bytes: int
    writes_first: tuple[StoreKey, ...]
    reads_last: tuple[StoreKey, ...]
    writes_after: tuple[StoreKey, ...]

    def __str__(self) -> str:
        sent = sum(m.nbytes for m in self.sends)
        got = sum(m.nbytes for m in self.recvs)
        return (f"exchange with {self.peer} stage {self.stage}: send {len(self.sends)} msgs {format_bytes(sent)}, "
                f"recv {len(self.recvs)} msgs {format_bytes(got)}")


class Broadcast(NamedTuple):
    """One stage of a promoted broadcast from ``root`` to ``members`` (plan ranks): the root packs
    ``parts``, every member joins, the others unpack."""

    root: int
    members: tuple[int, ...]
    stage: int
    parts: tuple[Part, ...]
    nbytes: int
    writes_first: tuple[StoreKey, ...]
    reads_last: tuple[StoreKey, ...]
    writes_after: tuple[StoreKey, ...]

    def __str__(self) -> str:
        return f"broadcast {self.root}->{list(self.members)} stage {self.stage}: {len(self.parts)} parts " \
               f"{format_bytes(self.nbytes)}"


Step = Union[Drop, Fill, Broadcast, Exchange, Keep, Copy]


class LocalTensor(NamedTuple):
    """A local tensor the program reads (source) or writes (destination): its elements and dtype."""

    key: StoreKey
    numel: int
    dtype: str


@dataclass(frozen=True, slots=True)
class SwitchProgram:
    """Everything one rank's switch does, decided before it runs (see the module docstring).

    Attributes:
        rank: the rank (group rank of the switch's process group).
        src, dst: the two layouts.
        topology: the node of every rank of the union world (the report's intra/inter split).
        staging_budget: bytes of stage buffers alive at once the program was cut for.
        needed_budget: the largest row this rank sends or receives: the smallest budget it can run
            under (every rank agrees on the largest of all ranks' before anything moves).
        buffer_bytes: the stage buffer's size: the largest stage that packs anything (0: nothing is
            packed). The one buffer every stage reuses; the most staging bytes alive at once.
        sources: the source local tensors the program reads.
        destinations: every destination local tensor of the rank.
        promotes: broadcasts were considered (link costs given): the walker then agrees on every
            rank's broadcast groups before anything moves (a collective all ranks join).
        broadcast_groups: member sets (plan ranks) of the promoted broadcasts this rank joins, sorted.
        steps: the steps, in order.
        group_size: the processes of the switch's group (0: the larger layout's world; a world
            change that renumbers, or one after a death, says so).
    """

    rank: int
    src: ParallelConfig
    dst: ParallelConfig
    topology: Topology
    staging_budget: int
    needed_budget: int
    buffer_bytes: int
    sources: tuple[LocalTensor, ...]
    destinations: tuple[LocalTensor, ...]
    promotes: bool
    broadcast_groups: tuple[tuple[int, ...], ...]
    steps: tuple[Step, ...]
    group_size: int = 0

    @property
    def world(self) -> int:
        """The processes the switch spans."""
        return self.group_size or max(self.src.world_size, self.dst.world_size)

    def counts(self) -> Counter[str]:
        """Steps by kind, and messages: ``{"exchange": 3, "messages": 8, "direct": 2, ...}``."""
        out: Counter[str] = Counter(type(s).__name__.lower() for s in self.steps)
        for s in self.steps:
            if isinstance(s, Exchange):
                out["messages"] += len(s.sends) + len(s.recvs)
                out["direct"] += sum(m.direct for m in s.sends + s.recvs)
        return out

    def __str__(self) -> str:
        n = self.counts()
        peers = sorted({s.peer for s in self.steps if isinstance(s, Exchange)})
        parts = []
        if n["fill"]:
            parts.append(f"{n['fill']} fills")
        if n["broadcast"]:
            parts.append(f"{n['broadcast']} broadcast stages in {len(self.broadcast_groups)} groups")
        if n["exchange"]:
            parts.append(f"exchanges with {peers} in {n['exchange']} stages ({n['messages']} msgs, {n['direct']} direct)")
        parts.append(f"{n['copy']} copies, {n['keep']} keeps")
        return (f"rank {self.rank} {self.src}->{self.dst}: {', '.join(parts)}, staging "
                f"{format_bytes(self.buffer_bytes)} (budget {format_bytes(self.staging_budget)})")

    def describe(self) -> str:
        """The program, one step per line, with what each allocates and frees."""
        lines = [str(self)]
        for i, step in enumerate(self.steps):
            extra = []
            if step.writes_first or step.writes_after:
                extra.append(f"+{len(step.writes_first) + len(step.writes_after)} new")
            if step.reads_last:
                extra.append(f"-{len(step.reads_last)} old")
            lines.append(f"  {i:4d} {step}" + (f"  [{' '.join(extra)}]" if extra else ""))
        return "\n".join(lines)


__all__ = ["Broadcast", "Copy", "Drop", "Exchange", "Fill", "Keep", "LocalTensor", "Message", "Part", "Step",
           "StoreKey", "SwitchProgram"]
