"""What the integration takes from an ``Accelerator``: its processes, device, precision and node map.

Accelerate owns the processes and the default process group (``accelerate launch`` starts them,
``Accelerator()`` initialises ``torch.distributed``: gloo under ``MULTI_CPU``, nccl under
``MULTI_GPU``); the integration builds megatron's groups inside that world and never creates or
destroys the default group. ``check_accelerator`` refuses the settings the megatron step cannot
honour, each with the rule and a fix:

- no process group (``python script.py``, or ``accelerate launch --cpu``, which starts ONE process):
  launch with ``accelerate launch --multi_gpu --num_processes N`` (``Accelerator(cpu=True)`` in the
  script on a machine without GPUs gives N processes in Accelerate's ``MULTI_CPU`` mode);
- Accelerate's own sharding engines (DeepSpeed, FSDP, Megatron-LM, XLA): the layout is ours;
- ``gradient_accumulation_steps > 1``: megatron accumulates micro-batches inside one step, so the
  batch sizes of ``MegatronRecipe`` say it (global batch = dp * micro batch * micro-batches);
- ``mixed_precision`` other than ``"no"`` and ``"bf16"``: megatron trains fp32, or bf16 params with
  fp32 main params (its own mixed precision: Accelerate's autocast is never applied).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from lightning_dynatrain.vps.errors import DynaTrainError

if TYPE_CHECKING:
    from accelerate import Accelerator
    from lightning.fabric.plugins import ClusterEnvironment

#: Accelerate's ``mixed_precision`` -> the dtype megatron builds the params in
PARAMS_DTYPES = {"no": torch.float32, "bf16": torch.bfloat16}
_FOREIGN_ENGINES = ("DEEPSPEED", "FSDP", "MEGATRON_LM", "XLA")


class AcceleratorSetupError(DynaTrainError):
    """The ``Accelerator`` (or how it was launched) is set up in a way the megatron step cannot use."""


def params_dtype_for(mixed_precision: str | None) -> torch.dtype:
    """The dtype megatron builds the params in for Accelerate's ``mixed_precision``.

    >>> params_dtype_for("bf16")
    torch.bfloat16

    Raises:
        AcceleratorSetupError: fp16 or fp8 (megatron's loss scaling and fp8 recipes are not wired here).
    """
    key = "no" if mixed_precision in (None, "no") else str(mixed_precision)
    if key not in PARAMS_DTYPES:
        raise AcceleratorSetupError(
            f"Accelerator(mixed_precision={mixed_precision!r}) is not supported by the megatron step",
            hint='use mixed_precision="no" (fp32) or "bf16" (bf16 params with fp32 main params, megatron\'s own)')
    return PARAMS_DTYPES[key]


def check_accelerator(*, distributed_type: str, gradient_accumulation_steps: int, mixed_precision: str | None,
                      initialized: bool) -> torch.dtype:
    """Refuse what the megatron step cannot honour (module docstring); the params dtype.

    Plain values, so it can be checked without processes: ``check_accelerator(**accelerator_facts(acc))``.

    Raises:
        AcceleratorSetupError: the rule broken, with how to launch or configure instead.
    """
    kind = str(distributed_type).rsplit(".", 1)[-1]
    if kind in _FOREIGN_ENGINES:
        raise AcceleratorSetupError(
            f"the Accelerator runs {kind}, which shards the model its own way",
            hint="launch with plain data-parallel settings (accelerate launch --multi_gpu ...); the layout comes "
            "from DynaTrainPlugin")
    if not initialized or kind == "NO":
        raise AcceleratorSetupError(
            "torch.distributed is not initialised: the Accelerator runs a single process without a process group",
            hint="launch with `accelerate launch --multi_gpu --num_processes N script.py` (on CPU keep "
            "Accelerator(cpu=True) in the script: that gives N processes in MULTI_CPU mode; `--cpu` starts one)")
    if gradient_accumulation_steps != 1:
        raise AcceleratorSetupError(
            f"gradient_accumulation_steps={gradient_accumulation_steps}: megatron accumulates micro-batches inside "
            "each step", hint="keep gradient_accumulation_steps=1 and set MegatronRecipe(global_batch_size=..., "
            "micro_batch_size=...): micro-batches per step = global // (dp * micro)")
    return params_dtype_for(mixed_precision)


def accelerator_facts(accelerator: "Accelerator") -> dict:
    """``check_accelerator``'s keyword arguments, read from ``accelerator``."""
    return dict(distributed_type=str(accelerator.distributed_type),
                gradient_accumulation_steps=accelerator.gradient_accumulation_steps,
                mixed_precision=accelerator.mixed_precision,
                initialized=dist.is_available() and dist.is_initialized())


def cluster_environment() -> "ClusterEnvironment":
    """Lightning's description of how the processes were started, for the node map (``gather_topology``).

    ``accelerate launch`` starts processes through torch's elastic agent (``GROUP_RANK`` is the node);
    under ``srun`` SLURM's variables say it; otherwise every process counts as node ``NODE_RANK`` (0).
    """
    from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment, TorchElasticEnvironment

    if TorchElasticEnvironment.detect():
        return TorchElasticEnvironment()
    if SLURMEnvironment.detect():
        return SLURMEnvironment()
    return LightningEnvironment()


__all__ = ["AcceleratorSetupError", "PARAMS_DTYPES", "accelerator_facts", "check_accelerator", "cluster_environment",
           "params_dtype_for"]
