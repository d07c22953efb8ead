"""Check a parsed demo config before anything is built: each failure names the config key and the rule.

jsonargparse already refuses a value of the wrong type (``model.hidden: abc``) or outside a
``Literal`` (``model.family: bert``), naming the key. What it cannot know is this project's rules:
that ``dp*tp*pp`` must equal the processes, that ``tp`` must divide the heads, that the global batch
must split into micro-batches at every layout of the schedule, which precisions megatron runs. Left
to the strategy, those would fail once the processes are up (or, for a schedule entry, at setup);
``check_config`` runs them on the parsed values at start, in one process, and a failure reads::

    config key trainer.strategy.init_args.layout = 'dp1-tp3-pp1': layout dp1-tp3-pp1 does not fit gpt:
    tp=3 must divide the 4 attention heads ... HINT: ...

The rules are the strategy's own functions (``validate_target``, ``parse_schedule``,
``validate_schedule``, ``parse_bytes``, ``model_shape``, ``MegatronPrecision``), so the config and
a run cannot disagree.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from lightning_dynatrain.vps.errors import DynaTrainError

STRATEGY_KEY = "trainer.strategy"
LAYOUT_KEY = "trainer.strategy.init_args.layout"
SCHEDULE_KEY = "schedule"
ELASTIC_KEY = "elastic"
POSITIVE = ("hidden", "layers", "heads", "ffn_hidden", "seq_length", "vocab_size", "global_batch_size",
            "micro_batch_size")
#: Lightning's older spellings of the precisions megatron runs
PRECISION_ALIASES = {"32": "32-true", "bf16": "bf16-mixed"}

T = TypeVar("T")


class ConfigError(DynaTrainError):
    """A config value breaks a rule; the message starts with the key's path."""


def _at(key: str, value: Any, fn: Callable[[], T]) -> T:
    """``fn()``, with a ``DynaTrainError`` it raises re-raised as a ``ConfigError`` naming ``key``."""
    try:
        return fn()
    except DynaTrainError as err:
        raise ConfigError(f"config key {key} = {value!r}: {err.message}", hint=err.hint) from err


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    node = cfg
    for part in key.split("."):
        if node is None:
            return default
        node = node.get(part) if isinstance(node, Mapping) or hasattr(node, "get") else getattr(node, part, None)
    return default if node is None else node


def world_size(trainer: Any) -> int | None:
    """Processes the Trainer config asks for (``devices`` x ``num_nodes``), or ``None`` when it cannot tell."""
    devices, nodes = _get(trainer, "devices"), _get(trainer, "num_nodes", 1)
    if isinstance(devices, int) and devices > 0:
        return devices * int(nodes)
    if isinstance(devices, str) and devices.strip().isdigit():
        return int(devices) * int(nodes)
    if isinstance(devices, (list, tuple)):
        return len(devices) * int(nodes)
    return None  # "auto", -1: the Trainer decides


def check_config(cfg: Any) -> None:
    """Check the parsed config of one subcommand (``cli.config.fit``); the first broken rule raises.

    Raises:
        ConfigError: the message names the key (``model.heads``, ``trainer.strategy.init_args.layout``,
            ``schedule``, ...) and the rule, with the rule's hint.
    """
    from lightning_dynatrain.runtime.switch_schedule import parse_schedule, validate_schedule
    from lightning_dynatrain.transition.staging import parse_bytes
    from lightning_dynatrain.lightning_cli.model import TP_SIZES_PADDED_ALIKE
    from lightning_dynatrain.megatron.shapes import model_shape
    from lightning_dynatrain.strategy.precision import MegatronPrecision
    from lightning_dynatrain.runtime.layout_checks import validate_target, vocab_divisor_for
    from lightning_dynatrain.vps.layout import ParallelConfig

    model = _get(cfg, "model")
    for name in POSITIVE:
        value = _get(model, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"config key model.{name} = {value!r}: must be a positive whole number",
                              hint=f"e.g. model.{name}: {_example(name)}")
    if not _get(model, "lr", 0) > 0:
        raise ConfigError(f"config key model.lr = {_get(model, 'lr')!r}: the learning rate must be positive",
                          hint="e.g. model.lr: 0.003")
    divisor = _get(model, "make_vocab_size_divisible_by") or vocab_divisor_for(model.vocab_size,
                                                                               list(TP_SIZES_PADDED_ALIKE))
    shape = _at("model", f"{model.family} {model.hidden}x{model.layers}",
                lambda: model_shape(model.family, hidden=model.hidden, layers=model.layers, heads=model.heads,
                                    ffn_hidden=model.ffn_hidden, vocab_size=model.vocab_size,
                                    seq_length=model.seq_length, make_vocab_size_divisible_by=divisor))

    trainer = _get(cfg, "trainer")
    precision = _get(trainer, "precision", "32-true")
    name = PRECISION_ALIASES.get(str(precision), str(precision))
    _at("trainer.precision", precision, lambda: MegatronPrecision(name))

    strategy = _get(trainer, "strategy")
    class_path = _get(strategy, "class_path", "")
    if not str(class_path).endswith("DynaTrainStrategy"):
        raise ConfigError(f"config key {STRATEGY_KEY} = {strategy!r}: the demo trains under DynaTrainStrategy",
                          hint="write trainer.strategy: {class_path: lightning_dynatrain.DynaTrainStrategy, "
                          "init_args: {layout: dp4-tp1-pp1}}")
    init = _get(strategy, "init_args", {})
    for key in ("staging_budget", "switch_memory_limit"):
        value = _get(init, key)
        if value is not None:
            _at(f"{STRATEGY_KEY}.init_args.{key}", value, lambda: parse_bytes(value))

    world = world_size(trainer)
    raw_layout = _get(init, "layout", "auto")
    if str(raw_layout).strip().lower() == "auto":
        start = ParallelConfig(dp=world) if world else None
    else:
        start = _at(LAYOUT_KEY, raw_layout, lambda: ParallelConfig.parse(str(raw_layout)))
    batch = dict(global_batch_size=model.global_batch_size, micro_batch_size=model.micro_batch_size)
    if start is not None:
        _at(LAYOUT_KEY, raw_layout, lambda: validate_target(start, world_size=world or start.world_size,
                                                             model=shape, **batch))

    raw_policy = _get(cfg, ELASTIC_KEY)
    if raw_policy:
        from lightning_dynatrain.elastic.driver.layout_policy import parse_policy

        _at(ELASTIC_KEY, raw_policy, lambda: parse_policy(raw_policy))

    raw_schedule = _get(cfg, SCHEDULE_KEY)
    schedule = _at(SCHEDULE_KEY, raw_schedule, lambda: parse_schedule(raw_schedule or None))
    if schedule and (world or start is not None):
        _at(SCHEDULE_KEY, raw_schedule,
            lambda: validate_schedule(schedule, world_size=world or start.world_size, start=start, model=shape,
                                      **batch))


def _example(name: str) -> int:
    return {"hidden": 128, "layers": 4, "heads": 4, "ffn_hidden": 512, "seq_length": 128, "vocab_size": 256,
            "global_batch_size": 16, "micro_batch_size": 2}[name]


__all__ = ["ConfigError", "ELASTIC_KEY", "LAYOUT_KEY", "SCHEDULE_KEY", "STRATEGY_KEY", "check_config", "world_size"]
