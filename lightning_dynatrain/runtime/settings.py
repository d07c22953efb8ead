"""``DynaTrainSettings``: how a run switches layout, parsed once at whichever edge gives it.

Every front end reads the same settings into this one frozen type before anything is built:
``DynaTrainStrategy``'s keyword arguments, ``DynaTrainFabricStrategy``'s, Accelerate's
``DynaTrainPlugin`` (``accelerate/plugin.py``), the ``DYNATRAIN_*`` environment variables
(``from_environment``) and a YAML block (``from_yaml``). The switcher (``LayoutSwitcher.from_settings``)
and the schedule (``SwitchSchedule``) are made from it, so the same words mean the same thing
under the Trainer, Fabric and Accelerate.

Where the values come from, for ``from_environment`` (and Accelerate's plugin), first match wins:

1. the arguments given;
2. environment variables ``DYNATRAIN_LAYOUT``, ``DYNATRAIN_SCHEDULE``, ``DYNATRAIN_STAGING_BUDGET``,
   ``DYNATRAIN_SWITCH_MEMORY_LIMIT``, ``DYNATRAIN_VERIFY``, ``DYNATRAIN_PROMOTE_BROADCASTS``,
   ``DYNATRAIN_SEED``, ``DYNATRAIN_SWITCH_TIMEOUT``, ``DYNATRAIN_SWITCH_SAFETY``,
   ``DYNATRAIN_SCHEDULE_AHEAD``, ``DYNATRAIN_ON_REFUSED`` (as Accelerate's plugins read
   ``MEGATRON_LM_TP_DEGREE``, ``FSDP_*``, ...), so ``DYNATRAIN_LAYOUT=dp2-tp2-pp1 accelerate launch ...``
   works with an unchanged script;
3. the defaults below.

A YAML block in the style of Accelerate's config file, read with ``from_yaml``::

    dynatrain_config:
      dynatrain_layout: dp2-tp2-pp1
      dynatrain_schedule: {200: dp1-tp2-pp2, 400: dp4-tp1-pp1}
      dynatrain_staging_budget: 256MiB

It lives in a file of its own: Accelerate 1.15's config loader refuses unknown top-level keys
(``ValueError: The config file at ... had unknown keys (['dynatrain_config'])``), so the block
cannot share the file given to ``accelerate launch --config_file``. Other top-level keys of the
file are ignored, so a copy of an Accelerate config with the block added reads fine here.

Everything is parsed and checked at construction (typed errors with a HINT); ``validate`` checks
the layout and every schedule entry against the world, the model and the batch before anything
is built.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from lightning_dynatrain.runtime.layout_checks import validate_target
from lightning_dynatrain.runtime.switch_schedule import ON_REFUSED, ScheduleLike, parse_schedule, validate_schedule
from lightning_dynatrain.transition.deadline import SwitchDeadline, parse_switch_timeout
from lightning_dynatrain.transition.staging import format_bytes, parse_bytes
from lightning_dynatrain.vps.errors import DynaTrainError
from lightning_dynatrain.vps.layout import ParallelConfig

#: the environment variables' prefix, as ``MEGATRON_LM_`` is Accelerate's Megatron-LM plugin's
ENV_PREFIX = "DYNATRAIN_"
#: the YAML block ``from_yaml`` reads, and the prefix of its keys
YAML_BLOCK = "dynatrain_config"
#: ``switch_safety``'s values: ``"fast"`` frees the old state as it moves it; ``"keep_old"`` holds it
#: until every rank confirmed its new state, so a failed switch rolls back to the old layout
SWITCH_SAFETY = ("fast", "keep_old")


class SettingsError(DynaTrainError):
    """A setting (an argument, a ``DYNATRAIN_*`` variable or a ``dynatrain_config`` YAML key) cannot be used."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DynaTrainSettings:
    """How a run lays out its megatron-core model and when and how it switches layout.

    Args (each ``None``, or left out, takes its default):
        layout: the starting layout, e.g. ``"dp2-tp2-pp1"``; ``"auto"`` (default) is pure data
            parallelism over every process.
        schedule: switches by optimizer step: ``{200: "dp1-tp2-pp2"}``, ``"200:dp1-tp2-pp2,400:dp4"`` or
            a YAML file; entry ``S: L`` runs once ``S`` steps are done (step ``S + 1`` trains at ``L``).
            Default: none. (Under the Trainer the schedule is ``ScheduledReconfig``'s.)
        staging_budget: bytes of in-flight buffers a switch may use (``"256MiB"``, an int); default 256 MiB.
        switch_memory_limit: at most this many bytes a switch may take on one rank beyond the state;
            ``None``: no limit of its own (every switch still checks the free memory of each host).
        verify: fingerprint the whole logical state around every switch (collective, slow; tests).
        promote_broadcasts: measure the links once per world and let switches broadcast where that
            pays (default ``True``).
        seed: seed of megatron's RNG trackers (the weights are seeded by ``MegatronRecipe.seed``); 1234.
        switch_timeout: how long any wait of a switch may take, in seconds; ``None`` or ``"auto"``:
            derived from each switch's bytes and the measured links. A rank that dies or stalls in a
            switch makes every other rank raise ``SwitchFailedError`` within it.
        switch_safety: ``"fast"`` (default): a switch frees the old state as it moves it;
            ``"keep_old"``: the old state is held until every rank has its new state, so a failed
            switch rolls back to the old layout (and the memory check counts both).
        schedule_ahead: build each schedule entry's switch in a background thread during the steps
            before it (``megatron.ahead``), so its pause is the transfer (default ``True``).
        on_refused: what a schedule entry's switch refused before anything moved does (memory,
            staging budget; or rolled back by ``switch_safety="keep_old"`` with the old state whole
            on every rank): ``"continue"`` (default) says why, records it and training goes on at
            the old layout; ``"raise"``: the error leaves the step boundary.

    After construction the fields hold the parsed values: ``layout`` a ``ParallelConfig`` or ``"auto"``,
    ``schedule`` a tuple of ``(step, ParallelConfig)`` sorted by step, the budgets whole bytes,
    ``switch_timeout`` a ``SwitchDeadline`` or ``None``; the settings are frozen and hashable
    (``dataclasses.replace`` derives others).

    Raises:
        LayoutError: ``layout`` cannot be parsed.
        ScheduleError: the schedule cannot be read (the message names the entry).
        StagingBudgetError: ``staging_budget`` or ``switch_memory_limit`` is not a byte count.
        SettingsError: a value of the wrong kind (``verify="maybe"``, ``switch_safety="safe"``, ...).

    Example::

        settings = DynaTrainSettings(layout="dp2-tp2-pp1", schedule={200: "dp1-tp2-pp2"}, staging_budget="64MiB")
        str(settings)   # 'DynaTrainSettings(dp2-tp2-pp1, 200:dp1-tp2-pp2, staging 64.0 MiB)'
    """

    layout: ParallelConfig | Literal["auto"] | str | None = None
    schedule: ScheduleLike | tuple[tuple[int, ParallelConfig], ...] = None
    staging_budget: int | str | None = None
    switch_memory_limit: int | str | None = None
    verify: bool | str | None = None
    promote_broadcasts: bool | str | None = None
    seed: int | str | None = None
    switch_timeout: float | str | SwitchDeadline | None = None
    switch_safety: Literal["fast", "keep_old"] | str | None = None
    schedule_ahead: bool | str | None = None
    on_refused: Literal["continue", "raise"] | str | None = None

    def __post_init__(self) -> None:
        schedule = self.schedule
        if isinstance(schedule, tuple):  # dataclasses.replace passes the parsed form back
            schedule = dict(schedule)
        limit = self.switch_memory_limit
        values = dict(layout=parse_start_layout(self.layout),
                      schedule=tuple(parse_schedule(schedule or None).items()),
                      staging_budget=parse_bytes(self.staging_budget if self.staging_budget is not None else "256MiB"),
                      switch_memory_limit=None if limit in (None, "", "none", "None") else parse_bytes(limit),
                      verify=_flag("verify", self.verify, default=False),
                      promote_broadcasts=_flag("promote_broadcasts", self.promote_broadcasts, default=True),
                      seed=_whole("seed", self.seed, default=1234),
                      switch_timeout=parse_switch_timeout(self.switch_timeout),
                      switch_safety=parse_switch_safety(self.switch_safety),
                      schedule_ahead=_flag("schedule_ahead", self.schedule_ahead, default=True),
                      on_refused=_choice("on_refused", self.on_refused, ON_REFUSED))
        for name, value in values.items():
            object.__setattr__(self, name, value)

    # ------------------------------------------------------------------------------- reading
    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None, **given: Any) -> "DynaTrainSettings":
        """The settings ``given``, each one not given (or ``None``) from its ``DYNATRAIN_<FIELD>``
        variable (``environ``, default ``os.environ``), else its default."""
        return cls(**with_environment(given, os.environ if environ is None else environ))

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, **overrides: Any) -> "DynaTrainSettings":
        """The settings of the ``dynatrain_config:`` block of the YAML file ``path`` (see the module
        docstring); ``overrides`` (constructor arguments) win over the file.

        Raises:
            SettingsError: the file cannot be read, has no ``dynatrain_config`` mapping, or the block
                has a key that is not ``dynatrain_<field>``.
        """
        import yaml

        path = Path(path)
        try:
            document = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as err:
            raise SettingsError(f"cannot read {path}: {err}",
                                hint=f"pass a YAML file with a `{YAML_BLOCK}:` mapping") from err
        block = document.get(YAML_BLOCK) if isinstance(document, dict) else None
        if not isinstance(block, dict):
            raise SettingsError(f"{path} has no `{YAML_BLOCK}:` mapping",
                                hint=f"write `{YAML_BLOCK}:` with keys such as dynatrain_layout: dp2-tp2-pp1")
        known = {f"dynatrain_{name}": name for name in FIELDS}
        unknown = sorted(set(map(str, block)) - set(known))
        if unknown:
            raise SettingsError(f"{path}: unknown keys {unknown} in `{YAML_BLOCK}`",
                                hint=f"use only {', '.join(sorted(known))}")
        kwargs = {known[str(key)]: value for key, value in block.items()}
        kwargs.update(overrides)
        return cls(**kwargs)

    # ---------------------------------------------------------------------------- using it
    @property
    def schedule_map(self) -> dict[int, ParallelConfig]:
        """``{step: layout}``, sorted by step."""
        return dict(self.schedule)

    def start_layout(self, world_size: int) -> ParallelConfig:
        """The layout training starts at on ``world_size`` processes (``auto``: ``dp{world_size}``)."""
        return ParallelConfig(dp=world_size) if self.layout == "auto" else self.layout

    def validate(self, *, world_size: int, model: Any = None, global_batch_size: int | None = None,
                 micro_batch_size: int | None = None) -> ParallelConfig:
        """Check the starting layout and every schedule entry against the world, the model and the
        batch; the starting layout.

        Raises:
            LayoutError / WorldSizeError / BatchSizeError: the starting layout does not fit.
            ScheduleError: an entry does not fit (the message names its step and the rule).
        """
        start = validate_target(self.start_layout(world_size), world_size=world_size, model=model,
                                global_batch_size=global_batch_size, micro_batch_size=micro_batch_size)
        validate_schedule(self.schedule_map, world_size=world_size, start=start, model=model,
                          global_batch_size=global_batch_size, micro_batch_size=micro_batch_size)
        return start

    def __str__(self) -> str:
        schedule = ",".join(f"{step}:{layout}" for step, layout in self.schedule) or "no switches"
        faults = "" if self.switch_timeout is None else f", switch_timeout {self.switch_timeout.seconds:g} s"
        faults += "" if self.switch_safety == "fast" else f", switch_safety {self.switch_safety}"
        faults += "" if self.schedule_ahead or not self.schedule else ", switches built on demand"
        faults += "" if self.on_refused == "continue" else ", refused switches raise"
        return f"{type(self).__name__}({self.layout}, {schedule}, staging {format_bytes(self.staging_budget)}{faults})"


#: the settings' names, in order (``DYNATRAIN_<NAME>`` each)
FIELDS = tuple(f.name for f in fields(DynaTrainSettings))


def parse_start_layout(value: Any) -> ParallelConfig | Literal["auto"]:
    """A starting layout: ``"auto"`` (also for ``None``) or a parsed ``ParallelConfig``.

    Raises:
        LayoutError: ``value`` is not a layout.
    """
    if value is None or isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    return ParallelConfig.parse(value)


def parse_switch_safety(value: str | None) -> str:
    """``switch_safety``: ``"fast"`` (also for ``None``) or ``"keep_old"``.

    Raises:
        SettingsError: another value.
    """
    text = "fast" if value is None else str(value).strip().lower()
    if text not in SWITCH_SAFETY:
        raise SettingsError(f"switch_safety={value!r} is not one of {', '.join(SWITCH_SAFETY)}",
                            hint='use "fast" (default: the old state is freed as it moves) or "keep_old" '
                            "(a failed switch rolls back; the old state is held until the switch ends)")
    return text


def with_environment(given: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """``given``, each setting not in it (or ``None``) taken from ``DYNATRAIN_<FIELD>`` where set.

    Raises:
        SettingsError: ``given`` names a setting that does not exist.
    """
    unknown = sorted(set(given) - set(FIELDS))
    if unknown:
        raise SettingsError(f"unknown settings {unknown}", hint=f"use only {', '.join(FIELDS)}")
    values = dict(given)
    for name in FIELDS:
        if values.get(name) is None and f"{ENV_PREFIX}{name.upper()}" in environ:
            values[name] = environ[f"{ENV_PREFIX}{name.upper()}"]
    return values


def _flag(name: str, value: Any, *, default: bool) -> bool:
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{name}={value!r} is not a yes/no value",
                        hint=f"write {ENV_PREFIX}{name.upper()}=true or false")


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    """``value`` (default the first of ``choices``), one of ``choices``."""
    if value is None:
        return choices[0]
    text = str(value).strip().lower()
    if text not in choices:
        raise SettingsError(f"{name}={value!r} is not one of {', '.join(choices)}",
                            hint=f"write {ENV_PREFIX}{name.upper()}={choices[0]}")
    return text


def _whole(name: str, value: Any, *, default: int) -> int:
    if value is None:
        return default
    try:
        if isinstance(value, bool) or float(value) != int(float(value)):
            raise ValueError
        return int(float(value))
    except (TypeError, ValueError):
        raise SettingsError(f"{name}={value!r} is not a whole number",
                            hint=f"write e.g. {ENV_PREFIX}{name.upper()}=1234") from None


__all__ = ["DynaTrainSettings", "ENV_PREFIX", "FIELDS", "SWITCH_SAFETY", "SettingsError", "YAML_BLOCK",
           "parse_start_layout", "parse_switch_safety", "with_environment"]
