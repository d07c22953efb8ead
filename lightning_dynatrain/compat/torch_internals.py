"""torch's private names this package uses, each behind a function here, checked on torch 2.13.0.

c10d's registry of process groups (``distributed_c10d._world``): which groups exist, the default
group (WORLD), the counter ``new_group`` names unnamed groups by, and the registration and
construction of a default group built outside ``init_process_group`` (``elastic/world.py``'s worlds
with a life cycle); a group's own timeout (``_set_pg_timeout``); torch's ``FakeProcessGroup``
(``megatron/probe.py``); ``Tensor._base``; the autograd engine entry megatron's own
``custom_backward`` calls (``devices/host/megatron_patches/cuda_mode.py``); and the ``ShardedTensor`` of
``torch.distributed._shard`` that DCP saves with global offsets (``checkpoint/logical.py``); and a
DCP stager for a state dict that is already a private copy (``AsyncStager._synchronize_after_execute``,
``checkpoint/writer.py``).
``tests/test_private_names.py`` fails when a private name of torch, megatron-core or Lightning is
used outside ``lightning_dynatrain/compat/``.
"""

from __future__ import annotations

import functools
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed._shard.metadata import ShardMetadata  # noqa: F401 - re-exported
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata  # noqa: F401
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties  # noqa: F401 - re-exported


# ------------------------------------------------------------------------------ the group registry
def registered_groups() -> list[dist.ProcessGroup]:
    """Every process group c10d knows now (none before ``init_process_group``)."""
    return [g for g in c10d._world.pg_map if g is not None] if dist.is_initialized() else []


def is_registered(group: dist.ProcessGroup | None) -> bool:
    """``group`` is one c10d knows (not destroyed, not a group built unregistered)."""
    return group is not None and dist.is_initialized() and group in c10d._world.pg_map


def default_group() -> dist.ProcessGroup | None:
    """The default group (WORLD) as an object (``GroupMember.WORLD`` is a sentinel in places), or
    ``None`` before there is one (a process joining a job)."""
    return c10d._world.default_pg


def default_store() -> dist.Store:
    """The store the default group was made over."""
    return c10d._get_default_store()


def set_default_group(group: dist.ProcessGroup) -> None:
    """Make ``group`` (registered) the default group."""
    c10d._update_default_pg(group)


def group_count() -> int:
    """The counter ``new_group`` names the next unnamed group by."""
    return c10d._world.group_count


def set_group_count(count: int) -> None:
    c10d._world.group_count = count


def named_group_count() -> int:
    """How many groups this process has registered by name now: the number torch hashes, with the
    ranks, into the name of a group made with ``new_group(use_local_synchronization=True)`` (a
    process that is no member of a group registers nothing)."""
    return len(c10d._world.pg_names) if dist.is_initialized() else 0


def backend_name(group: dist.ProcessGroup) -> str:
    return group._get_backend_name()


def set_group_timeout(group: dist.ProcessGroup, timeout: timedelta) -> None:
    """``group``'s own timeout: its waits fail past it (the public ``torch.distributed.set_timeout``
    where torch has it, 2.15; else the private ``_set_pg_timeout``, which 2.15 deprecates)."""
    public = getattr(dist, "set_timeout", None)
    if public is not None:
        public(timeout, group)
    else:
        c10d._set_pg_timeout(timeout, group)


def build_default_group(store: dist.Store, *, name: str, rank: int, size: int, backend: str, timeout: timedelta,
                        device: torch.device | None = None) -> dist.ProcessGroup:
    """A default group over ``store`` of ``size`` members named ``name``, connected but not registered
    (what ``init_process_group`` builds, without making it the default)."""
    pg = c10d.ProcessGroup(store, rank, size)
    if backend == "nccl":
        options = c10d.ProcessGroupNCCL.Options()
        options._timeout = timeout
        be = c10d.ProcessGroupNCCL(dist.PrefixStore("cuda/", store), rank, size, options)
        pg._set_default_backend(c10d.ProcessGroup.BackendType.NCCL)
        pg._register_backend(torch.device("cuda"), c10d.ProcessGroup.BackendType.NCCL, be)
        if device is not None:  # connect now, in the background, not at the first collective
            be.eager_connect_single_device(device)
    else:
        be = c10d.ProcessGroupGloo(dist.PrefixStore("cpu/", store), rank, size, timeout=timeout)
        pg._set_default_backend(c10d.ProcessGroup.BackendType.GLOO)
        pg._register_backend(torch.device("cpu"), c10d.ProcessGroup.BackendType.GLOO, be)
    be._set_sequence_number_for_group()
    pg._set_group_name(name)
    pg._set_group_desc("default_pg")
    return pg


def register_default_group(group: dist.ProcessGroup, store: dist.Store, *, name: str) -> None:
    """Register a group ``build_default_group`` made under ``name`` as a default group is (its
    ranks are the global ranks); it becomes the default with ``set_default_group``."""
    c10d._register_pg_in_world(group, backend_name=backend_name(group), store=store, group_name=name,
                               backend_config=str(c10d.BackendConfig(backend_name(group))), add_to_default_tag=True)
    c10d._world.pg_group_ranks[group] = {i: i for i in range(group.size())}


# ------------------------------------------------------------------------------ others
def fake_process_group(rank: int, size: int) -> dist.ProcessGroup:
    """A process group of ``size`` ranks in which this process is ``rank``; any collective is a
    no-op (``FakeProcessGroup._create_internal``: the constructor has no Python binding)."""
    from torch._C._distributed_c10d import FakeProcessGroup

    try:
        return FakeProcessGroup._create_internal(rank, size)
    except AttributeError as err:  # a torch without it: the probe cannot run, say which torch
        raise RuntimeError(f"torch {torch.__version__} has no FakeProcessGroup._create_internal; "
                           "lightning-dynatrain reads model descriptions with it (checked on 2.13)") from err


def run_backward(tensors: tuple, grad_tensors, *, retain_graph: bool | None, create_graph: bool, inputs: tuple) -> None:
    """The body of ``torch.autograd.backward`` (torch 2.13): the autograd engine run on ``tensors``
    from the caller's context (megatron's ``pipeline_parallel/schedules.py::custom_backward`` calls
    the engine so too)."""
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward

    grads = _make_grads(tensors, _tensor_or_tensors_to_tuple(grad_tensors, len(tensors)), is_grads_batched=False)
    _engine_run_backward(tensors, grads, create_graph if retain_graph is None else retain_graph, create_graph,
                         inputs, allow_unreachable=True, accumulate_grad=True)


def sharded_tensor_from_shards(shards: list, metadata: "ShardedTensorMetadata") -> "ShardedTensor":
    """A ``ShardedTensor`` of this rank's ``shards`` and the global ``metadata`` (no collective)."""
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, metadata)


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``tensor`` is a view of, or ``None`` when it is no view."""
    return tensor._base


def already_staged_stager() -> Any:
    """A stager for ``dcp.async_save(..., async_stager=...)`` of a state dict that is already this
    rank's private CPU copy: ``stage`` hands it over as it is (no second copy), and DCP does not wait
    on a staging to finish once it writes (``AsyncStager._synchronize_after_execute``)."""
    return _already_staged()()


@functools.cache
def _already_staged() -> type:
    from torch.distributed.checkpoint.staging import AsyncStager  # not at import: DCP takes seconds to import

    class AlreadyStaged(AsyncStager):
        _synchronize_after_execute = False

        def stage(self, state_dict: dict) -> dict:  # type: ignore[override]
            return state_dict

    return AlreadyStaged


__all__ = ["Shard", "ShardMetadata", "ShardedTensor", "ShardedTensorMetadata", "TensorProperties",
           "already_staged_stager",
           "backend_name", "build_default_group", "default_group", "default_store", "fake_process_group",
           "group_count", "is_registered", "named_group_count", "register_default_group", "registered_groups",
           "run_backward",
           "set_default_group", "sharded_tensor_from_shards",
           "set_group_count", "set_group_timeout", "view_base"]
