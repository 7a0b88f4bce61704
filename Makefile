# kvrelay developer entry points. `make test` works from a fresh clone.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: test lint proto venv demo bench clean clean-numba

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,dev]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check kvrelay tests benchmarks tools
	$(PY) -m mypy kvrelay

demo: $(STAMP)
	$(PY) -m kvrelay demo

proto: $(STAMP)
	$(PY) -m tools.protogen kvrelay/_proto

# Loopback benchmarks (benchmarks/README.md). Short (< 2 min) by default; FULL=1: full sweep,
# micro-benchmarks and the Dynamo side-by-side, light and heavy (side_by_side --heavy, ~15 min);
# SIDE=1 adds the light side-by-side to the short run.
bench: $(STAMP)
	@$(PY) -c "import matplotlib" 2>/dev/null || $(PY) -m pip install -q -e '.[bench]'
	$(PY) -m benchmarks.run $(if $(FULL),--full --micro --side-by-side,$(if $(SIDE),--side-by-side,))

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
