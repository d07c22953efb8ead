"""The 2-process job behind tests/checkpoint: real DCP files, real gloo, synthetic state (no megatron).

Every local tensor holds the bits of its global logical index (``tests/transition/state.py``), so a
state loaded at another layout is checked element by element against the state that layout would
hold. The job runs, in the same two processes:

1. ``reshard``: save at layout A, load at layout B into tensors full of ``PAD`` bits, for pairs that
   change tp (and with it the padded vocabulary: 192 rows at tp1, 256 at tp2), pp, dp, ep, etp and
   zero1, dense and MoE, in fp32 and bf16, with the synchronous writer;
2. ``async``: the background writer with a DCP writer gated by an event: ``save`` returns while the
   write is blocked, the live tensors then change without changing what is written, a second
   ``save`` waits for the first, ``close`` for the last; saving over an existing checkpoint (and
   over a link to one) replaces it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from lightning_dynatrain.megatron.gpt import GPTShape, logical_spec

#: tp1 pads the vocabulary to 192 rows, tp2 to 256 (a multiple of 64 * tp)
SHAPE = GPTShape(hidden=16, layers=2, heads=2, ffn_hidden=32, vocab_size=130, seq_length=8,
                 make_vocab_size_divisible_by=64)
MOE = GPTShape(hidden=16, layers=2, heads=2, ffn_hidden=32, vocab_size=130, seq_length=8,
               make_vocab_size_divisible_by=64, num_experts=4, moe_ffn_hidden=8, add_bias_linear=False)
SHAPES = {"dense": SHAPE, "moe": MOE}
PAIRS = [("dense", "dp1-tp2-pp1", "dp2-tp1-pp1-zero1", "fp32"), ("dense", "dp2-tp1-pp1-zero1", "dp1-tp2-pp1", "bf16"),
         ("dense", "dp1-tp1-pp2", "dp1-tp2-pp1-zero1", "fp32"), ("dense", "dp2-tp1-pp1", "dp1-tp1-pp2", "bf16"),
         ("moe", "dp2-tp1-pp1-ep2-zero1", "dp1-tp2-pp1-ep2-etp1", "fp32"),
         ("moe", "dp1-tp1-pp2", "dp2-tp1-pp1-ep2", "bf16")]
GATE_SECONDS = 1.0


def _padded(spec, layout) -> int:
    return spec.padded_vocab(layout.tp)


def _reshard(rank: int, tmp: Path) -> dict:
    from lightning_dynatrain.checkpoint import CheckpointWriter, load_logical, logical_state_dict
    from lightning_dynatrain.vps.layout import ParallelConfig
    from lightning_dynatrain.vps.spec import Precision
    from tests.transition.state import compare, local_state, padded_empty

    writer = CheckpointWriter()
    done = []
    for i, (shape, a, b, precision) in enumerate(PAIRS):
        spec = logical_spec(SHAPES[shape])
        src, dst, precision = ParallelConfig.parse(a), ParallelConfig.parse(b), Precision(precision)
        path = tmp / f"reshard{i}"
        store = local_state(spec, src, rank, precision)
        writer.save(logical_state_dict(store, spec, src, rank, precision=precision), path, rank=rank)
        grows = _padded(spec, dst) > _padded(spec, src)
        want = local_state(spec, dst, rank, precision, filled_from=_padded(spec, src) if grows else None)
        got = {k: padded_empty(k, t.numel(), t.dtype).view(t.shape) for k, t in want.items()}
        load_logical(got, spec, dst, rank, path, precision=precision)
        compare(got, want, f"{shape}: {a} -> {b} ({precision.value})")
        done.append((shape, a, b, precision.value))
    return {"pairs": done}


def _gated_writer(gate: threading.Event):
    import torch.distributed.checkpoint as dcp

    from lightning_dynatrain.checkpoint import CheckpointWriter

    class GatedFileSystemWriter(dcp.FileSystemWriter):
        def write_data(self, plan, planner):
            gate.wait()
            return super().write_data(plan, planner)

    class GatedWriter(CheckpointWriter):
        def storage_writer(self, directory):
            return GatedFileSystemWriter(directory, sync_files=True)

    return GatedWriter(async_save=True)


def _async(rank: int, tmp: Path) -> dict:
    import torch

    from lightning_dynatrain.checkpoint import load_logical, logical_state_dict
    from lightning_dynatrain.vps.layout import ParallelConfig
    from lightning_dynatrain.vps.spec import Precision
    from tests.transition.state import compare, local_state

    spec, layout, fp32 = logical_spec(SHAPE), ParallelConfig.parse("dp1-tp2-pp1"), Precision.FP32
    gate = threading.Event()
    writer = _gated_writer(gate)
    live = local_state(spec, layout, rank, fp32)
    saved = {k: t.clone() for k, t in live.items()}
    first, second = tmp / "async" / "first.ckpt", tmp / "async" / "second.ckpt"
    out: dict = {}
    writer.save(logical_state_dict(live, spec, layout, rank, copy_to_cpu=True), first, rank=rank)
    out["first_complete_after_save"] = (first / ".metadata").exists()
    out["pending"] = str(writer.pending_path)
    for t in live.values():  # training goes on: the checkpoint must hold the state at the save
        t.add_(1)
    threading.Timer(GATE_SECONDS, gate.set).start()
    t0 = time.perf_counter()
    writer.save(logical_state_dict(live, spec, layout, rank, copy_to_cpu=True), second, rank=rank)
    out["second_waited_s"] = time.perf_counter() - t0
    out["first_complete_when_second_starts"] = (first / ".metadata").exists()
    writer.close()
    out["second_complete_after_close"] = (second / ".metadata").exists()
    out["left_behind"] = sorted(p.name for p in (tmp / "async").iterdir())
    got = {k: torch.zeros_like(t) for k, t in live.items()}
    load_logical(got, spec, layout, rank, first)
    compare(got, saved, "the first background save")
    load_logical(got, spec, layout, rank, second)
    compare(got, live, "the second background save")
    return out


def _overwrite(rank: int, tmp: Path) -> dict:
    import os

    import torch.distributed as dist

    from lightning_dynatrain.checkpoint import CheckpointWriter, load_logical, logical_state_dict
    from lightning_dynatrain.vps.layout import ParallelConfig
    from lightning_dynatrain.vps.spec import Precision
    from tests.transition.state import compare, local_state

    spec, layout = logical_spec(SHAPE), ParallelConfig.parse("dp2-tp1-pp1-zero1")
    writer, path, target = CheckpointWriter(), tmp / "over" / "last.ckpt", tmp / "over" / "step=1.ckpt"
    state = local_state(spec, layout, rank, Precision.FP32)
    writer.save(logical_state_dict(state, spec, layout, rank), target, rank=rank)
    if rank == 0:  # ModelCheckpoint(save_last="link") makes last.ckpt a link to the newest checkpoint
        os.symlink(target.name, path)
    dist.barrier()
    for t in state.values():
        t.add_(1)
    writer.save(logical_state_dict(state, spec, layout, rank), path, rank=rank)  # over the link
    writer.save(logical_state_dict(state, spec, layout, rank), path, rank=rank)  # over a directory
    got = {k: t.clone().zero_() for k, t in state.items()}
    load_logical(got, spec, layout, rank, path)
    compare(got, state, "the overwritten checkpoint")
    return {"link_replaced": not path.is_symlink() and path.is_dir(), "target_kept": (target / ".metadata").exists(),
            "files": sorted(p.name for p in (tmp / "over").iterdir())}


def _job(rank: int, world: int, tmp: str) -> dict:
    tmp_path = Path(tmp)
    return {"reshard": _reshard(rank, tmp_path), "async": _async(rank, tmp_path),
            "overwrite": _overwrite(rank, tmp_path)}


def run_checkpoint2(tmp: str) -> list[dict]:
    from tests.dist import run_distributed

    return run_distributed(_job, 2, tmp, timeout_s=180, collective_timeout_s=90)
