"""``ScheduledReconfig``: switch the parallel layout at given optimizer steps.

A schedule maps optimizer-step numbers to layouts. Entry ``S: L`` means: once ``S`` optimizer steps
are done (``trainer.global_step == S``, at ``on_train_batch_end``, after the optimizer step), switch
to ``L``; step ``S + 1`` runs at ``L``. An entry at step 0 (or at or before the step a run resumes
from, if it has not run yet) is applied at ``on_train_start``.

Three ways to write it::

    ScheduledReconfig({200: "dp1-tp2-pp2", 400: "dp4-tp1-pp1"})
    ScheduledReconfig("200:dp1-tp2-pp2,400:dp4-tp1-pp1")
    ScheduledReconfig("schedule.yaml")      # schedule: {200: dp1-tp2-pp2, 400: dp4-tp1-pp1}

The whole schedule is checked at ``setup`` against the model (``GPTShape`` rules), the batch sizes
and the world size, so a bad layout at step 5000 fails before step 1, naming step 5000 and the rule.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Set
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_dynatrain.compat.lightning_internals import log_this_step
from lightning_dynatrain.engine.errors import SwitchFailedError, was_refused
from lightning_dynatrain.vps.errors import DynaTrainError
from lightning_dynatrain.vps.layout import ParallelConfig

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_dynatrain.strategy.dynatrain import DynaTrainStrategy

ScheduleLike = Mapping[int, "str | ParallelConfig"] | str | os.PathLike | None


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

    >>> parse_schedule("400:dp4, 200:dp1-tp2-pp2")
    {200: ParallelConfig(dp=1, tp=2, pp=2, cp=1, ep=1, etp=2, zero=0), 400: ParallelConfig(dp=4, tp=1, pp=1, cp=1, ep=1, etp=1, zero=0)}

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


class ScheduledReconfig(Callback):
    """Switch ``DynaTrainStrategy``'s layout at the optimizer steps of a schedule.

    Args:
        schedule: ``{step: layout}``, ``"STEP:LAYOUT,STEP:LAYOUT"``, or a YAML file path with a
            ``schedule:`` mapping (see module docstring). Empty/``None``: never switch.
        on_refused: what a switch refused before anything moved does (memory, staging budget, a
            target that does not fit the current world; ``engine.errors.was_refused``):
            ``"continue"`` (default) warns with the reason, records it (``refusals``) and training
            goes on at the old layout; ``"raise"`` ends ``fit`` with the error. A switch that fails
            once bytes moved raises, unless ``switch_safety="keep_old"`` rolled it back with the
            old state whole on every rank: that counts as refused.
        ahead: build each entry's switch ahead (``DynaTrainStrategy.prepare_reconfigure``): from
            the first step after the switch before it, its program and megatron objects are built
            in a background thread while training steps on, and the switch itself only binds their
            memory and moves the state. ``False``: every switch builds on demand, inside the pause.

    Raises:
        ScheduleError: at construction, when the schedule cannot be read; at ``setup``, when an entry
            does not fit the model, the batch or the world (the message names its step and the rule).
        TypeError: at ``setup``, when the Trainer's strategy is not a ``DynaTrainStrategy``.

    Example::

        trainer = Trainer(strategy=DynaTrainStrategy("dp2-tp2-pp1"), devices=4,
                          callbacks=[ScheduledReconfig({200: "dp1-tp2-pp2"})])

    State (``state_dict``): the steps whose switch already ran or was refused, so a resumed run does
    not repeat them, and the refusals (``(step, layout, error type, message)``).
    """

    def __init__(self, schedule: ScheduleLike, *, on_refused: Literal["continue", "raise"] = "continue",
                 ahead: bool = True) -> None:
        if on_refused not in ("continue", "raise"):
            raise ScheduleError(f"on_refused={on_refused!r}", hint='use "continue" or "raise"')
        self.schedule: dict[int, ParallelConfig] = parse_schedule(schedule)
        self.on_refused = on_refused
        self.ahead = ahead
        self._not_ahead: set[int] = set()  # entries whose build could not start (warned once)
        self.done: set[int] = set()
        self.refusals: list[tuple[int, str, str, str]] = []

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(schedule=tuple((s, str(l)) for s, l in self.schedule.items()))

    @staticmethod
    def _strategy(trainer: "pl.Trainer") -> "DynaTrainStrategy":
        from lightning_dynatrain.strategy.dynatrain import DynaTrainStrategy

        if not isinstance(trainer.strategy, DynaTrainStrategy):
            raise TypeError(f"ScheduledReconfig needs DynaTrainStrategy, the Trainer runs "
                            f"{type(trainer.strategy).__name__}. HINT: Trainer(strategy=DynaTrainStrategy(...))")
        return trainer.strategy

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit" or not self.schedule:
            return
        strategy = self._strategy(trainer)
        recipe = getattr(pl_module, "recipe", None)  # the module's: callbacks' setup runs before configure_model
        validate_schedule(self.schedule, world_size=trainer.world_size, start=strategy.layout,
                          model=recipe.model if recipe is not None else None,
                          global_batch_size=recipe.global_batch_size if recipe is not None else None,
                          micro_batch_size=recipe.micro_batch_size if recipe is not None else None)

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        due = [s for s in self.schedule if s <= trainer.global_step and s not in self.done]
        if due:  # step 0, or entries a resumed run has passed: go to the latest of them
            self.done.update(due)
            self._switch(trainer, max(due))

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        self._prepare_next(trainer)  # between two steps, before this one: the build runs beside it

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step in self.schedule and step not in self.done:
            self.done.add(step)
            self._switch(trainer, step, in_step=True)

    def _prepare_next(self, trainer: "pl.Trainer") -> None:
        """Build the next entry that changes the layout ahead, in the background (``ahead``), unless
        that build runs already (it is dropped by a switch elsewhere, e.g. ``reconfigure``)."""
        strategy = self._strategy(trainer)
        if not self.ahead or strategy.elastic is not None:  # an elastic run's worlds change under a build
            return
        entry = next_to_prepare(self.schedule.items(), after=trainer.global_step, skip=self.done | self._not_ahead,
                                current=strategy.layout, prepared=strategy.switcher.prepared_pair)
        if entry is None:
            return
        step, layout = entry
        try:
            if not strategy.prepare_reconfigure(layout):  # a build failed in this world
                self._not_ahead.add(step)
        except DynaTrainError as err:  # the same on every rank: the switch runs on demand (and may be refused)
            self._not_ahead.add(step)
            rank_zero_warn(f"ScheduledReconfig: the switch to {layout} at step {step} cannot be "
                           f"built ahead ({type(err).__name__}: {err}); it will be built when it runs")

    def _switch(self, trainer: "pl.Trainer", step: int, *, in_step: bool = False) -> None:
        """Switch to the entry of ``step``; ``in_step``: at the end of that step, whose metrics the
        loop logs only after the callbacks (a switch that ends the fit logs them first)."""
        strategy = self._strategy(trainer)
        try:
            strategy.reconfigure(self.schedule[step])
        except DynaTrainError as err:
            if self.on_refused == "raise" or not was_refused(err):
                if in_step:
                    log_this_step(trainer)
                raise
            self.refusals.append((step, str(self.schedule[step]), type(err).__name__, str(err)))
            rank_zero_warn(f"ScheduledReconfig: {refusal_message(step, self.schedule[step], err, strategy.layout)}")

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"done": sorted(self.done), "schedule": {s: str(l) for s, l in self.schedule.items()},
                "refusals": [list(r) for r in self.refusals]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.done = {int(s) for s in state_dict.get("done", [])}
        self.refusals = [tuple(r) for r in state_dict.get("refusals", [])]


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
                      model: Any = None, global_batch_size: int | None = None,
                      micro_batch_size: int | None = None) -> None:
    """Check every entry (world size, model rules, batch split); the first bad one raises, naming its step.

    Also warns when the padded vocabulary differs between layouts of the schedule: megatron's padded
    rows take part in the softmax, so the model would change at the switch.

    Raises:
        ScheduleError: ``"schedule entry at step 5000 (dp1-tp3-pp1): <rule>"`` with the rule's hint.
    """
    from lightning_dynatrain.strategy.validation import padded_vocab_sizes, validate_target

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
            rank_zero_warn(
                f"the padded vocabulary differs across the schedule's layouts ({padded} by tp): padded rows take "
                "part in the softmax, so the model changes at a switch. Set make_vocab_size_divisible_by to "
                "lightning_dynatrain.strategy.vocab_divisor_for(vocab_size, tp_sizes)")


__all__ = ["ScheduleError", "ScheduledReconfig", "next_to_prepare", "parse_schedule", "refusal_message",
           "validate_schedule"]
