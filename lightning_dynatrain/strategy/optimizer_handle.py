"""The optimizer Lightning sees: a thin ``torch.optim.Optimizer`` in front of megatron's optimizer.

Lightning counts optimizer steps (``trainer.global_step`` under manual optimization) when a
``LightningOptimizer`` steps, drives learning-rate schedulers, checkpoints and monitors optimizers
it knows about. Megatron's optimizer is not a ``torch.optim.Optimizer`` and is rebuilt at every
layout switch, so Lightning gets this stable handle instead:

- ``DynaTrainOptimizer(OptimizerConfig(...))`` is what ``configure_optimizers`` returns (with a
  scheduler built on it, if any): megatron's settings, and one *schedule group* holding the rate
  and weight decay a scheduler sets (a torch ``LRScheduler`` such as ``LambdaLR``, or megatron's
  ``OptimizerParamScheduler``). At each step the strategy applies them to every megatron param
  group, times the group's ``lr_mult`` / ``wd_mult`` (no weight decay on biases and norms), as
  Megatron-LM's scheduler does. The schedule group is the same object at every layout, so a
  scheduler and ``LearningRateMonitor`` never see a switch.
- ``step(closure)`` runs the closure, which is the whole fused megatron step (forward/backward over
  micro-batches, finalize grads, optimizer step); ``zero_grad`` is a no-op (megatron zeroes its
  grad buffer at the start of each step). Lightning's ``on_before_optimizer_step`` hooks run after
  megatron's step inside the closure (megatron's step is one call).

The strategy binds it to a layout's megatron optimizer (``rebind``) at set-up and after every switch.

Example::

    def configure_optimizers(self):
        optimizer = DynaTrainOptimizer(OptimizerConfig(optimizer="adam", lr=3e-4, weight_decay=0.1, clip_grad=1.0))
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 100))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from megatron.core.optimizer import OptimizerConfig

    from lightning_dynatrain.megatron.state import MegatronState
    from lightning_dynatrain.runtime.recipe import AdamSettings


class DynaTrainOptimizer(torch.optim.Optimizer):
    """Lightning's view of megatron's optimizer at whatever layout runs (see the module docstring).

    Args:
        config: megatron's ``OptimizerConfig`` (its ``lr`` and ``weight_decay`` start the schedule
            group), or ``AdamSettings``.
    """

    def __init__(self, config: "OptimizerConfig | AdamSettings") -> None:  # no super().__init__: megatron owns the params
        from lightning_dynatrain.runtime.recipe import optimizer_config

        self.config = optimizer_config(config)
        self.defaults: dict[str, Any] = {}
        self.state: dict = {}  # Lightning moves ``state`` between devices; megatron's stays where it is
        self._groups = [{"params": [], "lr": self.config.lr, "weight_decay": self.config.weight_decay,
                         "lr_mult": 1.0, "wd_mult": 1.0}]
        self._megatron: "MegatronState | None" = None

    def rebind(self, state: "MegatronState") -> None:
        """Point at the optimizer of a layout (at set-up and after a switch)."""
        self._megatron = state

    @property
    def megatron_state(self) -> "MegatronState":
        if self._megatron is None:
            raise RuntimeError("DynaTrainOptimizer is bound to megatron's optimizer in DynaTrainStrategy.setup(); "
                               "the Trainer has not reached it")
        return self._megatron

    @property
    def param_groups(self) -> list[dict]:  # type: ignore[override]
        """The schedule group (one): the rate and weight decay schedulers set."""
        return self._groups

    @param_groups.setter
    def param_groups(self, value: list[dict]) -> None:  # torch's __setstate__ may assign it
        pass

    @property
    def scheduled(self) -> tuple[float, float]:
        """``(lr, weight_decay)`` the schedule gives the next step."""
        group = self._groups[0]
        return float(group["lr"]), float(group["weight_decay"])

    def load_schedule(self, saved: dict) -> None:
        """The schedule group's values as a checkpoint saved them (``schedule_state``)."""
        self._groups[0].update({k: saved[k] for k in ("lr", "weight_decay", "initial_lr") if k in saved})

    def schedule_state(self) -> dict:
        """The schedule group's values, without params: layout-free, for a checkpoint."""
        return {k: v for k, v in self._groups[0].items() if k != "params"}

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        if closure is None:
            raise RuntimeError(
                "DynaTrainOptimizer.step() needs the closure that runs the megatron step. "
                "HINT: call DynaTrainStrategy.train_step(batch) from training_step instead"
            )
        return closure()

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        from lightning_dynatrain.runtime.steps import optimizer_state_dict

        return optimizer_state_dict(self.megatron_state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from lightning_dynatrain.runtime.steps import load_optimizer_state_dict

        load_optimizer_state_dict(self.megatron_state, state_dict)

    def __repr__(self) -> str:
        where = f"{self._megatron.layout}, {type(self._megatron.optimizer).__name__}" if self._megatron else "unbound"
        return f"DynaTrainOptimizer({self.config.optimizer}, {where})"


def handle_for(given: Any, optimizers: list, schedulers: list) -> tuple[DynaTrainOptimizer, list]:
    """The handle and learning-rate scheduler configs for what ``configure_optimizers()`` returned
    (``given``): megatron's ``OptimizerConfig`` (constant rate) and ``AdamSettings`` (the GPT preset's,
    which sets each step's rate itself) get a handle of their own; any other form is parsed by
    Lightning first (``optimizers``, ``schedulers``), and must hold one ``DynaTrainOptimizer``.

    Raises:
        TypeError: ``given`` is none of these.
    """
    from megatron.core.optimizer import OptimizerConfig

    from lightning_dynatrain.runtime.recipe import AdamSettings

    if isinstance(given, (AdamSettings, OptimizerConfig)):
        return DynaTrainOptimizer(given), []
    handles = [o for o in optimizers if isinstance(o, DynaTrainOptimizer)]
    if len(optimizers) != 1 or not handles:
        raise TypeError(
            "under DynaTrainStrategy, configure_optimizers() returns one DynaTrainOptimizer (optionally with "
            f"LR schedulers built on it), megatron's OptimizerConfig or AdamSettings; got {given!r}. HINT: "
            "return DynaTrainOptimizer(OptimizerConfig(optimizer='adam', lr=...)); the strategy builds "
            "megatron's optimizer for each layout")
    return handles[0], list(schedulers)


__all__ = ["DynaTrainOptimizer", "handle_for"]
