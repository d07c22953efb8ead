"""Third-party warnings and logged notices this project's runs trigger and cannot change, each
silenced by name and reason.

A training run here prints nothing a user has to act on. The project's own code triggers no
warning (it is fixed instead, and ``tests/test_demo.py`` turns the project's warnings into errors);
what is left comes from megatron-core, torch and Lightning, at the oldest and the newest tested
versions (a filter for a release that does not say it matches nothing). Each filter below names its
category, the module the warning is attributed to and the start of its message, and says why it is
safe to hide; nothing is filtered by category or module alone. Notices megatron and torch *log* at
warning level (``logging``, not ``warnings``) are ``QuietLog``: a logger's name and the start of the
message, with the reason, installed as a ``logging.Filter`` on that logger alone.

``quiet_third_party_warnings`` installs them (idempotent; ``warnings.filterwarnings`` drops a
duplicate before inserting). Importing ``lightning_dynatrain`` installs those that hold on every
device, before any of its modules imports megatron-core; ``DynaTrainStrategy.setup_environment``
(``DynaTrainFabricStrategy``'s, ``AccelerateHost``) adds the ones marked ``cpu_only`` once it knows
the run has no GPU: they are about GPU kernels or CUDA settings, real advice on a GPU.
"""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class QuietWarning:
    """One third-party warning to hide.

    Attributes:
        category: the warning's class.
        module: regular expression matched against the start of the module the warning is
            attributed to (``warnings.filterwarnings``' ``module``).
        message: the warning's first words (matched literally at the start of its text).
        why: why hiding it loses the user nothing.
        cpu_only: hide it only when the run uses no GPU.
    """

    category: type[Warning]
    module: str
    message: str
    why: str
    cpu_only: bool = False

    def install(self) -> None:
        warnings.filterwarnings("ignore", message=re.escape(self.message), category=self.category,
                                module=self.module)


@dataclass(frozen=True, slots=True)
class QuietLog(logging.Filter):
    """One third-party logged notice to hide: records of ``logger`` whose message starts with
    ``message``; the logger's other records pass.

    Attributes:
        logger: the logger's name (the module that logs, ``logging.getLogger(__name__)``).
        message: the notice's first words.
        why: why hiding it loses the user nothing.
        cpu_only: hide it only when the run uses no GPU.
    """

    logger: str
    message: str
    why: str
    cpu_only: bool = False

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.message)

    def install(self) -> None:
        target = logging.getLogger(self.logger)
        if self not in target.filters:  # equal filters are the same notice: installed once
            target.addFilter(self)


THIRD_PARTY: tuple[QuietWarning, ...] = (
    QuietWarning(
        UserWarning, r"megatron\.core\.", "Transformer Engine and Apex are not installed",
        "megatron-core 0.16.1 says at import that it uses its torch fallbacks; the project installs neither "
        "Transformer Engine nor Apex on purpose (not needed on CPU, optional on GPU) and runs the fallbacks"),
    QuietWarning(
        UserWarning, r"megatron\.core\.", "Apex is not installed. Falling back to Torch Norm",
        "the same notice for norms (megatron/core/models/backends.py, gpt_layer_specs.py)"),
    QuietWarning(
        UserWarning, r"megatron\.core\.transformer\.transformer_config", "full scope is deprecated",
        "megatron-core 0.16.1 warns about its own default TransformerConfig.cuda_graph_scope='full'; CUDA graphs "
        "are not used here"),
    QuietWarning(
        FutureWarning, r"torch\.distributed\.c10d_logger", "`torch.distributed.reduce_scatter_tensor` is deprecated",
        "megatron-core 0.16.1's DDP gradient buffers call the old name (param_and_grad_buffer.py); torch 2.13 "
        "deprecates it and both names do the same collective"),
    QuietWarning(
        FutureWarning, r"torch\.distributed\.c10d_logger", "`torch.distributed.all_gather_into_tensor` is deprecated",
        "megatron-core 0.16.1's distributed optimizer gathers params with the old name (param_and_grad_buffer.py)"),
    QuietWarning(
        UserWarning, r"(lightning_dynatrain\.devices\.host\.megatron_patches|torch\.optim\.)",
        "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed",
        "megatron-core 0.16.1's distributed optimizer keeps the shards of fp32 params as views of them and sets "
        "their .grad itself (distrib_optimizer._copy_model_grads_to_main_grads); torch warns at its first read, in "
        "megatron's zero_grad, which on CPU runs inside the adapter's torch-function mode (hence that module)"),
    QuietWarning(
        FutureWarning, r"lightning\.pytorch\.utilities\._pytree", "`isinstance(treespec, LeafSpec)` is deprecated",
        "Lightning 2.6.6 builds torch's LeafSpec when it flattens step outputs; torch 2.13 deprecates the class"),
    QuietWarning(
        FutureWarning, r"lightning\.fabric\.utilities\.distributed",
        "torch.distributed.nn.functional.all_gather is deprecated",
        "Lightning 2.6.6's fabric.all_gather calls torch's differentiable all_gather, which torch 2.13 deprecates "
        "in favour of its functional collectives; the gathered tensors are the same"),
    QuietWarning(
        UserWarning, r"megatron\.core\.tensor_parallel\.layers",
        "When using async grad allreduce it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
        "a CUDA stream setting that means nothing on CPU (megatron-core says it on every tp>1 run)", cpu_only=True),
    QuietWarning(
        UserWarning, r"megatron\.core\.tensor_parallel\.layers",
        "When using sequence parallelism it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
        "the same CUDA stream advice, on runs with sequence parallelism (MoE with tp>1)", cpu_only=True),
    QuietWarning(
        UserWarning, r"torch\.nn\.functional", "Mismatch dtype between input and weight",
        "under bf16-mixed megatron-core keeps norm weights in fp32 and its torch-norm fallback (no Apex or Transformer "
        "Engine) passes them with bf16 activations; torch then runs its unfused RMSNorm, which is the computation "
        "meant, and says it could not use the fused kernel", cpu_only=True),
    QuietWarning(
        UserWarning, r"megatron\.core\.transformer\.transformer_config",
        "If you are using transformer_engine as the transformer implementation, the core_attn",
        "megatron-core 0.16.1 says it for every selective recompute of core attention, in case Transformer "
        "Engine's fused attention is used; the project builds megatron's local spec, whose attention is not "
        "fused, so recomputing it is what saves memory (recompute='selective')"),
    QuietWarning(
        UserWarning, r"megatron\.core\.hyper_comm_grid", "absl.logging is not installed",
        "megatron-core 0.19 says at import that it logs through Python's logging instead of absl's; nothing the "
        "project runs needs absl"),
    QuietWarning(
        UserWarning, r"megatron\.core\.models\.mimo\.", "MimoModelConfig is experimental",
        "megatron-core 0.19 says it when its package imports the multimodal (MIMO) config, on every import of "
        "megatron.core.models; the project builds no MIMO model"),
    QuietWarning(
        UserWarning, r"megatron\.core\._rank_utils", "Could not determine rank from torch.distributed",
        "megatron-core 0.19's log_single_rank says it when a process without torch.distributed logs (a dataset "
        "built before the job's groups exist, a single-process tool); it then logs as rank 0, which that process is"),
    QuietWarning(
        DeprecationWarning, r"megatron\.core\.inference\.contexts",
        "The following imports from `dynamic_context.py` will be removed",
        "megatron-core 0.16-0.19 say it whenever their inference contexts package is imported (a rollout's KV "
        "cache, StaticInferenceContext); the project imports nothing of dynamic_context"),
)

#: notices megatron-core and torch log at warning level (not ``warnings``), each hidden by logger and message
THIRD_PARTY_LOGS: tuple[QuietLog, ...] = (
    QuietLog(
        "megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED",
        "megatron-core 0.19 logs it for every GPTModel built, on every rank that builds one: the GPT preset and "
        "users' GPT providers build it on every supported release (HybridModel exists only from 0.19), and "
        "megatron still fixes it; a user's own provider sees the notice in megatron's documentation, not per build"),
    QuietLog(
        "torch.utils.cpp_extension", "No CUDA runtime is found",
        "torch's CUDA build says it when torch.utils.cpp_extension is imported (megatron-core imports it) where no "
        "CUDA runtime is found, i.e. on a machine without a GPU, where a run is a CPU run: it would compile C++/CUDA "
        "extensions against CUDA_HOME and the project compiles none (installed at import: the notice comes then)"),
)


def quiet_third_party_warnings(*, on_cpu: bool) -> None:
    """Install ``THIRD_PARTY``'s and ``THIRD_PARTY_LOGS``' filters (those marked ``cpu_only`` only when
    ``on_cpu``)."""
    for quiet in (*THIRD_PARTY, *THIRD_PARTY_LOGS):
        if on_cpu or not quiet.cpu_only:
            quiet.install()


__all__ = ["THIRD_PARTY", "THIRD_PARTY_LOGS", "QuietLog", "QuietWarning", "quiet_third_party_warnings"]
