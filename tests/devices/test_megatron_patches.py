"""In-process tests of the CPU adapter: the CUDA-as-CPU mode, its scope, and the RNG tracker."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from lightning_dynatrain.devices.host.megatron_patches import apply_cpu_patches, cuda_is_used, megatron_on_cpu

pytestmark = pytest.mark.skipif(cuda_is_used(), reason="the CPU patches are not applied when CUDA is used")


def test_apply_is_idempotent():
    assert apply_cpu_patches() is True
    assert apply_cpu_patches() is True


def test_cuda_requests_land_on_cpu_inside_only():
    with megatron_on_cpu():
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.empty(3, device=torch.cuda.current_device()).device.type == "cpu"
        t = torch.ones(2)
        assert t.cuda() is t
        assert t.to("cuda").device.type == "cpu"
        assert t.type() == "torch.cuda.FloatTensor"
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            stream.wait_stream(torch.cuda.current_stream())
        torch.cuda.synchronize()
        with megatron_on_cpu():  # re-entrant
            assert torch.zeros(1, device="cuda:0").device.type == "cpu"
        assert torch.zeros(1, device="cuda").device.type == "cpu"
    assert torch.ones(2).type() == "torch.FloatTensor"
    with pytest.raises((RuntimeError, AssertionError)):
        torch.cuda.current_device()  # the real one again: this torch has no CUDA
    with pytest.raises((RuntimeError, AssertionError)):  # "Torch not compiled with CUDA enabled"
        torch.zeros(1, device="cuda")


class _Records(TorchFunctionMode):
    """Records the devices of the factory calls it sees and doubles every ``torch.ones``."""

    def __init__(self) -> None:
        super().__init__()
        self.devices: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            self.devices.append(kwargs["device"])
        out = func(*args, **kwargs)
        return out * 2 if func is torch.ones else out


@pytest.mark.parametrize("nested", [False, True])
def test_an_inner_mode_sees_cpu_devices_and_costs_no_mode_of_its_own(nested):
    """``megatron_on_cpu(inner=mode)``: the mode handles every call after the CUDA rewrite; at the
    outermost entry it runs inside the adapter's mode (one mode on the stack); nested, inside an
    adapter mode of its own on top of the outer one."""
    inner = _Records()
    with megatron_on_cpu() if nested else contextlib.nullcontext():
        with megatron_on_cpu(inner=inner):
            x = torch.ones(2, device="cuda")
            depth = _get_current_function_mode_stack()
    assert x.device.type == "cpu" and x.tolist() == [2.0, 2.0]
    assert [torch.device(d).type for d in inner.devices] == ["cpu"]
    assert len(depth) == (2 if nested else 1)
    assert torch.ones(1).tolist() == [1.0]  # gone with the block


class _AllocatesOnCudaInBackward(torch.autograd.Function):
    """Like megatron's ``_AllToAll``: its backward allocates on ``torch.cuda.current_device()``."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        out = torch.empty(grad.shape, device=torch.cuda.current_device())
        return out.copy_(grad) * 2


@pytest.mark.parametrize("how", ["tensor.backward", "autograd.backward"])
def test_backward_runs_inside_the_mode(how):
    x = torch.ones(3, requires_grad=True)
    with megatron_on_cpu():
        loss = _AllocatesOnCudaInBackward.apply(x).sum()
        if how == "tensor.backward":
            loss.backward()
        else:
            torch.autograd.backward([loss], grad_tensors=[torch.tensor(1.0)])
    assert x.grad.tolist() == [2.0, 2.0, 2.0]


def test_cpu_rng_tracker_forks_and_restores():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    apply_cpu_patches()
    model_parallel_cuda_manual_seed(5, tp_rank=0, ep_rank=0, etp_rank=0)
    tracker = get_cuda_rng_tracker()
    torch.manual_seed(0)
    outer_state = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outer_state)  # the global stream is untouched
    with tracker.fork():
        b = torch.rand(3)
    assert not torch.equal(a, b)  # the forked stream advanced
    model_parallel_cuda_manual_seed(5, tp_rank=0, ep_rank=0, etp_rank=0)
    with get_cuda_rng_tracker().fork():
        assert torch.equal(torch.rand(3), a)  # and is reproducible from the seed
    model_parallel_cuda_manual_seed(5, tp_rank=1, ep_rank=0, etp_rank=0)
    with get_cuda_rng_tracker().fork():
        assert not torch.equal(torch.rand(3), a)  # another TP rank draws another stream


def test_torch_norm_accepts_sequence_parallel():
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    apply_cpu_patches()
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, tensor_model_parallel_size=2,
                               sequence_parallel=True, normalization="RMSNorm")
    norm = WrappedTorchNorm(config, 8)
    assert isinstance(norm, torch.nn.RMSNorm)
    assert all(p.sequence_parallel for p in norm.parameters())
