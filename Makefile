# Developer and CI entry points. `make test` = `make setup` + the whole test suite; `make compare` = `make setup` +
# the main job (every sync mode on the digits, one table in outputs/compare/). `.ci/run` = `make check` + `make test`.
#
# `make setup` installs the exact versions and hashes of requirements.lock (every extra: apps, test, dev, docs, ft),
# then the project itself without dependencies. `make lock` refreshes the lock from pyproject.toml and
# requirements.in. The lock holds torch's CPU wheel (2.13.0+cpu): pip finds it in a find-links folder or an index
# that has it (on a machine without it: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu make setup; see
# docs/guide/install.md).

# Every process a target starts (test workers, ranks, servers, app runs) writes and reuses the bytecode of
# lightning_sync: where PYTHONDONTWRITEBYTECODE is set, each fresh interpreter compiled the package again, 1.6 s of
# CPU of its 7-9 s start.
unexport PYTHONDONTWRITEBYTECODE

VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
LOCK := requirements.lock
PYTEST_ARGS ?=
# pytest-xdist workers for `make test` and `make test-fast` (0: all in this one process), each taking a whole test
# file at a time (`--dist loadfile`), in the order tests/conftest.py collects them (`--no-loadscope-reorder`): the
# files that run whole jobs first, so that short files, not one long job, end the run. Three workers on 2 cores: the
# tests that time a failure spend much of their time waiting out a frozen peer's timeout, which the others fill. (Not
# `--dist loadgroup`: with pytest 9.2 and pytest-xdist 3.8 it ignores the groups, pytest-dev/pytest-xdist#1386.)
TEST_WORKERS ?= 3
COMPARE_ARGS ?=
BENCH_ARGS ?=
# The quick tier: no process group, or 2-rank collectives that take seconds; no Trainer fits, no root, nothing slow.
FAST_MARKERS := (unit or dist) and not (e2e or netns or slow)

.PHONY: setup test test-fast check lint typecheck imports docs docs-gen lock compare bench gpu-check notebook clean-venv

setup: $(VENV)/.installed

$(PY):
	$(PYTHON) -m venv $(VENV)

# Reinstalls when the lock or pyproject.toml changes. --no-build-isolation: the build tools (setuptools, wheel) come
# from the lock too, so nothing unpinned is installed.
$(VENV)/.installed: $(PY) $(LOCK) pyproject.toml
	$(PIP) install --require-hashes -r $(LOCK)
	$(PIP) install --no-deps --no-build-isolation -e .
	touch $@

# Refreshes requirements.lock: every extra, with hashes, for this Python and platform.
lock: $(PY)
	$(PIP) install 'pip-tools>=7.4'
	$(VENV)/bin/pip-compile --quiet --generate-hashes --allow-unsafe --strip-extras --no-emit-find-links \
		--no-emit-index-url --extra apps,test,dev,docs,ft --output-file $(LOCK) pyproject.toml requirements.in

# Any non-zero pytest exit, 5 ("no tests ran") included, fails the target and so `make` and .ci/run (nothing masks it).
test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q --durations=20 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		$(PYTEST_ARGS)

test-fast: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q --durations=10 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		-m "$(FAST_MARKERS)" $(PYTEST_ARGS)

# The checks CI runs before the tests.
check: lint typecheck imports docs

# ruff (rules and format), the rule that Lightning internals live in lightning_sync/strategies/_lightning.py, and
# the conventions of the text: a short README, the docs nav and links, no history or findings in the docs and
# docstrings, notebooks that take everything from the package (.ci/check_conventions.py).
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) .ci/check_lightning_internals.py lightning_sync
	$(PY) .ci/check_conventions.py

typecheck: setup
	$(VENV)/bin/mypy lightning_sync

# The layering contracts ([tool.importlinter] in pyproject.toml), and no import cycle anywhere in the package
# (function-level imports included).
imports: setup
	$(VENV)/bin/lint-imports
	$(PY) .ci/check_import_cycles.py lightning_sync

docs: setup
	@test -f mkdocs.yml || { echo "make docs: mkdocs.yml not found; the docs site cannot be built" >&2; exit 1; }
	$(VENV)/bin/mkdocs build --strict --site-dir $(VENV)/site

# docs/results.md and the README's headline, from the results files under benchmarks/results/ (tools/gen_docs.py;
# `make docs-gen GEN_ARGS=--check` fails when a page differs from what the files give).
GEN_ARGS ?=
docs-gen: setup
	$(PY) tools/gen_docs.py $(GEN_ARGS)

compare: setup
	OMP_NUM_THREADS=1 $(PY) -m lightning_sync.compare $(COMPARE_ARGS)

# The modes against the anchors (Lightning ddp, torch DDP, torch local SGD, the no-communication floor), alternating;
# e.g. `make bench BENCH_ARGS="workloads=digits network.rate=10mbit"` (emulated links need root). See --help.
bench: setup
	OMP_NUM_THREADS=1 $(PY) -m lightning_sync.bench $(BENCH_ARGS)

# The GPU path on one CUDA GPU, in at most 8 minutes (benchmarks/gpu_check.py): every mode on char_lm, the core
# collectives on CUDA tensors, the int8/int4 codec's GB/s, step times; the report goes to benchmarks/results/gpu/,
# then docs/guide/gpu.md is written from it. No `setup`: a GPU machine's own python3 (its CUDA torch) runs it when
# there is no $(VENV). Exits 1 when a case failed. On a CPU: make gpu-check GPU_CHECK_ARGS=--allow-cpu.
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)
GPU_CHECK_ARGS ?=
gpu-check:
	$(GPU_PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS); status=$$?; \
		$(GPU_PYTHON) benchmarks/gpu_report_to_docs.py && exit $$status

notebook: setup
	OMP_NUM_THREADS=1 $(PY) notebooks/01_overview.py

clean-venv:
	rm -rf $(VENV)
