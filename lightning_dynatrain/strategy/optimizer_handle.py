"""The optimizer Lightning sees: a thin ``torch.optim.Optimizer`` in front of megatron's optimizer.

Lightning counts optimizer steps (``trainer.global_step`` under manual optimization) when a
``LightningOptimizer`` steps, and checkpoints, monitors and moves optimizers it knows about. Megatron's
optimizer is not a ``torch.optim.Optimizer`` and is rebuilt at every layout switch, so Lightning gets
this stable handle instead: ``step(closure)`` runs the closure, which is the whole fused megatron step
(forward/backward over micro-batches, finalize grads, optimizer step); ``param_groups`` are megatron's
(for ``LearningRateMonitor``); ``state_dict`` is this rank's state. A switch calls ``rebind(new_state)``.

Consequence: Lightning's ``on_before_optimizer_step`` hooks run after megatron's step inside the
closure (megatron's step is one call), and ``zero_grad`` is a no-op (megatron zeroes its grad buffer
at the start of each step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from lightning_dynatrain.megatron.state import MegatronState


class MegatronOptimizerHandle(torch.optim.Optimizer):
    """Lightning's view of the current layout's megatron optimizer (see module docstring)."""

    def __init__(self, state: "MegatronState") -> None:  # no super().__init__: megatron owns the params
        self.defaults: dict[str, Any] = {}
        self.state: dict = {}  # Lightning moves ``state`` between devices; megatron's stays where it is
        self._megatron = state

    def rebind(self, state: "MegatronState") -> None:
        """Point at the optimizer of a new layout (after a switch)."""
        self._megatron = state

    @property
    def megatron_state(self) -> "MegatronState":
        return self._megatron

    @property
    def param_groups(self) -> list[dict]:  # type: ignore[override]
        return self._megatron.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict]) -> None:  # torch's __setstate__ may assign it
        pass

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        if closure is None:
            raise RuntimeError(
                "MegatronOptimizerHandle.step() needs the closure that runs the megatron step. "
                "HINT: call DynaTrainStrategy.train_step(batch, lr=...) from training_step instead"
            )
        return closure()

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        from lightning_dynatrain.strategy.megatron_step import optimizer_state_dict

        return optimizer_state_dict(self._megatron)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from lightning_dynatrain.strategy.megatron_step import load_optimizer_state_dict

        load_optimizer_state_dict(self._megatron, state_dict)

    def __repr__(self) -> str:
        return f"MegatronOptimizerHandle({self._megatron.layout}, {type(self._megatron.optimizer).__name__})"


__all__ = ["MegatronOptimizerHandle"]
