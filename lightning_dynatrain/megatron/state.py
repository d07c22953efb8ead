"""What a rank trains with at one layout: megatron's groups, the DDP-wrapped model and its optimizer.

One object per layout: building it is "initialise the layout's groups, build the model shard, wrap
it in DDP, build the optimizer"; a hot switch turns the state of layout A into the state of layout
B (``hot_switch.py``); the strategy trains on whichever is current.

Example::

    groups = initialize_for_layout(layout, seed=0)
    model = build_gpt_model(shape, layout, seed=0, pg_collection=groups)
    ddp, optimizer = build_ddp_and_optimizer(model, layout, lr=1e-3, pg_collection=groups)
    state = MegatronState(layout=layout, groups=groups, chunks=(ddp,), optimizer=optimizer)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.core.process_groups_config import ProcessGroupCollection

from lightning_dynatrain.megatron.model_chunks import ModelChunks
from lightning_dynatrain.vps.layout import ParallelConfig


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class MegatronState:
    """Everything megatron holds for one layout on this rank."""

    layout: ParallelConfig
    """The layout these objects were built for."""
    groups: ProcessGroupCollection
    """This rank's megatron groups for ``layout`` (``initialize_for_layout``'s result)."""
    chunks: tuple[DistributedDataParallel, ...]
    """Megatron DDP around each model chunk of this rank (contiguous param and grad buffers): one
    chunk, or one per virtual pipeline stage (``model_chunks``)."""
    optimizer: MegatronOptimizer
    """Megatron's optimizer over every chunk (distributed when ``layout.zero == 1``)."""
    model: torch.nn.Module = field(init=False)
    """This rank's model shard: its ``GPTModel`` (the user's module), or ``ModelChunks`` of them."""

    def __post_init__(self) -> None:
        modules = [chunk.module for chunk in self.chunks]
        object.__setattr__(self, "model", modules[0] if len(modules) == 1 else ModelChunks(modules))

    @property
    def ddp(self) -> DistributedDataParallel:
        """The DDP of a state of one model chunk.

        Raises:
            TypeError: the state has several (virtual pipeline stages): use ``chunks``.
        """
        if len(self.chunks) != 1:
            raise TypeError(f"the state at {self.layout} has {len(self.chunks)} model chunks: use .chunks")
        return self.chunks[0]

    @property
    def buffers(self) -> list:
        """DDP's param-and-grad buffers of every chunk (dense, then expert, chunk by chunk)."""
        return [buf for chunk in self.chunks for buf in [*chunk.buffers, *chunk.expert_parallel_buffers]]

    @property
    def dp_rank(self) -> int:
        return self.groups.dp.rank()

    @property
    def dp_size(self) -> int:
        return self.groups.dp.size()

    def gradient_buffers(self) -> list[torch.Tensor]:
        """DDP's gradient buffers (dense, then expert): between two optimizer steps they hold
        nothing the next step needs (megatron zeroes them first)."""
        return [buf.grad_data for buf in self.buffers]


def optimizer_tensors(state: MegatronState) -> list[torch.Tensor]:
    """Every tensor megatron's optimizer holds on this rank: its params (main params, or the
    model's own where it keeps none) and its per-param state (moments, Adam's step)."""
    out: list[torch.Tensor] = []
    for sub in getattr(state.optimizer, "chained_optimizers", [state.optimizer]):
        inner = sub.optimizer
        out += [p for group in inner.param_groups for p in group["params"]]
        out += [t for entry in inner.state.values() for t in entry.values() if isinstance(t, torch.Tensor)]
    return out


def free_memory(state: MegatronState) -> int:
    """Give back the memory of every tensor of ``state`` (its parameters and DDP buffers, the
    optimizer's main parameters and states); the bytes freed. For a state nothing will read again
    whose successor is built from elsewhere (a recovery that goes back to a snapshot): its memory is
    free before the successor takes its own. The state must not be trained on afterwards."""
    tensors = [*state.model.parameters(), *state.gradient_buffers(),
               *(b.param_data for b in state.buffers if getattr(b, "param_data", None) is not None),
               *optimizer_tensors(state)]
    freed, seen = 0, set()
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen or not storage.nbytes() or not storage.resizable():
            continue
        seen.add(storage.data_ptr())
        freed += storage.nbytes()
        storage.resize_(0)
    return freed


def release_state(state: MegatronState) -> None:
    """Take apart a state nothing trains on any more (a switch installed its successor), so that
    reference counting frees its objects now.

    Megatron's modules and DDP hold themselves in reference cycles (gradient hooks whose closures
    hold the DDP, which holds the hooks' nodes; module hooks; bucket groups that point at each
    other), so a dropped state would otherwise wait for Python's next *full* collection, which a
    long run reaches only after its tracked objects grew by a quarter: its Python objects pile up
    from switch to switch until then. The state's tensors are not the issue (a switch hands their
    memory to the new state or frees it). This drops the attributes of the DDP and every module
    under it, of its buffers, buckets and bucket groups, and of the optimizer: the state must not
    be used afterwards.
    """
    groups = [g for ddp in state.chunks for g in [*ddp.bucket_groups, *ddp.expert_parallel_bucket_groups]]
    parts = [*(m for ddp in state.chunks for m in ddp.modules()), *state.buffers, *groups,
             *(b for g in groups for b in g.buckets), state.optimizer]
    for part in parts:
        vars(part).clear()


__all__ = ["MegatronState", "free_memory", "optimizer_tensors", "release_state"]
