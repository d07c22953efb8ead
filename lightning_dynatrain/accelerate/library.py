"""``AccelerateLibrary``: an ``Accelerator`` as the ``LoopLibrary`` of a ``DynaTrainEngine``.

It checks the Accelerator once (``environment.check_accelerator``: what the megatron step cannot
honour is refused with a fix), and wires the engine into ``save_state``/``load_state``: the hooks of
``checkpoint.py`` (the engine's layout-free checkpoint) and the run's progress through ``register_for_checkpointing``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch.distributed as dist

from lightning_dynatrain.accelerate.environment import accelerator_facts, check_accelerator, cluster_environment

if TYPE_CHECKING:
    from accelerate import Accelerator

    from lightning_dynatrain.loop.engine import DynaTrainEngine


class AccelerateLibrary:
    """The ``LoopLibrary`` of a started ``Accelerator``.

    Raises:
        AcceleratorSetupError: the Accelerator cannot run the megatron step (no process group,
            DeepSpeed/FSDP, gradient accumulation, fp16).
    """

    name = "Accelerate"
    settings = None  # the engine's argument carries them (a ``DynaTrainPlugin``)

    def __init__(self, accelerator: "Accelerator") -> None:
        from lightning_dynatrain.warning_filters import quiet_third_party_warnings

        self.params_dtype = check_accelerator(**accelerator_facts(accelerator))
        self.accelerator = accelerator
        self.device = accelerator.device
        quiet_third_party_warnings(on_cpu=self.device.type == "cpu")

    def print(self, text: str) -> None:
        self.accelerator.print(text, flush=True)

    def describe(self) -> str:
        return f"{dist.get_backend()}, {self.accelerator.distributed_type}"

    def node_rank(self) -> int:
        return cluster_environment().node_rank()

    def attach(self, engine: "DynaTrainEngine") -> list[Callable[[], None]]:
        from lightning_dynatrain.accelerate.checkpoint import register_checkpoint_hooks

        hooks = register_checkpoint_hooks(self.accelerator, engine)
        self.accelerator.register_for_checkpointing(engine)  # the run's progress (engine.state_dict)
        return [hook.remove for hook in hooks]


__all__ = ["AccelerateLibrary"]
