# Two entry points: `make demo` (set up, run the main job) and `make test` (set up, run the tests).
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup demo plan-demo test test-fast gpu-check bench clean

setup: $(STAMP)

$(STAMP): requirements/cpu.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements/cpu.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

# The main job: 4 CPU processes train a byte-level GPT on the standard library's sources and hot-switch
# layout three times (dp, tp, pp and zero change), all set in examples/configs/demo.yaml; writes
# runs/demo/{metrics.csv,switches.jsonl,config.yaml,loss.png,transfers_step{60,120,180}.png}.
demo: $(STAMP)
	$(PY) examples/train_gpt.py fit --config examples/configs/demo.yaml

# A dry-run plan of a switch at cluster scale (1024 ranks, Qwen3-235B MoE).
plan-demo: $(STAMP)
	$(VENV)/bin/dynatrain plan --model qwen-moe-235b --src dp128-tp4-pp2-ep64-zero1 --dst dp256-tp2-pp2-ep128-zero1

test: $(STAMP)
	$(PY) -m pytest -q tests

# The tests that need no multi-process run (a few minutes).
test-fast: $(STAMP)
	$(PY) -m pytest -q tests -m "not slow"

# What one GPU can prove in a few minutes (world 1); without CUDA the CPU parts, the rest skipped.
gpu-check: $(STAMP)
	scripts/gpu_check.sh

bench: $(STAMP)
	$(PY) benchmarks/plan_at_scale.py
	$(PY) benchmarks/step_overhead.py --devices 2
	$(PY) benchmarks/launchers.py
	$(PY) benchmarks/switch_vs_checkpoint.py
	$(PY) benchmarks/soak.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
