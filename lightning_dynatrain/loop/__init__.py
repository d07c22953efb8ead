"""A megatron-core model trained in a plain loop that a loop library owns (Accelerate, Lightning Fabric).

- ``engine``: ``DynaTrainEngine`` (the run at its current layout, its steps, its switches: a
  ``runtime.training_run.TrainingRun`` with the schedule and the progress a loop keeps);
- ``library``: ``LoopLibrary``, all the engine takes from the loop library (``accelerate/library.py``,
  ``fabric/library.py``; each of those packages has a ``DynaTrainEngine`` over its library's object);
- ``prepared``: the model, optimizer and scheduler the loop hands to ``accelerator.prepare`` or
  ``fabric.setup``, views of one engine that those leave unwrapped;
- ``data``: the loader of whole global batches;
- ``checkpoint``: the engine's layout-free checkpoint, for ``accelerator.save_state`` and ``fabric.save``;
- ``gather``: what every rank holds of one small value (the engine's agreement checks);
- ``elastic_front``: ``LoopFront``, what the elastic driver needs of the engine (an elastic run).
"""

from lightning_dynatrain.loop.engine import DataMismatchError, DynaTrainEngine, LoopSetupError
from lightning_dynatrain.loop.library import LoopLibrary

__all__ = ["DataMismatchError", "DynaTrainEngine", "LoopLibrary", "LoopSetupError"]
