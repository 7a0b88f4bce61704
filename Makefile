# kvrelay developer entry points. `make test` works from a fresh clone.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: test lint proto venv demo bench clean

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
	$(PY) -m ruff check kvrelay tests benchmarks
	$(PY) -m mypy kvrelay

proto: $(STAMP)
	$(PY) -m kvrelay._protogen kvrelay/_proto

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
