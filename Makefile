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

# The suite's splits are markers (declared in pyproject.toml, set in the test modules): the plain
# run, then three re-runs. `guard`: on a GPU simulated on the CPU (tests/device_guard.py; ~4
# minutes on 2 cores): engines x maps x patterns forward and backward and the module, causal
# patterns, half precision, flex, training, hf.sparsify on encoders and decoders, MCA in a BERT,
# DAM, score modifiers. `triton`: the Triton kernels under Triton's interpreter, in a process of
# their own (the interpreter must be on before triton is imported, and importing FlexAttention
# imports triton).

# Inductor's on-disk cache is not keyed by the CPU's vector width (torch 2.13): code compiled
# on an AVX2 CPU is served on an AVX-512 one and the reverse, and computes wrong results. The
# machines here change CPU between runs, so each width has a cache of its own (docs/engines.md,
# "Results that depend on the CPU's vector width").
CPU_WIDTH := $(or $(ATEN_CPU_CAPABILITY),$(shell grep -qw avx512f /proc/cpuinfo 2>/dev/null && echo avx512 || echo avx2))
INDUCTOR_CACHE := $(or $(TMPDIR),/tmp)/torchinductor_$(shell id -un)_sparseattn
export TORCHINDUCTOR_CACHE_DIR ?= $(INDUCTOR_CACHE)_$(CPU_WIDTH)
# The tests marked `avx2` depend on that width: they run again as an AVX2-only CPU would run them.

test: $(STAMP)
	$(VENV)/bin/ruff check sparseattn tests
	$(VENV)/bin/lint-imports
	$(PY) -m pytest
	ATEN_CPU_CAPABILITY=avx2 TORCHINDUCTOR_CACHE_DIR=$(INDUCTOR_CACHE)_avx2 \
		$(PY) -m pytest -p no:cacheprovider -m "avx2 and not slow"
	$(PY) -m pytest --device guard -p no:cacheprovider -m "guard and not slow"
	TRITON_INTERPRET=1 $(PY) -m pytest -p no:cacheprovider -m "triton and not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check sparseattn tests
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff format --check sparseattn tests

format: $(STAMP)
	$(VENV)/bin/ruff format sparseattn tests
	$(VENV)/bin/ruff check --fix sparseattn tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
