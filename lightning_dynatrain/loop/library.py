"""``LoopLibrary``: what a training-loop library gives a ``DynaTrainEngine``.

The engine trains a megatron-core model inside processes and a default process group that someone
else started: Accelerate (``accelerate launch`` + ``Accelerator()``) or Lightning Fabric
(``fabric run`` / ``Fabric(...).launch()``). Everything the engine needs from that library goes
through this one small interface, so the step, the switches and the checkpoints read the same under
both; ``accelerate/library.py`` and ``fabric/library.py`` implement it, and each of those packages
has a ``DynaTrainEngine`` that takes its library's own object (an ``Accelerator``, a ``Fabric``).

What a library must not do: create or destroy the default process group after the engine is built,
wrap the engine's model in torch DDP, or shard its loader by world size (megatron's own DDP over
the layout's data-parallel group and the engine's slicing of the global batch do that work).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from lightning_dynatrain.elastic.driver.front import Launch
    from lightning_dynatrain.elastic.driver.options import ElasticOptions
    from lightning_dynatrain.elastic.session import ElasticSession
    from lightning_dynatrain.loop.engine import DynaTrainEngine
    from lightning_dynatrain.runtime.settings import DynaTrainSettings


@runtime_checkable
class LoopLibrary(Protocol):
    """The loop library's side of a ``DynaTrainEngine`` (see the module docstring).

    Attributes:
        device: where the engine builds the model and puts the loss (the process's accelerator).
        params_dtype: the dtype megatron builds the params in, from the library's precision setting,
            already checked (a setting the megatron step cannot honour raised in the library's
            constructor, with what to set instead).
        name: the loop library, for messages (``"Accelerate"``, ``"Fabric"``).
        settings: the run's ``DynaTrainSettings`` where the library holds them (Fabric's strategy
            does), else ``None`` (Accelerate: the engine's argument).
    """

    device: torch.device
    params_dtype: torch.dtype
    name: str
    settings: "DynaTrainSettings | None"

    def print(self, text: str) -> None:
        """Print ``text`` once per node (its local rank 0), at once."""

    def describe(self) -> str:
        """How the processes run, for the engine's first line (e.g. ``"gloo, DistributedType.MULTI_CPU"``)."""

    def node_rank(self) -> int:
        """This process's node, as its launcher numbers nodes (the node map of ``gather_topology``)."""

    def attach(self, engine: "DynaTrainEngine") -> list[Callable[[], None]]:
        """Wire ``engine`` into the library's checkpointing; the callables that undo it (``engine.close``)."""


@runtime_checkable
class ElasticLoopLibrary(LoopLibrary, Protocol):
    """A ``LoopLibrary`` that can carry an elastic run (Fabric's; Accelerate's cannot: its state keeps
    the process count it started with). The engine is elastic where ``elastic`` is set.

    Attributes:
        elastic: the options of an elastic run (``ElasticOptions``: the job's store makes the worlds,
            the library made no process group), or ``None``.
    """

    elastic: "ElasticOptions | None"

    def launch(self) -> "Launch":
        """This process as the library's launcher started it."""

    def follow(self, session: "ElasticSession") -> None:
        """The world size and rank the library reports are ``session``'s from now on."""


def elastic_options(library: LoopLibrary) -> "ElasticOptions | None":
    """The options of ``library``'s elastic run, or ``None`` where it has none (or cannot carry one)."""
    return library.elastic if isinstance(library, ElasticLoopLibrary) else None


def as_library(obj: Any) -> LoopLibrary:
    """``obj`` if it is a ``LoopLibrary``.

    Raises:
        TypeError: ``obj`` is not one (an ``Accelerator`` or a ``Fabric`` goes to the ``DynaTrainEngine``
            of ``lightning_dynatrain.accelerate`` or ``lightning_dynatrain.fabric``, which wrap it).
    """
    if isinstance(obj, LoopLibrary):
        return obj
    raise TypeError(f"lightning_dynatrain.loop.DynaTrainEngine needs a LoopLibrary, not {type(obj).__name__}. "
                    "HINT: build the engine with lightning_dynatrain.accelerate.DynaTrainEngine(accelerator, ...) or "
                    "lightning_dynatrain.fabric.DynaTrainEngine(fabric, ...)")


__all__ = ["ElasticLoopLibrary", "LoopLibrary", "as_library", "elastic_options"]
