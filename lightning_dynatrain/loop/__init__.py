"""A megatron-core GPT trained in a plain loop that a loop library owns (Accelerate, Lightning Fabric).

- ``engine``: ``DynaTrainEngine`` (the current layout's megatron state, its step, its switches);
- ``host``: ``LoopHost``, all the engine takes from the loop library (``accelerate/host.py``,
  ``fabric/host.py``);
- ``prepared``: the model, optimizer and scheduler the loop hands to ``accelerator.prepare`` or
  ``fabric.setup``, views of one engine that those leave unwrapped;
- ``data``: the loader of whole global batches;
- ``checkpoint``: the engine's layout-free checkpoint, for ``accelerator.save_state`` and ``fabric.save``;
- ``gather``: what every rank holds of one small value (the engine's agreement checks).
"""

from lightning_dynatrain.loop.engine import DataMismatchError, DynaTrainEngine, LoopSetupError
from lightning_dynatrain.loop.host import LoopHost

__all__ = ["DataMismatchError", "DynaTrainEngine", "LoopHost", "LoopSetupError"]
