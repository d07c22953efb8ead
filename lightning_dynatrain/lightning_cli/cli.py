"""``DynaTrainCLI``: the demo's one config schema, a LightningCLI over ``GPTFamilyModule`` and the stdlib data.

    python examples/train_gpt.py fit --config examples/configs/demo.yaml
    python examples/train_gpt.py fit --config examples/configs/demo.yaml --trainer.max_steps 20 --model.family llama
    python examples/train_gpt.py --devices 4 --max-steps 10 --layout dp2-tp2-pp1 --schedule 5:dp4   # old flags

The schema (``fit --print_config`` prints it whole; ``fit --help`` lists every key):

- ``trainer``: Lightning's ``Trainer`` arguments. The strategy is ``trainer.strategy`` (class
  ``DynaTrainStrategy``; ``init_args``: ``layout``, ``staging_budget``, ``switch_memory_limit``,
  ``verify``, ``seed``, ...), the precision ``trainer.precision`` (``32-true`` or ``bf16-mixed``).
  Defaults differ from Lightning's where the demo needs: CPU, 4 devices, DynaTrainStrategy at
  ``auto``, no logger, no checkpoints, no model summary, 300 steps.
- ``model``: ``GPTFamilyModule`` (``family``: gpt, llama or moe; sizes; optimizer and LR schedule).
  ``model.max_steps`` follows ``trainer.max_steps``, and ``model.seed`` and ``data.seed`` follow
  ``seed_everything`` (an int; ``true``, a random global seed, leaves them at 1234).
- ``data``: ``StdlibTextDataModule``; ``seq_length`` and ``global_batch_size`` follow the model's.
- ``schedule``: ``ScheduledReconfig``'s schedule, ``{step: layout}``, ``"STEP:LAYOUT,..."`` or a YAML path.
- ``elastic``: ``OnNodeChange``'s layout policy (``{world size: layout}``, ``auto`` or a YAML path): the fit
  becomes elastic (launch with torchrun or srun and ``DYNATRAIN_STORE``; see ``docs/elastic.md``).
- ``out``: the run's directory (``RunRecorder``: metrics.csv, switches.jsonl, loss.png, one
  transfers_step{N}.png per switch, and LightningCLI's config.yaml); also ``trainer.default_root_dir``.
- ``seed_everything``: 1234 unless set.

Values are checked at start (``checks.check_config``): a bad one exits with status 2 and a message
that names its key and the rule, before any process starts. The progress bar shows the layout and
the last switch (``LayoutProgressBar``).
"""

from __future__ import annotations

import sys
from typing import Any

from lightning.fabric.utilities.warnings import PossibleUserWarning
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from typing_extensions import override

from lightning_dynatrain.compat.lightning_internals import cli_config_value, cli_parser
from lightning_dynatrain.warning_filters import QuietWarning

DEMO_DEFAULTS: dict[str, Any] = {
    "trainer.accelerator": "cpu",
    "trainer.devices": 4,
    "trainer.max_steps": 300,
    "trainer.strategy": {"class_path": "lightning_dynatrain.strategy.dynatrain.DynaTrainStrategy",
                         "init_args": {"layout": "auto"}},
    "trainer.logger": False,
    "trainer.enable_checkpointing": False,
    "trainer.enable_model_summary": False,
    "trainer.log_every_n_steps": 10,
}

SRUN_NOT_USED = QuietWarning(
    PossibleUserWarning, r"lightning\.fabric\.plugins\.environments\.slurm",
    "The `srun` command is available on your system but is not used",
    "Lightning says it on every machine with SLURM installed (this project's tests install it); the demo starts "
    "its own processes on purpose, and under srun the warning does not arise")


class ShortUsageParser(LightningArgumentParser):
    """LightningCLI's parser, whose error messages come with a one-line usage instead of the whole list of
    options (over a hundred lines for the Trainer alone) above them, so the error stays in view."""

    @override
    def print_usage(self, file: Any = None) -> None:
        prog = self.prog.replace(" [options]", "")
        (file or sys.stdout).write(f"usage: {prog} [--config FILE.yaml] [--KEY VALUE ...]\n")


class DynaTrainCLI(LightningCLI):
    """LightningCLI with the demo's schema (see module docstring); ``main`` builds and runs it."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--schedule", type=dict[int, str] | str | None, default=None,
                            help="layout switches: {step: layout}, 'STEP:LAYOUT,...' or a YAML file "
                            "(ScheduledReconfig)")
        parser.add_argument("--schedule_ahead", type=bool, default=True,
                            help="build each scheduled switch in the background while training steps on, so its "
                            "pause is the transfer (ScheduledReconfig(ahead=...))")
        parser.add_argument("--elastic", type=dict[int, str] | str | None, default=None,
                            help="make the fit elastic (OnNodeChange) with this layout policy: {world size: layout}, "
                            "'auto' or a YAML file; launch with torchrun or srun and DYNATRAIN_STORE / DYNATRAIN_TOKEN "
                            "set (`dynatrain store`)")
        parser.add_argument("--out", type=str, default="runs/train_gpt",
                            help="the run's directory: metrics.csv, switches.jsonl, loss.png, transfers_step{N}.png, "
                            "config.yaml")
        parser.set_defaults(DEMO_DEFAULTS)
        parser.link_arguments("out", "trainer.default_root_dir")
        parser.link_arguments("trainer.max_steps", "model.max_steps", compute_fn=_lr_horizon)
        parser.link_arguments("seed_everything", "model.seed", compute_fn=_seed)
        parser.link_arguments("seed_everything", "data.seed", compute_fn=_seed)
        parser.link_arguments("model.seq_length", "data.seq_length")
        parser.link_arguments("model.global_batch_size", "data.global_batch_size")

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        # ``main`` passes the (possibly rewritten) command line itself; LightningCLI would warn that
        # sys.argv holds arguments too, which it always does here
        self.config = parser.parse_object(args) if isinstance(args, dict) else parser.parse_args(args)

    @override
    def before_instantiate_classes(self) -> None:
        from lightning_dynatrain.lightning_cli.checks import ConfigError, check_config

        cfg = self.config[self.subcommand] if self.subcommand else self.config
        try:
            check_config(cfg)
        except ConfigError as err:
            cli_parser(self, self.subcommand).error(str(err))  # usage, the message, exit status 2

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Any:
        from lightning.pytorch.callbacks import ProgressBar

        from lightning_dynatrain.callbacks import LayoutProgressBar, OnNodeChange, RunRecorder, ScheduledReconfig

        cfg = self.config[self.subcommand] if self.subcommand else self.config
        self.recorder = RunRecorder(cfg.out)
        callbacks = [self.recorder, ScheduledReconfig(cfg.schedule or None, ahead=cfg.get("schedule_ahead", True))]
        if cfg.get("elastic"):
            callbacks.append(OnNodeChange(cfg.elastic))
        trainer_callbacks = cli_config_value(self, self.config_init, "trainer").get("callbacks") or []
        if not isinstance(trainer_callbacks, list):
            trainer_callbacks = [trainer_callbacks]
        own_bar = any(isinstance(c, ProgressBar) for c in trainer_callbacks)  # the config names its own
        if cfg.trainer.get("enable_progress_bar") in (None, True) and not own_bar:
            callbacks.append(LayoutProgressBar())
        kwargs["callbacks"] = [*trainer_callbacks, *callbacks]
        return super().instantiate_trainer(**kwargs)

    def after_fit(self) -> None:
        """Rank 0 says what the run did and where its files are."""
        import torch

        trainer, rec = self.trainer, self.recorder
        if not (trainer.is_global_zero and rec.rows):
            return
        first = rec.rows[0][1]
        last = sum(r[1] for r in rec.rows[-10:]) / min(10, len(rec.rows))
        model = self.model.model
        params = sum(p.numel() for p in model.parameters()) if model is not None else 0
        files = ", ".join(["metrics.csv", "switches.jsonl", *(p.name for p in rec.pictures_written)])
        print(f"[train_gpt] {len(rec.rows)} steps in {rec.seconds:.1f} s on {trainer.world_size} processes "
              f"({torch.get_num_threads()} threads each, {params} params on rank 0): loss {first:.3f} -> {last:.3f} "
              f"(mean of last 10), {len(rec.switches)} switches; wrote {rec.out}/ {files}", flush=True)


def _lr_horizon(max_steps: int | None) -> int | None:
    return max_steps if max_steps is not None and max_steps > 0 else None


def _seed(seed: bool | int) -> int:
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else 1234


def main(argv: list[str] | None = None) -> DynaTrainCLI:
    """Run the demo's command line (``argv``: default ``sys.argv[1:]``); old-style flags are rewritten first."""
    SRUN_NOT_USED.install()
    from lightning_dynatrain.data.datamodule import StdlibTextDataModule
    from lightning_dynatrain.lightning_cli.legacy import FlagError, from_flags, is_legacy
    from lightning_dynatrain.lightning_cli.model import GPTFamilyModule

    args = list(sys.argv[1:] if argv is None else argv)
    if is_legacy(args):
        try:
            args = from_flags(args)
        except FlagError as err:
            print(f"train_gpt: error: {err}", file=sys.stderr)
            raise SystemExit(2) from None
    return DynaTrainCLI(GPTFamilyModule, StdlibTextDataModule, args=args, seed_everything_default=1234,
                        parser_class=ShortUsageParser, auto_configure_optimizers=False,
                        save_config_kwargs={"overwrite": True})


__all__ = ["DEMO_DEFAULTS", "DynaTrainCLI", "ShortUsageParser", "main"]
