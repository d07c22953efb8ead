"""Liveness by connection: the store records a member whose process ended ``CLOSES_TOGETHER`` (0.1 s)
later on its clock, with whoever else's connection closed meanwhile, and tells the survivors over
their connections.

A real ``TCPStore`` and ``StoreServer`` driven by hand as in ``test_store.py`` (its ``Job``: the
store's clock moves only when a test moves it), now with a real ``LivenessListener``. A member that
dies is a real process (``python -c``) holding a real ``LivenessLink``, ended by SIGKILL: its
kernel closes the connection. No test here moves the clock further than ``CLOSES_TOGETHER``, so no
heartbeat bound can be what names a member: ``dead_after`` never passes.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import pytest
import torch.distributed as dist

from lightning_dynatrain.elastic.client import JobStore
from lightning_dynatrain.elastic.liveness import LIVENESS_KEY, LivenessLink, LivenessListener, read_port
from lightning_dynatrain.elastic.records import LeaveRequest, Signer
from lightning_dynatrain.elastic.server import CLOSES_TOGETHER, StoreServer
from tests.elastic.test_store import MOMENT, TOKEN, Job, _form_first_world, _join

_CHILD = """
import sys, time
from lightning_dynatrain.elastic.liveness import LivenessLink
from lightning_dynatrain.elastic.records import LeaveRequest, Signer
LivenessLink("127.0.0.1", int(sys.argv[1]), Signer(sys.argv[2]), sys.argv[3], lambda g: None)
print("connected", flush=True)
time.sleep(600)
"""


class LiveJob(Job):
    """``test_store.Job`` with the store's liveness listener."""

    def __init__(self, **options: float) -> None:
        self.listener = LivenessListener("127.0.0.1", Signer(TOKEN), clock=lambda: self.clock(),
                                         log=lambda line: self.logged.append(line))
        super().__init__(liveness=self.listener, **options)

    def member_process(self, member: JobStore, token: str = TOKEN) -> subprocess.Popen:
        """A process that holds ``member``'s liveness connection (and does nothing else)."""
        proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(self.listener.port), token, member.member_id],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "connected"
        return proc

    def link(self, member: JobStore, on_notice=lambda generation: None) -> LivenessLink:
        """``member``'s connection, held by this process."""
        return LivenessLink("127.0.0.1", self.listener.port, Signer(TOKEN), member.member_id, on_notice)

    def until_heard(self, what, *, polls: int = 100) -> None:
        """Poll the listener (each poll waits up to 0.1 s for the network) until ``what()``."""
        for _ in range(polls):
            if what():
                return
            self.listener.poll(timeout=0.1)
        raise AssertionError(f"the listener never got to: {what.__doc__ or what}")


@pytest.fixture
def job():
    live = LiveJob(dead_after=10.0)
    yield live
    live.listener.close()


def test_the_listeners_port_is_in_the_store_signed(job):
    blob = job.reader.store.get(LIVENESS_KEY)
    assert read_port(Signer(TOKEN), blob) == job.listener.port
    assert read_port(Signer("another token"), blob) is None


def test_members_killed_are_recorded_failed_in_one_record_a_moment_later_and_the_survivors_are_told(job):
    """Two members' processes SIGKILLed one after the other (a node's, one event): the store waits
    ``CLOSES_TOGETHER`` after the first close, not a heartbeat bound, and records both in one
    generation; the survivors hear of it over their connections."""
    a, b, c, d = _form_first_world(job, 4)
    told: list[int] = []
    heard = threading.Event()

    def notice(generation: int) -> None:
        told.append(generation)
        heard.set()

    links = [job.link(m, notice) for m in (a, d)]
    victims = [job.member_process(b), job.member_process(c)]
    job.until_heard(lambda: len(job.listener.connected) == 4)
    job.beat(a, b, c, d)
    job.step()
    assert job.generation() == 0
    victims[0].send_signal(signal.SIGKILL)
    victims[0].wait()
    job.until_heard(lambda: b.member_id in job.listener.closed)
    job.step()
    assert job.generation() == 0  # the other closes of the same event may still come
    victims[1].send_signal(signal.SIGKILL)
    victims[1].wait()
    job.until_heard(lambda: c.member_id in job.listener.closed)
    job.pass_time(CLOSES_TOGETHER, beating=(a, d))  # far below any heartbeat bound
    world = a.membership(1)
    assert (job.generation(), set(world.failed)) == (1, {b.member_id, c.member_id})
    assert world.members == (a.member_id, d.member_id)
    for member in (b, c):
        assert f"[dynatrain store] member {member.member_id} failed: its process ended (its liveness connection " \
               "closed)" in job.logged
    assert heard.wait(30), "no survivor was told"
    for link in links:
        link.close()
    assert set(told) == {1}


def test_a_member_that_says_bye_is_no_death_nor_its_silence_and_a_leaver_that_ends_is_none_either(job):
    a, b, c = _form_first_world(job, 3)
    links = {m.member_id: job.link(m) for m in (a, b, c)}
    job.until_heard(lambda: len(job.listener.connected) == 3)
    links[a.member_id].close()  # its fit ended
    job.until_heard(lambda: a.member_id not in job.listener.connected)
    job.step()
    assert job.generation() == 0 and not job.listener.closed and a.member_id in job.listener.ended
    # its heartbeats stopped with its fit: silent past dead_after, it is still no failure
    job.pass_time(job.server.dead_after + 1.0, beating=(b, c))
    assert job.generation() == 0 and not any(" failed: " in line for line in job.logged), job.logged
    # c leaves: once the store published its leave, its process ending (no bye) is no failure
    nonce = c.send(LeaveRequest(member=c.member_id, step=0))
    job.reader.publish_step(2)
    job.step()  # popped: it waits ``gather`` for others of the same notice
    job.pass_time(job.server.gather + MOMENT, beating=(a, b, c))
    assert c.verdict(nonce)["admitted"] and c.member_id not in a.membership(job.generation()).members
    links[c.member_id].close(bye=False)
    job.until_heard(lambda: c.member_id not in job.listener.connected)
    generation = job.generation()
    job.step()
    assert job.generation() == generation and not job.listener.closed
    links[b.member_id].close()


def test_a_hello_without_the_token_or_for_a_member_already_connected_registers_nothing(job):
    (a,) = _form_first_world(job, 1)
    forged = job.member_process(a, token="guessed")
    job.until_heard(lambda: "[dynatrain store] refused a liveness connection: its hello is not signed with the "
                    "job's token" in job.logged)
    assert a.member_id not in job.listener.connected
    forged.kill()
    forged.wait()
    own = job.link(a)
    job.until_heard(lambda: a.member_id in job.listener.connected)
    second = job.member_process(a)  # someone replays a's hello: refused, and its end says nothing of a
    job.until_heard(lambda: f"[dynatrain store] refused a liveness connection: member {a.member_id} has its "
                    "connection already" in job.logged)
    second.kill()
    second.wait()
    job.step()
    assert job.generation() == 0 and a.member_id in job.listener.connected and not job.listener.closed
    own.close()


def test_the_members_of_a_launch_its_launcher_ends_together_are_recorded_with_it(job):
    """Two members of one torchrun launch (it ends every worker once one ended) and one of another:
    one of the launch dies; its sibling is recorded failed with it (still connected: the launcher
    is ending it), the other launch's member survives."""
    a = job.connect()
    nonce = _join(a, launch_id="first", launch_size=1)
    job.step()
    assert a.verdict(nonce)["admitted"]
    job.reader.mark_installed(0)
    b, c = job.connect(), job.connect()
    nonces = [_join(m, launch_id="torchrun", launch_size=2, launch_rank=r, ends_with_launch=True)
              for r, m in enumerate((b, c))]
    job.step()
    job.pass_time(job.server.gather + MOMENT, beating=(a,))
    assert all(m.verdict(n)["admitted"] for m, n in zip((b, c), nonces))
    job.reader.mark_installed(1)
    links = [job.link(a), job.link(c)]
    victim = job.member_process(b)
    job.until_heard(lambda: len(job.listener.connected) == 3)
    job.step()
    victim.kill()
    victim.wait()
    job.until_heard(lambda: b.member_id in job.listener.closed)
    job.pass_time(CLOSES_TOGETHER, beating=(a, c))
    world = a.membership(job.generation())
    assert (set(world.failed), world.members) == ({b.member_id, c.member_id}, (a.member_id,))
    assert f"[dynatrain store] member {c.member_id} failed: a process of its launch ended, and its launcher stops " \
           "the whole launch then" in job.logged
    for link in links:
        link.close()


def test_without_a_listener_the_members_live_on_heartbeats_alone():
    """A store without a listener (``StoreServer`` built bare): ``start_alive`` opens no connection."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    StoreServer(master, TOKEN)
    member = JobStore(dist.TCPStore("127.0.0.1", master.port, is_master=False), Signer(TOKEN))
    member.start_alive(60.0)
    assert member.liveness_port == 0
    member.stop_alive()
