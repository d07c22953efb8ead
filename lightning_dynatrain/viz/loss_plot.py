"""The loss curve of a run with its layout switches marked, written as a PNG.

Each switch is a dashed red line at its step, labelled with its two layouts and its seconds, so a
reader sees at a glance that the loss goes on where it was (the switch moved the state, it did not
restart training).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_dynatrain.viz.figure import new_figure


def plot_loss(path: str | Path, rows: Sequence[tuple[int, float, str]], switches: Sequence[Any], *,
              title: str | None = None) -> Path:
    """Draw ``rows`` (step, loss, layout) and ``switches`` (objects with ``step``, ``src``, ``dst``,
    ``seconds``: ``ReconfigReport``) into the PNG file ``path``; returns the path.

    Raises:
        PlotError: matplotlib is not installed.
    """
    fig = new_figure(9, 4.5)
    ax = fig.add_subplot()
    steps, losses = [r[0] for r in rows], [r[1] for r in rows]
    ax.plot(steps, losses, lw=1.0, color="tab:blue", label="train loss (global batch mean)")
    top = max(losses) if losses else 1.0
    for s in switches:
        ax.axvline(s.step, color="tab:red", ls="--", lw=0.8)
        ax.annotate(f"{s.src}\n-> {s.dst}\n{s.seconds:.2f} s", (s.step, top), fontsize=7, color="tab:red",
                    xytext=(3, -4), textcoords="offset points", va="top")
    start = rows[0][2] if rows else ""
    ax.set(xlabel="optimizer step", ylabel="loss (nats / byte)",
           title=title or f"byte-level GPT on the stdlib, start {start}")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left")  # the switch labels sit at the top
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


__all__ = ["plot_loss"]
