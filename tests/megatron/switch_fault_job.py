"""One rank of a 4-process hot switch that loses a rank: ``python switch_fault_job.py OUT --deadline S``.

The test (``test_switch_faults.py``) starts every rank as a process of its own with ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, and ``DYNATRAIN_SWITCH_FAULT`` naming the
rank that sends itself SIGKILL or SIGSTOP as it enters the transfer phase. Each rank builds a real
megatron GPT at ``--src``, switches to ``--dst`` under a ``SwitchWatch`` with a fixed deadline,
and writes ``OUT/rank{r}.json``: what it raised (type, the rank and phase it names, whether the
state is lost, the checkpoint named), when (``time.time()``), and when it was done tearing down.
With ``--keep-old`` (safe mode), after a rollback: whether the old state is bit for bit what it
was, and the layout a second switch reached.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from datetime import timedelta
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--deadline", type=float, required=True)
    parser.add_argument("--src", default="dp2-tp2-pp1")
    parser.add_argument("--dst", default="dp1-tp2-pp2")
    parser.add_argument("--keep-old", action="store_true", help="SwitchSetup(keep_old=True); after a rollback, "
                        "check the old state is bit for bit what it was and switch again")
    parser.add_argument("--stale-after", type=float, default=2.0)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    out = Path(args.out) / f"rank{rank}.json"

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(minutes=5))

    from lightning_dynatrain.transition.deadline import SwitchDeadline
    from lightning_dynatrain.transition.errors import SwitchFailedError, was_refused
    from lightning_dynatrain.transition.watch import FaultInjection, SwitchWatch
    from lightning_dynatrain.megatron.gpt import GPTShape, build_gpt_model
    from lightning_dynatrain.megatron.hot_switch import SwitchSetup, hot_switch
    from lightning_dynatrain.megatron.optimizer import build_ddp_and_optimizer
    from lightning_dynatrain.megatron.parallel_state_adapter import ProcessGroupCache, destroy, initialize_for_layout
    from lightning_dynatrain.megatron.state import MegatronState
    from lightning_dynatrain.megatron.state_bridge import materialize_optimizer_state, megatron_store
    from lightning_dynatrain.vps.layout import ParallelConfig
    from lightning_dynatrain.vps.topology import Topology

    shape = GPTShape(hidden=32, layers=4, heads=4, query_groups=2, ffn_hidden=64, vocab_size=120, seq_length=16,
                     make_vocab_size_divisible_by=64)
    optimizer = dict(lr=1e-3, weight_decay=0.1)
    src, dst = ParallelConfig.parse(args.src), ParallelConfig.parse(args.dst)
    groups = ProcessGroupCache()
    pgs = initialize_for_layout(src, seed=1, groups=groups)
    model = build_gpt_model(shape, src, seed=1)
    ddp, built = build_ddp_and_optimizer(model, src, pg_collection=pgs, **optimizer)
    state = MegatronState(layout=src, groups=pgs, chunks=(ddp,), optimizer=built)
    setup = SwitchSetup(model=shape, seed=1, optimizer=optimizer, staging_budget=4096,
                        topology=Topology.uniform(dist.get_world_size(), 2), keep_old=args.keep_old)
    materialize_optimizer_state(state.optimizer, 0)  # as hot_switch does before the first step
    before = {k: t.clone() for k, t in megatron_store(state.ddp, state.optimizer, setup.spec, src, rank).items()}

    def start_watch(fault):
        return SwitchWatch.start(training_timeout=timedelta(minutes=5), timeout=SwitchDeadline.fixed(args.deadline),
                                 resume_from=lambda: "/checkpoints/last", fault=fault, stale_after=args.stale_after)

    result: dict = {"rank": rank, "pid": os.getpid()}
    watch = None
    try:
        watch = start_watch(FaultInjection.from_environment())  # the switch's group: a fault may come here
        state = hot_switch(state, dst, setup, groups=groups, watch=watch).state
        result["switched"] = True
    except SwitchFailedError as err:
        result.update(error="SwitchFailedError", t_error=time.time(), missing=err.rank, phase=err.phase,
                      lost_state=err.lost_state, resume_from=err.resume_from, message=str(err),
                      refused=was_refused(err))
    except Exception as err:  # noqa: BLE001 - reported to the test as it is
        result.update(error=type(err).__name__, t_error=time.time(), message=traceback.format_exc())
    if args.keep_old and result.get("refused"):  # rolled back: the old state, then training goes on
        after = megatron_store(state.ddp, state.optimizer, setup.spec, src, rank)
        result["old_state_whole"] = sorted(before) == sorted(after) and all(
            torch.equal(before[k].view(-1).view(torch.uint8), after[k].view(-1).view(torch.uint8)) for k in before)
        watch.close()
        watch = start_watch(None)  # a failed switch broke the watch's group
        state = hot_switch(state, dst, setup, groups=groups, watch=watch).state
        result["retried"] = str(state.layout)
    # the job's teardown, as the strategy's: nothing here may wait on the missing rank
    if watch is not None:
        watch.close()
    destroy(keep=groups)
    groups.close()
    dist.destroy_process_group()
    result["t_exit"] = time.time()
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
