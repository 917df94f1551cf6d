# `make demo` and `make test` do all the set-up on a fresh machine: they create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test venv clean

venv: $(STAMP)

# torch first, pinned, so no other requirement can pull a CUDA build; then the package with the tested pins.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt torch
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH bash scripts/demo.sh

test: $(STAMP)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH HF_HUB_OFFLINE=1 WANDB_MODE=offline $(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info
