# kvrelay developer entry points. `make test` works from a fresh clone.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
SUM    := $(shell cat pyproject.toml | cksum | cut -d' ' -f1)
# Two stamps: the demo needs only kvrelay's runtime dependencies; tests and lint need the extras.
RUN_STAMP := $(VENV)/.installed-run-$(SUM)
STAMP     := $(VENV)/.installed-$(SUM)
PIP    := $(PY) -m pip --disable-pip-version-check
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: test lint proto docs venv demo bench clean clean-numba

$(PY):
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || { \
	  echo "kvrelay needs Python >= 3.11; '$(PYTHON)' is $$($(PYTHON) --version 2>&1)."; \
	  echo "Point PYTHON at a newer one, e.g.: PYTHON=python3.11 make demo"; exit 1; }
	@echo "==> creating $(VENV) with $$($(PYTHON) --version)"
	$(PYTHON) -m venv $(VENV)

$(RUN_STAMP): $(PY) pyproject.toml
	@echo "==> installing kvrelay and its runtime dependencies into $(VENV)"
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --progress-bar off -e .
	rm -f $(VENV)/.installed-run-*
	touch $(RUN_STAMP)

# One install for tests and tools (kvrelay's editable build once, not twice); it also
# satisfies the runtime stamp.
$(STAMP): $(PY) pyproject.toml
	@echo "==> installing kvrelay, the test and the development tools into $(VENV)"
	$(PIP) install --quiet -e '.[test,dev]'
	rm -f $(VENV)/.installed-*
	touch $(RUN_STAMP) $(STAMP)

venv: $(STAMP)

# Kernels first: a fresh clone has an empty numba cache, and daemon processes the tests start
# would otherwise each spend their start-up deadline compiling (a cache load after this). The
# cold-start test compiles every kernel in a cache of its own anyway: it runs first and hands
# that cache over (tests/support/kernel_cache.py), so `kvrelay warm` only loads. The rest runs
# in three processes (pytest-xdist), one more than this machine's two cores: most tests wait on
# sockets and timers, not on a core (two processes kept 1.2 cores busy), and deadlines stretch
# with the load the others add (tests/support/timing.py). Three took 310 s idle and 381 s with
# the other core busy where two took 382 s and 468 s.
COLD_START := tests/ops/test_cold_start.py
test: $(STAMP)
	KVRELAY_HAND_OVER_KERNELS=1 $(PY) -m pytest -q $(COLD_START)
	$(PY) -m kvrelay warm
	$(PY) -m pytest -q -n 3 --dist worksteal --deselect $(COLD_START)

lint: $(STAMP)
	$(PY) -m ruff check kvrelay tests benchmarks tools
	$(PY) -m mypy kvrelay

demo: $(RUN_STAMP)
	@echo "==> kvrelay demo (compiles the numba kernels on its first run: ~22 s on 2 quiet cores, up to ~75 s on busy ones)"
	$(PY) -m kvrelay demo

proto: $(STAMP)
	$(PY) -m tools.protogen kvrelay/_proto

# The metric table of docs/operations.md, from the collector (a test keeps it current).
docs: $(STAMP)
	$(PY) -m tools.metrics_table --write

# Loopback benchmarks (benchmarks/README.md). Short (< 2 min) by default; FULL=1: every committed
# result regenerated from this commit (benchmarks.run --all: micro, loopback short and full,
# start-up, snapshots, restart, workers, scaling model, soak, Dynamo side by side light and heavy
# with 3 repeats, mirror; about two hours, on a quiet machine); SIDE=1 adds the light side by side
# to the short run.
bench: $(STAMP)
	@$(PY) -c "import matplotlib" 2>/dev/null || $(PY) -m pip install -q -e '.[bench]'
	$(PY) -m benchmarks.run $(if $(FULL),--all,$(if $(SIDE),--side-by-side,))

# Every benchmark script once in its --smoke mode (seconds each, tiny sizes, nothing written to
# benchmarks/results): the in-process ones run in `make test` too, this adds the ones that start
# relays, engines and subscribers (3-6 min; the Dynamo ones when .venv-dynamo and root are there).
.PHONY: bench-smoke
bench-smoke: $(STAMP)
	$(PY) -m kvrelay warm
	KVRELAY_BENCH_SMOKE=1 $(PY) -m pytest -q tests/benchmarks/test_smoke.py

# Bounded soak (tests/reliability, docs/fault-matrix.md): 64 pool subscribers at a steady rate;
# fails on RSS growth, lag terminations or latency drift. SOAK_SECONDS (default 600) sets the length.
.PHONY: soak
soak: $(STAMP)
	$(PY) -m tests.reliability.soak --seconds $(or $(SOAK_SECONDS),600)

# numba's cache=True tracks each kernel's own file only: after editing a kernel another kernel
# calls (hashing/xxh3.py, pool/ckf.py), drop the caches so nothing stale is loaded.
clean-numba:
	find kvrelay -name '*.nbi' -delete -o -name '*.nbc' -delete

clean: clean-numba
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
