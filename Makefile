# `make demo` and `make test` do all the set-up on a fresh machine: they create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# DeepSpeed compiles its CPU comm op on first launch; keep the build inside the venv so a fresh clone never waits on
# a stale lock left in ~/.cache/torch_extensions by a process killed mid-compile.
RUN_ENV := PATH=$(CURDIR)/$(VENV)/bin:$$PATH TORCH_EXTENSIONS_DIR=$(CURDIR)/$(VENV)/torch_extensions

.PHONY: demo test check venv clean

venv: $(STAMP)

# torch first, pinned, so no other requirement can pull a CUDA build; then the package with the tested pins.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt torch
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(RUN_ENV) bash scripts/demo.sh

# The fast lane: every test that starts no launcher, server, browser or Slurm (marker `launch`), in about 4 minutes,
# on one pytest-xdist worker per core of the 2-core machines it must fit.
FAST_LANE := -m "not launch" -n 2
# The launch lane: each test starts 2 ranks (some a server, a browser or Slurm), on 2 pytest-xdist workers. Measured
# per test (children's CPU against wall time) a launch keeps only ~1-1.5 of the 2 cores busy and a fault test ~0.6 (a
# held rank, a hang timeout), so two at a time are faster than one. `--dist loadgroup` schedules by the groups of
# tests/helpers.py (launch_scheduler): a file, or the files of a directory that share session launches
# (SHARED_LAUNCHES), runs whole on one worker in its order, so every shared launch runs once. Serially: `make test LAUNCH_LANE='-m launch'`.
LAUNCH_LANE ?= -m launch -n 2 --dist loadgroup
TEST_ENV := $(RUN_ENV) HF_HUB_OFFLINE=1 WANDB_MODE=offline

test: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest -q -rfE $(FAST_LANE) --durations=10 tests; fast=$$?; \
	$(TEST_ENV) $(PY) -m pytest -q -rfE $(LAUNCH_LANE) --durations=40 tests; launch=$$?; \
	exit $$(( fast || launch ))

# ruff's small rule set (pyproject.toml [tool.ruff]: unused imports, undefined names, import order), then the fast lane
LINTED := toolkit tests benchmarks scripts

check: $(STAMP)
	$(VENV)/bin/ruff check $(LINTED)
	$(TEST_ENV) $(PY) -m pytest -q -rfE $(FAST_LANE) --durations=5 tests

clean:
	rm -rf $(VENV) build *.egg-info
