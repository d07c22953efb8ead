"""``FabricLibrary``: a launched ``Fabric`` with ``DynaTrainFabricStrategy`` as the ``LoopLibrary`` of a ``DynaTrainEngine``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch.distributed as dist

from lightning_dynatrain.fabric.strategy import DynaTrainFabricStrategy, FabricSetupError
from lightning_dynatrain.launch_environment import ElasticEnvironment, launch_of, set_rank_zero

if TYPE_CHECKING:
    from lightning.fabric import Fabric

    from lightning_dynatrain.elastic.driver.front import Launch
    from lightning_dynatrain.elastic.session import ElasticSession
    from lightning_dynatrain.loop.engine import DynaTrainEngine


class FabricLibrary:
    """The ``LoopLibrary`` of a launched ``Fabric`` whose strategy is a ``DynaTrainFabricStrategy``;
    the run's settings are the strategy's ``settings``.

    Raises:
        FabricSetupError: another strategy, or ``fabric.launch()`` has not run (no process group; an
            elastic run's comes from the job's store when the engine enters the job).
    """

    name = "Fabric"

    def __init__(self, fabric: "Fabric") -> None:
        strategy = fabric.strategy
        if not isinstance(strategy, DynaTrainFabricStrategy):
            raise FabricSetupError(
                f"Fabric runs {type(strategy).__name__}, which wraps the model in its own way",
                hint="build Fabric(strategy=DynaTrainFabricStrategy(layout=..., schedule=...), ...); the layout "
                "comes from the strategy")
        if strategy.elastic is None and not (dist.is_available() and dist.is_initialized()):
            raise FabricSetupError("torch.distributed is not initialised: Fabric has not been launched",
                                   hint="call fabric.launch() before building the DynaTrainEngine")
        self.fabric, self.strategy = fabric, strategy
        self.params_dtype = strategy.params_dtype
        self.device = fabric.device
        self.settings = strategy.settings
        self.elastic = strategy.elastic

    def print(self, text: str) -> None:
        self.fabric.print(text, flush=True)

    def describe(self) -> str:
        return f"{dist.get_backend()}, Fabric under {type(self.strategy.cluster_environment).__name__}"

    def node_rank(self) -> int:
        return self.strategy.cluster_environment.node_rank()

    def attach(self, engine: "DynaTrainEngine") -> list[Callable[[], None]]:
        return self.strategy.attach_engine(engine)

    def launch(self) -> "Launch":
        """This process as its launcher started it (``LauncherError`` under Fabric's own launcher of
        more than one process: ``fabric run`` and ``torchrun`` start each process on its own)."""
        strategy = self.strategy
        return launch_of(strategy.cluster_environment, backend=lambda: strategy.elastic_backend,
                         device=lambda: strategy.root_device, timeout=strategy.collective_timeout, library="Fabric")

    def follow(self, session: "ElasticSession") -> None:
        """``fabric.world_size`` and ``fabric.global_rank`` are the job's from now on, and Lightning's
        rank-zero-only helpers follow this process's rank."""
        strategy = self.strategy
        if not isinstance(strategy.cluster_environment, ElasticEnvironment):
            strategy.cluster_environment = ElasticEnvironment(strategy.cluster_environment, session)
        set_rank_zero(session.rank)


__all__ = ["FabricLibrary"]
