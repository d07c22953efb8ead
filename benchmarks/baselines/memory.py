"""What fits: the resident bytes of a training state per layout, the machine's free memory, peak RSS.

There is no swap here; a method that does not fit gets its processes killed. So before each method
the job asks ``fits(extra)``: the bytes that method adds on top of what is resident now (estimated
from the layout, below) plus a margin, against ``MemAvailable``. Peak RSS per method is measured
with ``VmHWM`` after resetting it (``/proc/self/clear_refs``).

State bytes of one rank (fp32): params + megatron's fp32 grad buffer (same size) + Adam's two
moments (the rank's zero1 shard under the distributed optimizer), counted from the VPS regions, so
no model needs to be built to know it.
"""

from __future__ import annotations

from lightning_dynatrain.transition.compiler import switch_program
from lightning_dynatrain.devices.host.meminfo import host_available_bytes, proc_field_bytes
from lightning_dynatrain.megatron.memory_check import GRAD_BYTES_PER_ELEMENT, local_numels, switch_need_bytes
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.spec import ModelSpec, Precision, StateKind
from lightning_dynatrain.vps.topology import Topology

GiB = 2**30


def state_bytes(spec: ModelSpec, layout: ParallelConfig, rank: int, precision: Precision = Precision.FP32) -> int:
    """Resident bytes of the rank's training state: params, grads, moments (fp32)."""
    n = local_numels(spec, layout, rank, precision)
    return 4 * (2 * n[StateKind.PARAM] + n[StateKind.EXP_AVG] + n[StateKind.EXP_AVG_SQ])


def world_state_bytes(spec: ModelSpec, layout: ParallelConfig) -> int:
    return sum(state_bytes(spec, layout, r) for r in range(layout.world_size))


def hot_switch_extra_bytes(spec: ModelSpec, src: ParallelConfig, dst: ParallelConfig, staging_bytes: int,
                           topology: Topology, recycle: bool = True) -> int:
    """Memory a megatron hot switch needs beyond the state at ``src`` (fp32, world total, upper bound):
    every rank's ``switch_need_bytes`` (what the switch itself checks), added as if all came at once.
    ``recycle``: the recycling policy may hold up to ``staging_bytes`` of old storage."""
    total = 0
    for rank in range(max(src.world_size, dst.world_size)):
        program = switch_program(spec, src, dst, rank, Precision.FP32, staging_budget=staging_bytes, topology=topology)
        grads = GRAD_BYTES_PER_ELEMENT * local_numels(spec, src, rank)[StateKind.PARAM]
        total += switch_need_bytes(program, old_grad_bytes=grads, held_bytes=staging_bytes if recycle else 0)
    return total


def unsharded_optimizer_bytes(spec: ModelSpec, layout: ParallelConfig, *, dp_rank0_only: bool = False) -> int:
    """Megatron's ``fully_reshardable`` format materialises param + both moments of every local
    (TP/PP) parameter, unsharded: on every rank when loading, on DP rank 0 only when saving with its
    memory-efficient variant. This is that, summed over the ranks that do it."""
    ranks = [r for r in range(layout.world_size) if not dp_rank0_only or layout.dense_coord(r).dp == 0]
    return sum(3 * 4 * local_numels(spec, layout, r)[StateKind.PARAM] for r in ranks)


def trim_heap() -> None:
    """Return free heap memory to the OS (glibc ``malloc_trim``).

    Tensors below glibc's (dynamic, up to 32 MiB) mmap threshold live in malloc heaps, whose freed
    pages stay with the process: after a 17 GB state is dropped the process can keep gigabytes it no
    longer uses, and the next method then "does not fit". The benchmark trims between methods,
    outside every timed window, so each method starts from the same clean state.
    """
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def mem_available() -> int:
    found = host_available_bytes()
    if found is None:
        raise RuntimeError("no MemAvailable in /proc/meminfo")
    return found


def reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # not Linux, or not allowed: the peak then counts from process start
        pass


def peak_rss() -> int:
    return proc_field_bytes("/proc/self/status", "VmHWM") or 0


def rss() -> int:
    return proc_field_bytes("/proc/self/status", "VmRSS") or 0


def machine_page_allocations() -> int:
    """Bytes of pages the kernel has handed out on this machine since boot (``pgalloc_*`` in
    ``/proc/vmstat``), or 0 where that is not readable. Fresh pages cost a fault and a kernel zero
    each, several times what writing memory already touched costs (``benchmarks/fresh_memory.py``).
    Read around a method on one rank, the difference is the fresh memory all ranks took (the page
    fault count cannot say it: one fault maps a 2 MiB page under transparent huge pages)."""
    import resource

    try:
        with open("/proc/vmstat") as f:
            pages = sum(int(line.split()[1]) for line in f if line.startswith("pgalloc_"))
    except (OSError, ValueError, IndexError):
        return 0
    return pages * resource.getpagesize()


def fmt_gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB"


__all__ = [
    "machine_page_allocations",
    "mem_available",
    "trim_heap",
    "peak_rss",
    "reset_peak_rss",
    "rss",
    "state_bytes",
    "hot_switch_extra_bytes",
    "unsharded_optimizer_bytes",
    "world_state_bytes",
]
