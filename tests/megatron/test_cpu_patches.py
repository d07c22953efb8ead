"""In-process tests of the CPU adapter: the CUDA-as-CPU mode, its scope, and the RNG tracker."""

from __future__ import annotations

import pytest
import torch

from lightning_dynatrain.megatron.cpu_patches import apply_cpu_patches, cuda_is_used, megatron_on_cpu

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
