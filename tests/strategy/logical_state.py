"""The full logical training state around the switches of a fit, from every rank's local tensors.

The jobs (``families_job``, ``own_models_job``) take each rank's ``local_state`` right before and
right after every scheduled switch; here the parent assembles both sides into whole logical tensors
(every param and Adam moment, from the regions the VPS gives each rank at its layout, replicas
required to agree bit for bit), the way tests/megatron/test_hot_switch.py does for a bare megatron
switch, and requires them equal.
"""

from __future__ import annotations

import numpy as np

from lightning_dynatrain.megatron.gpt import GPTShape, logical_spec
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.spec import Precision
from tests.logical_state import assemble, common


def local_state(strategy) -> dict:
    """This rank's local training state at the strategy's layout: every local tensor's bits (an
    integer view), Adam's step, the param groups' settings, and the model's buffers."""
    import torch

    from lightning_dynatrain.megatron.state_bridge import adam_step, megatron_store

    state = strategy.megatron
    store = megatron_store(state.ddp, state.optimizer, strategy.recipe.model.spec(), state.layout,
                           strategy.global_rank)
    ints = {4: torch.int32, 2: torch.int16}
    return dict(
        layout=str(state.layout),
        tensors={key: t.detach().clone().reshape(-1).view(ints[t.element_size()]).numpy() for key, t in store.items()},
        step=adam_step(state.optimizer),
        groups=sorted({(g["wd_mult"], g["lr_mult"], g["lr"], g["weight_decay"]) for g in state.optimizer.param_groups}),
        buffers=[(name, tuple(b.shape)) for name, b in state.model.named_buffers()],
    )


def logical_state(shape: GPTShape, layout: str, per_rank: list[dict]) -> dict:
    """``{(tensor, kind): bits}`` of the whole state at ``layout`` from each rank's ``local_state``."""
    return assemble(logical_spec(shape), ParallelConfig.parse(layout), [r["tensors"] for r in per_rank],
                     Precision.FP32)


def switch_differences(shape: GPTShape, runs: list[dict], step: int) -> list[str]:
    """What differs in the full logical state across the switch at ``step`` (empty: bit for bit the same);
    ``runs`` holds each rank's record of one fit."""
    before = [r["before"][step] for r in runs]
    after = [r["after"][step] for r in runs]
    old = logical_state(shape, before[0]["layout"], before)
    new = logical_state(shape, after[0]["layout"], after)
    out = [f"{key} is missing on one side" for key in set(old) ^ set(new)]
    out += [f"{key} changed" for key in sorted(set(old) & set(new), key=str)
            if not np.array_equal(*common(old[key], new[key]))]
    for b, a in zip(before, after):
        if (a["step"], a["groups"]) != (b["step"], b["groups"]):
            out.append(f"Adam's step or the param groups changed: {b['step'], b['groups']} -> {a['step'], a['groups']}")
    return out


__all__ = ["local_state", "logical_state", "switch_differences"]
