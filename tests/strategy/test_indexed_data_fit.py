"""Megatron's indexed dataset under ``DynaTrainStrategy``: which samples each step trains on, across
three layout switches and a resume (4 real processes; the llama fits of ``families_job.py``).

The dataloader serves the same global batch on every rank; each step cuts its data-parallel share
by the layout of that step. So whatever the layout, step ``k`` trains on dataset positions
``[k*G, (k+1)*G)``, each exactly once over the data-parallel ranks.
"""

from __future__ import annotations

from collections import Counter

import pytest

from lightning_dynatrain.vps.layout import ParallelConfig
from tests.strategy.families_job import GLOBAL_BATCH, LLAMA_SCHEDULE, LLAMA_STEPS, RESUME_AT

pytestmark = pytest.mark.slow


def consumed(runs: list[dict], run: str) -> dict[int, Counter]:
    """Per step, the multiset of samples the data-parallel ranks trained on (each dp rank counted once;
    the tp/pp ranks of a replica must have trained on the same rows)."""
    by_step: dict[int, dict[int, list[int]]] = {}
    for results in runs:
        for step, layout, dp_rank, rows, _ in results["llama"][run]["seen"]:
            shares = by_step.setdefault(step, {})
            assert shares.setdefault(dp_rank, rows) == rows, (run, step, layout, dp_rank)
    return {step: Counter(s for rows in shares.values() for s in rows) for step, shares in by_step.items()}


def test_each_step_trains_on_the_same_samples_as_the_static_run(families4) -> None:
    """With switches at steps 3, 6 and 9 (dp 2 -> 1 -> 4 -> 2) every step's multiset of samples is the
    static run's: none seen twice, none skipped, and the global batch is the same on every rank."""
    runs, _ = families4
    switched, static = consumed(runs, "switched"), consumed(runs, "static")
    assert sorted(switched) == sorted(static) == list(range(LLAMA_STEPS))
    for step in range(LLAMA_STEPS):
        assert switched[step] == static[step], step
        assert static[step] == Counter(range(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH))  # positions k*G...
    layout_of = [layout for _, layout, *_ in runs[0]["llama"]["switched"]["seen"]]
    dp_ranks = [len({r["llama"]["switched"]["seen"][step][2] for r in runs}) for step in range(LLAMA_STEPS)]
    assert dp_ranks == [ParallelConfig.parse(layout).dp for layout in layout_of]
    assert dp_ranks == [2, 2, 2, 1, 1, 1, 4, 4, 4, 2, 2, 2]
    for results in runs:  # the global batch itself does not depend on the layout
        assert [b for *_, b in results["llama"]["switched"]["seen"]] == [b for *_, b in results["llama"]["static"]["seen"]]


def test_a_resumed_run_continues_at_the_data_position_of_its_checkpoint(families4) -> None:
    """Resumed from the checkpoint written at step 6 (after that step's switch, at dp4-tp1-pp1), the run
    trains steps 7-12 on the static run's samples and gives the switched run's losses."""
    runs, _ = families4
    resumed, static = consumed(runs, "resumed"), consumed(runs, "static")
    assert sorted(resumed) == list(range(RESUME_AT, LLAMA_STEPS))
    for step in resumed:
        assert resumed[step] == static[step], step
    for results in runs:
        run = results["llama"]
        assert run["resumed"]["seen"][0][1] == LLAMA_SCHEDULE[RESUME_AT]
        assert run["resumed"]["history"] == [(9, LLAMA_SCHEDULE[RESUME_AT], LLAMA_SCHEDULE[9])]
        assert run["resumed"]["losses"] == pytest.approx(run["switched"]["losses"][RESUME_AT:], rel=1e-6)
