"""Patches E and F: megatron's MoE token dispatch over gloo and without Transformer Engine."""

from __future__ import annotations

import torch
import torch.distributed as dist


def patch_uneven_all_gather() -> None:
    """E: ``megatron/core/tensor_parallel/mappings.py::_gather_along_first_dim`` with
    ``output_split_sizes`` (MoE token dispatch with TP>1 / sequence parallel) calls
    ``torch.distributed.all_gather`` with tensors of different first dimensions, which gloo refuses
    ("ProcessGroupGloo::allgather: invalid tensor size"). On gloo, pad every rank's rows to the
    largest split, gather into one tensor, and trim."""
    from megatron.core.tensor_parallel import mappings

    original = mappings._gather_along_first_dim

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1 or dist.get_backend(group) != "gloo":
            return original(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        if len(set(sizes)) == 1:
            return original(input_, group, sizes, use_global_buffer)
        rows = max(sizes)
        padded = input_.new_zeros((rows, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        gathered = input_.new_empty((rows * len(sizes), *input_.shape[1:]))
        dist.all_gather_into_tensor(gathered, padded, group=group)
        return torch.cat([gathered[r * rows : r * rows + n] for r, n in enumerate(sizes)], dim=0)

    mappings._gather_along_first_dim = _gather_along_first_dim


def patch_moe() -> None:
    """F: ``megatron/core/transformer/moe/moe_utils.py``: ``te_general_gemm`` is only defined when
    Transformer Engine imports, yet ``RouterGatingLinearFunction`` tests ``te_general_gemm is not
    None`` (NameError without TE): define it as ``None``. ``maybe_move_tensor_to_cpu`` only converts
    CUDA tensors, so on CPU the alltoall dispatcher's split sizes stay tensors where
    ``token_dispatcher.py::_maybe_dtoh_and_synchronize`` expects numpy arrays: convert CPU tensors
    too. ``token_dispatcher`` imported the function by name, so it is replaced there as well."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor):
            tensor = tensor.cpu()
            if as_numpy:
                tensor = tensor.numpy()
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


__all__ = ["patch_moe", "patch_uneven_all_gather"]
