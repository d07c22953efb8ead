"""What a loop hands to ``accelerator.prepare`` or ``fabric.setup``: a model, an optimizer and a
scheduler that are views of one ``DynaTrainEngine``, which neither library wraps.

``Accelerator.prepare`` wraps a trainable ``nn.Module`` in torch DDP over the whole world, wraps an
optimizer in ``AcceleratedOptimizer``, a scheduler in ``AcceleratedScheduler`` (which steps it once
per process), and shards a ``DataLoader`` by world size: under tensor and pipeline parallelism the
first gives every rank a replica's gradient all-reduce over ranks that hold different shards, and
the last hands the ranks of one tensor-parallel group different rows. What ``prepare`` does
instead, object by object (Accelerate 1.15):

- ``DynaTrainModel`` and ``LoopOptimizer`` carry the mark ``prepare_model``/``prepare_optimizer``
  read to avoid wrapping twice (``compat.accelerate_internals.mark_prepared``): they are recorded
  (``accelerator._models``/``_optimizers``, so ``save_state``/``load_state`` see them) and returned
  as they are -- no DDP, no device move, no autocast;
- ``DynaTrainScheduler`` is not a torch ``LRScheduler``: ``prepare`` returns it untouched;
- the loader of ``engine.dataloader`` (``data.global_batch_loader``) carries the same mark: every
  rank keeps the whole global batch, the engine cuts the current layout's data-parallel share.

Under Fabric, ``DynaTrainFabricStrategy`` does the same from the strategy's side: ``fabric.setup``
puts Fabric's thin wrappers around the model and optimizer (calls pass through) but no DDP, no
device move and no precision context, and ``fabric.setup_dataloaders`` adds no distributed sampler.

The loop is Accelerate's Megatron-LM loop: ``model(batch)`` in training mode runs the whole
megatron step (forward and backward over the micro-batches through the pipeline schedule,
finalize grads, optimizer step) and returns the loss; ``accelerator.backward(loss)`` /
``fabric.backward(loss)`` and ``optimizer.zero_grad()`` have nothing left to do; ``optimizer.step()``
is the step boundary, where a scheduled layout switch runs; ``scheduler.step()`` has nothing to do
(the step's LR is ``lr_at(step)``, set inside the fused step). After ``model.eval()``, ``model(batch)``
is the batch's forward-only loss (megatron's forward-only schedule across pipeline stages).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lightning_dynatrain.compat.accelerate_internals import mark_prepared

if TYPE_CHECKING:
    from lightning_dynatrain.loop.engine import DynaTrainEngine
    from lightning_dynatrain.runtime.reconfig_report import ReconfigReport


class DynaTrainModel(torch.nn.Module):
    """The model a loop calls: ``loss = model(batch)`` runs one whole optimizer step in training
    mode; after ``model.eval()`` it is the forward-only loss of the batch (``engine.eval_step``).

    It registers no parameters of its own (the shard changes at every switch; ``shard`` is the
    current one), so ``state_dict()`` is empty: checkpoints go through ``save_state``, whose hook
    writes the engine's layout-free checkpoint (``checkpoint.py``), never through ``accelerator.save_model``.
    Under Fabric, ``fabric.save`` does the same through the strategy.
    """

    def __init__(self, engine: "DynaTrainEngine") -> None:
        super().__init__()
        self._engine = engine  # not a Module: not registered as a child
        mark_prepared(self)

    @property
    def engine(self) -> "DynaTrainEngine":
        return self._engine

    @property
    def shard(self) -> torch.nn.Module:
        """This rank's ``GPTModel`` shard at the current layout."""
        return self._engine.state.model

    def forward(self, batch: dict[str, torch.Tensor] | None = None, **tensors: torch.Tensor) -> torch.Tensor:
        """One optimizer step over the global batch (``model(batch)`` or ``model(**batch)``) in
        training mode; in eval mode the batch's loss, forward only (nothing trains).

        Returns:
            The global mean loss as a 0-dim tensor on the library's device. In training mode it is a
            leaf that requires grad, so ``accelerator.backward(loss)`` (``fabric.backward``) runs
            and changes nothing: the step ran.
        """
        batch = batch if batch is not None else tensors
        if not self.training:
            return torch.tensor(self._engine.eval_step(batch), dtype=torch.float32, device=self._engine.library.device)
        loss = self._engine.train_step(batch)
        return torch.tensor(loss, dtype=torch.float32, device=self._engine.library.device, requires_grad=True)

    def extra_repr(self) -> str:
        return repr(self._engine)


class LoopOptimizer(torch.optim.Optimizer):
    """The optimizer a loop steps: the current layout's megatron optimizer, seen through the engine.

    ``step()`` marks the step boundary (a scheduled switch due now runs); ``zero_grad()`` does
    nothing (megatron zeroes its gradient buffer at the start of each step); ``param_groups`` are
    megatron's current ones (their ``lr`` is set at each step). ``state_dict()`` says where it was
    written (layout and world size), the same on every rank, because Accelerate and Fabric write
    rank 0's copy and load it on every rank; the sharded Adam state goes to the engine's
    layout-free checkpoint (``checkpoint.py``).
    """

    def __init__(self, engine: "DynaTrainEngine") -> None:  # no super().__init__: megatron owns the params
        self.defaults: dict[str, Any] = {}
        self.state: dict = {}
        self._engine = engine
        mark_prepared(self)

    @property
    def param_groups(self) -> list[dict]:  # type: ignore[override]
        return self._engine.state.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict]) -> None:  # torch's __setstate__ may assign it
        pass

    @property
    def step_was_skipped(self) -> bool:
        """Read by ``accelerator.optimizer_step_was_skipped``: megatron's fp32/bf16 step never skips."""
        return False

    def step(self, closure: Any = None) -> "ReconfigReport | None":  # type: ignore[override]
        """The step boundary: the switch the schedule has due now, if any (its report)."""
        if closure is not None:
            raise TypeError("LoopOptimizer.step() takes no closure. HINT: model(batch) (or "
                            "engine.train_step(batch)) runs the whole megatron step; step() only marks its end")
        return self._engine.step_boundary()

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"layout": str(self._engine.layout), "world_size": self._engine.world_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore: the Adam state came with the engine's checkpoint (any layout and world size).

        Raises:
            CheckpointError: ``state_dict`` was not written by a ``LoopOptimizer``.
        """
        from lightning_dynatrain.checkpoint.identity import CheckpointError

        if not {"layout", "world_size"} <= set(state_dict):
            raise CheckpointError(f"the optimizer's saved state has keys {sorted(state_dict)}, not a "
                                  "LoopOptimizer's", hint="load a checkpoint written by save_state or fabric.save "
                                  "of a DynaTrainEngine run")

    def __repr__(self) -> str:
        return f"LoopOptimizer({self._engine.layout}, {type(self._engine.state.optimizer).__name__})"


class DynaTrainScheduler:
    """The LR scheduler an Accelerate loop steps, as ``MegatronLMDummyScheduler`` stands in for
    Megatron-LM's: the fused step sets step ``k``'s learning rate to ``lr_at(k)`` itself, so
    ``step()`` does nothing and the schedule cannot drift from the step count (a switch or a
    resume leaves it untouched)."""

    def __init__(self, engine: "DynaTrainEngine") -> None:
        self._engine = engine

    def step(self, *args: Any, **kwargs: Any) -> None:
        pass

    def get_last_lr(self) -> list[float]:
        """The learning rate the next optimizer step trains with (before megatron's per-group ``lr_mult``)."""
        return [self._engine.lr_at(self._engine.step)]

    def state_dict(self) -> dict[str, Any]:
        return {}  # the step count is the engine's progress

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


__all__ = ["DynaTrainModel", "DynaTrainScheduler", "LoopOptimizer"]
