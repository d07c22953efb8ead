"""``DynaTrainFabricStrategy``: Lightning Fabric's processes and process group for a ``DynaTrainEngine``.

It is Fabric's ``DDPStrategy`` for everything Fabric does itself -- launching (``fabric run``,
``torchrun``, ``srun``, or ``Fabric(devices=N).launch()`` re-running the script), the default
process group (gloo on CPU, nccl on GPUs), ``barrier``/``broadcast``/``all_reduce``/``all_gather``
over the world -- and differs where DDP would be wrong under tensor and pipeline parallelism:

- ``setup_module`` returns the engine's model unwrapped (no torch DDP over the world: megatron's
  own DDP runs over the layout's data-parallel group) and ``module_to_device`` moves nothing (the
  engine builds the shard on its device);
- ``distributed_sampler_kwargs`` is ``None``, so ``fabric.setup_dataloaders`` adds no
  ``DistributedSampler``: every rank reads the whole global batch and the engine cuts the current
  layout's data-parallel share;
- precision: megatron runs its own mixed precision, so ``Fabric(precision=...)`` only chooses the
  params dtype -- ``"32-true"`` fp32; ``"bf16-true"`` or ``"bf16-mixed"`` bf16 params with fp32
  main params -- and Fabric's autocast and dtype contexts are never applied (the strategy hands
  Fabric a plain ``Precision``); other precisions are refused;
- ``save_checkpoint``/``load_checkpoint`` write and read the engine's layout-free checkpoint
  (``loop/checkpoint.py``, the format of ``DynaTrainStrategy``'s) next to Fabric's own file of the
  rest of the state, so ``fabric.save(path, state)`` and ``fabric.load(path, state)`` keep their
  meaning; ``path`` is a folder::

      checkpoint/
        dynatrain/                  # every piece of state under its logical key (DCP), by every rank
        fabric.ckpt                 # the rest of ``state`` (the run's progress among it), by rank 0

  It loads at any layout and any number of processes, bf16 included.
- each process's intra-op threads are fitted to the node's cores, as ``DynaTrainStrategy`` does
  (``fabric run`` sets ``OMP_NUM_THREADS`` to every core in each process; ``runtime/threads.py``).

The layout, the switch schedule and the budgets are the strategy's: ``DynaTrainFabricStrategy(layout=...,
schedule=..., staging_budget=...)`` takes ``DynaTrainSettings``' fields (each one not given from its
``DYNATRAIN_*`` environment variable: ``DynaTrainSettings.from_environment``), or
``settings=DynaTrainSettings(...)``.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch.distributed.constants import default_pg_timeout

from lightning_dynatrain.compat.lightning_internals import requested_precision, set_requested_precision
from lightning_dynatrain.runtime.settings import DynaTrainSettings
from lightning_dynatrain.vps.errors import DynaTrainError

if TYPE_CHECKING:
    from lightning_dynatrain.elastic.driver.options import ElasticOptions
    from lightning_dynatrain.loop.engine import DynaTrainEngine

#: Fabric's precision settings -> the dtype megatron builds the params in
PARAMS_DTYPES = {"32-true": torch.float32, "bf16-true": torch.bfloat16, "bf16-mixed": torch.bfloat16}
#: the file of Fabric's own part of a checkpoint, inside the checkpoint folder
FABRIC_STATE = "fabric.ckpt"


class FabricSetupError(DynaTrainError):
    """``Fabric`` (or how it was launched) is set up in a way the megatron step cannot use."""


class DynaTrainFabricStrategy(DDPStrategy):
    """Fabric's strategy for a ``DynaTrainEngine`` (see the module docstring).

    Args:
        settings: the layout, the switch schedule and budgets (``DynaTrainSettings``); or give them as ``values``.
        process_group_backend: the default group's backend (default: gloo on CPU, nccl on GPUs).
        timeout: the default group's timeout.
        elastic: make the run elastic (``ElasticOptions``, the options of ``OnNodeChange``): the job's
            store makes the worlds (set ``DYNATRAIN_STORE`` and ``DYNATRAIN_TOKEN``; ``dynatrain store``
            starts one), processes join and leave the running loop and a member lost without leaving
            is recovered from (``loop.engine``'s module docstring says what the loop does).
        **values: ``DynaTrainSettings``' fields (``layout``, ``schedule``, ``staging_budget``,
            ``switch_memory_limit``, ``verify``, ``promote_broadcasts``, ``seed``, ``switch_timeout``,
            ``switch_safety``, ``schedule_ahead``).

    Raises:
        FabricSetupError: both ``settings`` and values given.
        LayoutError / ScheduleError / StagingBudgetError / AccelerateConfigError: a setting cannot be read.

    Example::

        strategy = DynaTrainFabricStrategy(layout="dp2-tp2-pp1", schedule={100: "dp1-tp2-pp2"})
        fabric = Fabric(accelerator="cpu", devices=4, strategy=strategy)
        fabric.launch()
        engine = DynaTrainEngine(fabric, recipe=recipe, adam=adam)
    """

    def __init__(self, settings: DynaTrainSettings | None = None, *, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout, elastic: "ElasticOptions | None" = None,
                 **values: Any) -> None:
        super().__init__(process_group_backend=process_group_backend, timeout=timeout, start_method="popen")
        self.elastic = elastic
        self._backend_asked, self._collective_timeout = process_group_backend, timeout or default_pg_timeout
        if settings is not None and values:
            raise FabricSetupError(f"DynaTrainFabricStrategy got settings and the values {sorted(values)}",
                                   hint="give the values to DynaTrainSettings(...), or pass them here without it")
        self.settings = settings if settings is not None else DynaTrainSettings.from_environment(**values)
        self._plain = Precision()
        self._engine: DynaTrainEngine | None = None

    # ------------------------------------------------------------------------- precision
    @property
    def precision(self) -> Precision:
        """What Fabric applies around the step: a plain ``Precision`` (megatron's own mixed precision
        runs inside the step); the requested setting is ``params_dtype``."""
        return self._plain

    @precision.setter
    def precision(self, precision: Precision | None) -> None:
        set_requested_precision(self, precision)

    @property
    def params_dtype(self) -> torch.dtype:
        """The dtype megatron builds the params in, from ``Fabric(precision=...)``.

        Raises:
            FabricSetupError: a precision megatron's step does not take here (fp16, fp64, fp8, ...).
        """
        requested = requested_precision(self)
        name = "32-true" if requested is None else str(requested.precision)
        if name not in PARAMS_DTYPES:
            raise FabricSetupError(
                f"Fabric(precision={name!r}) is not supported by the megatron step",
                hint='use precision="32-true" (fp32) or "bf16-true" (bf16 params with fp32 main params, megatron\'s own)')
        return PARAMS_DTYPES[name]

    # --------------------------------------------------------------------------- set-up
    def setup_environment(self) -> None:
        """Check the precision, fit the intra-op threads to the cores, then start the process group."""
        from lightning_dynatrain.runtime.threads import fit_intra_op_threads
        from lightning_dynatrain.warning_filters import quiet_third_party_warnings

        self.params_dtype  # a bad precision stops here, before any process group exists
        quiet_third_party_warnings(on_cpu=self.root_device.type == "cpu")  # the CPU-only ones too
        threads = fit_intra_op_threads(local_processes=max(1, self.num_processes))
        if threads.message:
            rank_zero_info(threads.message)
        if self.elastic is None:
            super().setup_environment()
        else:  # the device only: the job's store makes the worlds (the engine enters the job)
            super(DDPStrategy, self).setup_environment()

    @property
    def elastic_backend(self) -> str:
        """The backend of an elastic run's worlds: the one asked for, else the device's (gloo, nccl)."""
        from lightning_dynatrain.compat.lightning_internals import default_backend_for_device

        return self._backend_asked or default_backend_for_device(self.root_device)

    @property
    def collective_timeout(self) -> timedelta:
        """The process groups' timeout outside switches."""
        return self._collective_timeout

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """The engine's model as it is (see the module docstring).

        Raises:
            FabricSetupError: ``module`` is not a ``DynaTrainEngine``'s model.
        """
        from lightning_dynatrain.loop.prepared import DynaTrainModel

        if not isinstance(module, DynaTrainModel):
            raise FabricSetupError(
                f"DynaTrainFabricStrategy sets up a DynaTrainEngine's model, not a {type(module).__name__}",
                hint="build engine = DynaTrainEngine(fabric, recipe=..., adam=...) and call "
                "fabric.setup(engine.model, engine.optimizer)")
        return module

    def module_to_device(self, module: torch.nn.Module) -> None:
        pass  # the engine built the shard on its device

    @property
    def distributed_sampler_kwargs(self) -> None:  # type: ignore[override]
        return None  # every rank reads the global batch: no DistributedSampler

    # ---------------------------------------------------------------------------- engine
    def attach_engine(self, engine: "DynaTrainEngine") -> list[Callable[[], None]]:
        """Make ``engine`` the one this strategy checkpoints; the callable that undoes it.

        Raises:
            FabricSetupError: another engine is attached (close it first).
        """
        if self._engine is not None and self._engine is not engine:
            raise FabricSetupError("this DynaTrainFabricStrategy already has a DynaTrainEngine",
                                   hint="close the first engine (engine.close()) before building another")
        self._engine = engine

        def detach() -> None:
            if self._engine is engine:
                self._engine = None

        return [detach]

    # ------------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str | Path, state: dict[str, Any], storage_options: Any | None = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        """The engine's state under ``path/dynatrain``, the rest of ``state`` in ``path/fabric.ckpt``
        (collective). Without an engine, Fabric's own single file at ``path``."""
        from lightning_dynatrain.loop.checkpoint import save_engine_state

        if self._engine is None:
            super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)
            return
        save_engine_state(self._engine, path)
        super().save_checkpoint(Path(path) / FABRIC_STATE, state, storage_options=storage_options, filter=filter)

    def load_checkpoint(self, path: str | Path, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Read a folder ``save_checkpoint`` wrote: the engine's state first (into its current layout),
        then Fabric's part into ``state`` (the engine's progress among it).

        Raises:
            CheckpointError / CheckpointMismatchError: see ``loop.checkpoint.load_engine_state``.
        """
        from lightning_dynatrain.loop.checkpoint import load_engine_state

        if self._engine is None:
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        load_engine_state(self._engine, path)
        return super().load_checkpoint(Path(path) / FABRIC_STATE, state, strict=strict, weights_only=weights_only)

    def __repr__(self) -> str:
        return f"DynaTrainFabricStrategy({self.settings})"


__all__ = ["FABRIC_STATE", "DynaTrainFabricStrategy", "FabricSetupError", "PARAMS_DTYPES"]
