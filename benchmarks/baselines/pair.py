"""One layout pair, every method, in one spawned job (+ one more job for the restart's second half).

``pair_job`` runs on every rank of a 4-process gloo world. It builds the trained state at layout A
and fingerprints it, makes megatron's process groups of B as well (every in-process method finds
both layouts' groups made; a restart's fresh processes make their own), measures the link and copy
speeds, then runs each method A -> B:

- ``hot_switch``: ``megatron.hot_switch.hot_switch`` (+ dropping the old state);
- ``hot_switch_ahead``: the same with the target's program and megatron objects built ahead
  (``megatron.ahead.prepare_switch``, untimed: its background build is reported apart), so the
  timed switch only binds memory and transfers;
- ``allgather``: build B empty, ``allgather_switch``, drop A;
- ``dcp``: DCP save of A's logical boxes, drop A, build B empty, resharding load;
- ``megatron``: megatron ``dist_checkpointing`` save, drop A, build B empty, load;
- ``restart`` (first half, last): DCP save, then the job returns and its processes exit;
  ``restart_job`` in fresh processes then initialises, builds B and loads.

Before each method, untimed, the ranks write and free as much memory as the state grows by
(``warm_memory``), so that no method pays for memory the machine's host took back while another
finds memory just freed. After each method the state at B is fingerprinted against A's, then
brought back to A (a hot switch back when it fits in memory, else a deterministic rebuild of A)
for the next method. A method whose extra memory does not fit (``devices/memory_policy.py``) or that megatron
cannot run is skipped with the reason. Times are the slowest rank's, between barriers.
"""

from __future__ import annotations

import gc
import os
import shutil
import time
import traceback
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from benchmarks.baselines import dcp, megatron_ckpt
from benchmarks.baselines.allgather import CHUNK_ELEMENTS, allgather_switch
from lightning_dynatrain.transition.fingerprint import Fingerprint, diff, logical_fingerprint
from benchmarks.baselines.floor import measure_speeds, switch_floor
from benchmarks.baselines.memory import (
    GiB,
    fmt_gb,
    hot_switch_extra_bytes,
    machine_page_allocations,
    mem_available,
    peak_rss,
    reset_peak_rss,
    rss,
    trim_heap,
    unsharded_optimizer_bytes,
    world_state_bytes,
)
from benchmarks.baselines.state import BenchSetup, build_empty_state, build_trained_state, step_of, store_of
from lightning_dynatrain.megatron.ahead import PreparedSwitch, prepare_switch
from lightning_dynatrain.megatron.hot_switch import hot_switch
from lightning_dynatrain.megatron.parallel_state_adapter import ProcessGroupCache, destroy, initialize_for_layout
from lightning_dynatrain.megatron.state import MegatronState
from lightning_dynatrain.megatron.state_bridge import set_adam_step
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.planner import union_world
from lightning_dynatrain.vps.topology import Topology

METHODS = ("hot_switch", "hot_switch_ahead", "allgather", "dcp", "megatron", "restart")
#: the phases of a rebuild, as the hot switch names them (``HotSwitchResult.phases``); the checkpoint
#: baselines' rebuilds (``state.build_empty_state``) time the same ones
STEPS = ("plan", "memory_check", "groups", "model", "ddp_optimizer", "bind", "optimizer_state", "engine")
WARM_EXTRA_BYTES = 256 * 2**20
"""Memory each rank writes and frees before each method on top of its share of the state's growth
(``PairBench.warm_memory``): staging buffers, checkpoint reads, temporaries."""


@dataclass(frozen=True, kw_only=True)
class PairConfig:
    setup: BenchSetup
    src: str
    dst: str
    methods: tuple[str, ...] = METHODS
    workdir: str = "/tmp"
    """Checkpoints go to fresh directories under it (removed after use)."""
    margin_bytes: int = int(1.5 * GiB)
    """Memory kept free on top of a method's estimated need."""
    gpus_per_node: int = 4
    probe_bytes: int = 64 * 2**20
    """Message size of the p2p bandwidth probe (the copy probe moves four times as much)."""


def megatron_skip_reason(src: ParallelConfig, dst: ParallelConfig) -> str | None:
    """Switches megatron-core 0.16.1's dist_checkpointing cannot load (found on this machine)."""
    if src.zero == 0 and dst.zero == 1:
        return ("megatron-core 0.16.1 cannot load a non-distributed-optimizer checkpoint into a distributed "
                "optimizer (KeyError: optimizer.state.param.* not in the checkpoint)")
    if src.zero == 1 and dst.zero == 0:
        return ("megatron-core 0.16.1 cannot load a distributed-optimizer checkpoint into a non-distributed "
                "optimizer (KeyError: 'pre_wd_mult' in FP32Optimizer._filter_and_reorder_param_groups)")
    return None


def _max(*values: float) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _sum(*values: float) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def _agree(value):
    """Rank 0's value on every rank (decisions every rank must take alike)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class PairBench:
    """The mutable state of one pair's job on one rank. ``self.state`` is at A between methods."""

    def __init__(self, cfg: PairConfig, rank: int) -> None:
        self.cfg = cfg
        self.setup = cfg.setup
        self.spec = cfg.setup.spec
        self.rank = rank
        self.src = ParallelConfig.parse(cfg.src)
        self.dst = ParallelConfig.parse(cfg.dst)
        self.state: MegatronState | None = None
        self.fp_src: Fingerprint = {}
        self.step = 0
        self.out: dict = {"methods": {}, "skipped": {}, "errors": {}, "checks": {}, "restores": []}
        # megatron's groups of both layouts, kept for the whole job: every in-process method
        # (the hot switch and the checkpoint baselines' rebuilds) finds them made, none tears them down
        self.groups = ProcessGroupCache()
        self.topology = Topology.uniform(union_world(self.src, self.dst), cfg.gpus_per_node)
        self.switch_setup = cfg.setup.switch_setup(self.topology)

    # ------------------------------------------------------------------ helpers
    def fits(self, extra: int, what: str) -> str | None:
        """``None`` when ``extra`` bytes (world total) fit now, else why not; the same on every rank."""
        reason = None
        if self.rank == 0:
            free = mem_available()
            if extra + self.cfg.margin_bytes > free:
                reason = (f"needs {fmt_gb(extra)} more for {what} (+{fmt_gb(self.cfg.margin_bytes)} margin), "
                          f"{fmt_gb(free)} available")
        return _agree(reason)

    def timed_barrier(self) -> float:
        dist.barrier()
        return time.perf_counter()

    def fingerprint(self) -> Fingerprint:
        return logical_fingerprint(store_of(self.state, self.spec, self.rank), self.spec, self.state.layout, self.rank)

    def check(self, name: str) -> None:
        fp = self.fingerprint()
        self.out["checks"][name] = {"passed": fp == self.fp_src, "diff": diff(self.fp_src, fp)}

    def drop_state(self) -> float:
        """Forget the current state and collect it; returns the seconds it took."""
        start = time.perf_counter()
        self.state = None
        gc.collect()
        return time.perf_counter() - start

    def fresh_dir(self, name: str) -> str:
        path = os.path.join(self.cfg.workdir, name)
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            os.makedirs(path)
        dist.barrier()
        return path

    def remove_dir(self, path: str) -> None:
        dist.barrier()
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)

    def switch(self, target: ParallelConfig, prepared: PreparedSwitch | None = None):
        return hot_switch(self.state, target, self.switch_setup, groups=self.groups, prepared=prepared)

    # ---------------------------------------------------------------- set up
    def start(self) -> None:
        self.out["base_rss"] = rss()
        speeds = measure_speeds(nbytes=self.cfg.probe_bytes, copy_bytes=4 * self.cfg.probe_bytes)
        self.out["speeds"] = {k: getattr(speeds, k) for k in speeds.__slots__}
        self.speeds = speeds
        if "megatron" in self.cfg.methods and megatron_skip_reason(self.src, self.dst) is None:
            megatron_ckpt.warm_up()
        t0 = self.timed_barrier()
        self.state = build_trained_state(self.setup, self.src, self.rank, self.groups)
        self.out["build_trained_seconds"] = _max(time.perf_counter() - t0)[0]
        # B's groups too, before any method: otherwise the first method to reach B (the hot switch)
        # would pay for creating them and every later one would find them in the cache
        t0 = self.timed_barrier()
        initialize_for_layout(self.dst, seed=self.setup.seed, groups=self.groups)
        initialize_for_layout(self.src, seed=self.setup.seed, groups=self.groups)
        self.out["dst_groups_seconds"] = _max(time.perf_counter() - t0)[0]
        self.out["groups_made"] = {"start": len(self.groups)}
        trim_heap()  # the training step's temporaries: about 1 GB per rank at 270M, dp4
        self.step = step_of(self.state)
        self.fp_src = self.fingerprint()
        self.out["fingerprint_elements"] = sum(n for _, n in self.fp_src.values())

    def floor(self) -> None:
        floor = switch_floor(self.spec, self.src, self.dst, self.rank, self.speeds, topology=self.topology)
        self.out["floor"] = floor.as_dict()

    def back_to_src(self, after: str) -> None:
        """Bring the state back to A: hot switch back when it fits, else rebuild A (deterministic)."""
        how = "hot_switch_back"
        back = hot_switch_extra_bytes(self.spec, self.dst, self.src, self.setup.staging_budget, self.topology,
                                      recycle=self.setup.recycle)
        if self.fits(back, "the switch back") is None:
            t0 = self.timed_barrier()
            result = self.switch(self.src)
            self.state = result.state
            del result
            gc.collect()
            seconds = _max(time.perf_counter() - t0)[0]
        else:
            how = "rebuild"
            self.drop_state()
            trim_heap()
            t0 = self.timed_barrier()
            self.state = build_trained_state(self.setup, self.src, self.rank, self.groups)
            seconds = _max(time.perf_counter() - t0)[0]
            trim_heap()
        passed = self.fingerprint() == self.fp_src
        self.out["restores"].append({"after": after, "how": how, "seconds": seconds, "passed": passed})
        if not passed:
            raise AssertionError(f"the state at {self.src} after {after} and {how} is not the original one")

    # ---------------------------------------------------------------- methods
    def hot_switch_ahead(self) -> dict:
        """The hot switch with its objects built ahead; the build (untimed in ``seconds``) as
        ``ahead_seconds`` (prepare call to built, slowest rank) and ``ahead_build_seconds`` (the
        background thread's share)."""
        t0 = self.timed_barrier()
        prepared = prepare_switch(self.state, self.dst, self.switch_setup, groups=self.groups).result()
        ahead, build = _max(time.perf_counter() - t0, prepared.build_seconds)
        return dict(self.hot_switch(prepared), ahead_seconds=ahead, ahead_build_seconds=build)

    def hot_switch(self, prepared: PreparedSwitch | None = None) -> dict:
        t0 = self.timed_barrier()
        result = self.switch(self.dst, prepared)
        t1 = time.perf_counter()
        self.state = result.state  # the old state had no other reference: it goes now
        report, rebuild, inner, freed = result.report, result.rebuild_seconds, result.seconds, result.memory.freed_bytes
        need, recycled, steps = result.need_bytes, result.memory.recycled_bytes, dict(result.phases)
        del result
        gc.collect()
        t2 = time.perf_counter()
        t3 = self.timed_barrier()
        prep = inner - rebuild - report.total_seconds  # plan, Adam step, old store: before the rebuild
        total, switch_s, release, engine, rebuild_max, prep_max, peak = _max(
            t3 - t0, t1 - t0, t2 - t1, report.total_seconds, rebuild, prep, report.peak_staging_bytes)
        phases = _max(*report.seconds.values())
        recv, retained, in_place, direct, freed, need, recycled = _sum(
            report.recv_bytes, report.retained_bytes, report.in_place.bytes, report.p2p_direct.bytes, freed,
            need or 0, recycled)
        return dict(seconds=total, switch_seconds=switch_s, release_seconds=release, engine_seconds=engine,
                    rebuild_seconds=rebuild_max, plan_seconds=prep_max, steps=self.slowest_steps(steps),
                    phases=dict(zip(report.seconds, phases)), recv_bytes=int(recv), retained_bytes=int(retained),
                    in_place_bytes=int(in_place), p2p_direct_bytes=int(direct), old_freed_bytes=int(freed),
                    peak_staging_bytes=int(peak), need_bytes=int(need), recycled_bytes=int(recycled))

    def slowest_steps(self, steps: dict[str, float]) -> dict[str, float]:
        """Seconds per step (``STEPS``), slowest rank; collective."""
        return dict(zip(STEPS, _max(*(steps.get(n, 0.0) for n in STEPS))))

    def build_empty(self) -> tuple[MegatronState, dict[str, float]]:
        """The checkpoint baselines' rebuild, with the same step timings as the hot switch's."""
        return build_empty_state(self.setup, self.dst, self.step, self.groups)

    def allgather(self) -> dict:
        t0 = self.timed_barrier()
        source = store_of(self.state, self.spec, self.rank)
        new, steps = self.build_empty()
        t1 = time.perf_counter()
        stats = allgather_switch(source, store_of(new, self.spec, self.rank), self.spec, self.src, self.dst, self.rank)
        del source
        self.state = new
        del new
        gc.collect()
        t2 = self.timed_barrier()
        total, rebuild, gather, in_collectives = _max(t2 - t0, t1 - t0, stats.seconds, stats.gather_seconds)
        (recv,) = _sum(stats.recv_bytes)
        return dict(seconds=total, rebuild_seconds=rebuild, gather_seconds=gather, steps=self.slowest_steps(steps),
                    collective_seconds=in_collectives, collectives=stats.collectives, recv_bytes=int(recv))

    def through_checkpoint(self, name: str, save, load) -> tuple[dict, object]:
        """Save A with ``save(path)``, drop it, build B empty, ``load(path)`` into it; timed between
        barriers. Returns the record and what ``load`` returned."""
        path = self.fresh_dir(name)
        t0 = self.timed_barrier()
        saved = save(path)
        t1 = time.perf_counter()
        self.drop_state()
        t2 = time.perf_counter()
        self.state, steps = self.build_empty()
        t3 = time.perf_counter()
        loaded = load(path)
        t4 = self.timed_barrier()
        total, save_s, free_s, build_s, load_s = _max(t4 - t0, t1 - t0, t2 - t1, t3 - t2, t4 - t3)
        size = _dir_bytes(path) if self.rank == 0 else 0
        self.remove_dir(path)
        return dict(seconds=total, save_seconds=save_s, free_seconds=free_s, build_seconds=build_s,
                    load_seconds=load_s, save_prepare_seconds=saved.prepare, load_prepare_seconds=loaded.prepare,
                    checkpoint_bytes=_agree(size), steps=self.slowest_steps(steps)), loaded

    def dcp(self) -> dict:
        def load(path: str):
            loaded = dcp.load(store_of(self.state, self.spec, self.rank), self.spec, self.dst, self.rank, path)
            set_adam_step(self.state.optimizer, loaded.step)
            return loaded

        record, loaded = self.through_checkpoint(
            "dcp", lambda path: dcp.save(store_of(self.state, self.spec, self.rank), self.spec, self.src, self.rank,
                                         path, step=self.step), load)
        return dict(record, step=loaded.step)

    def megatron(self) -> dict:
        record, loaded = self.through_checkpoint("megatron", lambda path: megatron_ckpt.save(self.state, path),
                                                 lambda path: megatron_ckpt.load(self.state, path))
        return dict(record, load_apply_seconds=loaded.apply, step=step_of(self.state))

    def restart_save(self) -> dict:
        """The first half of checkpoint-and-restart: the decision, the save; then the job exits."""
        path = os.path.join(self.cfg.workdir, "restart")
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            os.makedirs(path)
        dist.barrier()
        decided = time.time()
        dcp.save(store_of(self.state, self.spec, self.rank), self.spec, self.src, self.rank, path, step=self.step)
        saved = time.time()
        (first,) = _max(-decided)
        (last,) = _max(saved)
        return dict(decided_at=-first, saved_at=last, path=path)

    # ---------------------------------------------------------------- driver
    def extra_need(self, method: str) -> tuple[int, str]:
        a, b = world_state_bytes(self.spec, self.src), world_state_bytes(self.spec, self.dst)
        world = self.src.world_size
        if method in ("hot_switch", "hot_switch_ahead"):
            return (hot_switch_extra_bytes(self.spec, self.src, self.dst, self.setup.staging_budget, self.topology,
                                           recycle=self.setup.recycle),
                    "the new buffers and the switch's peak (the old state is freed as it is read)")
        if method == "allgather":
            return b + world * (world + 2) * CHUNK_ELEMENTS * 4, "the new state beside the old"
        if method == "dcp":
            return max(0, b - a) + world * 256 * 2**20, "the new state after the old is dropped"
        if method == "megatron":  # the save gathers beside A; the load (A dropped) unshards beside B
            save = unsharded_optimizer_bytes(self.spec, self.src, dp_rank0_only=True) if self.src.zero else 0
            load = b + (unsharded_optimizer_bytes(self.spec, self.dst) if self.dst.zero else 0) - a
            return max(save, load, 0), "megatron's unsharded optimizer state (fully_reshardable) and the new state"
        return 0, ""

    def warm_bytes(self) -> int:
        """World total: what every method's new state grows by, plus ``WARM_EXTRA_BYTES`` a rank."""
        growth = world_state_bytes(self.spec, self.dst) - world_state_bytes(self.spec, self.src)
        return max(0, growth) + self.src.world_size * WARM_EXTRA_BYTES

    def warm_memory(self) -> float:
        """Before each method, outside its timed window: write ``warm_bytes`` (split over the ranks)
        and free it again; returns the seconds it took (slowest rank), 0 when it does not fit.

        On a virtual machine whose guest gives free memory back to its host (Linux free page
        reporting; ``benchmarks/fresh_memory.py``), the first write to memory the host has taken
        back costs a fault on the host as well: 0.5-1.5 GB/s here, against several GB/s for memory
        freed a moment before. Without this, the first method of a job (the hot switch) paid that
        for every byte the state grows by, and each method after it found the memory the previous
        method's switch back had just freed: dp1-tp1-pp4 -> dp4 (12.8 GB of growth) took the hot
        switch 13.3 s run first and 3.1 s run again, in the same job. So every method starts from
        memory written a moment before, and none inherits another's.
        """
        total = self.warm_bytes()
        if self.fits(total, "warming memory") is not None:
            return 0.0
        t0 = self.timed_barrier()
        block = torch.empty(total // self.src.world_size // 4)
        block.fill_(0.0)
        del block
        return _max(time.perf_counter() - t0)[0]

    def run(self, method: str) -> None:
        if method == "megatron" and (reason := megatron_skip_reason(self.src, self.dst)):
            self.out["skipped"][method] = reason
            return
        need, what = self.extra_need(method)
        if (reason := self.fits(need, what)) is not None:
            self.out["skipped"][method] = reason
            return
        warm_seconds = self.warm_memory()
        before, pages = rss(), machine_page_allocations()
        reset_peak_rss()
        try:
            record = getattr(self, method)()
        except Exception:
            self.out["errors"][method] = traceback.format_exc(limit=6)
            self.recover(method)
            return
        record["warm_seconds"] = warm_seconds
        record["peak_rss"] = peak_rss()
        record["rss_before"] = before
        record["machine_pages_bytes"] = machine_page_allocations() - pages  # every rank reads the same machine
        self.out["methods"][method] = record
        trim_heap()  # outside the timed window: every method starts from a trimmed heap
        self.check(method)
        self.back_to_src(method)
        trim_heap()

    def recover(self, method: str) -> None:
        """After a failed method: forget whatever is half built and rebuild A."""
        dist.barrier()
        self.drop_state()
        trim_heap()
        self.state = build_trained_state(self.setup, self.src, self.rank, self.groups)
        trim_heap()
        self.out["restores"].append({"after": method, "how": "rebuild after error", "passed": self.fingerprint() == self.fp_src})


def _settle() -> None:
    """Process set-up of every job: quiet deprecation warnings, and ``gc.freeze()`` what the imports
    made, so that collecting a dropped megatron model (it has reference cycles) scans only the
    objects created since (0.3 s -> ~0 per ``gc.collect()`` here). Same for every method."""
    warnings.filterwarnings("ignore")
    gc.collect()
    gc.freeze()


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def pair_job(rank: int, world: int, cfg: PairConfig) -> dict:
    """Job 1 of a pair (see the module docstring); returns this rank's record."""
    _settle()
    bench = PairBench(cfg, rank)
    bench.start()
    in_process = [m for m in cfg.methods if m != "restart"]
    for method in in_process:
        bench.run(method)
        if method == "hot_switch":
            bench.floor()
    if "floor" not in bench.out:
        bench.floor()
    if "restart" in cfg.methods:  # the load's memory is checked by the parent, once these processes are gone
        bench.out["restart_save"] = bench.restart_save()
    bench.out["groups_made"]["end"] = len(bench.groups)
    bench.out["fp_src"] = bench.fp_src
    bench.out["step"] = bench.step
    destroy()
    bench.groups.close()
    return bench.out


def restart_job(rank: int, world: int, cfg: PairConfig, path: str, fp_src: Fingerprint, step: int) -> dict:
    """Job 2 of the restart: fresh processes initialise megatron, build B and load the checkpoint."""
    started = time.time()
    _settle()
    setup, spec, dst = cfg.setup, cfg.setup.spec, ParallelConfig.parse(cfg.dst)
    state, _ = build_empty_state(setup, dst, 0)
    built = time.time()
    loaded = dcp.load(store_of(state, spec, rank), spec, dst, rank, path)
    set_adam_step(state.optimizer, loaded.step)
    dist.barrier()
    done = time.time()
    fp = logical_fingerprint(store_of(state, spec, rank), spec, dst, rank)
    first_start, last_built, last_done = -_max(-started)[0], _max(built)[0], _max(done)[0]
    passed = fp == fp_src and loaded.step == step
    destroy()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    return dict(fn_started_at=first_start, built_at=last_built, loaded_at=last_done, load_seconds=loaded.total,
                passed=passed, diff=diff(fp_src, fp), step=loaded.step)


__all__ = ["METHODS", "PairConfig", "megatron_skip_reason", "pair_job", "restart_job"]
