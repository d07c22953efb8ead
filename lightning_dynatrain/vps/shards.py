"""What a megatron module says it holds at one layout, as plain data: the input of ``derive.py``.

Every megatron module describes its local tensors for distributed checkpointing
(``sharded_state_dict()``): each ``ShardedTensor`` names a layout-free key, the global shape, where
the local tensor sits in it (global offset, local shape) and how many leading axes index separate
local tensors (``prepend_axis_num``: the layer and the expert axes). A factory (megatron's SwiGLU
``linear_fc1``) describes one parameter as several chunks, each a view of it.

``megatron/describe.py`` reads that description off a module into these records; here they are
torch-free, so the derivation and its tests need no process and no megatron.

Example: rank 1 of ``dp1-tp2-pp1`` holding ``decoder.layers.0.mlp.linear_fc2.weight`` of a 2-layer
model, hidden 8, ffn 16::

    ShardRecord(key="decoder.layers.mlp.linear_fc2.weight", param="decoder.layers.0.mlp.linear_fc2.weight",
                global_shape=(2, 8, 16), global_offset=(0, 0, 8), local_shape=(8, 8), stack_axes=1, start=0)
"""

from __future__ import annotations

from typing import NamedTuple

from lightning_dynatrain.vps.layout import ParallelConfig


class ShardRecord(NamedTuple):
    """One chunk of one local parameter, as megatron describes it."""

    key: str
    """Megatron's layout-free key (``ShardedTensor.key``), e.g. ``decoder.layers.mlp.linear_fc1.weight``."""
    param: str
    """The local parameter's name in ``named_parameters()`` (stage-local layer, rank-local expert)."""
    global_shape: tuple[int, ...]
    """The whole tensor at this layout, stack axes included (a vocabulary padded for this tp)."""
    global_offset: tuple[int, ...]
    """Where the chunk starts in it (on stack axes: the global layer and expert)."""
    local_shape: tuple[int, ...]
    """The chunk's shape (non-stack axes only)."""
    stack_axes: int
    """Leading axes that index separate local tensors (megatron's ``prepend_axis_num``)."""
    start: int
    """Element offset of the chunk in the parameter (0 unless a factory split it); the chunk is a
    contiguous row-major block of the parameter (``describe.py`` checks)."""


class ParamRecord(NamedTuple):
    """One local parameter of a probed module."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    """Torch dtype name (``"float32"``, ``"bfloat16"``)."""


class ModuleDescription(NamedTuple):
    """Everything one rank's module says at one layout (``megatron.describe.describe_module``)."""

    layout: ParallelConfig
    rank: int
    records: tuple[ShardRecord, ...]
    params: tuple[ParamRecord, ...]
    """Every parameter, in ``named_parameters()`` order (megatron's registration order)."""
    undescribed: tuple[str, ...] = ()
    """Parameters no ``ShardedTensor`` covers."""
    buffers: tuple[str, ...] = ()
    """Floating-point state the description holds that is not a parameter (a persistent buffer,
    such as a router's expert bias)."""
    unsupported: tuple[str, ...] = ()
    """Descriptions this project cannot read (``flattened_range``, non-contiguous factory chunks),
    one line each naming the key."""
    vocab_params: tuple[str, ...] = ()
    """Parameters megatron splits along a padded vocabulary (a ``VocabParallelEmbedding``'s weight,
    a language model's ``output_layer``)."""

    def by_key(self) -> dict[str, list[ShardRecord]]:
        out: dict[str, list[ShardRecord]] = {}
        for record in self.records:
            out.setdefault(record.key, []).append(record)
        return out


class VocabPadding(NamedTuple):
    """Megatron's vocabulary padding rule (Megatron-LM's ``--make-vocab-size-divisible-by``): the
    vocabulary of ``size`` rows is padded to a multiple of ``divisible_by * tp``."""

    size: int
    divisible_by: int = 128

    def padded(self, tp: int) -> int:
        multiple = self.divisible_by * tp
        return -(-self.size // multiple) * multiple


__all__ = ["ModuleDescription", "ParamRecord", "ShardRecord", "VocabPadding"]
