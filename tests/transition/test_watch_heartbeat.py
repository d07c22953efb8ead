"""``SwitchWatch``'s heartbeat stamps the store while a switch runs and is silent between switches
(a real gloo world of 2 processes and its TCP store)."""

from __future__ import annotations

import time
from datetime import timedelta

from tests.dist import run_distributed


def _beats(rank: int, world_size: int) -> dict:
    from lightning_dynatrain.transition.deadline import SwitchDeadline
    from lightning_dynatrain.transition.watch import SwitchWatch

    watch = SwitchWatch.start(training_timeout=timedelta(minutes=5), timeout=SwitchDeadline.fixed(30.0))

    def count_after(seconds: float) -> int:
        first = watch.read_beat(rank).count
        time.sleep(seconds)
        return watch.read_beat(rank).count - first

    idle_before = count_after(1.0)
    attempt = watch.begin(None, None, "a test switch")  # a fixed deadline: no program needed
    attempt.phase("transfer")
    during = count_after(1.0)
    phase_during = watch.read_beat(rank).phase
    watch.end()
    idle_after = count_after(1.0)
    phase_after = watch.read_beat(rank).phase
    watch.close()
    return dict(idle_before=idle_before, during=during, idle_after=idle_after, interval=watch.interval,
                phases=(phase_during, phase_after))


def test_heartbeat_runs_only_while_a_switch_runs() -> None:
    for result in run_distributed(_beats, 2, timeout_s=60):
        assert result["idle_before"] == 0 and result["idle_after"] == 0, result
        assert result["during"] >= 0.5 / result["interval"], result  # 0.25 s interval: about 4 beats a second
        assert result["phases"] == ("transfer", "idle")


def _a_rank_holding_no_state_goes_missing(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from lightning_dynatrain.transition.deadline import SwitchDeadline
    from lightning_dynatrain.transition.errors import was_refused
    from lightning_dynatrain.transition.watch import SwitchWatch

    watch = SwitchWatch.start(training_timeout=timedelta(minutes=5), timeout=SwitchDeadline.fixed(30.0))
    attempt = watch.begin(None, None, "a test grow", holders=frozenset({0, 1}))  # rank 2 joins: it holds nothing
    attempt.phase("transfer")
    if rank == 2:  # its heartbeat stops, as a joiner's that died
        watch.close()
        dist.barrier()
        return {}
    error = attempt.failure(RuntimeError("a peer's connection closed"), lost_state=False)
    watch.end()
    watch.close()
    dist.barrier()
    return dict(rank=error.rank, phase=error.phase, lost_state=error.lost_state, refused=was_refused(error),
                message=str(error))


def test_a_missing_rank_that_holds_no_old_state_loses_none() -> None:
    """A grow's joiner that goes missing: the old state is whole on the others (``holders``), so the
    failure counts as refused and the grow can go back to the old world."""
    for result in run_distributed(_a_rank_holding_no_state_goes_missing, 3, timeout_s=90)[:2]:
        assert (result["rank"], result["phase"]) == (2, "transfer"), result
        assert not result["lost_state"] and result["refused"], result
        assert "state is whole on every rank" in result["message"], result["message"]
