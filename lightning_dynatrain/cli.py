"""``dynatrain``: command-line entry point. ``dynatrain plan`` dry-runs a switch at any scale;
``dynatrain store`` hosts an elastic job's store.

Example::

    dynatrain plan --model llama2-70b --src dp16-tp8-pp8 --dst dp8-tp8-pp16 --json
    dynatrain plan --model llama2-7b --src dp8-tp4-pp2 --dst dp4-tp8-pp2 --plot switch.png

A plan that takes more than ``PROGRESS_AFTER_S`` seconds reports its progress on stderr
(``progress_line.ProgressLine``); ``--plot`` also draws every rank pair's bytes (``viz``).
"""

from __future__ import annotations

import argparse
import json
import sys

from pathlib import Path

from lightning_dynatrain.elastic import store_cli
from lightning_dynatrain.progress_line import ProgressLine
from lightning_dynatrain.vps.dryrun import GB, LinkModel, dry_run
from lightning_dynatrain.vps.errors import DynaTrainError
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.planner import union_world
from lightning_dynatrain.vps.presets import preset, preset_names
from lightning_dynatrain.vps.spec import Precision
from lightning_dynatrain.vps.topology import Topology

_DEFAULTS = LinkModel()
PROGRESS_AFTER_S = 1.0
"""A plan running longer than this prints a progress line on stderr."""
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def _plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="plan a layout switch for a named model without running it",
        description="Plan every rank's send/recv/retain lists for a switch SRC -> DST and print the totals. "
        "Bytes count parameters and every optimizer state kind at the chosen precision (the parameters "
        "alone with --weights-only).",
    )
    p.add_argument("--model", required=True, help=f"model preset: {', '.join(preset_names())}")
    p.add_argument("--src", required=True, help="source layout, e.g. dp16-tp8-pp8, dp128-tp4-pp2-ep64-zero1 or "
                   "dp32-tp4-pp8-first7-last7 (an uneven pipeline: 7 layers on the first and the last stage)")
    p.add_argument("--dst", required=True, help="destination layout")
    p.add_argument("--gpus-per-node", type=int, default=8, help="ranks per node, for locality (default 8)")
    p.add_argument("--rank", type=int, default=None, help="plan and report this one rank only")
    p.add_argument("--precision", choices=[x.value for x in Precision], default=Precision.BF16.value,
                   help="bf16: bf16 params + fp32 main params and Adam moments (default, as large runs train); "
                   "fp32: fp32 params + Adam moments (as this project trains on CPU); +sgd: SGD's momentum "
                   "in place of Adam's moments")
    p.add_argument("--weights-only", action="store_true",
                   help="plan the params alone, in the dtype they train in (the switch to a rollout layout and "
                   "back, the optimizer's state staying where it is)")
    p.add_argument("--intra-node-gbps", type=float, default=_DEFAULTS.intra_node / GB,
                   help="GB/s per rank and direction inside a node (default %(default)s, NVLink class)")
    p.add_argument("--inter-node-gbps", type=float, default=_DEFAULTS.inter_node / GB,
                   help="GB/s per rank and direction across nodes (default %(default)s, one 200 Gb/s NIC per GPU)")
    p.add_argument("--copy-gbps", type=float, default=_DEFAULTS.local_copy / GB,
                   help="GB/s of a local device copy for retained state (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object with the figures")
    p.add_argument("--plot", type=Path, default=None, metavar="FILE.png",
                   help="also draw a heatmap of the bytes every rank sends every other rank (kept bytes on the "
                   "diagonal, nodes of --gpus-per-node ranks outlined) into FILE (.png, .svg or .pdf); needs "
                   "matplotlib and plans every rank again, even with --rank")
    p.set_defaults(func=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    spec = preset(args.model)
    src = ParallelConfig.parse(args.src)
    dst = ParallelConfig.parse(args.dst)
    if args.gpus_per_node < 1:
        raise DynaTrainError(f"--gpus-per-node {args.gpus_per_node} is not positive", hint="use e.g. 8")
    links = LinkModel(intra_node=args.intra_node_gbps * GB, inter_node=args.inter_node_gbps * GB,
                      local_copy=args.copy_gbps * GB)
    if args.plot is not None and args.plot.suffix.lower() not in PLOT_SUFFIXES:
        raise DynaTrainError(f"--plot {args.plot}: cannot tell the picture's format from its suffix",
                             hint=f"name the file with one of {', '.join(PLOT_SUFFIXES)}, e.g. switch.png")
    precision = Precision(args.precision)
    world = union_world(src, dst)
    topology = Topology.uniform(world, args.gpus_per_node)
    ranks = f"rank {args.rank}" if args.rank is not None else f"{world} ranks"
    try:
        with ProgressLine(f"dynatrain plan: planning {ranks} of {args.model}", after=PROGRESS_AFTER_S):
            report, plans = dry_run(spec, src, dst, precision=precision, topology=topology, links=links,
                                    only_rank=args.rank, weights_only=args.weights_only)
    except IndexError as err:
        raise DynaTrainError(str(err), hint="pass a rank inside the larger of the two worlds") from None
    if args.plot is not None:
        _plot(args, spec, src, dst, precision)
    figures = report.as_dict()
    if args.json:
        print(json.dumps(figures))
        return 0
    print(f"{args.model}: {src} -> {dst} ({args.precision}{', weights only' if args.weights_only else ''})")
    if args.rank is not None:
        print(plans[args.rank])
    width = max(map(len, figures))
    for key, value in figures.items():
        if isinstance(value, bool):
            text = "yes" if value else "no"
        elif key.endswith("_bytes"):
            text = f"{value:,} ({value / GB:.3f} GB)"
        elif isinstance(value, float):
            text = f"{value:.4f}"
        else:
            text = f"{value:,}"
        print(f"  {key:<{width}}  {text}")
    return 0


def _plot(args: argparse.Namespace, spec, src: ParallelConfig, dst: ParallelConfig, precision: Precision) -> None:
    """Plan every rank again for the rank-pair bytes (``viz.transfer_matrix``) and draw them to ``--plot``."""
    from lightning_dynatrain.viz.transfer_matrix import transfer_matrix
    from lightning_dynatrain.viz.transfer_plot import plot_transfer_matrix

    world = union_world(src, dst)
    with ProgressLine(f"dynatrain plan: bytes between {world} ranks for {args.plot}", after=PROGRESS_AFTER_S) as line:
        matrix = transfer_matrix(spec, src, dst, precision=precision, gpus_per_node=args.gpus_per_node,
                                 progress=line.update, weights_only=args.weights_only)
    what = f"{precision.value} {'params' if args.weights_only else 'state'}"
    path = plot_transfer_matrix(matrix, args.plot, title=f"{args.model}: {src} -> {dst} ({what})")
    # stdout stays one JSON object under --json
    print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dynatrain", description="lightning-dynatrain tools")
    sub = parser.add_subparsers(dest="command", required=True)
    _plan_parser(sub)
    store_cli.add_parser(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except DynaTrainError as err:
        print(f"dynatrain {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
