"""A matplotlib ``Figure`` that needs no GUI backend, or a ``PlotError`` that says how to get matplotlib.

Pictures are written from training processes and from the command line, where no display exists;
``matplotlib.figure.Figure`` draws with the Agg canvas by itself, so nothing here switches the
process-wide backend (``matplotlib.use``) behind the user's back.
"""

from __future__ import annotations

from typing import Any

from lightning_dynatrain.vps.errors import DynaTrainError


class PlotError(DynaTrainError):
    """A picture cannot be drawn (matplotlib is not installed)."""


def new_figure(width: float, height: float) -> Any:
    """A ``matplotlib.figure.Figure`` of ``width`` x ``height`` inches.

    Raises:
        PlotError: matplotlib is not installed.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise PlotError("drawing a picture needs matplotlib, which is not installed",
                        hint="pip install matplotlib (or the project's dev extra: pip install -e '.[dev]')") from err
    return Figure(figsize=(width, height))


__all__ = ["PlotError", "new_figure"]
