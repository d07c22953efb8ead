"""megatron-core's private names this package uses, each behind a function here, checked on
megatron-core 0.16.1.

``parallel_state``'s module globals: the list of the groups it made (``_global_process_group_list``:
the adapter destroys them and keeps cached ones, ``megatron/parallel_state_adapter.py``), and the
globals that hold each group and its rank and size (``groups_as_globals``: a module built to read
its description sees the probe's groups, ``megatron/probe.py``); the distributed optimizer's map
from a parameter to the range of it this rank's shard holds (``_get_model_param_range_map``), and
its loading of one parameter's optimizer states from a checkpoint
(``_set_main_param_and_optimizer_states``: ``optimizer_states_loaded_without_step`` patches it
around a load of megatron's own ``dist_checkpointing``, ``benchmarks/baselines/megatron_ckpt.py``).
The CPU adapter (``devices/host/megatron_patches/``) patches private functions of megatron by design, each
patch naming the line it answers. ``tests/test_private_names.py`` fails on a private name used
elsewhere.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection

if TYPE_CHECKING:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer


def megatron_groups() -> list[Any]:
    """The groups ``parallel_state.initialize_model_parallel`` made for the current layout."""
    return [g for g in (parallel_state._global_process_group_list or []) if g is not None]


def forget_megatron_groups() -> None:
    """``parallel_state`` holds no group any more (after ``destroy_model_parallel``, which leaves its
    list of groups, and in 0.16 the intra-partial data-parallel groups and the hierarchical
    context-parallel ones, set): the groups themselves are the caller's to keep or destroy."""
    parallel_state._global_process_group_list = None
    for name in _LEFT_BY_DESTROY:
        if getattr(parallel_state, name) is not None:
            setattr(parallel_state, name, None)


#: megatron's globals that hold a group, and the ``ProcessGroupCollection`` field each holds
_GROUP_GLOBALS = {
    "_TENSOR_MODEL_PARALLEL_GROUP": "tp", "_PIPELINE_MODEL_PARALLEL_GROUP": "pp", "_MODEL_PARALLEL_GROUP": "mp",
    "_CONTEXT_PARALLEL_GROUP": "cp", "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": "tp_cp", "_DATA_PARALLEL_GROUP": "dp",
    "_DATA_PARALLEL_GROUP_WITH_CP": "dp_cp", "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": "intra_dp_cp",
    "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": "tp_dp_cp", "_EXPERT_MODEL_PARALLEL_GROUP": "ep",
    "_EXPERT_TENSOR_PARALLEL_GROUP": "expt_tp", "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": "tp_ep",
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": "tp_ep_pp", "_EXPERT_DATA_PARALLEL_GROUP": "expt_dp",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": "intra_expt_dp", "_EMBEDDING_GROUP": "embd",
    "_POSITION_EMBEDDING_GROUP": "pos_embd",
}
#: megatron's group globals ``destroy_model_parallel`` leaves set (0.16)
_LEFT_BY_DESTROY = ("_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP", "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
                    "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS")
#: megatron's rank and size overrides (its ``set_*_rank`` / ``set_*_world_size``), and the field whose
#: group's rank and size each holds
_RANK_GLOBALS = {
    "tp": ("_MPU_TENSOR_MODEL_PARALLEL_RANK", "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE"),
    "pp": ("_MPU_PIPELINE_MODEL_PARALLEL_RANK", "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE"),
    "dp": ("_MPU_DATA_PARALLEL_RANK", "_MPU_DATA_PARALLEL_WORLD_SIZE"),
    "ep": ("_MPU_EXPERT_MODEL_PARALLEL_RANK", "_MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE"),
    "expt_tp": ("_MPU_EXPERT_TENSOR_PARALLEL_RANK", "_MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE"),
}


@contextmanager
def groups_as_globals(groups: ProcessGroupCollection) -> Iterator[None]:
    """Inside: megatron's parallel-state globals answer with ``groups`` (their ranks and sizes too),
    then they are put back. For a module built only to read its description (``megatron.probe``)
    on groups that are not the current layout's: megatron's own modules mostly take the groups
    they are given, but a few still read the globals (0.16's ``BertModel`` builds its encoder
    without them), and a user's module may. Not for a module that trains: the globals are the
    current layout's again after it."""
    names = list(_GROUP_GLOBALS) + [name for pair in _RANK_GLOBALS.values() for name in pair]
    saved = {name: getattr(parallel_state, name) for name in names}
    try:
        for name, field in _GROUP_GLOBALS.items():
            setattr(parallel_state, name, getattr(groups, field, None))
        for field, (rank, size) in _RANK_GLOBALS.items():
            group = getattr(groups, field)
            setattr(parallel_state, rank, group.rank())
            setattr(parallel_state, size, group.size())
        yield
    finally:
        for name, value in saved.items():
            setattr(parallel_state, name, value)


def shard_range(optimizer: DistributedOptimizer, param: Any) -> tuple[int, int]:
    """``[start, end)`` of ``param`` (flattened) that this rank's shard of megatron's
    ``DistributedOptimizer`` holds."""
    found = optimizer._get_model_param_range_map(param)["param"]
    return found.start, found.end


@contextmanager
def optimizer_states_loaded_without_step() -> Iterator[None]:
    """Inside: megatron's ``DistributedOptimizer`` loads a parameter's optimizer states from a
    checkpoint that carries no ``step`` (patch G of ``MEGATRON_ON_CPU.md``; the step comes back
    through the param groups in ``load_state_dict``).

    Without Apex or Transformer Engine the live Adam state has a ``step`` the checkpoint does not
    carry, and ``distrib_optimizer.py::_set_main_param_and_optimizer_states`` copies every live key
    (``dst_tensors[key].copy_(tensors[key])``: ``KeyError: 'step'``). The patch copies the others;
    megatron's own method runs for a checkpoint with a ``step`` and for the precision-aware optimizer.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def patched(self: DistributedOptimizer, model_param: Any, tensors: dict[str, Any]) -> None:
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            live = {"param": main_param, **self.optimizer.state[main_param]}
            for key, tensor in live.items():
                if key != "step":
                    tensor.copy_(tensors[key])
            return
        original(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = patched
    try:
        yield
    finally:
        DistributedOptimizer._set_main_param_and_optimizer_states = original


def checkpoint_write_results_queue() -> Any:
    """The queue megatron's asynchronous checkpoint writer reports through (a ``multiprocessing.Manager``
    started at its first use): public as ``get_write_results_queue`` from megatron-core 0.19, private
    (``_get_write_results_queue``) before."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    public = getattr(filesystem_async, "get_write_results_queue", None)
    return public() if public is not None else filesystem_async._get_write_results_queue()


def in_process_checkpoint_write_results() -> None:
    """Let megatron's checkpoint writer report a synchronous save through a plain in-process queue
    instead of the ``multiprocessing.Manager`` it starts at a process's first save (a fresh
    interpreter, about 10 s on a CPU): a synchronous save's results never cross a process. Keeps a
    queue already there. ``_results_queue`` is private in every megatron-core this project supports."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


__all__ = ["checkpoint_write_results_queue", "forget_megatron_groups", "groups_as_globals",
           "in_process_checkpoint_write_results", "megatron_groups",
           "optimizer_states_loaded_without_step", "shard_range"]
