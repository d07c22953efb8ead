# Two entry points: `make demo` (set up, run the main job) and `make test` (set up, run the tests).
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup demo test bench clean

setup: $(STAMP)

$(STAMP): requirements/cpu.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements/cpu.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

# The main job: a dry-run plan of a real switch at cluster scale (1024 ranks, Qwen3-235B MoE).
demo: $(STAMP)
	$(VENV)/bin/dynatrain plan --model qwen-moe-235b --src dp128-tp4-pp2-ep64-zero1 --dst dp256-tp2-pp2-ep128-zero1

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) benchmarks/plan_at_scale.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
