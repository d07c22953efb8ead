"""An RL run's reward curve with its phases marked, written as a PNG.

The x axis is wall-clock seconds since the run's first iteration; each iteration's rollout phase
(entering it, generating, leaving it) is shaded orange and its training step blue, so a reader sees
the reward climb and, beside it, how the time of each iteration splits between the two layouts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lightning_dynatrain.viz.figure import new_figure


@dataclass(frozen=True, kw_only=True)
class RLIteration:
    """One iteration of an RL run, in seconds since the run's first iteration began."""

    iteration: int
    reward: float
    rollout_start: float
    rollout_end: float
    train_end: float


def plot_rewards(path: str | Path, rows: Sequence[RLIteration], *, rollout_layout: str, train_layout: str,
                 title: str | None = None) -> Path:
    """Draw ``rows`` into the PNG file ``path``: the mean reward at the end of each iteration, the
    rollout phases and training steps shaded; returns the path.

    Raises:
        PlotError: matplotlib is not installed.
    """
    fig = new_figure(9, 4.5)
    ax = fig.add_subplot()
    for i, row in enumerate(rows):
        ax.axvspan(row.rollout_start, row.rollout_end, color="tab:orange", alpha=0.25, lw=0,
                   label=f"rollout at {rollout_layout}" if i == 0 else None)
        ax.axvspan(row.rollout_end, row.train_end, color="tab:blue", alpha=0.12, lw=0,
                   label=f"training at {train_layout}" if i == 0 else None)
    ax.plot([r.train_end for r in rows], [r.reward for r in rows], marker=".", lw=1.2, color="black",
            label="mean reward of the rollout")
    ax.set(xlabel="seconds", ylabel="mean reward", ylim=(-0.02, 1.02), title=title or "GRPO reward")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


__all__ = ["RLIteration", "plot_rewards"]
