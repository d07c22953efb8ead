"""``ElasticOptions`` (one type for every front end's elastic options) and ``LeaveNotice`` (a leave
signal marks the process): checked in-process, with real signals."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from lightning_dynatrain.callbacks.node_change import OnNodeChange
from lightning_dynatrain.elastic.driver.leave_notice import LEAVE_SIGNALS, LeaveNotice
from lightning_dynatrain.elastic.driver.options import ElasticOptions
from lightning_dynatrain.fabric.strategy import DynaTrainFabricStrategy
from lightning_dynatrain.vps.errors import LayoutError


@pytest.mark.parametrize(("bad", "match"), [(dict(snapshot_every=0), "snapshot_every=0"),
                                            (dict(snapshot_every=True), "snapshot_every=True"),
                                            (dict(snapshot_buffers=3), "snapshot_buffers=3"),
                                            (dict(keep_worlds=-1), "keep_worlds=-1")])
def test_bad_options_are_refused_at_construction_under_every_front_end(bad: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ElasticOptions({2: "dp2-tp1-pp1"}, **bad)
    with pytest.raises(ValueError, match=match):
        OnNodeChange({2: "dp2-tp1-pp1"}, **bad)


def test_a_policy_that_cannot_be_read_is_refused_before_any_change() -> None:
    with pytest.raises(LayoutError):
        ElasticOptions({2: "dp2-tp1-ppx"})


def test_the_trainer_and_fabric_hold_the_same_options_type(tmp_path: Path) -> None:
    options = ElasticOptions({2: "dp2-tp1-pp1", 4: "dp2-tp2-pp1"}, snapshot_every=3, ahead=False)
    assert OnNodeChange({2: "dp2-tp1-pp1", 4: "dp2-tp2-pp1"}, snapshot_every=3, ahead=False).options == options
    assert DynaTrainFabricStrategy(layout="dp2-tp1-pp1", elastic=options).elastic is options
    policy = tmp_path / "policy.yaml"
    policy.write_text("{2: dp2-tp1-pp1}\n")
    assert ElasticOptions(str(policy)).policy == policy  # a YAML file of the map, read at each change
    assert ElasticOptions("auto").policy == "auto"


def test_a_leave_signal_marks_the_process_once_and_restore_puts_the_old_handler_back() -> None:
    seen: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: seen.append(signum)) for sig in LEAVE_SIGNALS}
    try:
        notice = LeaveNotice()
        notice.listen()
        assert not notice.take()
        os.kill(os.getpid(), signal.SIGTERM)  # delivered before kill returns (to this thread, the main one)
        assert notice.take() and not notice.take() and seen == []
        notice.restore()
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == [signal.SIGTERM] and not notice.take()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
