# make test / make demo do all the set-up on a fresh machine: a .venv, torch if it is not
# importable (the CPU build where there is no GPU), then tierflow with its test extras.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tierflow-installed
# The CPU build of torch; on a machine with an NVIDIA driver, pip's default (CUDA) build.
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "torch>=2.4" || echo "torch==2.13.0")

.PHONY: install test demo lint bench smoke clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

test: $(STAMP) lint
	$(PY) -m pytest -q

demo: $(STAMP)
	$(VENV)/bin/tierflow demo

# the wheel as pip installs it, no extras, in a fresh virtualenv: CI's second half
smoke:
	bash .ci/wheel_smoke.sh

bench: $(STAMP)
	$(PY) benchmarks/g10_baselines.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .ruff_cache
