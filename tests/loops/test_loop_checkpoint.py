"""The engine's checkpoint folder: how every rank agrees on what it holds before anything is read
(pure decisions over what each rank saw, so no rank is left alone in a collective)."""

from __future__ import annotations

from pathlib import Path

from lightning_dynatrain.loop.checkpoint import CheckpointError, agreed_kind, agreed_meta
from lightning_dynatrain.runtime.layout_checks import WorldSizeError
from tests.errors import refused


def test_every_rank_must_see_the_same_kind_of_checkpoint() -> None:
    where = Path("ckpt/dynatrain")
    assert agreed_kind(["logical"] * 4, where=where) == "logical"
    assert agreed_kind(["per_rank"] * 2, where=where) == "per_rank"
    refused(CheckpointError, "ckpt/dynatrain holds no DynaTrainEngine checkpoint on ranks [1, 3]", "shared file system",
            call=lambda: agreed_kind(["logical", "none", "logical", "none"], where=where))
    refused(CheckpointError, "on ranks [0, 1]", "fabric.save", call=lambda: agreed_kind(["none", "none"], where=where))
    refused(CheckpointError, "each rank saw ['logical', 'per_rank']",
            call=lambda: agreed_kind(["logical", "per_rank"], where=where))


def test_a_per_rank_checkpoint_of_an_earlier_version_loads_only_when_every_rank_read_the_same_layout_json() -> None:
    where = Path("ckpt/dynatrain/layout.json")
    meta = {"layout": "dp1-tp2-pp2", "world_size": 4, "step": 3}
    assert agreed_meta([meta] * 4, where=where, world_size=4) == meta
    refused(WorldSizeError, "written on 4 processes at layout dp1-tp2-pp2, this run has 2", "--num_processes 4",
            call=lambda: agreed_meta([meta] * 2, where=where, world_size=2))
    refused(CheckpointError, "cannot read ckpt/dynatrain/layout.json on ranks [1]", "FileNotFoundError",
            call=lambda: agreed_meta([meta, "FileNotFoundError: no such file"], where=where, world_size=2))
    refused(CheckpointError, "the ranks read different", "shared file system",
            call=lambda: agreed_meta([meta, {**meta, "step": 4}], where=where, world_size=2))
