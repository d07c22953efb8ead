"""Every private name ``lightning_dynatrain/compat/`` holds is still where it was: an upgrade of torch,
megatron-core or Lightning that moves one fails here, naming it and the installed version, before
any run reaches it."""

from __future__ import annotations

import importlib
import importlib.metadata as md

import pytest

#: (package whose private name it is, module, attribute path; ``a|b``: the layer takes the first the
#: installed version has, a public name where there is one)
PRIVATE = [
    ("torch", "torch.distributed.distributed_c10d", "_world.pg_map"),
    ("torch", "torch.distributed.distributed_c10d", "_world.pg_group_ranks"),
    ("torch", "torch.distributed.distributed_c10d", "_world.group_count"),
    ("torch", "torch.distributed.distributed_c10d", "_world.pg_names"),
    ("torch", "torch.distributed.distributed_c10d", "_world.default_pg"),
    ("torch", "torch.distributed.distributed_c10d", "_update_default_pg"),
    ("torch", "torch.distributed.distributed_c10d", "_register_pg_in_world"),
    ("torch", "torch.distributed.distributed_c10d", "_get_default_store"),
    ("torch", "torch.distributed", "set_timeout|distributed_c10d._set_pg_timeout"),
    ("torch", "torch.distributed.distributed_c10d", "ProcessGroup._set_default_backend"),
    ("torch", "torch.distributed.distributed_c10d", "ProcessGroup._register_backend"),
    ("torch", "torch.distributed.distributed_c10d", "ProcessGroup._set_group_name"),
    ("torch", "torch.distributed.distributed_c10d", "ProcessGroup._set_group_desc"),
    ("torch", "torch.distributed.distributed_c10d", "ProcessGroup._get_backend_name"),
    ("torch", "torch.distributed.distributed_c10d", "ProcessGroupGloo._set_sequence_number_for_group"),
    ("torch", "torch._C._distributed_c10d", "FakeProcessGroup._create_internal"),
    ("torch", "torch.autograd", "_make_grads"),
    ("torch", "torch.autograd", "_tensor_or_tensors_to_tuple"),
    ("torch", "torch.autograd.graph", "_engine_run_backward"),
    ("torch", "torch.distributed._shard.sharded_tensor", "ShardedTensor._init_from_local_shards_and_global_metadata"),
    ("torch", "torch", "Tensor._base"),
    ("megatron-core", "megatron.core.parallel_state", "_global_process_group_list"),
    ("megatron-core", "megatron.core.parallel_state", "_TENSOR_MODEL_PARALLEL_GROUP"),
    ("megatron-core", "megatron.core.parallel_state", "_MPU_TENSOR_MODEL_PARALLEL_RANK"),
    ("megatron-core", "megatron.core.parallel_state", "_MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE"),
    ("megatron-core", "megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer._get_model_param_range_map"),
    ("megatron-core", "megatron.core.dist_checkpointing.strategies.filesystem_async",
     "get_write_results_queue|_get_write_results_queue"),
    ("lightning", "lightning.fabric.utilities.distributed", "_init_dist_connection"),
    ("lightning", "lightning.fabric.utilities.distributed", "_sync_ddp_if_available"),
    ("lightning", "lightning.fabric.utilities.distributed", "_get_default_process_group_backend_for_device"),
    ("lightning", "lightning.pytorch.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher"),
    ("lightning", "lightning.pytorch.trainer.call", "_call_lightning_module_hook"),
]


@pytest.mark.parametrize("package, module, path", PRIVATE, ids=[f"{m}.{p}" for _, m, p in PRIVATE])
def test_the_private_name_is_where_the_compatibility_layer_reads_it(package: str, module: str, path: str) -> None:
    assert any(_has(importlib.import_module(module), one) for one in path.split("|")), (
        f"{package} {md.version(package)} has no {module}.{' nor '.join(path.split('|'))}: "
        "lightning_dynatrain/compat/ reads it (checked on torch 2.13 and 2.15, megatron-core 0.16.1 and 0.19.2, "
        "lightning 2.6.6); adapt the layer to this version")


def _has(found: object, path: str) -> bool:
    for part in path.split("."):
        if not hasattr(found, part):
            return False
        found = getattr(found, part)
    return True


def test_the_trainers_connectors_are_where_the_layer_reads_them() -> None:
    from lightning.pytorch import Trainer

    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    for name in ("_accelerator_connector", "_checkpoint_connector", "_signal_connector", "_logger_connector"):
        assert hasattr(trainer, name), f"lightning {md.version('lightning')}: Trainer has no {name}"
    assert hasattr(trainer._checkpoint_connector, "_loaded_checkpoint")
    for name in ("on_batch_end", "update_train_step_metrics"):
        assert hasattr(trainer._logger_connector, name), f"lightning {md.version('lightning')}: no {name}"
