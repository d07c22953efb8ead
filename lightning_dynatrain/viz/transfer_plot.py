"""A heatmap of one switch's rank-to-rank bytes (``TransferMatrix``), written as a PNG.

Rows are source ranks (what they held at the old layout), columns destination ranks (what they
hold at the new one). Three layers share one logarithmic colour scale so their cells compare:

- green, on the diagonal: bytes a rank keeps in its own memory (no copy over any link);
- blue, inside a node (the grey squares on the diagonal): bytes sent between ranks of one node;
- red, outside them: bytes sent across nodes.

Empty cells stay white. Up to 16 ranks each non-empty cell also prints its bytes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lightning_dynatrain.transition.staging import format_bytes
from lightning_dynatrain.viz.figure import new_figure
from lightning_dynatrain.viz.transfer_matrix import TransferMatrix

ANNOTATE_UP_TO = 16
"""Largest world whose cells print their bytes."""
NODE_BOXES_UP_TO = 256
"""Most nodes whose squares are drawn (beyond, they would hide the cells)."""


def plot_transfer_matrix(matrix: TransferMatrix, path: str | Path, *, title: str | None = None) -> Path:
    """Draw ``matrix`` (see module docstring) into the PNG file ``path``; returns the path.

    Raises:
        PlotError: matplotlib is not installed.
    """
    from matplotlib.colors import LogNorm
    from matplotlib.patches import Patch, Rectangle
    from matplotlib.ticker import FuncFormatter, NullLocator

    world, m = matrix.world, matrix.bytes
    eye = np.eye(world, dtype=bool)
    same = matrix.same_node()
    layers = [("kept (diagonal)", eye, "Greens"), ("sent inside a node", same & ~eye, "Blues"),
              ("sent across nodes", ~same, "Reds")]
    nonzero = m[m > 0]
    norm = LogNorm(vmin=max(1.0, float(nonzero.min()) / 2), vmax=float(nonzero.max())) if nonzero.size else None

    fig = new_figure(10.5, 8.0)
    ax = fig.add_axes((0.08, 0.2, 0.55, 0.72))
    as_bytes = FuncFormatter(lambda value, _: format_bytes(value))
    legend = []
    bars = 0
    for label, where, cmap in layers:
        cells = np.ma.masked_where(~where | (m == 0), m)
        if cells.count() == 0:
            continue
        image = ax.imshow(cells, cmap=cmap, norm=norm, interpolation="nearest", origin="upper",
                          extent=(-0.5, world - 0.5, world - 0.5, -0.5))
        bar_ax = fig.add_axes((0.66 + 0.105 * bars, 0.2, 0.016, 0.72))
        bar = fig.colorbar(image, cax=bar_ax)
        bar.set_label(f"bytes {label}", fontsize=8)
        bar.set_ticks(np.geomspace(norm.vmin, norm.vmax, 5))
        bar_ax.yaxis.set_major_formatter(as_bytes)
        bar_ax.yaxis.set_minor_locator(NullLocator())
        bar_ax.tick_params(labelsize=7)
        bars += 1
        legend.append(Patch(color=image.cmap(0.75), label=f"{label}: {format_bytes(int(m[where].sum()))}"))
    nodes = -(-world // matrix.gpus_per_node)
    if 1 < world and nodes <= NODE_BOXES_UP_TO:
        g = matrix.gpus_per_node
        for k in range(nodes):
            size = min(g, world - k * g)
            ax.add_patch(Rectangle((k * g - 0.5, k * g - 0.5), size, size, fill=False, edgecolor="0.45",
                                   lw=1.2 if nodes <= 32 else 0.4))
        legend.append(Patch(facecolor="none", edgecolor="0.45", label=f"one node ({g} ranks)"))
    if world <= ANNOTATE_UP_TO:
        for i, j in zip(*np.nonzero(m)):
            dark = norm is not None and norm(m[i, j]) > 0.55
            ax.text(j, i, format_bytes(int(m[i, j])).replace(" ", "\n"), ha="center", va="center", fontsize=7,
                    color="white" if dark else "black")
    if world <= 32:
        ax.set_xticks(range(world))
        ax.set_yticks(range(world))
    ax.set_xlim(-0.5, world - 0.5)
    ax.set_ylim(world - 0.5, -0.5)
    ax.set_xlabel(f"destination rank (holds it at {matrix.dst})")
    ax.set_ylabel(f"source rank (held it at {matrix.src})")
    ax.set_title(title or f"{matrix.src} -> {matrix.dst}: bytes between ranks ({matrix.precision.value} state)",
                 fontsize=10)
    if legend:
        ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=2, fontsize=8, frameon=False)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=max(110, min(300, world // 6)))
    return path


__all__ = ["plot_transfer_matrix"]
