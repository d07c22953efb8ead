# Two entry points: `make demo` (set up, run the main job) and `make test` (set up, run the tests).
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup demo plan-demo test test-fast test-newest setup-newest gpu-check bench clean

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
	$(PY) -m pytest -q --durations=15 tests

# The tests that need no multi-process run (a few minutes).
test-fast: $(STAMP)
	$(PY) -m pytest -q tests -m "not slow"

# The newest tested set (requirements/newest.txt: Python 3.12, megatron-core 0.19, torch 2.15) in its own
# environment: the fast tests and the slow ones on the seams an upgrade moves (the demo without a
# warning, a checkpoint at another layout, a world that grows and shrinks, the megatron checkpoint
# baseline and import, the Accelerate and Fabric runs, megatron's interleaved schedule, generation through
# megatron's pipeline schedules and KV cache). torch 2.15 has no CPU
# build on the registry: the first set-up downloads its CUDA build (about 3 GB). The set itself
# (extras dropped) is the pip constraint, so a machine-wide cap on torch does not hold it back.
PYTHON_NEWEST ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
VENV_NEWEST   ?= .venv-newest
PY_NEWEST     := $(VENV_NEWEST)/bin/python
STAMP_NEWEST  := $(VENV_NEWEST)/.installed
NEWEST_SLOW   := tests/test_demo.py tests/checkpoint/test_logical_dcp.py tests/baselines/test_baselines.py \
                 tests/elastic/test_world.py::test_a_world_grows_with_joiners_and_shrinks_with_a_leaver_while_the_old_one_steps \
                 tests/loops/test_accelerate_example.py tests/loops/test_fabric_example.py \
                 tests/megatron/test_virtual_pipeline.py tests/strategy/test_checkpoints.py tests/megatron/test_rollout.py

setup-newest: $(STAMP_NEWEST)

$(STAMP_NEWEST): requirements/newest.txt pyproject.toml
	$(PYTHON_NEWEST) -m venv $(VENV_NEWEST)
	sed 's/\[[^]]*\]//' requirements/newest.txt > $(VENV_NEWEST)/constraints.txt
	PIP_CONSTRAINT=$(CURDIR)/$(VENV_NEWEST)/constraints.txt $(PY_NEWEST) -m pip install --quiet -r requirements/newest.txt
	PIP_CONSTRAINT=$(CURDIR)/$(VENV_NEWEST)/constraints.txt $(PY_NEWEST) -m pip install --quiet -e .
	$(PY_NEWEST) -m pip check
	touch $(STAMP_NEWEST)

test-newest: $(STAMP_NEWEST)
	$(PY_NEWEST) -m pytest -q tests -m "not slow"
	$(PY_NEWEST) -m pytest -q $(NEWEST_SLOW)

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
	rm -rf $(VENV) $(VENV_NEWEST) .pytest_cache .hypothesis
