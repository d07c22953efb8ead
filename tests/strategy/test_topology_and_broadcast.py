"""Where the bytes of a switch go, under ``DynaTrainStrategy``: nodes and broadcasts (4 processes, gloo).

One spawned job, two fits:

1. two "nodes" of two ranks on this machine (``Trainer(devices=2, num_nodes=2)``, each process told
   its ``NODE_RANK``): the strategy gathers that topology once, the planner prefers sources on a
   rank's own node, and the report's intra/inter-node split is the dry run's for that topology;
2. new replicas: ``dp1-tp2-pp2 -> dp4`` feeds each shard from its one holder to three new
   replicas; the links are measured once (the real cost model, nothing forced), and the switch
   broadcasts exactly where that model says it pays; ``verify=True`` checks the state bit for bit.
"""

from __future__ import annotations

import os

import pytest

from tests.dist import run_distributed

pytestmark = pytest.mark.slow

SMALL = dict(hidden=32, layers=2, heads=4, ffn_hidden=64, vocab_size=256, seq_length=32,
             make_vocab_size_divisible_by=128)
#: big enough that a shard's broadcast (about 5 MB) dwarfs a broadcast's fixed cost
WIDE = dict(SMALL, hidden=256, ffn_hidden=1024)
NODE_SCHEDULE = {1: "dp4-tp1-pp1", 2: "dp2-tp1-pp2", 3: "dp4-tp1-pp1", 4: "dp2-tp2-pp1"}


def _fit(shape: dict, start: str, schedule: dict, steps: int, **trainer_kwargs):
    from lightning.pytorch import Trainer

    from lightning_dynatrain.callbacks import ScheduledReconfig
    from lightning_dynatrain.data import StdlibTextDataModule
    from lightning_dynatrain.megatron.gpt import GPTShape
    from lightning_dynatrain.strategy import DynaTrainStrategy, GPTLightningModule

    strategy = DynaTrainStrategy(start, verify=True, staging_budget="64MiB")
    module = GPTLightningModule(GPTShape(**shape), lr=1e-3, global_batch_size=4, micro_batch_size=1, seed=1234)
    trainer = Trainer(accelerator="cpu", strategy=strategy, max_steps=steps, callbacks=[ScheduledReconfig(schedule)],
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      **trainer_kwargs)
    trainer.fit(module, datamodule=StdlibTextDataModule(seq_length=shape["seq_length"], global_batch_size=4,
                                                        seed=0, max_bytes=100_000))
    return strategy


def _job(rank: int, world_size: int) -> dict:
    import torch

    torch.set_num_threads(1)
    os.environ["NODE_RANK"], os.environ["LOCAL_RANK"] = str(rank // 2), str(rank % 2)
    nodes = _fit(SMALL, "dp2-tp2-pp1", NODE_SCHEDULE, 5, devices=2, num_nodes=2)
    os.environ["NODE_RANK"], os.environ["LOCAL_RANK"] = "0", str(rank)
    wide = _fit(WIDE, "dp1-tp2-pp2", {1: "dp4-tp1-pp1"}, 2, devices=4)
    return dict(topology=nodes.switcher.topology.nodes, node_history=[r.to_json() for r in nodes.switch_history],
                link_costs=wide.switcher.link_costs, wide_history=[r.to_json() for r in wide.switch_history])


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_job, 4, timeout_s=300)


def test_the_topology_is_gathered_from_the_launchers_node_ranks(runs):
    assert all(r["topology"] == (0, 0, 1, 1) for r in runs)


def test_the_reports_node_split_is_the_plans(runs):
    """Every switch's moved and inter-node bytes are the dry run's for two nodes of two ranks (where
    a rank takes a box from a holder on its own node whenever one has it: ``vps.planner``)."""
    from lightning_dynatrain.megatron.gpt import GPTShape, logical_spec
    from lightning_dynatrain.vps.dryrun import dry_run
    from lightning_dynatrain.vps.layout import ParallelConfig
    from lightning_dynatrain.vps.spec import Precision
    from lightning_dynatrain.vps.topology import Topology

    spec, topology = logical_spec(GPTShape(**SMALL)), Topology((0, 0, 1, 1))
    history = runs[0]["node_history"]
    assert [h["dst"] for h in history] == list(NODE_SCHEDULE.values())
    inter = []
    for h in history:
        src, dst = ParallelConfig.parse(h["src"]), ParallelConfig.parse(h["dst"])
        expected, _ = dry_run(spec, src, dst, precision=Precision.FP32, topology=topology)
        assert (h["moved_bytes"], h["inter_node_bytes"]) == (expected.moved_bytes, expected.inter_node_bytes), h
        inter.append(h["inter_node_bytes"])
    # dp2-tp2 -> dp4 finds every missing half on its own node; dp2-pp2 -> dp4 must fetch the other
    # stage, which lives on the other node
    assert inter[0] == 0 < inter[2], inter


def test_new_replicas_are_fed_by_broadcast_where_the_measured_links_say_it_pays(runs):
    """The decision is the measured cost model's (the same costs on every rank); here, on loopback,
    one broadcast of a ~5 MB shard to three replicas beats three sends of it."""
    from lightning_dynatrain.transition.collectives import plan_broadcasts
    from lightning_dynatrain.megatron.gpt import GPTShape, logical_spec
    from lightning_dynatrain.vps.layout import ParallelConfig
    from lightning_dynatrain.vps.planner import plan_all
    from lightning_dynatrain.vps.spec import Precision

    costs = runs[0]["link_costs"]
    assert costs is not None and all(r["link_costs"] == costs for r in runs)
    spec = logical_spec(GPTShape(**WIDE))
    plans = plan_all(spec, ParallelConfig.parse("dp1-tp2-pp2"), ParallelConfig.parse("dp4-tp1-pp1"))
    jobs = plan_broadcasts(plans, costs, itemsize=lambda t, k: spec.itemsize(t, k, Precision.FP32)).jobs
    carried = sum(b.numel * 4 for j in jobs for _ in j.receivers for _, _, b in j.items)
    (switch,) = runs[0]["wide_history"]
    assert switch["broadcast_bytes"] == carried, (costs, switch)
    assert carried > 0, f"the measured links ({costs}) made no broadcast pay"
    assert switch["moved_bytes"] >= carried
