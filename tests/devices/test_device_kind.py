"""``devices.device_kind``: one kind per device, chosen once; the host's kind hands out the CPU-only
code, an accelerator's kind plain memory and megatron as it is (no accelerator needed: the kind is
chosen from the device alone)."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from lightning_dynatrain.devices import device_kind
from lightning_dynatrain.devices.accelerator import AcceleratorKind
from lightning_dynatrain.devices.host import HostKind
from lightning_dynatrain.devices.host.carve_buffers import CarveBuffers
from lightning_dynatrain.devices.host.megatron_patches import cuda_is_used
from lightning_dynatrain.devices.host.page_moves import can_move_pages
from lightning_dynatrain.devices.host.recycling_memory import RecyclingMemory
from lightning_dynatrain.devices.snapshot_copy import PlainHostCopier
from lightning_dynatrain.devices.memory_policy import KeepOldMemory, PlainMemory
from lightning_dynatrain.devices.old_storage import OldStorage, ReturnToOS


class _Marker(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_the_kind_is_chosen_from_the_device_alone():
    assert device_kind(torch.device("cpu")) == HostKind(torch.device("cpu"))
    assert isinstance(device_kind("meta"), HostKind)  # a probe's storage-free build
    assert device_kind("cuda:1") == AcceleratorKind(torch.device("cuda", 1))
    assert isinstance(device_kind(torch.device("xpu")), AcceleratorKind)
    with pytest.raises(dataclasses.FrozenInstanceError):
        device_kind("cpu").device = torch.device("meta")


def test_the_host_recycles_unless_told_not_to_and_the_accelerator_never_does():
    host, accelerator = device_kind("cpu"), device_kind("cuda")
    recycling = host.switch_memory(recycle=None, idle_cap=1 << 20)
    assert isinstance(recycling, RecyclingMemory) and recycling.held_bytes == 1 << 20
    assert isinstance(recycling.buffer_mode(), CarveBuffers)
    assert type(host.switch_memory(recycle=False, idle_cap=1 << 20)) is PlainMemory
    for recycle in (None, True, False):
        memory = accelerator.switch_memory(recycle=recycle, idle_cap=1 << 20)
        assert type(memory) is PlainMemory and memory.held_bytes == 0 and memory.buffer_mode() is None
    for kind in (host, accelerator):
        assert type(kind.switch_memory(recycle=True, idle_cap=1 << 20, keep_old=True)) is KeepOldMemory


def test_only_the_host_builds_ahead_into_untouched_buffers():
    mode = device_kind("cpu").unfilled_buffer_mode()
    assert isinstance(mode, CarveBuffers) and mode.skip_copies and not mode.zero
    assert mode.recycler.idle_cap == 0
    assert device_kind("cuda").unfilled_buffer_mode() is None


def test_memory_goes_back_by_pages_only_on_the_host():
    host, accelerator = device_kind("cpu"), device_kind("cuda")
    assert host.gives_pages_back == can_move_pages() and not accelerator.gives_pages_back
    assert accelerator.release_pages(0, 1 << 20) == 0
    old = torch.full((1 << 20,), 1.0)
    assert OldStorage({("w", None, ()): old}, ReturnToOS()).gives_pages_back == can_move_pages()
    released = ReturnToOS().give_range(old.untyped_storage(), 0, old.nbytes, "param")  # the host's kind
    if not can_move_pages():
        assert released == 0
        return
    page = os.sysconf("SC_PAGE_SIZE")
    assert old.nbytes - 2 * page <= released <= old.nbytes and released % page == 0  # whole pages only
    assert torch.count_nonzero(old) <= 2 * page // 4  # given back: those pages read as zeros


def test_each_kind_names_its_pool():
    host = device_kind("cpu")
    assert host.pool_name() == socket.gethostname() and (host.free_bytes() or 0) >= 0
    assert device_kind("cuda:1").pool_name() == f"{socket.gethostname()}/cuda:1"
    if not torch.accelerator.is_available():
        assert device_kind("cuda").free_bytes() is None


def test_the_accelerators_megatron_context_runs_megatron_as_it_is_under_the_given_mode():
    from megatron.core.transformer import torch_norm

    from lightning_dynatrain.devices.norm_patch import _wrapped_torch_norm_new

    inner = _Marker()
    with device_kind("cuda").megatron_context(inner=inner):
        assert list(_get_current_function_mode_stack()) == [inner]
        assert torch_norm.WrappedTorchNorm.__new__ is _wrapped_torch_norm_new  # patch D, on every device
    with device_kind("cuda").megatron_context():
        assert list(_get_current_function_mode_stack()) == []


@pytest.mark.skipif(cuda_is_used(), reason="the CPU patches are not applied when CUDA is used")
def test_the_hosts_megatron_context_answers_cuda_on_cpu():
    with device_kind("cpu").megatron_context():
        assert torch.zeros(2, device="cuda").device.type == "cpu"


def test_a_snapshot_copies_host_state_plainly_from_its_thread():
    import threading

    copier = device_kind("cpu").host_copier()
    assert type(copier) is PlainHostCopier and type(device_kind("xpu").host_copier()) is PlainHostCopier
    state = torch.arange(1000, dtype=torch.float32)
    buffer = copier.host_buffer(state)
    assert buffer.shape == state.shape and buffer.dtype == state.dtype and buffer.data_ptr() != state.data_ptr()
    copier.mark()
    thread = threading.Thread(target=copier.copy, args=([(buffer, state)],))
    thread.start()
    thread.join()
    assert torch.equal(buffer, state)


def test_the_accelerator_path_never_imports_the_host_package():
    code = """
import sys
import torch
import lightning_dynatrain.megatron.ahead, lightning_dynatrain.megatron.hot_switch
import lightning_dynatrain.megatron.memory_check, lightning_dynatrain.transition.walker
import lightning_dynatrain.megatron.snapshot
from lightning_dynatrain.devices import device_kind
kind = device_kind(torch.device("cuda"))
kind.switch_memory(recycle=True, idle_cap=0).start({})
kind.unfilled_buffer_mode(), kind.pool_name(), kind.free_bytes()
with kind.megatron_context():
    pass
print(sorted(m for m in sys.modules if m.startswith("lightning_dynatrain.devices.host")))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
