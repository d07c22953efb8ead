"""A short soak (``benchmarks/soak.py``): three cycles of four layouts in one fit on 4 processes.

After the first cycle (every layout and its process groups seen once) nothing may grow: open
files, Python and OS threads, live process groups. After the last switch the only rotary
embedding alive is the current model's (megatron's class-wide rotary cache kept old models'
modules alive). Timing and memory goals live in the benchmark, not here.
"""

from __future__ import annotations

import os

import pytest

from tests.dist import run_distributed

CYCLES = 3


def _rope_census():
    from lightning.pytorch import Callback

    class RopeCensus(Callback):
        """After the last switch: rotary modules alive (after a full collection) and the current model's."""

        def __init__(self) -> None:
            self.alive: int | None = None
            self.in_model: int | None = None

        def on_train_end(self, trainer, pl_module) -> None:
            import gc

            from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

            gc.collect()
            self.alive = sum(1 for o in gc.get_objects() if isinstance(o, RotaryEmbedding))
            self.in_model = sum(1 for m in pl_module.model.modules() if isinstance(m, RotaryEmbedding))

    return RopeCensus()


def _soak_job(rank: int, world_size: int) -> dict:
    import torch

    from benchmarks.soak import LAYOUTS, rank_growth, soak_fit

    os.environ["LOCAL_RANK"] = str(rank)  # Lightning then launches nothing: the harness made the processes
    os.environ["NODE_RANK"] = "0"
    torch.set_num_threads(1)
    census = _rope_census()
    _, results = soak_fit(LAYOUTS, CYCLES * len(LAYOUTS), 1, callbacks=[census])
    mine = next(r for r in results if r["rank"] == rank)
    return dict(growth=rank_growth(mine, len(LAYOUTS)), switched_to=[s["dst"] for s in mine["samples"]],
                losses=mine["losses"], rope_alive=census.alive, rope_in_model=census.in_model)


@pytest.fixture(scope="module")
def soak4() -> list[dict]:
    return run_distributed(_soak_job, 4, timeout_s=300, collective_timeout_s=120)


@pytest.mark.slow
def test_every_switch_ran_and_training_went_on(soak4: list[dict]) -> None:
    from benchmarks.soak import LAYOUTS

    expected = [LAYOUTS[i % len(LAYOUTS)] for i in range(1, CYCLES * len(LAYOUTS) + 1)]
    for result in soak4:
        assert result["switched_to"] == expected
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
