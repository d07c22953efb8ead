"""The demo's config schema, parsed in this process (no training): the demo YAML, every old flag's key,
and bad values refused at start with the key's path and the rule.

``_parsed`` runs the real command line (``lightning_cli.main``) up to the point where LightningCLI
would build the Trainer: the config has been parsed and passed ``check_config`` by then.
"""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import yaml

from lightning_dynatrain.lightning_cli import FLAGS, DynaTrainCLI, main
from lightning_dynatrain.lightning_cli.model import Family
from lightning_dynatrain.megatron.shapes import FAMILIES

ROOT = Path(__file__).resolve().parents[2]
DEMO_YAML = ROOT / "examples" / "configs" / "demo.yaml"


class _Parsed(Exception):
    """Raised where LightningCLI would instantiate the classes; carries the checked config."""

    def __init__(self, config) -> None:
        super().__init__("parsed")
        self.config = config


@pytest.fixture
def parsed(monkeypatch: pytest.MonkeyPatch):
    """``parsed(argv)`` -> the ``fit`` config ``main(argv)`` checked, without building anything."""

    def stop(self) -> None:
        raise _Parsed(self.config[self.subcommand])

    monkeypatch.setattr(DynaTrainCLI, "instantiate_classes", stop)

    def run(argv: list[str]):
        with pytest.raises(_Parsed) as caught:
            main(argv)
        return caught.value.config

    return run


def _write(tmp_path: Path, overrides: dict) -> Path:
    """The demo YAML with ``overrides`` ({"a.b.c": value}) applied, written to a file."""
    cfg = yaml.safe_load(DEMO_YAML.read_text())
    for key, value in overrides.items():
        node = cfg
        *path, last = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_family_choices_are_the_shapes_families() -> None:
    assert typing.get_args(Family) == FAMILIES


def test_the_demo_yaml_holds_strategy_schedule_model_precision_data_and_trainer(parsed) -> None:
    cfg = parsed(["fit", "--config", str(DEMO_YAML)])
    assert cfg.trainer.strategy.class_path.endswith("DynaTrainStrategy")
    assert cfg.trainer.strategy.init_args.layout == "dp4-tp1-pp1"
    assert cfg.trainer.strategy.init_args.staging_budget == "256MiB"
    assert {int(k): v for k, v in cfg.schedule.items()} == {60: "dp2-tp2-pp1", 120: "dp1-tp2-pp2-zero1",
                                                            180: "dp2-tp1-pp2-zero1"}
    assert (cfg.trainer.devices, cfg.trainer.max_steps, cfg.trainer.precision) == (4, 240, "32-true")
    assert (cfg.model.family, cfg.model.hidden, cfg.model.layers) == ("gpt", 128, 4)
    assert cfg.out == "runs/demo"
    # links: the LR horizon, seeds, and the data's shapes follow their one source
    assert cfg.model.max_steps == 240 and cfg.model.seed == cfg.data.seed == 1234
    assert (cfg.data.seq_length, cfg.data.global_batch_size) == (cfg.model.seq_length, cfg.model.global_batch_size)
    assert cfg.trainer.default_root_dir == "runs/demo"
    assert cfg.schedule_ahead is True  # ScheduledReconfig(ahead=True): switches built in the background
    assert parsed(["fit", "--config", str(DEMO_YAML), "--schedule_ahead", "false"]).schedule_ahead is False


def test_every_old_flag_sets_its_config_key(parsed) -> None:
    values = {"--devices": "4", "--max-steps": "12", "--precision": "bf16-mixed", "--layout": "dp2-tp2-pp1",
              "--schedule": "4:dp4-tp1-pp1", "--out": "runs/x", "--model": "llama", "--hidden": "64", "--layers": "2",
              "--heads": "4", "--ffn": "96", "--seq-length": "64", "--global-batch": "8", "--micro-batch": "1",
              "--lr": "0.001", "--warmup": "3", "--weight-decay": "0.1", "--seed": "7"}
    assert set(values) == set(FLAGS)
    cfg = parsed([x for flag, value in values.items() for x in (flag, value)])
    for flag, key in FLAGS.items():
        got = cfg
        for part in key.split("."):
            got = got[part]
        assert str(got) == values[flag], (flag, key, got)


def test_family_and_precision_change_the_run(parsed) -> None:
    cfg = parsed(["fit", "--config", str(DEMO_YAML), "--model.family", "moe", "--trainer.precision", "bf16-mixed"])
    assert (cfg.model.family, cfg.trainer.precision) == ("moe", "bf16-mixed")


@pytest.mark.parametrize(("overrides", "key", "rule"), [
    ({"trainer.strategy.init_args.layout": "dp2-tx2"}, "config key trainer.strategy.init_args.layout = 'dp2-tx2'",
     "unknown part 'tx2'"),
    ({"trainer.strategy.init_args.layout": "dp2-tp1-pp1"}, "config key trainer.strategy.init_args.layout",
     "needs dp*tp*pp*cp = 2 processes but the job runs 4"),
    ({"trainer.strategy.init_args.layout": "dp1-tp4-pp1", "model.heads": 2, "model.hidden": 64},
     "config key trainer.strategy.init_args.layout", "tp=4 must divide the 2 attention heads"),
    ({"schedule": {60: "dp2-tp2-pp1", 5000: "dp1-tp1-pp8"}}, "config key schedule",
     "schedule entry at step 5000 (dp1-tp1-pp8)"),
    ({"schedule": "60-dp2-tp2-pp1"}, "config key schedule", "has no ':'"),
    ({"elastic": {2: "dp2-tp1-pp1", 4: "dp2-tp1-pp1"}}, "config key elastic",
     "maps world sizes to layouts of other sizes"),
    ({"trainer.precision": "16-mixed"}, "config key trainer.precision = '16-mixed'",
     "fp16 needs megatron's dynamic loss scaler"),
    ({"trainer.strategy.init_args.staging_budget": "lots"}, "config key trainer.strategy.init_args.staging_budget",
     "HINT"),
    ({"model.micro_batch_size": 0}, "config key model.micro_batch_size = 0", "must be a positive whole number"),
    ({"model.global_batch_size": 12, "model.micro_batch_size": 2}, "config key trainer.strategy.init_args.layout",
     "global batch 12 is not a multiple of dp * micro_batch_size = 4 * 2 = 8"),
    ({"model.family": "llama", "model.heads": 3, "model.hidden": 96}, "config key model",
     "heads=3 cannot be shared by half as many key/value heads"),
    ({"model.family": "bert"}, "model.family", "bert"),
    ({"trainer.strategy": "ddp"}, "config key trainer.strategy", "the demo trains under DynaTrainStrategy"),
])
def test_a_bad_value_stops_at_start_naming_its_key_and_the_rule(tmp_path: Path, capsys, overrides: dict, key: str,
                                                                 rule: str) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", str(_write(tmp_path, overrides))])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert key in err and rule in err, err[-2000:]
    assert "Traceback" not in err
    assert len(err.splitlines()) <= 4, err  # the error in view, not under the list of every option


def test_the_elastic_policy_is_a_key_of_the_same_config(tmp_path: Path, parsed) -> None:
    policy = {2: "dp2-tp1-pp1", 4: "dp2-tp2-pp1"}
    config = parsed(["fit", "--config", str(_write(tmp_path, {"elastic": policy}))])
    assert config.elastic == policy
    assert parsed(["fit", "--config", str(DEMO_YAML)]).elastic is None


def test_an_unknown_old_flag_says_which_flags_exist(capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["--devices", "4", "--layuot", "dp4"])
    assert stop.value.code == 2
    assert "unknown flag '--layuot'" in capsys.readouterr().err
