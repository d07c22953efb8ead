"""Plan real switches at cluster scale (1024 ranks) on one CPU and check the planner's speed goals.

Goals (issue "Foundation and the Virtual Parameter Space"): every rank's plan at most 0.25 s
(``plan_seconds_per_rank_max``), all 1024 ranks' plans at most 30 s (``plan_seconds``).

Usage::

    python benchmarks/plan_at_scale.py            # a table
    python benchmarks/plan_at_scale.py --json     # the table, then one JSON object on the last line
"""

from __future__ import annotations

import argparse
import json

from lightning_dynatrain.vps.dryrun import dry_run
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.presets import preset
from lightning_dynatrain.vps.spec import Precision

CASES = [
    ("llama2-70b", "dp16-tp8-pp8", "dp8-tp8-pp16"),
    ("llama2-70b", "dp16-tp8-pp8", "dp32-tp4-pp8"),
    ("qwen-moe-235b", "dp128-tp4-pp2-ep64-zero1", "dp256-tp2-pp2-ep128-zero1"),
]
GOAL_PER_RANK_S = 0.25
GOAL_TOTAL_S = 30.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    args = parser.parse_args()
    rows = []
    for model, src, dst in CASES:
        report, _ = dry_run(preset(model), ParallelConfig.parse(src), ParallelConfig.parse(dst),
                            precision=Precision.BF16)  # nodes of 8 ranks
        r = report.as_dict()
        r.update(model=model, src=src, dst=dst, world=ParallelConfig.parse(src).world_size,
                 meets_goals=r["plan_seconds_per_rank_max"] <= GOAL_PER_RANK_S and r["plan_seconds"] <= GOAL_TOTAL_S)
        rows.append(r)
    header = f"{'model':<14} {'switch':<52} {'ranks':>5} {'moved GB':>10} {'retained GB':>12} {'plan s (all)':>12} {'plan s/rank max':>15} {'est. s':>7} goals"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['model']:<14} {r['src'] + ' -> ' + r['dst']:<52} {r['world']:>5} {r['moved_bytes'] / 1e9:>10.1f} "
              f"{r['retained_bytes'] / 1e9:>12.1f} {r['plan_seconds']:>12.2f} {r['plan_seconds_per_rank_max']:>15.3f} "
              f"{r['estimated_transfer_seconds']:>7.3f} {'met' if r['meets_goals'] else 'MISSED'}")
    if args.json:
        print(json.dumps({"cases": rows, "all_goals_met": all(r["meets_goals"] for r in rows)}))


if __name__ == "__main__":
    main()
