"""``DynaTrainEngine`` for Lightning Fabric: the loop engine (``loop.engine``) over a launched ``Fabric``.

Example::

    fabric = Fabric(accelerator="cpu", devices=4, strategy=DynaTrainFabricStrategy(layout="dp2-tp2-pp1"))
    fabric.launch()
    engine = DynaTrainEngine(fabric, recipe=recipe, adam=adam)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_dynatrain.fabric.library import FabricLibrary
from lightning_dynatrain.loop import engine as loop_engine

if TYPE_CHECKING:
    from lightning.fabric import Fabric


class DynaTrainEngine(loop_engine.DynaTrainEngine):
    """``loop.engine.DynaTrainEngine`` whose library is ``fabric`` (``FabricLibrary``: its strategy, a
    ``DynaTrainFabricStrategy``, holds the run's settings). Every other argument, and what it raises:
    the loop engine's."""

    def __init__(self, fabric: "Fabric", **kwargs: Any) -> None:
        super().__init__(FabricLibrary(fabric), **kwargs)


__all__ = ["DynaTrainEngine"]
