"""Which survivors source the state after members died mid-step (pure).

A member that dies inside an optimizer step leaves the survivors at two steps at most: those that
passed megatron's ``optimizer.step()`` hold the step's result, the others the step before. A new
world must start from one step: every box comes from a survivor at that step, never some from each.
``recovery_source`` takes the newest step whose holders among the survivors still hold every box of
the old layout (data-parallel replicas make that likely); survivors at another step and the dead
hold nothing (``Members.src`` is ``None`` for them) and receive their part like every destination.
When no step is whole (a ZeRO-1 shard, or a tp/pp shard at dp1, went with the dead),
``StateLostError`` names what went, unless an in-memory snapshot holds it: ``snapshot_source``
then goes back to the snapshot's step, each survivor's own copy and the dead's boxes from the
survivors that keep them.

Example (dp2-tp2, rank 1 died after its optimizer step, ranks 0 and 3 had stepped too, rank 2 not)::

    >>> source = recovery_source(spec, ParallelConfig.parse("dp2-tp2"), Precision.FP32, old_size=4,
    ...                          survivors=(SurvivorState(0, 6), SurvivorState(2, 5), SurvivorState(3, 6)))
    >>> source.step, source.members.src
    (6, (0, None, None, 2))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_dynatrain.vps.box import Box
from lightning_dynatrain.vps.errors import StateLostError
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.lost_state import LostBox, describe_lost, lost_state
from lightning_dynatrain.vps.members import Members
from lightning_dynatrain.vps.snapshot_plan import SnapshotPlan
from lightning_dynatrain.vps.spec import ModelSpec, Precision, StateKind


@dataclass(frozen=True)
class SurvivorState:
    """A survivor's rank in the old world and the optimizer step its state is the result of."""

    old_rank: int
    step: int


@dataclass(frozen=True)
class RecoverySource:
    """The step the new world starts from and who holds it (``members``: old ranks at that step as
    sources, the survivors in order as the destination's processes)."""

    step: int
    members: Members
    stale: tuple[int, ...]
    """Old ranks of survivors at another step: they hold nothing of ``step``'s state."""


def recovery_source(spec: ModelSpec, layout: ParallelConfig, precision: Precision, *, old_size: int,
                    survivors: Sequence[SurvivorState]) -> RecoverySource:
    """The newest step whole among ``survivors`` (in the new world's rank order) of a world of
    ``old_size`` at ``layout`` (see the module docstring).

    Raises:
        StateLostError: no step's holders hold every box; the newest step's missing boxes.
    """
    if not survivors:
        raise StateLostError("no survivor holds any state", hint="restart the job from its last checkpoint")
    process = {s.old_rank: p for p, s in enumerate(survivors)}
    first_lost = None
    for step in sorted({s.step for s in survivors}, reverse=True):
        holders = {s.old_rank for s in survivors if s.step == step}
        empty = frozenset(r for r in range(old_size) if r not in holders)
        lost = lost_state(spec, layout, empty, precision)
        if not lost:
            members = Members(tuple(process[r] if r in holders else None for r in range(old_size)),
                              tuple(range(len(survivors))), len(survivors))
            stale = tuple(s.old_rank for s in survivors if s.step != step)
            return RecoverySource(step=step, members=members, stale=stale)
        first_lost = first_lost or (step, lost, empty)
    assert first_lost is not None
    step, lost, empty = first_lost
    dead = sorted(set(range(old_size)) - set(process))
    counted, shown = describe_lost(spec, lost, precision)
    raise StateLostError(
        f"{counted} of the {layout} state at step {step} "
        f"are held by no survivor (dead: rank{'s' * (len(dead) > 1)} {', '.join(map(str, dead))}): {shown}",
        hint="restart the job from its last checkpoint; a layout with data-parallel replicas (dp >= 2, without "
             "zero1 for the optimizer's state) keeps a copy of every box on another rank",
        lost=lost, ranks=tuple(sorted(empty)))




@dataclass(frozen=True)
class SnapshotHolding:
    """What a survivor holds of in-memory snapshots: the steps of its whole own copies and of the
    whole copies it keeps for others (one of each per snapshot buffer; empty: none whole)."""

    old_rank: int
    own_steps: tuple[int, ...]
    kept_steps: tuple[int, ...]


@dataclass(frozen=True)
class SnapshotSource:
    """Go back to the snapshot of ``step``: every survivor holds its old rank's state of that step
    (``members``, with ``holes`` for the boxes only the dead held), and ``keepers`` name the old
    rank keeping each of those boxes."""

    step: int
    members: Members
    keepers: dict[tuple[str, StateKind, Box], int]
    lost: tuple[LostBox, ...]


def snapshot_source(spec: ModelSpec, plan: SnapshotPlan, *, old_size: int,
                    survivors: Sequence[SnapshotHolding]) -> SnapshotSource:
    """The newest snapshot every survivor can go back to (``plan``: the copies it was taken with,
    for the old layout): a step of which every survivor holds its own copy and, for each box of the
    dead, a survivor the copy. ``StateLostError`` saying why when there is none: no step whose own
    copies every survivor holds, or a box of the dead whose copy is on no survivor at that step."""
    common = set.intersection(*(set(s.own_steps) for s in survivors)) if survivors else set()
    if not common:
        held = sorted({tuple(sorted(s.own_steps)) for s in survivors})
        raise StateLostError(f"the survivors' own snapshot copies are not of one step (held: {held}): a member died "
                             "while a snapshot was being taken, or before the first",
                             hint="restart the job from its last checkpoint; OnNodeChange(snapshot_buffers=2) keeps "
                             "the previous snapshot whole while the next one is taken")
    process = {s.old_rank: p for p, s in enumerate(survivors)}
    dead = frozenset(range(old_size)) - process.keys()
    lost = lost_state(spec, plan.layout, dead, plan.precision)
    newest: StateLostError | None = None
    for step in sorted(common, reverse=True):
        keeping = {s.old_rank for s in survivors if step in s.kept_steps}
        keepers = {(c.tensor, c.kind, c.box): c.keeper for c in plan.copies if c.keeper in keeping}
        missing = tuple(b for b in lost if (b.tensor, b.kind, b.box) not in keepers)
        if not missing:
            members = Members(tuple(process.get(r) for r in range(old_size)), tuple(range(len(survivors))),
                              len(survivors), holes=bool(lost))
            return SnapshotSource(step=step, members=members,
                                  keepers={(b.tensor, b.kind, b.box): keepers[(b.tensor, b.kind, b.box)] for b in lost},
                                  lost=lost)
        if newest is None:
            counted, shown = describe_lost(spec, missing, plan.precision)
            newest = StateLostError(
                f"{counted} of the {plan.layout} state at step {step} are in no survivor's snapshot copies (dead: "
                f"{sorted(dead)}): {shown}", hint="restart the job from its last checkpoint; the snapshot of a "
                "failure domain is kept in another one, so losing two at once loses it", lost=missing,
                ranks=tuple(sorted(dead)))
    assert newest is not None
    raise newest


__all__ = ["RecoverySource", "SnapshotHolding", "SnapshotSource", "SurvivorState", "recovery_source", "snapshot_source"]
