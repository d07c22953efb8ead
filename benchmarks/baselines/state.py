"""The training state every baseline starts from and ends in: a megatron GPT + Adam at one layout.

``BenchSetup`` says which model and how it is trained (one step with a tiny batch, so the Adam
moments are real, non-zero state). ``build_trained_state`` builds it at a layout and runs that
step; ``build_empty_state`` builds a layout's model, DDP buffers and optimizer *without* weight init
and with empty Adam state at a given step (what a checkpoint load or a switch fills).

Example (every rank of a 4-rank gloo world)::

    setup = BenchSetup(shape=GPTShape(...))
    state = build_trained_state(setup, ParallelConfig.parse("dp2-tp2-pp1"), rank)
    store = store_of(state, setup.spec, rank)        # (tensor, kind, stack) -> live local tensor
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property

import torch

from lightning_dynatrain.megatron.gpt import GPTShape, build_gpt_model, gpt_provider, logical_spec
from lightning_dynatrain.megatron.hot_switch import SwitchSetup
from lightning_dynatrain.megatron.optimizer import adam_config, build_ddp_chunks_and_optimizer
from lightning_dynatrain.megatron.train_step import run_train_step
from lightning_dynatrain.megatron.parallel_state_adapter import ProcessGroupCache, initialize_for_layout
from lightning_dynatrain.megatron.state import MegatronState
from lightning_dynatrain.megatron.state_bridge import adam_step, materialize_optimizer_state, megatron_store
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.spec import ModelSpec


@dataclass(frozen=True, kw_only=True)
class BenchSetup:
    """What is trained, and how, in every method of a benchmark run."""

    shape: GPTShape
    """The model (layout-free)."""
    seed: int = 1234
    """Weight-init seed (layout-independent init) and data seed."""
    optimizer: dict = field(default_factory=lambda: dict(lr=1e-3, weight_decay=0.1))
    """``adam_config`` keyword arguments; every rebuilt optimizer gets the same."""
    global_batch: int = 4
    """Sequences in the one training step that gives Adam its state (split over data parallel)."""
    train_seq: int = 32
    """Tokens per sequence of that step (the model's ``seq_length`` is only its maximum)."""
    staging_budget: int = 256 * 2**20
    """The hot switch's staging budget (bytes)."""
    recycle: bool = True
    """Whether the hot switch writes new state into old storages (the host's ``RecyclingMemory``, ``devices.host.recycling_memory``)."""
    derived: bool = False
    """The hot switch reads the model's description from megatron (``gpt_provider``: the spec
    derived at its first use, in the job) instead of the hand-written GPT spec. The other methods and
    the parent's estimates use the hand-written one (equal: ``tests/megatron/test_derived_spec.py``)."""

    @cached_property
    def spec(self) -> ModelSpec:
        return logical_spec(self.shape)

    def switch_setup(self, topology) -> SwitchSetup:
        """What the hot switch of this run is given (no broadcast promotion: the default pairs
        have none that pays here, and every method then moves the same bytes point to point)."""
        model = gpt_provider(self.shape) if self.derived else self.shape
        return SwitchSetup(model=model, seed=self.seed, optimizer=self.optimizer,
                           staging_budget=self.staging_budget, recycle=self.recycle, topology=topology)


def _batch(setup: BenchSetup, layout: ParallelConfig, rank: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(setup.seed)
    tokens = torch.randint(0, setup.shape.vocab_size, (setup.global_batch, setup.train_seq + 1), generator=generator)
    per = setup.global_batch // layout.dp
    dp_rank = layout.dense_coord(rank).dp
    local = tokens[dp_rank * per:(dp_rank + 1) * per]
    return {"tokens": local[:, :-1].contiguous(), "labels": local[:, 1:].contiguous()}


def build_trained_state(setup: BenchSetup, layout: ParallelConfig, rank: int,
                        groups: ProcessGroupCache | None = None) -> MegatronState:
    """Build the model at ``layout`` (layout-independent init) and run one optimizer step.

    Deterministic: the same setup and layout give the same state bit for bit, so a state can be
    rebuilt instead of kept. Collective over the world.
    """
    if setup.global_batch % layout.dp:
        raise ValueError(f"global_batch={setup.global_batch} is not a multiple of dp={layout.dp}")
    pgs = initialize_for_layout(layout, seed=setup.seed, groups=groups)
    model = build_gpt_model(setup.shape, layout, seed=setup.seed, pg_collection=pgs)
    chunks, optimizer = build_ddp_chunks_and_optimizer(model, layout, config=adam_config(**setup.optimizer),
                                                       pg_collection=pgs)
    batch = _batch(setup, layout, rank)
    run_train_step(chunks, optimizer, batch, layout, num_microbatches=batch["tokens"].shape[0])
    return MegatronState(layout=layout, groups=pgs, chunks=chunks, optimizer=optimizer)


def build_empty_state(setup: BenchSetup, layout: ParallelConfig, step: int,
                      groups: ProcessGroupCache | None = None) -> tuple[MegatronState, dict[str, float]]:
    """Megatron groups, model, DDP and optimizer for ``layout``, weights not initialised, Adam state
    allocated (zeros) at ``step``: what a checkpoint load then fills. With the seconds of each
    step, named as the hot switch names its phases (``HotSwitchResult.phases``)."""
    seconds, t0 = {}, time.perf_counter()
    pgs = initialize_for_layout(layout, seed=setup.seed, groups=groups)
    seconds["groups"], t0 = time.perf_counter() - t0, time.perf_counter()
    model = build_gpt_model(setup.shape, layout, seed=setup.seed, initialize=False, pg_collection=pgs)
    seconds["model"], t0 = time.perf_counter() - t0, time.perf_counter()
    chunks, optimizer = build_ddp_chunks_and_optimizer(model, layout, config=adam_config(**setup.optimizer),
                                                       pg_collection=pgs)
    seconds["ddp_optimizer"], t0 = time.perf_counter() - t0, time.perf_counter()
    materialize_optimizer_state(optimizer, step)
    seconds["optimizer_state"] = time.perf_counter() - t0
    return MegatronState(layout=layout, groups=pgs, chunks=chunks, optimizer=optimizer), seconds


def step_of(state: MegatronState) -> int:
    return adam_step(state.optimizer) or 0


def store_of(state: MegatronState, spec: ModelSpec, rank: int) -> dict:
    """Every local tensor of the state keyed ``(tensor, kind, stack)`` (live views, no copies)."""
    return megatron_store(state.chunks, state.optimizer, spec, state.layout, rank)


__all__ = ["BenchSetup", "build_empty_state", "build_trained_state", "step_of", "store_of"]
