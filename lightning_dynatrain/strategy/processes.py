"""The process side of ``DynaTrainStrategy``: Lightning's ranks, devices, launcher and collectives.

What any Lightning strategy over megatron-core with global batches needs, whatever its layout:
the processes (Lightning's launcher, or an external one: torchrun, ``fabric run``, ``srun``), the
default process group, a device per process, megatron's own mixed precision in place of Lightning's
autocast (``precision.py``), and job-wide collectives. ``DynaTrainStrategy`` adds the layout, the
model and the switches.

Launchers: ``python train.py`` (Lightning's subprocess launcher, as for DDP), ``torchrun`` and
``fabric run`` (TorchElasticEnvironment), ``srun`` (SLURMEnvironment). Lightning's ranks and world
come from the cluster environment. Each process's intra-op threads are fitted to the cores of its
node, whatever the launcher set (``threads.py``; ``DYNATRAIN_NUM_THREADS=N`` overrides).

The dataloader serves the same GLOBAL batch on every rank (``data.GlobalBatchSampler``) and the
strategy slices this rank's data-parallel share at each step, so a switch needs no dataloader
rebuild. ``is_distributed`` is ``True`` (so that ``self.log(..., sync_dist=True)`` reduces, over the
current layout's data-parallel group: ``reduce``), and the strategy turns off Lightning's
``DistributedSampler`` injection, which would fix the data-parallel size when the loader is built.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from typing_extensions import override

from lightning_dynatrain.compat.lightning_internals import (
    ScriptLaunchedStrategy,
    accelerator_connector,
    default_backend_for_device,
    init_dist_connection,
    module_trainer,
    set_strategy_precision_plugin,
    strategy_precision_plugin,
    sync_ddp_if_available,
)
from lightning_dynatrain.strategy.precision import MegatronPrecision, megatron_precision
from lightning_dynatrain.runtime.threads import fit_intra_op_threads
from lightning_dynatrain.runtime.layout_checks import WorldSizeError
from lightning_dynatrain.warning_filters import quiet_third_party_warnings

if TYPE_CHECKING:
    import lightning.pytorch as pl


class MegatronProcessStrategy(ScriptLaunchedStrategy):
    """Processes, devices, precision and collectives for a megatron-core strategy (see the module docstring).

    Args:
        backend: process-group backend; ``None`` picks nccl on CUDA devices and gloo otherwise.
        timeout: timeout of collectives (``init_process_group``).
        cluster_environment, parallel_devices, checkpoint_io, precision_plugin: as for any Lightning
            ``ParallelStrategy`` (leave ``precision_plugin`` out: ``Trainer(precision=...)`` says it).
    """

    def __init__(self, *, backend: str | None = None, timeout: timedelta = timedelta(minutes=30),
                 cluster_environment: ClusterEnvironment | None = None,
                 parallel_devices: list[torch.device] | None = None, checkpoint_io: CheckpointIO | None = None,
                 precision_plugin: Precision | None = None) -> None:
        super().__init__(accelerator=None, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self.num_nodes = 1
        self._backend = backend
        self._collective_timeout = timeout
        self._owns_process_group = False

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    @override
    def precision_plugin(self) -> MegatronPrecision:
        """Megatron's own mixed precision, as ``Trainer(precision=...)`` asked (``strategy.precision``)."""
        plugin = strategy_precision_plugin(self)
        return plugin if plugin is not None else MegatronPrecision()

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        # None stays None until the Trainer sets its plugin: Lightning reads a strategy's own plugin
        # as the user's choice and would then ignore Trainer(precision=...)
        set_strategy_precision_plugin(self, None if plugin is None else megatron_precision(plugin))

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def process_group_backend(self) -> str:
        return self._backend or default_backend_for_device(self.root_device)

    @property
    def is_distributed(self) -> bool:
        """``True``: ``self.log(..., sync_dist=True)`` reduces (see the module docstring)."""
        return True

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        trainer = self._running_trainer()
        if trainer is not None:  # before any dataloader is requested: global batches, no DistributedSampler
            accelerator_connector(trainer).use_distributed_sampler = False
        # before megatron-core is first imported: its import-time notices are named there
        quiet_third_party_warnings(on_cpu=self.root_device.type == "cpu")
        # Share the node's cores among its processes: launchers leave 1 thread each (torchrun), cores //
        # processes (Lightning's), or every core in each (fabric run, srun). See threads.py for the rule.
        threads = fit_intra_op_threads(local_processes=max(1, self.num_processes))
        if threads.message:
            rank_zero_info(threads.message)

    def _setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        if dist.is_available() and dist.is_initialized():
            if dist.get_world_size() != self.world_size:
                raise WorldSizeError(
                    f"torch.distributed is already initialised with {dist.get_world_size()} ranks but Lightning "
                    f"sees {self.world_size}", hint="pass Trainer(devices=..., num_nodes=...) matching the job")
            return  # someone else owns the group (a test harness, an outer script): leave it to them
        # on an accelerator the default group is bound to this process's device at creation (NCCL
        # connects eagerly, and no collective has to guess the device), as Lightning's DDP does
        device_id = self.root_device if self.root_device.type != "cpu" else None
        init_dist_connection(self.cluster_environment, self.process_group_backend, timeout=self._collective_timeout,
                              device_id=device_id)
        self._owns_process_group = True

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @override
    def model_to_device(self) -> None:
        pass  # build_model puts the shard on root_device

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # Not Lightning's default (root_device as the default device): megatron builds on CPU
        # (use_cpu_initialization, CPU generators for the layout-free init) and build_model moves the
        # shard to root_device afterwards; a CUDA default device breaks those CPU draws.
        with self.precision_plugin.tensor_init_context():
            yield

    def _running_trainer(self) -> "pl.Trainer | None":
        """The trainer the module is attached to (a fit, a validation), ``None`` outside one."""
        module = self.lightning_module
        return module_trainer(module) if module is not None else None

    def _global_step(self) -> int:
        trainer = self._running_trainer()
        return trainer.global_step if trainer is not None else 0

    def _collectives_are_local(self) -> bool:
        """While ``True`` the collectives Lightning asks for are local no-ops (a process that joins
        a running fit and catches up, or one that left)."""
        return False

    @override
    def barrier(self, name: str | None = None) -> None:
        if not (dist.is_available() and dist.is_initialized()) or self._collectives_are_local():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not (dist.is_available() and dist.is_initialized()) or self._collectives_are_local():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Agree over every process (not only data-parallel replicas): stopping is a job-wide decision."""
        if self._collectives_are_local():
            return decision
        value = torch.tensor(int(decision), device=self.root_device)
        value = sync_ddp_if_available(value, None, reduce_op=ReduceOp.SUM)
        return bool(value == self.world_size) if all else bool(value)

    def _teardown_process_group(self) -> None:
        """Destroy the default group if this strategy created it (a harness's group stays)."""
        if self._owns_process_group and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_process_group = False


__all__ = ["MegatronProcessStrategy"]
