"""The demo's flags from before its config schema, each mapped to its config key.

``python examples/train_gpt.py --devices 4 --max-steps 10 --layout dp2-tp2-pp1 --schedule 5:dp4 --out DIR``
still works: ``from_flags`` rewrites it to ``fit --trainer.devices 4 --trainer.max_steps 10 ...``
and LightningCLI parses that, so both forms go through one schema and one set of checks. The table
doubles as the answer to "which YAML key is this flag?".
"""

from __future__ import annotations

from lightning_dynatrain.vps.errors import DynaTrainError

#: old flag -> config key (``--key`` on LightningCLI's command line, ``a.b.c`` nesting in YAML)
FLAGS: dict[str, str] = {
    "--devices": "trainer.devices",
    "--max-steps": "trainer.max_steps",
    "--precision": "trainer.precision",
    "--layout": "trainer.strategy.init_args.layout",
    "--schedule": "schedule",
    "--out": "out",
    "--model": "model.family",
    "--hidden": "model.hidden",
    "--layers": "model.layers",
    "--heads": "model.heads",
    "--ffn": "model.ffn_hidden",
    "--seq-length": "model.seq_length",
    "--global-batch": "model.global_batch_size",
    "--micro-batch": "model.micro_batch_size",
    "--lr": "model.lr",
    "--warmup": "model.warmup_steps",
    "--weight-decay": "model.weight_decay",
    "--seed": "seed_everything",
}
SUBCOMMANDS = ("fit", "validate", "test", "predict")


class FlagError(DynaTrainError):
    """An old-style flag is unknown or has no value."""


def is_legacy(argv: list[str]) -> bool:
    """Old-style flags (or none at all): no subcommand, no LightningCLI option first."""
    if not argv:
        return True
    first = argv[0].split("=", 1)[0]
    return first not in SUBCOMMANDS and first in FLAGS


def from_flags(argv: list[str]) -> list[str]:
    """``["--devices", "4", "--layout=dp4"]`` -> ``["fit", "--trainer.devices", "4", "--trainer.strategy...", "dp4"]``.

    Raises:
        FlagError: a flag outside ``FLAGS``, or one without its value.
    """
    out = ["fit"]
    i = 0
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        if flag not in FLAGS:
            raise FlagError(f"unknown flag {flag!r}",
                            hint=f"old-style flags are {', '.join(FLAGS)}; or use `fit --config FILE.yaml` "
                            "with the config keys (`fit --help` lists them)")
        if not eq:
            if i + 1 >= len(argv):
                raise FlagError(f"flag {flag} has no value", hint=f"write {flag} VALUE")
            i += 1
            value = argv[i]
        out += [f"--{FLAGS[flag]}", value]
        i += 1
    return out


__all__ = ["FLAGS", "FlagError", "from_flags", "is_legacy"]
