"""The job's store process: admission by token and model fingerprint, generations, liveness.

A real ``TCPStore`` (the store process's loop runs in a thread of the test) and real clients.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from lightning_dynatrain.elastic.client import JobStore
from lightning_dynatrain.elastic.records import AdmissionError, JoinRequest, LeaveRequest
from lightning_dynatrain.elastic.server import StoreServer

TOKEN = "job-secret"


@pytest.fixture
def served():
    yield from _serve(dead_after=1.0, together=0.5)


@pytest.fixture
def served_with_a_long_dead_after():
    yield from _serve(dead_after=30.0, suspect_after=1.0, together=0.3)


def _serve(**options):
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    logged: list[str] = []
    server = StoreServer(master, TOKEN, margin=3, log=logged.append, **options)
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, kwargs=dict(poll=0.005, should_stop=stop.is_set), daemon=True)
    thread.start()
    yield f"127.0.0.1:{master.port}", server, logged
    stop.set()
    thread.join(timeout=5)


def _join_first_world(address: str, size: int, fingerprint: str = "fp") -> list[JobStore]:
    clients = [JobStore.connect(address, TOKEN) for _ in range(size)]
    verdicts: list[dict] = [{}] * size

    def ask(rank: int) -> None:
        verdicts[rank] = clients[rank].ask(JoinRequest(member=clients[rank].member_id, fingerprint=fingerprint,
                                                       launch_rank=rank, launch_size=size,
                                                       launch_id="first"), timeout=10)

    threads = [threading.Thread(target=ask, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(v["generation"] == 0 for v in verdicts)
    return clients


def test_the_first_world_forms_in_the_launchers_rank_order(served):
    address, _, _ = served
    clients = _join_first_world(address, 3)
    world = clients[0].membership(0)
    assert world.members == tuple(c.member_id for c in clients) and world.effective_step == 0
    assert [world.rank_of(c.member_id) for c in clients] == [0, 1, 2]


def test_a_joiner_gets_the_next_rank_from_a_step_every_rank_reaches_after_reading_it(served):
    address, _, _ = served
    clients = _join_first_world(address, 2)
    clients[0].publish_step(40)
    joiner = JobStore.connect(address, TOKEN)
    verdict = joiner.ask(JoinRequest(member=joiner.member_id, fingerprint="fp"), timeout=10)
    world = joiner.membership(verdict["generation"])
    assert (world.generation, world.members[-1], world.effective_step, world.joined) == \
        (1, joiner.member_id, 43, (joiner.member_id,))
    # one change at a time: a leave waits until the trainers installed generation 1
    leaver = clients[1]
    answered: list[dict] = []
    threading.Thread(target=lambda: answered.append(leaver.ask(LeaveRequest(member=leaver.member_id), timeout=10)),
                     daemon=True).start()
    time.sleep(0.3)
    assert not answered and leaver.generation() == 1
    clients[0].publish_step(44)
    clients[0].mark_installed(1)
    deadline = time.monotonic() + 5
    while not answered and time.monotonic() < deadline:
        time.sleep(0.01)
    world = leaver.membership(answered[0]["generation"])
    assert world.members == (clients[0].member_id, joiner.member_id) and world.left == (leaver.member_id,)
    assert world.effective_step == 47


def test_leaves_asked_moments_apart_make_one_change(served):
    """Two ranks that get the preemption notice together ask to leave 0.3 s apart, one at the
    boundary after step 20 and one (its boundary passed before the notice came) after step 21: one
    generation, once the job published step 22 (every such notice has been sent by then)."""
    address, server, _ = served
    clients = _join_first_world(address, 4)
    clients[0].publish_step(20)
    answered: list[dict] = []
    for step, leaver in zip((20, 21), clients[2:]):
        threading.Thread(target=lambda c=leaver, s=step: answered.append(
            c.ask(LeaveRequest(member=c.member_id, step=s), timeout=10)), daemon=True).start()
        time.sleep(0.3)
    assert server.gather > 0.3
    clients[0].publish_step(21)
    time.sleep(server.gather + 0.5)
    assert not answered and clients[0].generation() == 0  # the second could have asked at step 21's boundary
    clients[0].publish_step(22)
    deadline = time.monotonic() + 5
    while len(answered) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [a["generation"] for a in answered] == [1, 1]
    world = clients[0].membership(1)
    assert world.members == (clients[0].member_id, clients[1].member_id)
    assert set(world.left) == {c.member_id for c in clients[2:]} and world.effective_step == 25


def test_joiners_that_ask_meanwhile_join_together_and_a_joiner_that_dies_cancels_only_its_change(served):
    address, _, _ = served
    clients = _join_first_world(address, 2)
    for c in clients:
        c.start_alive(interval=0.1)
    clients[0].publish_step(10)
    first = JobStore.connect(address, TOKEN)
    first.ask(JoinRequest(member=first.member_id, fingerprint="fp"), timeout=10)  # generation 1, not installed
    late = [JobStore.connect(address, TOKEN) for _ in range(2)]
    answered: list[dict] = []
    for j in late:
        j.start_alive(interval=0.1)
        threading.Thread(target=lambda j=j: answered.append(j.ask(JoinRequest(member=j.member_id, fingerprint="fp"),
                                                                  timeout=10)), daemon=True).start()
    time.sleep(0.3)
    clients[0].mark_installed(1)  # (the first joiner's world runs; it says nothing about liveness here)
    first.start_alive(interval=0.1)
    deadline = time.monotonic() + 5
    while len(answered) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert {a["generation"] for a in answered} == {2}
    world = clients[0].membership(2)
    assert set(world.joined) == {j.member_id for j in late} and len(world.members) == 5
    late[1].stop_alive()  # dies while the others build generation 2's world
    while clients[0].generation() < 3 and time.monotonic() < deadline + 5:
        time.sleep(0.05)
    cancelled = clients[0].membership(3)
    assert cancelled.dropped == (late[1].member_id,) and not cancelled.failed
    assert cancelled.members == clients[0].membership(1).members  # the running world goes on
    for c in [*clients, first, late[0]]:
        c.stop_alive()


def test_a_joiner_without_the_token_or_with_another_model_is_refused_and_changes_nothing(served):
    address, _, logged = served
    clients = _join_first_world(address, 2)
    intruder = JobStore.connect(address, "guessed")
    with pytest.raises(AdmissionError, match="not signed with this job's token"):
        intruder.ask(JoinRequest(member=intruder.member_id, fingerprint="fp"), timeout=10)
    other_model = JobStore.connect(address, TOKEN)
    with pytest.raises(AdmissionError, match="model, recipe or package version differs"):
        other_model.ask(JoinRequest(member=other_model.member_id, fingerprint="another"), timeout=10)
    assert clients[0].generation() == 0 and len(clients[0].membership(0).members) == 2
    assert sum("refused" in line for line in logged) == 2
    # a record forged by someone without the token is not a membership record
    intruder.store.set("membership/1", b'{"body": "{}", "mac": "00"}')
    intruder.store.set("gen", "1")
    with pytest.raises(AdmissionError, match="no signed membership record"):
        clients[0].membership(1)


def test_a_member_that_stops_saying_it_is_alive_is_recorded_as_failed(served):
    address, _, _ = served
    clients = _join_first_world(address, 2)
    for c in clients:
        c.start_alive(interval=0.1)
    clients[1].stop_alive()  # it dies: no leave request
    deadline = time.monotonic() + 10
    while clients[0].generation() < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    world = clients[0].membership(1)
    assert world.failed == (clients[1].member_id,)
    clients[0].stop_alive()
    # the job is over: a process that asks to join now is told so at once, not left waiting
    late = JobStore.connect(address, TOKEN)
    with pytest.raises(AdmissionError, match="there is no running world to join"):
        late.ask(JoinRequest(member=late.member_id, fingerprint="fp"), timeout=10)


def test_members_that_die_at_the_same_instant_are_recorded_together(served):
    """Their last heartbeats were apart (here 0.3 s): the record names both, not the first found."""
    address, _, _ = served
    clients = _join_first_world(address, 3)
    for c in clients:
        c.start_alive(interval=0.1)
    clients[1].stop_alive()
    time.sleep(0.3)
    clients[2].stop_alive()
    deadline = time.monotonic() + 10
    while clients[0].generation() < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    world = clients[0].membership(1)
    assert world.failed == (clients[1].member_id, clients[2].member_id)
    clients[0].stop_alive()


def test_together_must_stay_below_dead_after():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with pytest.raises(ValueError, match="below dead_after"):
        StoreServer(master, TOKEN, dead_after=1.0, together=1.0)
    assert StoreServer(master, TOKEN, dead_after=10.0).together == 2.0


def test_a_failed_collective_reported_names_the_silent_member_in_seconds(served_with_a_long_dead_after):
    """dead_after is 30 s; once a member says its collective failed, 1 s of silence is enough."""
    address, _, _ = served_with_a_long_dead_after
    clients = _join_first_world(address, 2)
    for c in clients:
        c.start_alive(interval=0.1)
    clients[1].stop_alive()  # it dies
    time.sleep(2.0)
    assert clients[0].generation() == 0, "without a report the bound is dead_after"
    reported = time.monotonic()
    clients[0].suspect_failure("DistBackendError: Connection closed by peer")
    while clients[0].generation() < 1 and time.monotonic() - reported < 10:
        time.sleep(0.02)
    assert time.monotonic() - reported < 1.0
    assert clients[0].membership(1).failed == (clients[1].member_id,)
    clients[0].stop_alive()
    with pytest.raises(ValueError, match="suspect_after"):
        StoreServer(dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False), TOKEN, dead_after=5.0,
                    suspect_after=6.0)
