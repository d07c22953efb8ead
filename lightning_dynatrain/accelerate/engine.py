"""``DynaTrainEngine`` for Accelerate: the loop engine (``loop.engine``) over a started ``Accelerator``.

Example::

    accelerator = Accelerator()
    engine = DynaTrainEngine(accelerator, DynaTrainPlugin(layout="dp2-tp2-pp1"), recipe=recipe, adam=adam)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_dynatrain.accelerate.library import AccelerateLibrary
from lightning_dynatrain.loop import engine as loop_engine

if TYPE_CHECKING:
    from accelerate import Accelerator

    from lightning_dynatrain.runtime.settings import DynaTrainSettings


class DynaTrainEngine(loop_engine.DynaTrainEngine):
    """``loop.engine.DynaTrainEngine`` whose library is ``accelerator`` (``AccelerateLibrary``); ``plugin``:
    the run's settings (``DynaTrainPlugin``; default: ``DYNATRAIN_*`` variables, else the defaults).
    Every other argument, and what it raises: the loop engine's."""

    def __init__(self, accelerator: "Accelerator", plugin: "DynaTrainSettings | None" = None, **kwargs: Any) -> None:
        super().__init__(AccelerateLibrary(accelerator), plugin, **kwargs)


__all__ = ["DynaTrainEngine"]
