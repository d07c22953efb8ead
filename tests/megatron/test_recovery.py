"""The survivors of a rank that died rebuild the whole training state from the replicas they hold.

Four processes train a real megatron GPT at ``dp2-tp1-pp2-vpp2`` (two virtual stages per pipeline
rank, megatron's interleaved schedule; Adam, fp32) on world generation 0; rank 1 then dies
(``os._exit``, after leaving its local tensors in the store for the comparison). The three
survivors build generation 1 among themselves (``elastic.world``), install it, and run
``hot_switch`` to ``dp3-tp1-pp1`` with ``Members.after_loss``: the planner reads every box from a
surviving holder (rank 1's two model chunks of the first pipeline stage have a data-parallel
replica on rank 0), over the new world only. The parent assembles the full state (every param and
both Adam moments) as megatron itself describes it (each chunk's ``sharded_state_dict()``,
``tests/megatron_description.py``, not the library's mapping) from the four ranks before and from
the three after: bit for bit the same. Training then goes on at the new layout on the same global
batches.

A ZeRO-1 shard only the dead held: the plan's refusal is ``tests/vps/test_lost_state.py``'s, the
fit that ends naming it ``tests/elastic/test_recovery_fit.py``'s.

Noticing the death inside a fit, agreeing on it through the job's store and going on with
``trainer.fit`` (from replicas or an in-memory snapshot) is ``tests/elastic/test_recovery_fit.py``'s.
"""

from __future__ import annotations

import os
import pickle
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_dynatrain.megatron.gpt import GPTShape
from lightning_dynatrain.vps.layout import ParallelConfig
from tests.elastic.processes import Processes
from tests.megatron.jobs import DENSE, GLOBAL_BATCH, MICROBATCHES, SEED
from tests.megatron_description import assemble, describe, differences

pytestmark = pytest.mark.slow

SRC, DST, DEAD = "dp2-tp1-pp2-vpp2", "dp3-tp1-pp1", 1
OPTIMIZER = dict(lr=1e-2, weight_decay=0.1, clip_grad=1.0)


def _member(name: str, address: str, rank: int, source: str) -> dict:
    import torch

    from lightning_dynatrain.elastic.world import NextWorld, build_group, install, retire
    from lightning_dynatrain.megatron.gpt import build_gpt_model
    from lightning_dynatrain.megatron.hot_switch import SwitchSetup, hot_switch
    from lightning_dynatrain.megatron.optimizer import adam_config, build_ddp_chunks_and_optimizer
    from lightning_dynatrain.megatron.parallel_state_adapter import destroy, initialize_for_layout
    from lightning_dynatrain.megatron.state import MegatronState
    from lightning_dynatrain.megatron.train_step import run_train_step
    from lightning_dynatrain.runtime.steps import set_lr_and_wd
    from lightning_dynatrain.vps.members import Members

    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60))
    install(build_group(store, generation=0, rank=rank, size=4), store, generation=0)
    shape, src = GPTShape(**DENSE), ParallelConfig.parse(source)
    tokens = torch.randint(0, shape.vocab_size, (GLOBAL_BATCH, shape.seq_length + 1),
                           generator=torch.Generator().manual_seed(11))

    def train(state, me: int, steps: int) -> list[float]:
        per = GLOBAL_BATCH // state.layout.dp
        dp_rank = state.layout.dense_coord(me).dp
        local = tokens[dp_rank * per:(dp_rank + 1) * per]
        batch = {"tokens": local[:, :-1].contiguous(), "labels": local[:, 1:].contiguous()}
        set_lr_and_wd(state.optimizer, lr=OPTIMIZER["lr"], weight_decay=OPTIMIZER["weight_decay"])
        return [run_train_step(state.chunks, state.optimizer, batch, state.layout, MICROBATCHES) for _ in range(steps)]

    pgs = initialize_for_layout(src, seed=SEED)
    chunks, optimizer = build_ddp_chunks_and_optimizer(build_gpt_model(shape, src, seed=SEED), src,
                                                       config=adam_config(**OPTIMIZER), pg_collection=pgs)
    state = MegatronState(layout=src, groups=pgs, chunks=chunks, optimizer=optimizer)
    losses = train(state, rank, 2)
    before = describe(state)
    dist.barrier()  # every rank has its state of step 2
    if rank == DEAD:
        store.set(f"before/{rank}", pickle.dumps(before))
        store.add("dead_wrote", 1)
        os._exit(9)  # no goodbye: its connections close as the kernel ends it
    store.wait(["dead_wrote"])
    survivors = [r for r in range(4) if r != DEAD]
    me = survivors.index(rank)
    world = NextWorld(store, generation=1, rank=me, size=len(survivors), background=False).group(timeout=60)
    start = time.perf_counter()
    old = install(world, store, generation=1)
    dst = ParallelConfig.parse(DST)
    setup = SwitchSetup(model=shape, seed=SEED, optimizer=OPTIMIZER, staging_budget=64 * 2**20)
    members = Members.after_loss(4, dead={DEAD}, dst_world=len(survivors))
    result = hot_switch(state, dst, setup, members=members)
    seconds = time.perf_counter() - start
    retire(old.groups)
    after = describe(result.state)
    losses += train(result.state, me, 2)
    destroy()
    dist.barrier()
    return {"rank": rank, "new_rank": me, "before": before, "after": after, "losses": losses, "seconds": seconds,
            "report": str(result.report)}


def _run(source: str) -> tuple[dist.TCPStore, list[dict]]:
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    address = f"127.0.0.1:{master.port}"
    procs = Processes()
    for rank, name in enumerate("abcd"):
        procs.start(name, _member, address, rank, source)
    results = procs.collect(timeout_s=240, expect_dead=("b",))
    return master, sorted(results.values(), key=lambda r: r["new_rank"])


def test_the_survivors_rebuild_the_whole_state_from_replicas_bit_for_bit():
    master, survivors = _run(SRC)
    assert [r["rank"] for r in survivors] == [0, 2, 3]
    dead_before = pickle.loads(master.get(f"before/{DEAD}"))
    olds = {r["rank"]: r["before"] for r in survivors} | {DEAD: dead_before}
    before = assemble([olds[r] for r in range(4)])
    after = assemble([r["after"] for r in survivors])
    assert any(key.startswith("optimizer.state.exp_avg_sq.") for key in before), sorted(before)
    assert differences(before, after) == []
    for r in survivors:
        assert r["after"]["groups"] == r["before"]["groups"] and r["after"]["steps"] == r["before"]["steps"] == [2]
    # the survivors train on, on the same global batches, and agree on the loss
    assert len({tuple(r["losses"]) for r in survivors}) == 1
    print("survivors' switch from replicas:", [f"{r['seconds']:.2f} s" for r in survivors], survivors[0]["report"])
