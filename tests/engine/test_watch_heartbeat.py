"""``SwitchWatch``'s heartbeat stamps the store while a switch runs and is silent between switches
(a real gloo world of 2 processes and its TCP store)."""

from __future__ import annotations

import time
from datetime import timedelta

from tests.dist import run_distributed


def _beats(rank: int, world_size: int) -> dict:
    from lightning_dynatrain.engine.deadline import SwitchDeadline
    from lightning_dynatrain.engine.watch import SwitchWatch

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
