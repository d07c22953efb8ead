"""``DynaTrainPlugin``: the layout, the switch schedule and the switch budgets of an Accelerate run.

It plays the part of Accelerate's ``MegatronLMPlugin`` (a layout fixed for the run, read from
``MEGATRON_LM_*`` environment variables the launcher sets from the config file's
``megatron_lm_config:`` block) and adds what that one lacks: a schedule of layout switches.

It is the run's ``runtime.settings.DynaTrainSettings`` (the one settings type every front end
parses into) under the name Accelerate users look for, with one difference: a setting not given
comes from its ``DYNATRAIN_*`` environment variable where one is set, so
``DYNATRAIN_LAYOUT=dp2-tp2-pp1 accelerate launch ...`` works with an unchanged script. Fields,
defaults, the YAML block (``DynaTrainPlugin.from_yaml``) and the errors: ``DynaTrainSettings``.

Example::

    plugin = DynaTrainPlugin(layout="dp2-tp2-pp1", schedule={200: "dp1-tp2-pp2"}, staging_budget="64MiB")
    str(plugin)   # 'DynaTrainPlugin(dp2-tp2-pp1, 200:dp1-tp2-pp2, staging 64.0 MiB)'
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from lightning_dynatrain.runtime.settings import (
    ENV_PREFIX,
    FIELDS,
    YAML_BLOCK,
    DynaTrainSettings,
    SettingsError,
    with_environment,
)

#: the error a ``DYNATRAIN_*`` variable or a ``dynatrain_config`` key that cannot be used raises
AccelerateConfigError = SettingsError


@dataclass(frozen=True, kw_only=True, slots=True)
class DynaTrainPlugin(DynaTrainSettings):
    """``DynaTrainSettings`` whose fields not given come from ``DYNATRAIN_*`` variables (see the module docstring)."""

    def __post_init__(self) -> None:
        given = {name: getattr(self, name) for name in FIELDS}
        for name, value in with_environment(given, os.environ).items():
            object.__setattr__(self, name, value)
        DynaTrainSettings.__post_init__(self)


__all__ = ["AccelerateConfigError", "DynaTrainPlugin", "ENV_PREFIX", "YAML_BLOCK"]
