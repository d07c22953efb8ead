"""SwitchReport: frozen, one line, figures from the recorder."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_dynatrain.transition.report import PHASES, SwitchRecorder
from lightning_dynatrain.vps.topology import Topology


def test_report_is_frozen_and_prints_on_one_line():
    rec = SwitchRecorder(rank=3, topology=Topology.uniform(8, 2))
    with rec.phase("pack"):
        pass
    rec.delivered(2, 100)  # same node (ranks 2, 3)
    rec.delivered(0, 50)
    rec.received(1, 70)
    rec.primitive("p2p", 2, 220)
    rec.staging_alloc(300)
    rec.staging_free(300)
    report = rec.report(src="dp2", dst="tp2", budget=1024)
    assert report.sent_intra_node_bytes == 100 and report.sent_inter_node_bytes == 50
    assert report.recv_inter_node_bytes == 70 and report.sent_bytes == 150 and report.recv_bytes == 70
    assert report.peak_staging_bytes == 300 and report.p2p.ops == 2
    assert set(report.seconds) == set(PHASES)
    line = str(report)
    assert "\n" not in line and line.startswith("rank 3 dp2->tp2:") and "peak 300 B/1.0 KiB" in line
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.rank = 0  # type: ignore[misc]
    hash(report)
