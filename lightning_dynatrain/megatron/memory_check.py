"""Does a megatron hot switch fit in memory? Checked on every rank before anything is freed or moved.

A switch takes memory on top of the state it starts from: the new model's buffers (megatron's
gradient buffer; under zero1 a flat param buffer too; bf16 main params), whatever the engine's
order holds of new state before old state is given back, and the stage buffer
(``transition.memory_fold``). ``switch_need_bytes`` bounds that per rank from the compiled program alone. Ranks draw on shared
pools (on CPU every rank of a host shares its RAM; on an accelerator, each device is one pool: the
device's kind names the pool and reads its free bytes, ``devices.DeviceKind.pool_name`` and
``free_bytes``), so ``check_switch_memory`` gathers every rank's need and its pool's free bytes (one small
all-gather) and compares, pool by pool, the sum of the needs with what the pool has free. Every
rank reaches the same verdict from the same numbers: all go on, or all raise ``SwitchMemoryError``
with nothing moved, naming the pool, the figures and what to change.

``limit_bytes`` (the strategy's ``switch_memory_limit``) caps what one rank's switch may take, for
nodes shared with other jobs.

Example::

    need = switch_need_bytes(program, old_grad_bytes=sum(t.nbytes for t in state.gradient_buffers()))
    check_switch_memory(need, device=torch.device("cpu"), what=f"{src} -> {dst}")
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_dynatrain.devices import device_kind
from lightning_dynatrain.transition.comm import default_device
from lightning_dynatrain.transition.memory_fold import switch_peak_bytes
from lightning_dynatrain.transition.program import SwitchProgram
from lightning_dynatrain.transition.local_state import RegionIndex, local_numel
from lightning_dynatrain.vps.errors import DynaTrainError
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.mapping import DTYPE_SIZES, rank_regions
from lightning_dynatrain.vps.spec import ModelSpec, Precision, StateKind

#: megatron's gradient buffer is fp32 here (``grad_reduce_in_fp32=True`` in ``build_ddp_and_optimizer``).
GRAD_BYTES_PER_ELEMENT = 4


class SwitchMemoryError(DynaTrainError):
    """A switch would take more memory than a rank's pool has free (or than the limit allows); nothing moved."""


def local_numels(spec: ModelSpec, layout: ParallelConfig, rank: int,
                 precision: Precision = Precision.FP32) -> dict[StateKind, int]:
    """Elements of each state kind the rank stores at ``layout`` (padding rows included; none off the layout)."""
    out: dict[StateKind, int] = {kind: 0 for kind, _ in precision.kinds}
    if rank < layout.world_size:
        for key, region in RegionIndex(rank_regions(spec, layout, rank, precision)).local_tensors().items():
            out[key[1]] += local_numel(region)
    return out


def new_buffer_bytes(program: SwitchProgram) -> int:
    """What building the new layout's DDP model and optimizer allocates and writes at once (before
    the engine): the fp32 gradient buffers, under zero1 the flat param buffers (one per param
    dtype), in bf16 the optimizer's fp32 main params."""
    total = 0
    for key, numel, dtype in program.destinations:
        if key[1] is StateKind.PARAM:
            total += GRAD_BYTES_PER_ELEMENT * numel + (numel * DTYPE_SIZES[dtype] if program.dst.zero else 0)
        elif key[1] is StateKind.MAIN_PARAM:
            total += numel * DTYPE_SIZES[dtype]
    return total


def switch_need_bytes(program: SwitchProgram, *, old_grad_bytes: int, held_bytes: int = 0,
                      keep_old: bool = False) -> int:
    """Upper bound on the memory this rank's hot switch takes beyond its state at the source (pure).

    The old gradient buffers are freed first (``old_grad_bytes``), then the new model's buffers are
    built (``new_buffer_bytes``), then the engine runs: the peak of its program
    (``switch_peak_bytes``: the stage buffer included), with the source's zero1 params views into
    one buffer (nothing of it goes before the end) and the destination's zero1 param buffer and
    bf16 main params already built. A memory policy may hold ``held_bytes`` of old storage on top
    (``PlainMemory.held_bytes``). ``keep_old``: the old state, its gradient buffers included, is
    held whole until every rank confirmed its new state (``switch_safety="keep_old"``).
    """
    if program.rank >= program.dst.world_size:  # a rank leaving builds nothing
        return 0
    preallocated = [StateKind.MAIN_PARAM] + ([StateKind.PARAM] if program.dst.zero else [])
    engine = switch_peak_bytes(program, with_staging=True, preallocated_kinds=preallocated,
                               shared_source_kinds=[StateKind.PARAM] if program.src.zero else [], keep_old=keep_old)
    freed_first = 0 if keep_old else old_grad_bytes
    return max(0, new_buffer_bytes(program) - freed_first + engine + held_bytes)


def _pool_id(name: str) -> int:
    """A pool's name as the integer the all-gather carries."""
    return zlib.crc32(name.encode())


@dataclass(frozen=True, slots=True)
class MemoryReading:
    """One rank's side of the check: what its switch needs and what its pool has free (-1: unknown)."""

    rank: int
    pool: int
    need: int
    free: int


def gather_readings(need: int, device: torch.device, group: dist.ProcessGroup | None = None, *,
                    read_free: bool = True) -> list[MemoryReading]:
    """Every rank's reading (collective over ``group``: one all-gather of three integers per rank).
    ``read_free=False`` reports the free memory as unknown (only a limit is then checked)."""
    kind = device_kind(device)
    free = kind.free_bytes() if read_free else None
    mine = torch.tensor([need, _pool_id(kind.pool_name()), -1 if free is None else free], dtype=torch.int64,
                        device=default_device(group))
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return [MemoryReading(rank=r, pool=t[1].item(), need=t[0].item(), free=t[2].item()) for r, t in enumerate(out)]


def _gb(nbytes: int) -> str:
    if nbytes >= 10**9:
        return f"{nbytes / 1e9:.2f} GB"
    return f"{nbytes / 1e6:.1f} MB" if nbytes >= 10**6 else f"{nbytes} bytes"


def refusal(readings: Sequence[MemoryReading], *, what: str, limit_bytes: int | None = None,
            pool_names: dict[int, str] | None = None) -> SwitchMemoryError | None:
    """The error every rank raises for these readings, or ``None`` when the switch fits (pure).

    A pool fits when the sum of its ranks' needs is at most the smallest free figure its ranks read.
    A pool whose free memory nobody could read is not checked.
    """
    names = pool_names or {}
    hint = ("choose a target that shards more (zero1, tp or pp), lower staging_budget, or free memory "
            "where it is short")
    if limit_bytes is not None:
        over = [r for r in readings if r.need > limit_bytes]
        if over:
            worst = max(over, key=lambda r: r.need)
            return SwitchMemoryError(
                f"the switch {what} needs up to {_gb(worst.need)} beyond the state on rank {worst.rank} "
                f"({len(over)} rank(s) over), more than switch_memory_limit {_gb(limit_bytes)}; nothing was moved",
                hint=f"raise switch_memory_limit, or {hint}")
    pools: dict[int, list[MemoryReading]] = {}
    for r in readings:
        pools.setdefault(r.pool, []).append(r)
    for pool, members in sorted(pools.items()):
        known = [r.free for r in members if r.free >= 0]
        if not known:
            continue
        need, free = sum(r.need for r in members), min(known)
        if need > free:
            ranks = ", ".join(str(r.rank) for r in members)
            return SwitchMemoryError(
                f"the switch {what} needs up to {_gb(need)} more memory on {names.get(pool, f'pool {pool:#x}')} "
                f"(ranks {ranks}: {', '.join(_gb(r.need) for r in members)}) but {_gb(free)} is free there; "
                "nothing was moved", hint=hint)
    return None


def check_switch_memory(need: int, *, device: torch.device, what: str, limit_bytes: int | None = None,
                        group: dist.ProcessGroup | None = None, read_free: bool = True) -> list[MemoryReading]:
    """Gather every rank's need and free memory, and raise ``SwitchMemoryError`` on every rank if
    the switch does not fit (collective). Returns the readings when it fits."""
    readings = gather_readings(need, device, group, read_free=read_free)
    name = device_kind(device).pool_name()
    error = refusal(readings, what=what, limit_bytes=limit_bytes, pool_names={_pool_id(name): name})
    if error is not None:
        raise error
    return readings


__all__ = [
    "GRAD_BYTES_PER_ELEMENT",
    "MemoryReading",
    "SwitchMemoryError",
    "check_switch_memory",
    "gather_readings",
    "local_numels",
    "new_buffer_bytes",
    "refusal",
    "switch_need_bytes",
]
