"""The job's store process: admission by token and model fingerprint, generations, liveness.

A real ``TCPStore``, a real ``StoreServer`` and real clients. The store's clock is the one thing a
test fakes (``ManualClock``, given as both its ``clock`` and ``wall_clock``): no loop runs; the test
moves the clock, writes the members' heartbeat stamps on it, and runs the store's decision itself
(``StoreServer.step``, one pass). So each test says exactly how much time has passed when the store
decides, and asserts what it decided: a request still waiting is one the store has popped and
held back, not one it has not reached yet. One end-to-end test runs the store's own loop on the
real clocks, with real heartbeat threads, for the wiring (the members' stamps and the store's
``wall_clock`` are one time base).
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_dynatrain.elastic.client import JobStore
from lightning_dynatrain.elastic.records import AdmissionError, JoinRequest, LeaveRequest, Signer
from lightning_dynatrain.elastic.server import StoreServer

TOKEN = "job-secret"
TICK = 0.25
"""The heartbeat period on the test clock (the members that beat say so once per tick)."""
MOMENT = 1 / 64
"""A time short next to every bound here (exact in binary, as are the ticks: no rounding at a bound)."""


class ManualClock:
    """The store's clock in these tests: it moves only when the test moves it (``advance``), so what
    the store decides depends on the seconds the test says have passed, not on thread scheduling."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Job:
    """One job's store process, driven by hand: a real ``TCPStore`` and ``StoreServer`` whose clocks
    are a ``ManualClock``; no loop runs, the test calls ``step`` (the store's decision, one pass)."""

    def __init__(self, **options: float) -> None:
        self.master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.clock = ManualClock()
        self.logged: list[str] = []
        self.server = StoreServer(self.master, TOKEN, margin=3, log=self.logged.append, clock=self.clock,
                                  wall_clock=self.clock, **options)
        self.connection = dist.TCPStore("127.0.0.1", self.master.port, is_master=False)
        self.reader = self.connect()  # what any process holding the token reads

    def connect(self, token: str = TOKEN) -> JobStore:
        """A process of the job (a member id of its own), over the test's one client connection: these
        tests run in one thread, so the processes' store operations come one at a time anyway (and
        opening a ``TCPStore`` connection now and then stalls for seconds on a loaded machine)."""
        return JobStore(self.connection, Signer(token))

    def step(self) -> None:
        self.server.step()

    def generation(self) -> int:
        return self.reader.generation()

    def beat(self, *members: JobStore) -> None:
        """``members`` say they are alive now: the stamp ``JobStore.start_alive``'s thread writes,
        at the test clock's time."""
        for m in members:
            m.store.set(f"alive/{m.member_id}", repr(self.clock()))

    def pass_time(self, seconds: float, *, beating: tuple[JobStore, ...] = ()) -> None:
        """Move the clock ``seconds`` on, a ``TICK`` at a time (the last one shorter if need be); at
        each tick the ``beating`` members say they are alive, then the store makes its decisions."""
        while seconds > 0:
            dt = min(TICK, seconds)
            self.clock.advance(dt)
            self.beat(*beating)
            self.step()
            seconds -= dt

    def waiting(self, client: JobStore, nonce: str) -> bool:
        """The store has taken request ``nonce`` off the queue (nothing is queued) and not answered it:
        it holds the request back, rather than not having got to it."""
        return self.reader.store.queue_len("requests") == 0 and client.verdict(nonce) is None


@pytest.fixture
def job() -> Job:
    return Job(dead_after=1.0, together=0.5)


@pytest.fixture
def job_with_a_long_dead_after() -> Job:
    return Job(dead_after=30.0, suspect_after=1.0, together=0.3)


def _join(client: JobStore, **fields: object) -> str:
    return client.send(JoinRequest(member=client.member_id, **{"fingerprint": "fp", **fields}))


def _form_first_world(job: Job, size: int) -> list[JobStore]:
    """``size`` processes of one launch ask to join; one pass of the store forms generation 0."""
    clients = [job.connect() for _ in range(size)]
    nonces = [_join(c, launch_rank=r, launch_size=size, launch_id="first") for r, c in enumerate(clients)]
    job.step()
    assert [c.verdict(n) for c, n in zip(clients, nonces)] == [{"admitted": True, "reason": "", "generation": 0}] * size
    return clients


def test_the_first_world_forms_in_the_launchers_rank_order(job):
    """Not before every process of the first launch asked (ranks 2 and 0 asked: it waits), then in
    the launch's rank order, whatever order they asked in."""
    clients = [job.connect() for _ in range(3)]
    nonces = {r: _join(clients[r], launch_rank=r, launch_size=3, launch_id="first") for r in (2, 0)}
    job.step()
    assert all(job.waiting(clients[r], n) for r, n in nonces.items()) and job.generation() == -1
    nonces[1] = _join(clients[1], launch_rank=1, launch_size=3, launch_id="first")
    job.step()
    assert {r: clients[r].verdict(n)["generation"] for r, n in nonces.items()} == {0: 0, 1: 0, 2: 0}
    world = clients[0].membership(0)
    assert world.members == tuple(c.member_id for c in clients) and world.effective_step == 0
    assert [world.rank_of(c.member_id) for c in clients] == [0, 1, 2]


def test_a_joiner_gets_the_next_rank_from_a_step_every_rank_reaches_after_reading_it(job):
    """A join is admitted once it waited ``gather`` (others may come with it), effective ``margin``
    steps after the step published; a leave asked meanwhile waits until the trainers installed that
    generation (one change at a time), then takes effect ``margin`` steps on."""
    clients = _form_first_world(job, 2)
    clients[0].publish_step(40)
    joiner = job.connect()
    asked = _join(joiner)
    job.step()
    assert job.waiting(joiner, asked), "a join waits gather seconds for others of its kind"
    job.clock.advance(job.server.gather)
    job.step()
    world = joiner.membership(joiner.verdict(asked)["generation"])
    assert (world.generation, world.members[-1], world.effective_step, world.joined) == \
        (1, joiner.member_id, 43, (joiner.member_id,))
    # one change at a time: a leave waits until the trainers installed generation 1
    leaver = clients[1]
    leave = leaver.send(LeaveRequest(member=leaver.member_id))  # asked after step 40
    job.step()
    clients[0].publish_step(44)  # past its notice's step + 2, and its gather passed: only the install is missing
    job.clock.advance(job.server.gather)
    job.step()
    assert job.waiting(leaver, leave) and job.generation() == 1
    clients[0].mark_installed(1)
    job.step()
    world = leaver.membership(leaver.verdict(leave)["generation"])
    assert world.generation == 2
    assert world.members == (clients[0].member_id, joiner.member_id) and world.left == (leaver.member_id,)
    assert world.effective_step == 47


def test_leaves_asked_moments_apart_make_one_change(job):
    """Two ranks that get the preemption notice together ask to leave 0.3 s apart, one at the
    boundary after step 20 and one (its boundary passed before the notice came) after step 21: one
    generation, once the job published step 22 (every such notice has been sent by then), and not
    at step 21 even once ``gather`` has long passed."""
    clients = _form_first_world(job, 4)
    clients[0].publish_step(20)
    assert job.server.gather > 0.3
    leaves = []
    for step, leaver in zip((20, 21), clients[2:]):
        leaves.append(leaver.send(LeaveRequest(member=leaver.member_id, step=step)))
        job.step()
        job.clock.advance(0.3)
    clients[0].publish_step(21)
    job.clock.advance(job.server.gather + 0.5)
    job.step()
    # the second could have asked at step 21's boundary
    assert all(job.waiting(c, n) for c, n in zip(clients[2:], leaves)) and job.generation() == 0
    clients[0].publish_step(22)
    job.step()
    assert [c.verdict(n)["generation"] for c, n in zip(clients[2:], leaves)] == [1, 1]
    world = clients[0].membership(1)
    assert world.members == (clients[0].member_id, clients[1].member_id)
    assert set(world.left) == {c.member_id for c in clients[2:]} and world.effective_step == 25


def test_joiners_that_ask_meanwhile_join_together_and_a_joiner_that_dies_cancels_only_its_change(job):
    """Joiners that ask while generation 1 is not installed wait, then join in one generation; one
    of them silent ``dead_after`` (and a moment) before generation 2 is installed cancels that
    change (``dropped``, not ``failed``): the running world goes on."""
    clients = _form_first_world(job, 2)
    job.beat(*clients)
    clients[0].publish_step(10)
    first = job.connect()
    asked = _join(first)
    job.step()  # popped now: its gather counts from here
    job.pass_time(job.server.gather, beating=(*clients,))
    assert first.verdict(asked)["generation"] == 1  # not installed
    late = [job.connect() for _ in range(2)]
    job.beat(*late)
    nonces = [_join(j) for j in late]
    job.step()
    job.pass_time(job.server.gather, beating=(*clients, *late))
    assert all(job.waiting(j, n) for j, n in zip(late, nonces)) and job.generation() == 1
    clients[0].mark_installed(1)  # (the first joiner's world runs)
    job.beat(first)
    job.step()
    assert [j.verdict(n)["generation"] for j, n in zip(late, nonces)] == [2, 2]
    world = clients[0].membership(2)
    assert set(world.joined) == {j.member_id for j in late} and len(world.members) == 5
    # late[1] dies while the others build generation 2's world; everyone else keeps saying it is alive
    alive = (*clients, first, late[0])
    job.beat(*alive, late[1])
    job.pass_time(job.server.dead_after, beating=alive)
    assert job.generation() == 2, "silent exactly dead_after: not yet"
    job.pass_time(MOMENT, beating=alive)
    assert job.generation() == 3
    cancelled = clients[0].membership(3)
    assert cancelled.dropped == (late[1].member_id,) and not cancelled.failed
    assert cancelled.members == clients[0].membership(1).members  # the running world goes on
    assert cancelled.effective_step == 13


def test_a_join_waits_for_a_world_size_the_policy_has_and_a_leave_asked_after_it_goes_first(job):
    """The first world's processes say their layout policy has layouts for worlds of 1-4. At world 4 a
    joiner waits as a spare (a world of 5 has none; the store says so, once); a leave asked after it
    is not held behind it (world 3); once that is installed the spare is admitted (world 4 again).
    Launches that ask together are admitted as far as a size fits: from world 2 under a policy of 2
    and 4, two one-process launches join together, never the first alone."""
    sizes = (1, 2, 3, 4)
    clients = [job.connect() for _ in range(4)]
    nonces = [_join(c, launch_rank=r, launch_size=4, launch_id="first", world_sizes=sizes)
              for r, c in enumerate(clients)]
    job.step()
    assert [c.verdict(n)["generation"] for c, n in zip(clients, nonces)] == [0] * 4
    clients[0].publish_step(10)
    spare = job.connect()
    asked = _join(spare, launch_id="spare", world_sizes=sizes)
    job.step()
    for _ in range(3):
        job.clock.advance(job.server.gather)
        job.step()
    assert job.waiting(spare, asked) and job.generation() == 0
    said = [line for line in job.logged if f"join of {spare.member_id} waits" in line]
    assert len(said) == 1 and "a world of 5 processes has no layout in the job's policy (it has [1, 2, 3, 4])" in said[0]
    leaver = clients[3]
    leave = leaver.send(LeaveRequest(member=leaver.member_id, step=10))
    job.step()
    clients[0].publish_step(12)
    job.clock.advance(job.server.gather)
    job.step()
    assert leaver.verdict(leave)["generation"] == 1 and job.waiting(spare, asked)
    assert clients[0].membership(1).members == tuple(c.member_id for c in clients[:3])
    clients[0].mark_installed(1)
    job.step()
    assert spare.verdict(asked)["generation"] == 2
    world = clients[0].membership(2)
    assert world.members == (*(c.member_id for c in clients[:3]), spare.member_id) and world.joined == (spare.member_id,)

    other = Job(dead_after=1.0, together=0.5)
    first = [other.connect() for _ in range(2)]
    for r, c in enumerate(first):
        _join(c, launch_rank=r, launch_size=2, launch_id="first", world_sizes=(2, 4))
    other.step()
    joiners = [other.connect() for _ in range(2)]
    asks = [_join(j, launch_id=f"launch{i}", world_sizes=(2, 4)) for i, j in enumerate(joiners)]
    other.step()
    other.clock.advance(other.server.gather)
    other.step()
    assert [j.verdict(n)["generation"] for j, n in zip(joiners, asks)] == [1, 1]
    assert not [line for line in other.logged if "waits" in line]


def test_a_joiner_without_the_token_or_with_another_model_is_refused_and_changes_nothing(job):
    """A request not signed with the token is refused in the pass that pops it (its sender cannot
    read why: the answer is signed too); a join with another model once its ``gather`` passed.
    Neither bumps the generation; both are logged."""
    clients = _form_first_world(job, 2)
    intruder = job.connect("guessed")
    forged = _join(intruder)
    other_model = job.connect()
    other = _join(other_model, fingerprint="another")
    job.step()
    assert intruder.verdict(forged) == {"admitted": False, "reason": "the verdict is not signed with this job's token"}
    assert "not signed with the job's token" in job.reader.verdict(forged)["reason"]
    assert job.waiting(other_model, other)
    job.clock.advance(job.server.gather)
    job.step()
    verdict = other_model.verdict(other)
    assert not verdict["admitted"] and "model, recipe or package version differs" in verdict["reason"]
    assert job.generation() == 0 and len(clients[0].membership(0).members) == 2
    assert sum("refused" in line for line in job.logged) == 2
    # a record forged by someone without the token is not a membership record
    intruder.store.set("membership/1", b'{"body": "{}", "mac": "00"}')
    intruder.store.set("gen", "1")
    with pytest.raises(AdmissionError, match="no signed membership record"):
        clients[0].membership(1)


def test_a_member_that_stops_saying_it_is_alive_is_recorded_as_failed_after_dead_after(job):
    """A member that keeps beating is never named, however long; one that stops is named failed in
    the first pass after ``dead_after`` of silence, not at ``dead_after`` itself; the survivor goes
    on until it stops too, and then the job is over: a join is refused in the pass that pops it."""
    a, b = _form_first_world(job, 2)
    job.beat(a, b)
    job.pass_time(10 * job.server.dead_after, beating=(a, b))
    assert job.generation() == 0, "members that keep saying they are alive are never named"
    job.pass_time(job.server.dead_after, beating=(a,))  # b died (no leave) as that began
    assert job.generation() == 0, "silent exactly dead_after: not yet"
    job.pass_time(MOMENT, beating=(a,))
    world = a.membership(1)
    assert (job.generation(), world.failed, world.members, world.survived) == (1, (b.member_id,), (a.member_id,), True)
    job.pass_time(10 * job.server.dead_after, beating=(a,))
    assert job.generation() == 1, "the survivor keeps saying it is alive"
    job.pass_time(job.server.dead_after + MOMENT)  # a stops too
    over = a.membership(2)
    assert (job.generation(), over.failed, over.survived) == (2, (a.member_id,), False)
    late = job.connect()
    asked = _join(late)
    job.step()  # the clock has not moved: no gather, no waiting
    assert "there is no running world to join" in late.verdict(asked)["reason"]


def test_members_that_die_at_the_same_instant_are_recorded_together(job):
    """Their last heartbeats were apart (here 0.25 s): when the first is found dead, the record
    names every member silent more than ``dead_after - together``, not just the first found; one
    that stopped later than that is named on its own, once its own silence passed ``dead_after``."""
    a, b, c, d = _form_first_world(job, 4)
    job.beat(a, b, c, d)
    job.pass_time(TICK, beating=(a, c, d))  # b stopped as that began
    job.pass_time(0.5, beating=(a, d))  # c stopped 0.25 s after b
    job.pass_time(0.25, beating=(a,))  # d stopped 0.75 s after b
    assert job.generation() == 0, "b silent exactly dead_after: not yet"
    job.pass_time(MOMENT, beating=(a,))
    world = a.membership(1)
    assert job.generation() == 1 and world.failed == (b.member_id, c.member_id)
    assert world.members == (a.member_id, d.member_id), "d was silent for less than dead_after - together"
    job.pass_time(job.server.dead_after - 0.25 - MOMENT, beating=(a,))
    assert job.generation() == 1, "d silent exactly dead_after: not yet"
    job.pass_time(MOMENT, beating=(a,))
    assert a.membership(2).failed == (d.member_id,) and a.membership(2).members == (a.member_id,)


def test_together_must_stay_below_dead_after():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with pytest.raises(ValueError, match="below dead_after"):
        StoreServer(master, TOKEN, dead_after=1.0, together=1.0)
    assert StoreServer(master, TOKEN, dead_after=10.0).together == 2.0


def test_a_failed_collective_reported_names_the_silent_member_after_suspect_after(job_with_a_long_dead_after):
    """``dead_after`` is 30 s; once a member says its collective failed, more than ``suspect_after``
    (1 s) of silence is enough: a member silent 2 s already is named in the first pass after the
    report; one that stops as the report comes is named once its silence passed ``suspect_after``,
    not before; each report is used up by the record it brings (the next death waits for a new one)."""
    job = job_with_a_long_dead_after
    a, b, c, d = _form_first_world(job, 4)
    job.beat(a, b, c, d)
    job.pass_time(2.0, beating=(a, c, d))  # b died as that began
    assert job.generation() == 0, "without a report the bound is dead_after"
    a.suspect_failure("DistBackendError: Connection closed by peer")
    job.step()  # the clock has not moved
    world = a.membership(1)
    assert (job.generation(), world.failed) == (1, (b.member_id,))
    assert world.members == (a.member_id, c.member_id, d.member_id)
    assert int(job.reader.store.add("suspects", 0)) == 0
    a.suspect_failure("DistBackendError: Connection closed by peer")  # c dies now
    job.pass_time(job.server.suspect_after, beating=(a, d))
    assert job.generation() == 1, "silent exactly suspect_after: not yet"
    job.pass_time(MOMENT, beating=(a, d))
    world = a.membership(2)
    assert (job.generation(), world.failed, world.members) == (2, (c.member_id,), (a.member_id, d.member_id))
    job.pass_time(2.0, beating=(a,))  # d died as that began; nobody reported it
    assert job.generation() == 2, "the report was used up: the bound is dead_after again"
    with pytest.raises(ValueError, match="suspect_after"):
        StoreServer(dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False), TOKEN, dead_after=5.0,
                    suspect_after=6.0)


# ------------------------------------------------------------------- end to end, on the real clocks
@pytest.fixture
def served():
    """The store process's own loop (``serve``) on the real clocks, in a thread of the test."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    server = StoreServer(master, TOKEN, margin=3, dead_after=2.0, together=0.5, log=lambda line: None)
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, kwargs=dict(poll=0.005, should_stop=stop.is_set), daemon=True)
    thread.start()
    yield f"127.0.0.1:{master.port}"
    stop.set()
    thread.join(timeout=5)
    assert not thread.is_alive(), "the store's loop did not stop"


def _wait_for_record(client: JobStore, generation: int, *, timeout: float = 30.0):
    """Generation ``generation``'s record, once the store process wrote it (a ``TCPStore`` wait on its
    key: it returns when the key is set); ``timeout`` only guards against a hang."""
    try:
        client.store.wait([f"membership/{generation}"], timedelta(seconds=timeout))
    except dist.DistStoreError:
        pytest.fail(f"the store wrote no generation {generation} in {timeout:.0f} s (it stands at "
                    f"{client.generation()})")
    return client.membership(generation)


def test_end_to_end_a_member_whose_heartbeat_thread_stops_is_recorded_as_failed(served):
    """The store's loop, the clients' ``ask`` and their heartbeat threads on the real clocks: the
    members' stamps (``time.time``) and the store's default ``wall_clock`` agree, and the member
    whose thread stops is the one recorded (the bounds themselves are the tests above). The
    heartbeat period (0.1 s, against ``dead_after`` 2 s) is real time: that is what this checks."""
    clients = [JobStore.connect(served, TOKEN) for _ in range(2)]
    verdicts: dict[int, dict] = {}

    def ask(rank: int) -> None:
        verdicts[rank] = clients[rank].ask(JoinRequest(member=clients[rank].member_id, fingerprint="fp",
                                                       launch_rank=rank, launch_size=2, launch_id="first"), timeout=30)

    threads = [threading.Thread(target=ask, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)  # ask itself gives up after 30 s
    assert {r: v["generation"] for r, v in verdicts.items()} == {0: 0, 1: 0}
    for c in clients:
        c.start_alive(interval=0.1)
    clients[1].stop_alive()  # it dies: no leave request
    world = _wait_for_record(clients[0], 1)
    clients[0].stop_alive()
    assert world.failed == (clients[1].member_id,) and world.members == (clients[0].member_id,)
