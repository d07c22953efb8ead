"""A run's schedule of layout switches: reading it, checking it, and running each entry once.

A schedule maps optimizer-step numbers to layouts. Entry ``S: L`` means: once ``S`` optimizer steps
are done, switch to ``L`` at that step boundary; step ``S + 1`` runs at ``L``. An entry at or before
the step a run starts or resumes from, not run yet, runs at its first boundary (the latest of them).

Three ways to write it (``parse_schedule``)::

    {200: "dp1-tp2-pp2", 400: "dp4-tp1-pp1"}
    "200:dp1-tp2-pp2,400:dp4-tp1-pp1"
    "schedule.yaml"      # schedule: {200: dp1-tp2-pp2, 400: dp4-tp1-pp1}

``SwitchSchedule`` is the one driver of a schedule: Lightning's ``ScheduledReconfig`` and the loop
engine (``DynaTrainEngine``) both hand it their step boundaries and their way to switch, so an entry
is checked, run, refused or built ahead the same way under the Trainer, Fabric and Accelerate.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Set
from pathlib import Path
from typing import Any, Literal, TypeVar

from lightning_dynatrain.runtime.layout_checks import padded_vocab_sizes, validate_target
from lightning_dynatrain.transition.errors import SwitchFailedError, was_refused
from lightning_dynatrain.vps.errors import DynaTrainError
from lightning_dynatrain.vps.layout import ParallelConfig

ScheduleLike = Mapping[int, "str | ParallelConfig"] | str | os.PathLike | None
R = TypeVar("R")

#: what a switch refused before anything moved does: go on at the old layout, or end the run
ON_REFUSED = ("continue", "raise")


class ScheduleError(DynaTrainError):
    """A schedule cannot be read, or one of its entries cannot run (the message names the step)."""


def _step(key: Any, where: str) -> int:
    try:
        step = int(str(key).strip())
    except ValueError:
        raise ScheduleError(f"{where}: step {key!r} is not a whole number",
                            hint="write entries as STEP:LAYOUT, e.g. 200:dp1-tp2-pp2") from None
    if step < 0:
        raise ScheduleError(f"{where}: step {step} is negative", hint="steps count optimizer steps from 0")
    return step


def _layout(value: Any, step: int, where: str) -> ParallelConfig:
    try:
        return ParallelConfig.parse(value if isinstance(value, ParallelConfig) else str(value))
    except DynaTrainError as err:
        raise ScheduleError(f"{where}: entry at step {step}: {err.message}", hint=err.hint) from err


def _from_string(text: str) -> dict[int, ParallelConfig]:
    out: dict[int, ParallelConfig] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if ":" not in part:
            raise ScheduleError(f"schedule {text!r}: entry {part!r} has no ':'",
                                hint="write STEP:LAYOUT[,STEP:LAYOUT...], e.g. 200:dp1-tp2-pp2,400:dp4")
        key, value = part.split(":", 1)
        step = _step(key, f"schedule {text!r}")
        if step in out:
            raise ScheduleError(f"schedule {text!r}: step {step} appears twice", hint="give each step once")
        out[step] = _layout(value.strip(), step, f"schedule {text!r}")
    return out


def _from_yaml(path: Path) -> dict[int, ParallelConfig]:
    from omegaconf import DictConfig, OmegaConf

    try:
        cfg = OmegaConf.load(path)
    except Exception as err:  # omegaconf / yaml raise many types
        raise ScheduleError(f"cannot read schedule file {path}: {err}",
                            hint="write YAML like `schedule: {200: dp1-tp2-pp2}`") from err
    node = cfg.get("schedule", cfg) if isinstance(cfg, DictConfig) else None
    if not isinstance(node, DictConfig):
        raise ScheduleError(f"schedule file {path} has no mapping of steps to layouts",
                            hint="write YAML like `schedule: {200: dp1-tp2-pp2, 400: dp4-tp1-pp1}`")
    raw = OmegaConf.to_container(node, resolve=True)
    return {_step(k, str(path)): _layout(v, _step(k, str(path)), str(path)) for k, v in raw.items()}


def parse_schedule(schedule: ScheduleLike) -> dict[int, ParallelConfig]:
    """Read a schedule (dict, ``"STEP:LAYOUT,..."``, or a YAML path) into ``{step: layout}``, sorted by step.

    >>> {step: str(layout) for step, layout in parse_schedule("400:dp4, 200:dp1-tp2-pp2").items()}
    {200: 'dp1-tp2-pp2', 400: 'dp4-tp1-pp1'}

    Raises:
        ScheduleError: unreadable file, malformed entry, negative or repeated step, unparsable layout.
    """
    if schedule is None:
        entries: dict[int, ParallelConfig] = {}
    elif isinstance(schedule, Mapping):
        entries = {}
        for key, value in schedule.items():
            step = _step(key, "schedule")
            if step in entries:
                raise ScheduleError(f"schedule: step {step} appears twice", hint="give each step once")
            entries[step] = _layout(value, step, "schedule")
    elif isinstance(schedule, os.PathLike) or (
        isinstance(schedule, str) and (schedule.strip().endswith((".yaml", ".yml")) or Path(schedule).is_file())
    ):
        path = Path(schedule)
        if not path.is_file():
            raise ScheduleError(f"schedule file {path} does not exist", hint="pass an existing YAML path or STEP:LAYOUT,...")
        entries = _from_yaml(path)
    elif isinstance(schedule, str):
        entries = _from_string(schedule)
    else:
        raise ScheduleError(f"cannot read a schedule from {type(schedule).__name__}",
                            hint="pass a dict {step: layout}, a 'STEP:LAYOUT,...' string or a YAML path")
    return dict(sorted(entries.items()))

def refusal_message(step: int, layout: ParallelConfig, err: Exception, now: ParallelConfig) -> str:
    """What a schedule says when its switch at ``step`` to ``layout`` was refused (``was_refused``)."""
    how = "failed and was rolled back" if isinstance(err, SwitchFailedError) else "was refused before anything moved"
    return (f"the switch to {layout} at step {step} {how} ({type(err).__name__}: {err}); the old state is whole "
            f"and training goes on at {now}")


def next_to_prepare(schedule: Iterable[tuple[int, ParallelConfig]], *, after: int, skip: Set[int],
                    current: ParallelConfig, prepared: tuple[ParallelConfig, ParallelConfig] | None,
                    ) -> tuple[int, ParallelConfig] | None:
    """The first entry after step ``after`` (not in ``skip``) that changes the layout from ``current``,
    unless its build from ``current`` is ``prepared`` already: what to build ahead next, or ``None``."""
    later = sorted((s, layout) for s, layout in schedule if s > after and s not in skip and layout != current)
    if not later or prepared == (current, later[0][1]):
        return None
    return later[0]


def validate_schedule(schedule: Mapping[int, ParallelConfig], *, world_size: int, start: ParallelConfig | None = None,
                      model: Any = None, global_batch_size: int | None = None, micro_batch_size: int | None = None,
                      warn: Callable[[str], None] = warnings.warn) -> None:
    """Check every entry (world size, model rules, batch split); the first bad one raises, naming its step.

    Also warns (``warn``: the front end's rank-zero warning) when the padded vocabulary differs between
    layouts of the schedule: megatron's padded rows take part in the softmax, so the model would
    change at the switch.

    Raises:
        ScheduleError: ``"schedule entry at step 5000 (dp1-tp3-pp1): <rule>"`` with the rule's hint.
    """
    for step, layout in schedule.items():
        try:
            validate_target(layout, world_size=world_size, model=model, global_batch_size=global_batch_size,
                            micro_batch_size=micro_batch_size, current=start)
        except DynaTrainError as err:
            raise ScheduleError(f"schedule entry at step {step} ({layout}): {err.message}", hint=err.hint) from err
    if model is not None and model.spec().vocab_size:
        layouts = ([start] if start is not None else []) + list(schedule.values())
        padded = padded_vocab_sizes(model.spec(), layouts)
        if len(set(padded.values())) > 1:
            warn(
                f"the padded vocabulary differs across the schedule's layouts ({padded} by tp): padded rows take "
                "part in the softmax, so the model changes at a switch. Set make_vocab_size_divisible_by to "
                "lightning_dynatrain.runtime.layout_checks.vocab_divisor_for(vocab_size, tp_sizes)")


class SwitchSchedule:
    """A run's schedule and what became of each entry (see the module docstring).

    Args:
        schedule: ``{step: layout}``, ``"STEP:LAYOUT,..."`` or a YAML path (``parse_schedule``).
        on_refused: ``"continue"``: a switch refused before anything moved (memory, staging budget;
            or rolled back by ``switch_safety="keep_old"`` with the old state whole) is told
            (``say``), recorded in ``refusals``, and training goes on at the old layout;
            ``"raise"``: the error leaves the boundary.
        ahead: build the next entry's switch in the background during the steps before it.

    Raises:
        ScheduleError: the schedule cannot be read, or ``on_refused`` is not one of ``ON_REFUSED``.

    Example (a front end, at every step boundary)::

        schedule = SwitchSchedule({200: "dp1-tp2-pp2"})
        schedule.run_due(step, switch=run.switch_to, current=run.layout, say=print)
        schedule.prepare_next(step, current=run.layout, prepared=run.switcher.prepared_pair,
                              prepare=run.prepare, say=print)

    State (``state_dict``): the entries already run or refused, so a resumed run does not repeat
    them, and the refusals (``(step, layout, error type, message)``).
    """

    def __init__(self, schedule: ScheduleLike | Iterable[tuple[int, ParallelConfig]] = None, *,
                 on_refused: Literal["continue", "raise"] | str = "continue", ahead: bool = True) -> None:
        if on_refused not in ON_REFUSED:
            raise ScheduleError(f"on_refused={on_refused!r}", hint='use "continue" or "raise"')
        if isinstance(schedule, tuple):  # the parsed form, (step, layout) pairs
            schedule = dict(schedule)
        self.entries: dict[int, ParallelConfig] = parse_schedule(schedule)
        self.on_refused = on_refused
        self.ahead = ahead
        self.done: set[int] = set()
        self.refusals: list[tuple[int, str, str, str]] = []
        self._not_ahead: set[int] = set()  # entries whose build could not start (told once)

    def check(self, *, world_size: int, start: ParallelConfig | None, model: Any = None,
              global_batch_size: int | None = None, micro_batch_size: int | None = None,
              warn: Callable[[str], None] = warnings.warn) -> None:
        """Every entry against the world, the model and the batch (``validate_schedule``)."""
        validate_schedule(self.entries, world_size=world_size, start=start, model=model,
                          global_batch_size=global_batch_size, micro_batch_size=micro_batch_size, warn=warn)

    def run_due(self, step: int, *, switch: Callable[[ParallelConfig], R], current: Callable[[], ParallelConfig],
                say: Callable[[str], None]) -> R | None:
        """After ``step`` optimizer steps: run the entry due now (entries at or before ``step`` not run
        yet: the latest wins, the others count as run) through ``switch``; its result, or ``None``
        when none is due or it was refused under ``on_refused="continue"`` (``current()``: the
        layout training goes on at, for the message)."""
        due = [s for s in self.entries if s <= step and s not in self.done]
        if not due:
            return None
        self.done.update(due)
        entry = max(due)
        layout = self.entries[entry]
        try:
            return switch(layout)
        except DynaTrainError as err:  # the same on every rank
            if self.on_refused == "raise" or not was_refused(err):
                raise
            self.refusals.append((entry, str(layout), type(err).__name__, str(err)))
            say(refusal_message(entry, layout, err, current()))
            return None

    def prepare_next(self, step: int, *, current: ParallelConfig,
                     prepared: tuple[ParallelConfig, ParallelConfig] | None,
                     prepare: Callable[[ParallelConfig], bool], say: Callable[[str], None]) -> None:
        """Start building the next entry after ``step`` that changes the layout, in the background
        (``ahead``; ``prepare`` starts a build and says whether it did), unless it is ``prepared``
        already. An entry whose build cannot start is built when it runs (told once)."""
        if not self.ahead:
            return
        entry = next_to_prepare(self.entries.items(), after=step, skip=self.done | self._not_ahead, current=current,
                                prepared=prepared)
        if entry is None:
            return
        at, layout = entry
        try:
            if not prepare(layout):  # a build failed in this world: switches build on demand
                self._not_ahead.add(at)
        except DynaTrainError as err:  # the same on every rank: the switch is built when it runs
            self._not_ahead.add(at)
            say(f"the switch to {layout} at step {at} cannot be built ahead ({type(err).__name__}: {err}); "
                "it will be built when it runs")

    def state_dict(self) -> dict[str, Any]:
        return {"done": sorted(self.done), "schedule": {s: str(l) for s, l in self.entries.items()},
                "refusals": [list(r) for r in self.refusals]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.done = {int(s) for s in state.get("done", state.get("schedule_done", ()))}
        self.refusals = [tuple(r) for r in state.get("refusals", ())]

    def __str__(self) -> str:
        return ",".join(f"{step}:{layout}" for step, layout in self.entries.items()) or "no switches"


__all__ = ["ON_REFUSED", "ScheduleError", "ScheduleLike", "SwitchSchedule", "next_to_prepare", "parse_schedule",
           "refusal_message", "validate_schedule"]
