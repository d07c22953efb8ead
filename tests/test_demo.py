"""The demo, run as ``make demo`` runs it but short: a YAML config, 4 processes, two switches (the
second to an uneven pipeline: 1 of the model's 3 layers on the first stage), ``verify=True``.

What a user sees is checked, not only what it computes:

- the project's own warnings are errors here: a ``sitecustomize`` on the children's PYTHONPATH
  turns every warning attributed to ``lightning_dynatrain`` or the demo script into an exception,
  in every process (Lightning's launcher starts the ranks with this environment);
- the output holds no warning at all, nor a notice logged at warning level (third-party ones the
  project cannot change are silenced by name in ``lightning_dynatrain/warning_filters.py``);
- the progress bar shows the layout and the last switch's seconds; rank 0 prints one line per switch;
- ``out`` holds metrics.csv, switches.jsonl, config.yaml, loss.png and one transfer picture per switch.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "train_gpt.py"
pytestmark = pytest.mark.slow

SITECUSTOMIZE = '''
import warnings
# the project's own warnings fail the run (filters added later by the project take precedence, and
# name only third-party warnings)
warnings.filterwarnings("error", module=r"lightning_dynatrain(\\.|$)")
warnings.filterwarnings("error", module=r"__main__$")
'''

CONFIG = {
    "seed_everything": 1234,
    "schedule": {3: "dp2-tp2-pp1", 6: "dp1-tp2-pp2-zero1-first1"},
    "trainer": {"accelerator": "cpu", "devices": 4, "max_steps": 8, "precision": "32-true",
                "strategy": {"class_path": "lightning_dynatrain.DynaTrainStrategy",
                             "init_args": {"layout": "dp4-tp1-pp1", "staging_budget": "64MiB", "verify": True}}},
    "model": {"family": "gpt", "hidden": 32, "layers": 3, "heads": 4, "ffn_hidden": 64, "seq_length": 32,
              "global_batch_size": 8, "micro_batch_size": 1, "lr": 0.003, "warmup_steps": 2},
    "data": {"max_bytes": 200_000},
}


def test_demo_from_a_yaml_config_switches_twice_without_a_warning(tmp_path: Path) -> None:
    out = tmp_path / "run"
    config = tmp_path / "demo.yaml"
    config.write_text(yaml.safe_dump({**CONFIG, "out": str(out)}))
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_", "LOCAL_RANK", "MASTER_", "WORLD_SIZE", "RANK",
                                "GROUP_RANK", "PYTHONWARNINGS", "LT_", "PL_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(DEMO), "fit", "--config", str(config)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-6000:]

    # warnings, and notices logged at warning level: torch's glog-style ``W1203 12:00:00...`` lines,
    # megatron's ``... IS DEPRECATED``
    warnings = [line for line in text.splitlines()
                if re.search(r"Warning\b|warnings\.warn|^[WE]\d{4} \d|(?i:deprecated)", line)]
    assert not warnings, "\n".join(warnings[:20])

    assert "layout=dp4-tp1-pp1" in text and "layout=dp1-tp2-pp2-zero1-first1, switch=" in text, text[-3000:]
    for step, src, dst in ((3, "dp4-tp1-pp1", "dp2-tp2-pp1"), (6, "dp2-tp2-pp1", "dp1-tp2-pp2-zero1-first1")):
        assert text.count(f"[dynatrain] step {step}: {src} -> {dst} in ") == 1, text[-3000:]
    assert "[train_gpt] 8 steps in" in text

    with open(out / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["layout"] for r in rows] == \
        ["dp4-tp1-pp1"] * 3 + ["dp2-tp2-pp1"] * 3 + ["dp1-tp2-pp2-zero1-first1"] * 2
    seconds = [float(r["seconds"]) for r in rows]
    assert seconds == sorted(seconds) and seconds[0] > 0
    switches = [json.loads(line) for line in (out / "switches.jsonl").read_text().splitlines()]
    assert [(s["step"], s["src"], s["dst"]) for s in switches] == [(3, "dp4-tp1-pp1", "dp2-tp2-pp1"),
                                                                   (6, "dp2-tp2-pp1", "dp1-tp2-pp2-zero1-first1")]
    pictures = sorted(p.name for p in out.glob("*.png"))
    assert pictures == ["loss.png", "transfers_step3.png", "transfers_step6.png"]
    for name in pictures:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["trainer"]["strategy"]["init_args"]["layout"] == "dp4-tp1-pp1"
