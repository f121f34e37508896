# The two commands of the README: `make demo` and `make test`. Each creates .venv when missing.
# `make demo` runs the tour: results/tour/index.html (2–5 minutes on 2 cores, see README).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint format clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/sparseattn tour

test: $(STAMP)
	$(VENV)/bin/ruff check sparseattn tests
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check sparseattn tests
	$(VENV)/bin/ruff format --check sparseattn tests

format: $(STAMP)
	$(VENV)/bin/ruff format sparseattn tests
	$(VENV)/bin/ruff check --fix sparseattn tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
