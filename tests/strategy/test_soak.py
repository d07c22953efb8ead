"""A short soak (``benchmarks/soak.py``): three cycles of four layouts in one fit on 4 processes.

After the first cycle (every layout and its process groups seen once) nothing may grow: open
files, Python and OS threads, live process groups. After the last switch the only model and DDP
tracked are the current ones (dropped states are taken apart, not left in reference cycles for the
collector), and the only rotary embedding alive after a collection is the current model's
(megatron's class-wide rotary cache kept old models' modules alive). Timing and memory goals live
in the benchmark, not here.
"""

from __future__ import annotations

import os

import pytest

from tests.dist import run_distributed

CYCLES = 3


def _census():
    from lightning.pytorch import Callback

    class Census(Callback):
        """After the last switch: megatron models and DDPs the collector tracks (live ones and cyclic
        garbage not yet collected), then rotary modules alive after a full collection, and the
        current model's."""

        def __init__(self) -> None:
            self.models: int | None = None
            self.ddps: int | None = None
            self.rope_alive: int | None = None
            self.rope_in_model: int | None = None

        def on_train_end(self, trainer, pl_module) -> None:
            import gc

            from megatron.core.distributed import DistributedDataParallel
            from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
            from megatron.core.models.gpt import GPTModel

            tracked = gc.get_objects()
            self.models = sum(1 for o in tracked if isinstance(o, GPTModel))
            self.ddps = sum(1 for o in tracked if isinstance(o, DistributedDataParallel))
            del tracked
            gc.collect()
            self.rope_alive = sum(1 for o in gc.get_objects() if isinstance(o, RotaryEmbedding))
            self.rope_in_model = sum(1 for m in pl_module.model.modules() if isinstance(m, RotaryEmbedding))

    return Census()


def _soak_job(rank: int, world_size: int) -> dict:
    import torch

    from benchmarks.soak import LAYOUTS, rank_growth, soak_fit

    os.environ["LOCAL_RANK"] = str(rank)  # Lightning then launches nothing: the harness made the processes
    os.environ["NODE_RANK"] = "0"
    torch.set_num_threads(1)
    census = _census()
    _, results = soak_fit(LAYOUTS, CYCLES * len(LAYOUTS), 1, callbacks=[census])
    mine = next(r for r in results if r["rank"] == rank)
    return dict(growth=rank_growth(mine, len(LAYOUTS)), switched_to=[s["dst"] for s in mine["samples"]],
                built_ahead=[s["built_ahead"] for s in mine["samples"]],
                losses=mine["losses"], rope_alive=census.rope_alive, rope_in_model=census.rope_in_model,
                models=census.models, ddps=census.ddps)


@pytest.fixture(scope="module")
def soak4() -> list[dict]:
    return run_distributed(_soak_job, 4, timeout_s=300, collective_timeout_s=120)


@pytest.mark.slow
def test_every_switch_ran_and_training_went_on(soak4: list[dict]) -> None:
    from benchmarks.soak import LAYOUTS

    expected = [LAYOUTS[i % len(LAYOUTS)] for i in range(1, CYCLES * len(LAYOUTS) + 1)]
    for result in soak4:
        assert result["switched_to"] == expected
        assert all(result["built_ahead"]), result["built_ahead"]  # ScheduledReconfig built each one ahead
        assert len(result["losses"]) == len(expected) + 1
        assert all(loss == loss and loss < 10 for loss in result["losses"])  # finite, not diverged


@pytest.mark.slow
@pytest.mark.parametrize("count", ["fds", "python_threads", "os_threads", "process_groups"])
def test_nothing_grows_after_the_first_cycle(soak4: list[dict], count: str) -> None:
    for result in soak4:
        growth = result["growth"]
        assert growth[f"{count}_peak_growth"] == 0, (
            f"rank {growth['rank']}: {count} grew after the first cycle: at each cycle's end "
            f"{[c[count] for c in growth['cycle_ends']]}")


@pytest.mark.slow
def test_old_models_rotary_tables_are_released(soak4: list[dict]) -> None:
    for result in soak4:
        assert result["rope_in_model"] == 1
        assert result["rope_alive"] == result["rope_in_model"], (
            f"{result['rope_alive']} rotary embeddings alive after {CYCLES} cycles, the model has "
            f"{result['rope_in_model']}: old models' modules are kept")


@pytest.mark.slow
def test_old_states_do_not_wait_for_the_cyclic_collector(soak4: list[dict]) -> None:
    """Each switch takes the state it replaces apart (``release_state``): after 12 switches the one
    model and DDP the collector tracks are the current ones, with no collection run."""
    for result in soak4:
        assert (result["models"], result["ddps"]) == (1, 1), (
            f"{result['models']} GPT models and {result['ddps']} DDPs tracked after {CYCLES} cycles: dropped "
            "states are left for the cyclic collector")


# ------------------------------------------------------------------ the benchmark's figures, no processes
def _fake_rank(rank: int, rss: list[int], groups: list[int], seconds: list[float]) -> dict:
    from benchmarks.soak import Sample

    def row(i: int) -> dict:
        return dict(step=i + 1, dst="x", seconds=seconds[i], step_seconds=0.5, phase_seconds={"plan": seconds[i] / 2},
                    rss_bytes=rss[i], fds=10, python_threads=2, os_threads=5, process_groups=groups[i],
                    gc_objects=100, gc_full_collections=0)

    start = Sample(rss_bytes=rss[0] - 1000, fds=10, python_threads=2, os_threads=5, process_groups=1, gc_objects=90,
                   gc_full_collections=0)
    from dataclasses import asdict

    return dict(rank=rank, start=asdict(start), samples=[row(i) for i in range(len(rss))], losses=[5.5, 5.0])


def test_schedule_cycles_from_the_second_layout() -> None:
    from benchmarks.soak import make_schedule

    assert make_schedule(("a", "b", "c"), 5, 2) == {2: "b", 4: "c", 6: "a", 8: "b", 10: "c"}
    with pytest.raises(ValueError, match="at least 2 layouts"):
        make_schedule(("a",), 4, 1)


def test_growth_is_counted_from_the_first_cycles_end() -> None:
    from benchmarks.soak import rank_growth

    # 2 layouts a cycle: the first cycle ends at the 2nd switch
    growth = rank_growth(_fake_rank(0, [100, 500, 900, 700, 600, 650], [7, 9, 9, 11, 9, 9], [1.0] * 6), 2)
    assert (growth["rss_growth_bytes"], growth["rss_peak_growth_bytes"]) == (150, 400)
    assert (growth["process_groups_growth"], growth["process_groups_peak_growth"]) == (0, 2)
    assert [c["step"] for c in growth["cycle_ends"]] == [2, 4, 6]
    with pytest.raises(ValueError, match="at least two cycles"):
        rank_growth(_fake_rank(0, [1, 2, 3], [1, 1, 1], [1.0] * 3), 2)


def test_goals_compare_the_last_cycle_with_the_second() -> None:
    from benchmarks.soak import RSS_GOAL_BYTES, summarize

    seconds = [9.0, 9.0, 1.0, 1.0, 1.0, 1.2]  # the first cycle (group creation) does not count
    results = [_fake_rank(r, [0, 0, 0, 0, 0, RSS_GOAL_BYTES + r], [5] * 6, seconds) for r in range(2)]
    summary = summarize(results, 2)
    assert summary["cycle_median_seconds"] == [9.0, 1.0, 1.1]
    assert summary["goals"]["last_over_second_cycle_seconds"] == {"value": 1.1, "limit": 1.1, "met": True}
    assert summary["goals"]["rss_growth_bytes"]["met"] is False  # rank 1 is over
    assert summary["goals"]["process_groups_growth"]["met"] is True
    assert summary["all_met"] is False
