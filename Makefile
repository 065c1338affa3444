# Developer and CI entry points. `make test` = `make setup` + the test suite (.ci/run calls `make test`);
# `make compare` = `make setup` + the main job (the digits with every sync mode and the language model with DDP and
# the byte-saving modes, seeds 0,1,2; mean [min, max] tables in outputs/compare/).
#
# torch is pinned and installed first: this machine has the CPU wheel of torch 2.13.0 on disk, while an unpinned
# torch (or one pulled in by another package) would download a multi-GB CUDA build.

VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH := torch==2.13.0
PYTEST_ARGS ?=
COMPARE_ARGS ?=
BENCH_ARGS ?=

.PHONY: setup test compare bench notebook clean-venv

setup: $(VENV)/.installed

$(PY):
	$(PYTHON) -m venv $(VENV)

# Reinstalls when pyproject.toml changes. setuptools>=70.1 builds wheels without the `wheel` package; both are
# needed for the wheel test's `pip wheel --no-build-isolation` (a venv's bundled setuptools is older).
$(VENV)/.installed: $(PY) pyproject.toml
	$(PIP) install --upgrade 'setuptools>=70.1' wheel
	$(PIP) install $(TORCH)
	$(PIP) install $(TORCH) -e '.[apps,test]'
	touch $@

# Any non-zero pytest exit, 5 ("no tests ran") included, fails the target and so `make` and .ci/run (nothing masks it).
test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(PYTEST_ARGS)

compare: setup
	OMP_NUM_THREADS=1 $(PY) -m lightning_sync.compare $(COMPARE_ARGS)

# The modes against the anchors (Lightning ddp, torch DDP, torch local SGD, the no-communication floor), alternating;
# e.g. `make bench BENCH_ARGS="workloads=digits network.rate=10mbit"` (emulated links need root). See --help.
bench: setup
	OMP_NUM_THREADS=1 $(PY) -m lightning_sync.bench $(BENCH_ARGS)

notebook: setup
	OMP_NUM_THREADS=1 $(PY) notebooks/01_overview.py

clean-venv:
	rm -rf $(VENV)
