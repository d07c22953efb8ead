"""``LoopHost``: what a training-loop library gives a ``DynaTrainEngine``.

The engine trains a megatron-core GPT inside processes and a default process group that someone
else started: Accelerate (``accelerate launch`` + ``Accelerator()``) or Lightning Fabric
(``fabric run`` / ``Fabric(...).launch()``). Everything the engine needs from that library goes
through this one small interface, so the step, the switches and the checkpoints read the same under
both; ``accelerate/host.py`` and ``fabric/host.py`` implement it.

What a host must not do: create or destroy the default process group after the engine is built,
wrap the engine's model in torch DDP, or shard its loader by world size (megatron's own DDP over
the layout's data-parallel group and the engine's slicing of the global batch do that work).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from lightning.fabric.plugins import ClusterEnvironment

    from lightning_dynatrain.loop.engine import DynaTrainEngine


@runtime_checkable
class LoopHost(Protocol):
    """The loop library's side of a ``DynaTrainEngine`` (see the module docstring).

    Attributes:
        device: where the engine builds the model and puts the loss (the process's accelerator).
        params_dtype: the dtype megatron builds the params in, from the host's precision setting,
            already checked (a setting the megatron step cannot honour raised in the host's
            constructor, with what to set instead).
        name: the loop library, for messages (``"Accelerate"``, ``"Fabric"``).
        plugin: the run's ``DynaTrainPlugin`` where the host holds the settings (Fabric's strategy
            does), else ``None`` (Accelerate: the engine's argument).
    """

    device: torch.device
    params_dtype: torch.dtype
    name: str
    plugin: Any  # the run's DynaTrainPlugin where the host holds it (Fabric's strategy), else None

    def print(self, text: str) -> None:
        """Print ``text`` once per node (its local rank 0), at once."""

    def describe(self) -> str:
        """How the processes run, for the engine's first line (e.g. ``"gloo, DistributedType.MULTI_CPU"``)."""

    def cluster_environment(self) -> "ClusterEnvironment":
        """Lightning's description of how the processes were started (the node map of ``gather_topology``)."""

    def attach(self, engine: "DynaTrainEngine") -> list[Callable[[], None]]:
        """Wire ``engine`` into the host's checkpointing; the callables that undo it (``engine.close``)."""


def as_host(obj: Any) -> LoopHost:
    """The ``LoopHost`` of a started ``Accelerator``, a launched ``Fabric``, or ``obj`` itself if it is one.

    Raises:
        TypeError: ``obj`` is none of them.
    """
    if isinstance(obj, LoopHost):
        return obj
    from lightning.fabric import Fabric

    if isinstance(obj, Fabric):
        from lightning_dynatrain.fabric.host import FabricHost

        return FabricHost(obj)
    from accelerate import Accelerator

    if isinstance(obj, Accelerator):
        from lightning_dynatrain.accelerate.host import AccelerateHost

        return AccelerateHost(obj)
    raise TypeError(f"DynaTrainEngine needs an Accelerator, a Fabric or a LoopHost, not {type(obj).__name__}. "
                    "HINT: build it with accelerate.Accelerator() or a launched "
                    "Fabric(strategy=DynaTrainFabricStrategy(...))")


__all__ = ["LoopHost", "as_host"]
