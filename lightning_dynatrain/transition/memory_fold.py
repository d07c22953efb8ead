"""How much memory one rank's switch takes on top of its old state: a fold over its program (pure).

The walker allocates a destination local tensor where a step writes it first and releases a source
tensor where a step reads it last (``program.py``); replaying the same steps with the same rules
gives the peak of (new memory taken - old memory given back) over the switch. The stage buffer is
alive from the first step that packs to the first retained box, ``buffer_bytes`` of it.

It is an upper bound: a destination tensor is counted whole at its first write, though its pages
fill as it is written. ``shared_source_kinds`` names state kinds whose source tensors are views
into one buffer (megatron's params under the distributed optimizer): they give nothing back until
the end. ``preallocated_kinds`` names destination kinds whose memory was taken before the switch
(a zero1 model's param buffer, zeroed by megatron at construction): writing them takes nothing more.
With ``keeps_in_place`` the ``Keep`` steps are assumed kept (a whole tensor neither taken nor given
back; a slice gives back the rest of its old tensor), as the memory policies do where they can.

Example::

    program = compile_switch(plan, source_regions, dest_regions, staging_budget=256 * 2**20)
    need = switch_peak_bytes(program, with_staging=True)
"""

from __future__ import annotations

from collections.abc import Iterable

from lightning_dynatrain.transition.program import Broadcast, Copy, Exchange, Keep, StoreKey, SwitchProgram
from lightning_dynatrain.vps.mapping import DTYPE_SIZES
from lightning_dynatrain.vps.spec import StateKind


def switch_peak_bytes(
    program: SwitchProgram,
    *,
    keeps_in_place: bool = True,
    shared_source_kinds: Iterable[StateKind] = (),
    preallocated_kinds: Iterable[StateKind] = (),
    with_staging: bool = False,
    keep_old: bool = False,
) -> int:
    """Peak bytes this rank's switch takes beyond its old state (the stage buffer only ``with_staging``).

    ``keep_old``: the old state is held whole until the switch is confirmed (``switch_safety="keep_old"``):
    nothing is given back and nothing is kept in place."""
    keeps_in_place = keeps_in_place and not keep_old
    shared, preallocated = frozenset(shared_source_kinds), frozenset(preallocated_kinds)
    old = {t.key: t.numel * DTYPE_SIZES[t.dtype] for t in program.sources}
    new = {t.key: t.numel * DTYPE_SIZES[t.dtype] for t in program.destinations}
    net = peak = 0
    written: set[StoreKey] = set()
    buffer = 0

    def take(keys: Iterable[StoreKey]) -> None:
        nonlocal net, peak
        for key in keys:
            if key not in written:
                written.add(key)
                net += 0 if key[1] in preallocated else new[key]
        peak = max(peak, net + buffer)

    def give(key: StoreKey, nbytes: int) -> None:
        nonlocal net
        net -= 0 if key[1] in shared or keep_old else nbytes

    for step in program.steps:
        if isinstance(step, (Keep, Copy)):
            buffer = 0  # the walker gives the stage buffer back before the first retained box
        elif with_staging and (isinstance(step, Broadcast) or (isinstance(step, Exchange) and step.buffer_bytes)):
            buffer = program.buffer_bytes  # allocated at the first step that packs, kept until then
        if isinstance(step, Keep) and keeps_in_place:
            written.add(step.key)
            if step.span is not None and step.reads_last:  # the old tensor around the kept slice
                give(step.key, old[step.key] - old[step.key] * (step.span[1] - step.span[0]) // step.source_numel)
            continue
        take(step.writes_first)
        for key in step.reads_last:
            give(key, old.get(key, 0))
        take(step.writes_after)
    return peak


__all__ = ["switch_peak_bytes"]
