"""Megatron's distributed-optimizer buffer, recomputed from the spec: who owns which flat range.

Megatron-core 0.16 (``distributed/param_and_grad_buffer.py``, ``optimizer/distrib_optimizer.py``)
lays the parameters of one pipeline stage into one flat buffer per (param dtype, dense|expert)
(under bf16 the bf16 params share one buffer and the params megatron keeps in fp32, the norms,
another: ``LogicalTensor.always_fp32``):

- parameters in *reverse* registration order (to follow backprop);
- each parameter's start padded to a multiple of 64 elements;
- one bucket (this project keeps ``overlap_grad_reduce=False``, so ``bucket_size`` is ``None``), except
  that a tied embedding with pp > 1 (``shared_embedding``) gets a bucket of its own;
- each bucket's end padded to a multiple of ``lcm(shard_group_size, 128)``;
- shard ``d`` of a bucket is ``[offset + d * size/D, offset + (d+1) * size/D)``, ``D`` the size of the
  data-parallel group: ``dp * cp`` for dense parameters, ``edp`` for expert parameters. Expert
  parameters only have a buffer of their own when ``ep > 1`` (Megatron sets ``allreduce=False`` only
  then); with ``ep == 1`` they sit in the dense buffer.

The buffer is the same for every rank of a stage (local shapes do not depend on the tp/ep rank),
so one is computed per (layout, stage, group) and cached. With virtual stages each model chunk of a
stage has buffers of its own (megatron's DDP wraps each chunk alone): the embedding in the first
stage's first chunk, the output layer in the last stage's last chunk, each chunk's own layers.
"""

from __future__ import annotations

import bisect
import math
from functools import lru_cache
from typing import NamedTuple

from lightning_dynatrain.vps.grid import grid_placement
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.spec import EXPERT, Group, LogicalTensor, ModelSpec, Place, Precision

PARAM_START_ALIGN = 64
BUCKET_ALIGN = 128


class BufferEntry(NamedTuple):
    """One local parameter in the buffer: ``[start, stop)`` of the flat buffer, in bucket ``bucket``."""

    tensor: str
    stack: tuple[int, ...]  # stage-local layer index, rank-local expert index (as many as stack axes)
    start: int
    stop: int
    bucket: int


class ShardBuffer(NamedTuple):
    """One Megatron param-and-grad buffer of one stage, as seen by the distributed optimizer."""

    entries: tuple[BufferEntry, ...]
    buckets: tuple[tuple[int, int], ...]
    shard_group_size: int
    index: dict  # (tensor name, stack) -> BufferEntry
    by_tensor: dict  # tensor name -> its entries in buffer order

    def shard_range(self, bucket: int, shard: int) -> tuple[int, int]:
        start, stop = self.buckets[bucket]
        size = (stop - start) // self.shard_group_size
        return start + shard * size, start + (shard + 1) * size

    def entries_in(self, tensor: str, start: int, stop: int) -> list[BufferEntry]:
        """Entries of ``tensor`` that overlap the flat range ``[start, stop)``."""
        spans = self.by_tensor.get(tensor, ())
        # entries are in buffer order (increasing start); bisect on their stops
        i = bisect.bisect_right([e.stop for e in spans], start)
        out = []
        while i < len(spans) and spans[i].start < stop:
            out.append(spans[i])
            i += 1
        return out

    def shards_of(self, entry: BufferEntry) -> range:
        """Shard indices whose range overlaps ``entry``."""
        start, stop = self.buckets[entry.bucket]
        size = (stop - start) // self.shard_group_size
        return range((entry.start - start) // size, (entry.stop - 1 - start) // size + 1)


def buffer_group(tensor: LogicalTensor, layout: ParallelConfig) -> Group:
    """The buffer a tensor's optimizer state lives in under ``layout``."""
    if tensor.group is Group.EXPERT and layout.ep > 1:
        return Group.EXPERT
    return Group.DENSE


def shard_group_size(group: Group, layout: ParallelConfig) -> int:
    return layout.edp if group is Group.EXPERT else layout.dp_cp


def _registration_order(spec: ModelSpec, layout: ParallelConfig, stage: int, chunk: int = 0
                        ) -> list[tuple[LogicalTensor, tuple[int, ...]]]:
    """Local parameters of a stage's model chunk in Megatron's ``named_parameters()`` order."""
    last = layout.pp - 1
    first_chunk, last_chunk = chunk == 0, chunk == layout.vpp - 1
    out: list[tuple[LogicalTensor, tuple[int, ...]]] = []
    if stage == 0 and first_chunk:
        out += [(t, ()) for t in spec.tensors if t.place in (Place.FIRST, Place.FIRST_AND_LAST)]
    layer_tensors = [t for t in spec.tensors if t.place is Place.LAYERS]
    local_experts = spec.num_experts // layout.ep if spec.num_experts else 0
    for layer in range(layout.chunk_layers(spec.num_layers, stage)):
        i = 0
        while i < len(layer_tensors):
            t = layer_tensors[i]
            if EXPERT not in t.axes:
                out.append((t, (layer,)))
                i += 1
                continue
            # a run of expert tensors: Megatron registers them expert by expert
            run = []
            while i < len(layer_tensors) and EXPERT in layer_tensors[i].axes:
                run.append(layer_tensors[i])
                i += 1
            for expert in range(local_experts):
                out += [(e, (layer, expert)) for e in run]
    if stage == last and last_chunk:
        out += [(t, ()) for t in spec.tensors if t.place is Place.LAST]
        if layout.pp > 1:
            out += [(t, ()) for t in spec.tensors if t.place is Place.FIRST_AND_LAST]
    return out


def param_dtype_of(tensor: LogicalTensor, precision: Precision) -> str:
    """The dtype (name) of ``tensor``'s params at ``precision``: which of a stage's buffers it is in."""
    return "float32" if precision.of(tensor).params == "fp32" else "bfloat16"


@lru_cache(maxsize=1024)
def shard_buffer(spec: ModelSpec, layout: ParallelConfig, stage: int, group: Group,
                 precision: Precision = Precision.FP32, param_dtype: str = "float32", *, chunk: int = 0) -> ShardBuffer:
    """The distributed-optimizer buffer of ``group`` and ``param_dtype`` on pipeline ``stage`` (its
    model ``chunk``), laid out as Megatron does (``param_dtype_of`` says which tensors are in it at
    ``precision``)."""
    params = [(t, s) for t, s in _registration_order(spec, layout, stage, chunk)
              if buffer_group(t, layout) is group and param_dtype_of(t, precision) == param_dtype]
    D = shard_group_size(group, layout)
    bucket_divisor = math.lcm(D, BUCKET_ALIGN)

    def pad(n: int, d: int) -> int:
        return -(-n // d) * d

    entries: list[BufferEntry] = []
    buckets: list[tuple[int, int]] = []
    bucket_start = 0
    start = 0
    open_bucket = False
    for tensor, stack in reversed(params):
        numel = math.prod(grid_placement(spec, tensor.name, layout).local_shape())
        start = pad(start, PARAM_START_ALIGN)
        shared = tensor.place is Place.FIRST_AND_LAST and layout.pp > 1
        if shared and open_bucket:
            end = pad(start, bucket_divisor)
            buckets.append((bucket_start, end))
            bucket_start = start = end
        entries.append(BufferEntry(tensor.name, stack, start, start + numel, len(buckets)))
        open_bucket = True
        start += numel
        if shared:
            end = pad(start, bucket_divisor)
            buckets.append((bucket_start, end))
            bucket_start = start = end
            open_bucket = False
    if open_bucket:
        buckets.append((bucket_start, pad(start, bucket_divisor)))
    by_tensor: dict[str, list[BufferEntry]] = {}
    for e in entries:
        by_tensor.setdefault(e.tensor, []).append(e)
    return ShardBuffer(tuple(entries), tuple(buckets), D, {(e.tensor, e.stack): e for e in entries}, by_tensor)
