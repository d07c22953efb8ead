"""The store process of an elastic job: hosts the ``TCPStore`` and is the only writer of the world.

``dynatrain store --port P`` runs it beside the job (the launch script starts it on a host that
stays; SLURM: the first node's batch script). No training process owns it, so any rank, rank 0
included, may leave and the job can still change again.

Admission is this process's job (``records.py``): it pops the signed requests, checks each (token,
then the model's fingerprint for a join), and only then writes a new generation's ``Membership``,
signed: member ids in rank order and the step the change takes effect at (``step`` the job last
published + ``margin``, so every rank reads it before its step gets there; ranks are never more
than a step apart, since every step runs collectives over the whole world). A request that fails a
check is answered with the reason and logged; it consumes no rank and bumps no generation.

Changes are one at a time: requests wait until the trainers say the previous generation is
installed (key ``installed``); the requests of one kind waiting then make one change, once the
oldest of them has waited ``gather`` seconds (preemption notices reach a node's processes within
moments of each other, and each answers on its own: the window makes them one change). Leaves wait
also until the job published step ``s + 2``, ``s`` the step the first of them asked after: each
process notices its signal at a step boundary, and the processes pass a boundary moments apart, so
a notice that came between two processes' passing of boundary ``s`` is seen by the later one at
``s + 1`` (seconds later for a large model); it asked before step ``s + 2`` could end, and the store
reads the step before the requests. Processes a
launcher started together (one ``torchrun``, one ``srun`` step) join together: a join waits until
every process of its launch has asked (at most ``launch_wait`` seconds). The first world forms
from the first launch's processes, in their launch's rank order; their requests say which world
sizes the job's layout policy has a layout for (``JoinRequest.world_sizes``). A join is admitted
only into a world of one of those sizes: the launches that asked first, as many as fit; the others
wait, as spares, until a leave or a failure makes room (a leave or failure is never held back, and
a join held so lets requests of the other kind go first). A member of the running world
that stops saying it is alive for ``dead_after`` seconds without leaving is recorded as failed in a
new generation, together with every member silent for nearly as long (``together`` seconds less:
members that died at the same instant said they were alive last up to a heartbeat apart, and the
record must name them all). Once a member reported a collective that failed (``suspect/{member}``,
a count in ``suspects``: gloo says at once when a peer's connection closed), the bound is
``suspect_after`` instead, a few heartbeats: the dead are named in seconds, not ``dead_after``
(which stays for a member that hangs without anything failing). A member whose process ended is
known at once, not after a silence: each member holds a connection to this process's liveness
listener (``liveness.py``), which its kernel closes when it ends; the first pass
``CLOSES_TOGETHER`` (0.1 s) after it records it failed (a pass every 20 ms), with every member
whose connection closed meanwhile (the processes of a node one event ended: one record, one
recovery) and every member of its launch when its launcher ends a launch with any of its processes
(torchrun's agent does: ``JoinRequest.ends_with_launch``), and tells the survivors over their
connections at once. A member that closed its connection with ``bye`` (its fit ended) is no death,
silent or not. The heartbeat bounds stay for what closes nothing: a process that hangs, a host
that vanishes. That generation is the survivors' world, effective at once: its members are the
running world's without the failed ones (a change not yet installed is dropped with it), and the
survivors recover into it (``elastic/driver/recovery.py``) or, where the state the dead held is
gone, stop. When no member survives, the job is over and every request after that is refused
(also when the members stopped because their fit ended). A joiner that stops before its
generation is installed only cancels that change (a generation with the running world's members,
``dropped``): training goes on.

Time comes from two clocks, both arguments of ``StoreServer`` so that a test can move time by hand
and run the decision itself (``step``: one pass) instead of sleeping and hoping the loop has run:
``clock`` (default ``time.monotonic``) measures what the store times on its own (``gather``,
``launch_wait``: how long a request has waited since it was popped); ``wall_clock`` (default
``time.time``) is the time base the members stamp their heartbeats with (``alive/{member}``,
``JobStore.start_alive``), so a member's silence is ``wall_clock()`` minus its last stamp (the hosts'
clocks are assumed to agree, as NTP keeps them). A test gives both the same hand-moved clock and
writes the stamps on it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.distributed as dist

from lightning_dynatrain.elastic.client import PREFIX
from lightning_dynatrain.elastic.liveness import LIVENESS_KEY, LivenessListener
from lightning_dynatrain.elastic.records import Membership, Signer


@dataclass
class _World:
    """What the store process knows: the current world, the first world forming, requests waiting."""

    generation: int = -1
    members: tuple[str, ...] = ()
    running: tuple[str, ...] = ()  # the members of the last generation the trainers installed
    fingerprint: str | None = None
    forming: dict[int, tuple[str, str]] = field(default_factory=dict)  # initial rank -> (member, nonce)
    waiting: list[dict] = field(default_factory=list)
    first_launch: str | None = None
    effective_step: int = 0
    failed: bool = False
    launch_of: dict[str, str] = field(default_factory=dict)  # member -> its launch, where it ends with its launch
    world_sizes: tuple[int, ...] | None = None  # the sizes the job's layout policy has a layout for (None: any)


#: seconds the store waits after a member's liveness connection closed for other closes before it records
#: the failure: the processes one event ended (a node's, a launch's) go in one record, one recovery
CLOSES_TOGETHER = 0.1


class StoreServer:
    """The admission and membership loop over a master ``TCPStore`` (see the module docstring)."""

    def __init__(self, store: dist.Store, token: bytes | str, *, margin: int = 3, dead_after: float = 10.0,
                 launch_wait: float = 60.0, gather: float = 1.0, together: float | None = None,
                 suspect_after: float | None = None, log: Callable[[str], None] = print,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time,
                 liveness: LivenessListener | None = None) -> None:
        """``clock``, ``wall_clock``: where ``now`` comes from (seconds; see the module docstring): the
        real clocks, except in tests, which move time by hand and call ``step`` themselves.
        ``liveness``: the listener members hold a connection to (``liveness.py``; ``serve_forever``
        makes one); without it, heartbeats alone say who is alive."""
        self.store = dist.PrefixStore(PREFIX, store)
        self.liveness = liveness
        if liveness is not None:
            self.store.set(LIVENESS_KEY, liveness.advertise())
        self.clock, self.wall_clock = clock, wall_clock
        self.signer = Signer(token)
        self.margin, self.dead_after, self.launch_wait, self.log = margin, dead_after, launch_wait, log
        self.together = min(2.0, dead_after / 2) if together is None else together
        if not 0 <= self.together < dead_after:
            raise ValueError(f"together={together} must be at least 0 and below dead_after={dead_after}: the "
                             "members silent that much less than dead_after when one is found dead count as dead too")
        self.suspect_after = min(4.0, dead_after) if suspect_after is None else suspect_after
        if not 0 < self.suspect_after <= dead_after:
            raise ValueError(f"suspect_after={suspect_after} must be above 0 and at most dead_after={dead_after}: "
                             "the silence that counts as dead once a member reported a failed collective")
        self.gather = gather
        self.world = _World()

    def step(self) -> None:
        """Handle every request queued, then changes that can take effect, then liveness (one pass).

        Every decision the store makes is made here, at ``clock()``/``wall_clock()`` now: ``serve``
        calls it in a loop; a test calls it after moving its clock, and when it returns, every request
        queued before the call has been handled (answered, or waiting on a rule of the module docstring).
        """
        seen = self._current_step()  # before the queue: every request sent before the job got here is popped
        if self.liveness is not None:
            self.liveness.poll()
        while self.store.queue_len("requests"):
            blob = self.store.queue_pop("requests", block=False)
            request = self.signer.verify(blob)
            if request is None:  # answered (its nonce is readable) so that its sender learns why
                self._answer(_unsigned(blob), False, "it is not signed with the job's token")
                continue
            asked = int(request.get("step", -1))
            if request.get("kind") == "join" and request.get("ends_with_launch"):
                self.world.launch_of[str(request.get("member"))] = str(request.get("launch_id"))
            self.world.waiting.append({**request, "received": self.clock(), "asked_step": asked if asked >= 0 else seen})
        if self.world.failed:  # the job is over (a member stopped without leaving, or the fit ended)
            for request in self.world.waiting:
                self._answer(request, False, "the job's members stopped (failed, or their fit ended): there is no "
                             "running world to join or leave; start a new job")
            self.world.waiting = []
            return
        if self.world.generation < 0:
            self._form_first_world()
        else:
            self._next_change(seen)
            self._check_alive()

    def serve(self, *, poll: float = 0.02, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Run ``step`` every ``poll`` seconds (real time) until ``should_stop()``."""
        while not should_stop():
            self.step()
            time.sleep(poll)

    # ------------------------------------------------------------------------------- verdicts
    def _answer(self, request: dict, admitted: bool, reason: str = "", **extra: object) -> None:
        self.store.set(f"verdict/{request.get('nonce')}",
                       self.signer.sign({"admitted": admitted, "reason": reason, **extra}))
        if not admitted:
            self.log(f"[dynatrain store] refused {request.get('kind')} of {request.get('member')}: {reason}")

    def _publish(self, members: tuple[str, ...], effective_step: int, **change: tuple[str, ...]) -> Membership:
        """Write the next generation (signed), then bump ``gen``."""
        world = Membership(generation=self.world.generation + 1, members=members, effective_step=effective_step,
                           **change)
        self.store.set(f"membership/{world.generation}", self.signer.sign(world.to_dict()))
        self.store.set("gen", str(world.generation))  # after the record: a reader of ``gen`` finds it
        self.world.generation, self.world.members, self.world.effective_step = world.generation, members, effective_step
        self.log(f"[dynatrain store] generation {world.generation}: {len(members)} members from step "
                 f"{effective_step} (joined {list(world.joined)}, left {list(world.left)}, failed {list(world.failed)}, "
                 f"dropped {list(world.dropped)})")
        return world

    # -------------------------------------------------------------------------------- changes
    def _form_first_world(self) -> None:
        """The first launch's processes, all of them, form generation 0 in their launch's order."""
        keep = []
        for request in self.world.waiting:
            if request.get("kind") != "join":
                keep.append(request)  # a leaver before the first world: wait for it
                continue
            if self.world.fingerprint is None:
                self.world.fingerprint, self.world.first_launch = request["fingerprint"], request.get("launch_id")
                sizes = request.get("world_sizes")
                self.world.world_sizes = tuple(sorted(int(n) for n in sizes)) if sizes is not None else None
            if request["fingerprint"] != self.world.fingerprint:
                self._answer(request, False, "its model, recipe or package version differs from the job's")
                continue
            if request.get("launch_id") != self.world.first_launch:
                keep.append(request)  # another launch: it joins the running job
                continue
            self.world.forming[int(request.get("launch_rank", 0))] = (request["member"], request["nonce"])
            size = int(request.get("launch_size", 1))
            if len(self.world.forming) == size:
                members = tuple(self.world.forming[r][0] for r in range(size))
                world = self._publish(members, 0, joined=members)
                self.world.running = members  # every member installs it before training starts
                for r, (member, nonce) in self.world.forming.items():
                    self._answer({"nonce": nonce, "member": member}, True, generation=world.generation)
        self.world.waiting = keep

    def _launches_ready(self, joins: list[dict]) -> list[dict]:
        """The joins whose whole launch has asked (processes started together join together), or
        whose launch's first request waited ``launch_wait`` seconds (the rest of it may be gone)."""
        launches: dict[str, list[dict]] = {}
        for request in joins:
            launches.setdefault(str(request.get("launch_id")), []).append(request)
        now, ready = self.clock(), []
        for group in launches.values():
            whole = len(group) >= int(group[0].get("launch_size", 1))
            if whole or now - min(r["received"] for r in group) > self.launch_wait:
                ready += sorted(group, key=lambda r: int(r.get("launch_rank", 0)))
        return ready

    def _current_step(self) -> int:
        return int(self.store.get("step")) if self.store.check(["step"]) else 0

    def _installed(self) -> int:
        """The last generation the trainers installed (its new rank 0 says so)."""
        return int(self.store.get("installed")) if self.store.check(["installed"]) else -1

    def _next_change(self, seen: int) -> None:
        if self._installed() == self.world.generation:
            self.world.running = self.world.members
        if not self.world.waiting or self.world.running != self.world.members:
            return  # one change at a time: the last one is not installed yet
        for kind in dict.fromkeys(r.get("kind") for r in self.world.waiting):  # the oldest request's kind first
            if not self._change(kind, seen):
                return

    def _change(self, kind: str, seen: int) -> bool:
        """Make the change the waiting requests of ``kind`` ask for, if it can be made now; ``True``
        only when they are joins the world sizes hold back (requests of the other kind may go)."""
        batch = [r for r in self.world.waiting if r.get("kind") == kind]
        if self.clock() - min(r["received"] for r in batch) < self.gather:
            return False  # others of the same kind may be on their way
        if kind == "leave" and seen < min(r["asked_step"] for r in batch) + 2:
            return False  # the others of the same notice: see the module docstring
        if kind == "join":
            batch = self._launches_ready(batch)
        self.world.waiting = [r for r in self.world.waiting if all(r is not b for b in batch)]
        admitted, step = [], self._current_step() + self.margin
        for request in batch:
            member = request.get("member")
            if kind == "join" and request.get("fingerprint") != self.world.fingerprint:
                self._answer(request, False, "its model, recipe or package version differs from the job's")
            elif kind == "join" and (member in self.world.members or member in [r.get("member") for r in admitted]):
                self._answer(request, False, "it is a member already")
            elif kind == "leave" and member not in self.world.members:
                self._answer(request, False, "'leave' of a process that is not a member")
            elif kind not in ("join", "leave"):
                self._answer(request, False, f"unknown request {kind!r}")
            else:
                admitted.append(request)
        if kind == "leave" and len(admitted) == len(self.world.members):
            for request in admitted:
                self._answer(request, False, "every member asked to leave: stop the job instead")
            return False
        held: list[dict] = []
        if kind == "join":
            admitted, held = self._room_for(admitted)
            self.world.waiting = held + self.world.waiting
        if not admitted:
            return bool(held)
        names = tuple(r["member"] for r in admitted)
        if kind == "join":
            world = self._publish(self.world.members + names, step, joined=names)
        else:
            world = self._publish(tuple(m for m in self.world.members if m not in names), step, left=names)
        for request in admitted:
            self._answer(request, True, generation=world.generation)
        return False

    def _room_for(self, joins: list[dict]) -> tuple[list[dict], list[dict]]:
        """``joins`` (whole launches, in the order they asked) split into those admitted now, the
        most launches in order that make a world of a size the job's policy has, and those held."""
        sizes = self.world.world_sizes
        if sizes is None:
            return joins, []
        launches: list[list[dict]] = []
        for request in joins:
            if launches and launches[-1][0].get("launch_id") == request.get("launch_id"):
                launches[-1].append(request)
            else:
                launches.append([request])
        counts = [len(self.world.members) + sum(len(group) for group in launches[:k])
                  for k in range(len(launches) + 1)]
        fits = max((k for k in range(1, len(launches) + 1) if counts[k] in sizes), default=0)
        admitted, held = [r for group in launches[:fits] for r in group], [r for group in launches[fits:] for r in group]
        for request in held:
            if not request.get("held"):
                request["held"] = True
                self.log(f"[dynatrain store] join of {request.get('member')} waits: a world of {counts[-1]} "
                         f"processes has no layout in the job's policy (it has {list(sizes)}); it joins when "
                         "a leave or a failure makes room")
        return admitted, held

    def _check_alive(self) -> None:
        now = self.wall_clock()  # the members' heartbeat stamps are on this clock
        closed = self._closed_members()
        ended = self.liveness.ended if self.liveness is not None else set()  # (their fit ended: no heartbeats)
        settled = any(self.clock() - at >= CLOSES_TOGETHER for at in closed.values())  # (closes that come with it)

        def silent(member: str) -> float:
            key = f"alive/{member}"
            return now - float(self.store.get(key)) if self.store.check([key]) else 0.0

        bound = self.suspect_after if int(self.store.add("suspects", 0)) else self.dead_after

        def dead(member: str) -> bool:
            if member in closed:
                return settled
            return member not in ended and silent(member) > bound

        if any(dead(m) for m in self.world.running):  # and whoever died with it (see the module docstring)
            together = min(self.together, bound / 2)
            launches = {self.world.launch_of[m] for m in closed if m in self.world.launch_of}
            failed = tuple(m for m in self.world.running if m in closed or self.world.launch_of.get(m) in launches
                           or m not in ended and silent(m) > bound - together)
            for member in failed:
                how = _how_found(member, closed, launches, self.world, silent)
                self.log(f"[dynatrain store] member {member} failed: {how}")
            survivors = tuple(m for m in self.world.running if m not in failed)
            if not survivors:  # nobody is left to go on
                self.world.failed = True
                self._publish_failure(self.world.members, self.world.effective_step, failed=failed)
                return
            # the survivors' world, from now (they are stuck or recovering, not stepping): a change
            # pending (joiners not yet installed) is dropped with it; its joiners ask again
            self._publish_failure(survivors, self._current_step(), failed=failed)
            self.world.running = survivors  # their liveness is what counts now
            self.store.set("suspects", "0")  # the next death waits for a new report (or dead_after)
            return
        dropped = tuple(m for m in self.world.members if m not in self.world.running and dead(m))
        if dropped:  # joiners gone before their world was installed: cancel the change
            self._publish_failure(self.world.running, self._current_step() + self.margin, dropped=dropped)

    def _closed_members(self) -> dict[str, float]:
        """Members of the latest world whose liveness connection closed without ``bye`` (their
        process ended); closes of processes that are no members any more (they left) are dropped."""
        if self.liveness is None:
            return {}
        self.liveness.forget(tuple(m for m in (*self.liveness.closed, *self.liveness.ended)
                                   if m not in self.world.members))
        return dict(self.liveness.closed)

    def _publish_failure(self, members: tuple[str, ...], effective_step: int, **change: tuple[str, ...]) -> None:
        """Publish a generation that records failed or dropped members, and tell every member still
        connected at once (``liveness.LivenessListener.notify``)."""
        world = self._publish(members, effective_step, **change)
        if self.liveness is not None:
            self.liveness.forget(world.failed + world.dropped)
            self.liveness.notify(world.generation)


def _how_found(member: str, closed: dict[str, float], launches: set[str], world: _World,
               silent: Callable[[str], float]) -> str:
    if member in closed:
        return "its process ended (its liveness connection closed)"
    if world.launch_of.get(member) in launches:
        return "a process of its launch ended, and its launcher stops the whole launch then"
    return f"silent for {silent(member):.2f} s"


def _unsigned(blob: bytes) -> dict:
    """What can be read of a request whose signature does not hold (for the refusal)."""
    import json

    try:
        body = json.loads(json.loads(blob)["body"])
        return {"nonce": str(body.get("nonce")), "member": str(body.get("member")), "kind": str(body.get("kind"))}
    except (ValueError, KeyError, TypeError):
        return {"nonce": "unreadable", "member": "?", "kind": "?"}


def serve_forever(host: str, port: int, token: bytes | str, *, on_ready: Callable[[int], None] | None = None,
                  **options: float) -> None:
    """Host the job's store on ``host:port`` (0: a free port) until the process is stopped; ``options``
    are ``StoreServer``'s (``margin``, ``dead_after``, ``launch_wait``, ``gather``, ``together``,
    ``suspect_after``)."""
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False)
    liveness = LivenessListener(host, Signer(token), clock=time.monotonic)
    if on_ready is not None:
        on_ready(store.port)
    try:
        StoreServer(store, token, liveness=liveness, **options).serve()
    finally:
        liveness.close()


__all__ = ["CLOSES_TOGETHER", "StoreServer", "serve_forever"]
