"""Pictures from the pure planner: the rank-pair matrix adds up to the dry run's figures, and both
pictures are drawn (files checked as PNGs; the pictures themselves were looked at by eye)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from lightning_dynatrain.viz.loss_plot import plot_loss
from lightning_dynatrain.viz.transfer_matrix import transfer_matrix
from lightning_dynatrain.viz.transfer_plot import plot_transfer_matrix
from lightning_dynatrain.vps.dryrun import dry_run
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.presets import preset
from lightning_dynatrain.vps.spec import Precision
from lightning_dynatrain.vps.topology import Topology

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("src", "dst", "gpus_per_node"), [
    ("dp4-tp1-pp1", "dp2-tp2-pp1", 4),           # nothing moves: the diagonal holds it all
    ("dp2-tp2-pp4", "dp4-tp4-pp1", 4),           # across nodes
    ("dp2-tp2-pp1-zero1", "dp1-tp2-pp2", 2),
    ("dp2-tp1-pp1", "dp4-tp1-pp1", 8),           # the world grows: ranks 2 and 3 only receive
])
def test_matrix_adds_up_to_the_dry_run(src: str, dst: str, gpus_per_node: int) -> None:
    spec = preset("llama2-7b")
    a, b = ParallelConfig.parse(src), ParallelConfig.parse(dst)
    m = transfer_matrix(spec, a, b, precision=Precision.BF16, gpus_per_node=gpus_per_node)
    topology = Topology.uniform(max(a.world_size, b.world_size), gpus_per_node)
    report, _ = dry_run(spec, a, b, precision=Precision.BF16, topology=topology)
    assert m.moved_bytes == report.moved_bytes
    assert m.kept_bytes == report.retained_bytes
    assert (m.intra_node_bytes, m.inter_node_bytes) == (report.intra_node_bytes, report.inter_node_bytes)
    assert (m.bytes >= 0).all() and m.world == max(a.world_size, b.world_size)
    # every destination rank ends up with its whole new state: received + kept = its column
    assert int(m.bytes.sum()) == report.moved_bytes + report.retained_bytes


def test_rows_are_what_a_rank_held_and_columns_what_it_gets() -> None:
    """tp4 -> dp4: each rank keeps its quarter and receives the other three quarters, one from each peer."""
    spec = preset("llama2-7b")
    m = transfer_matrix(spec, ParallelConfig.parse("dp1-tp4-pp1"), ParallelConfig.parse("dp4-tp1-pp1"),
                        gpus_per_node=8)
    off = m.bytes[~np.eye(4, dtype=bool)]
    assert (off > 0).all() and np.allclose(off, off.mean(), rtol=0.05)
    assert m.moved_bytes == pytest.approx(3 * m.kept_bytes, rel=0.05)


def test_pictures_are_written(tmp_path) -> None:
    spec = preset("llama2-7b")
    m = transfer_matrix(spec, ParallelConfig.parse("dp2-tp2-pp4"), ParallelConfig.parse("dp4-tp4-pp1"),
                        gpus_per_node=4)
    heat = plot_transfer_matrix(m, tmp_path / "sub" / "t.png")
    switch = SimpleNamespace(step=3, src="dp4", dst="dp2-tp2", seconds=0.12)
    loss = plot_loss(tmp_path / "loss.png", [(1, 5.3, "dp4"), (2, 5.0, "dp4"), (3, 4.8, "dp2-tp2")], [switch])
    for path in (heat, loss):
        assert path.read_bytes()[:8] == PNG and path.stat().st_size > 10_000
