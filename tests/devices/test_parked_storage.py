"""``ParkedStorages``: whole storages out of memory and back, every view into them seeing its memory
again (a parameter inside a flat buffer, a shard of it), by host copy or zeroed."""

from __future__ import annotations

import torch

from lightning_dynatrain.devices import device_kind
from lightning_dynatrain.devices.parked_storage import ParkedStorages, unique_storages


def _flat_buffer_with_views():
    buffer = torch.randn(64)
    return buffer, [buffer[:16].view(4, 4), buffer[16:48], buffer[48:]]


def test_a_storage_parked_on_the_host_comes_back_bit_for_bit_under_every_view():
    buffer, views = _flat_buffer_with_views()
    own = torch.randn(3, 5, dtype=torch.bfloat16)
    before = [v.clone() for v in (*views, own)]
    storages = unique_storages([*views, own])
    assert len(storages) == 2  # the views share their buffer's storage
    parked = ParkedStorages.to_host(storages, device_kind("cpu").host_copier())
    assert parked.on_host and parked.bytes == 64 * 4 + 15 * 2
    assert buffer.untyped_storage().nbytes() == 0 and own.untyped_storage().nbytes() == 0  # freed meanwhile
    parked.restore()
    for view, was in zip((*views, own), before):
        assert torch.equal(view.view(-1).view(torch.int16 if view.dtype == torch.bfloat16 else torch.int32),
                           was.view(-1).view(torch.int16 if was.dtype == torch.bfloat16 else torch.int32))


def test_a_dropped_storage_comes_back_zeroed_and_what_is_left_out_is_not_touched():
    buffer, views = _flat_buffer_with_views()
    kept = torch.randn(8)
    kept_before = kept.clone()
    parked = ParkedStorages.drop(unique_storages([*views, kept], leaving_out=[kept]))
    assert not parked.on_host and parked.bytes == 64 * 4
    assert kept.untyped_storage().nbytes() == 32 and torch.equal(kept, kept_before)
    parked.restore()
    assert buffer.untyped_storage().nbytes() == 64 * 4 and all(bool((v == 0).all()) for v in views)


def test_only_the_hosts_kind_says_its_memory_is_the_hosts():
    """A rollout's ``park="host"`` moves nothing on CPU processes, and the optimizer's state on a GPU."""
    assert device_kind("cpu").memory_is_host and not device_kind("cuda").memory_is_host
