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

# The device guard (tests/device_guard.py) re-runs a chosen set on a GPU simulated on the CPU
# (~4 minutes on 2 cores): every engine x map x pattern forward and backward and the module
# (test_attention), causal patterns and queries at an offset (test_causal), half precision,
# flex, training and hf.sparsify (test_gpu), encoders (test_hf), MCA in a BERT
# (test_montecarlo), DAM (test_learned_mask), score modifiers, decoders with generate and GQA
# (a slice of test_hf_decoders). tests/test_device_guard.py is in the plain run.
# The Triton kernels then run under Triton's interpreter in a process of their own: the
# interpreter must be on before triton is imported, and importing FlexAttention imports triton.
GUARDED := tests/test_attention.py tests/test_causal.py tests/test_gpu.py tests/test_hf.py \
	tests/test_montecarlo.py \
	tests/test_learned_mask.py tests/test_score_mods.py tests/test_hf_score_mods.py \
	"tests/test_hf_decoders.py::test_sparse_generation_equals_full_recompute_at_every_step" \
	"tests/test_hf_decoders.py::test_head_split_with_grouped_query_heads_equals_full_recompute"

# Inductor's on-disk cache is not keyed by the CPU's vector width (torch 2.13): code compiled
# on an AVX2 CPU is served on an AVX-512 one and the reverse, and computes wrong results. The
# machines here change CPU between runs, so each width has a cache of its own (docs/engines.md,
# "Results that depend on the CPU's vector width").
CPU_WIDTH := $(or $(ATEN_CPU_CAPABILITY),$(shell grep -qw avx512f /proc/cpuinfo 2>/dev/null && echo avx512 || echo avx2))
INDUCTOR_CACHE := $(or $(TMPDIR),/tmp)/torchinductor_$(shell id -un)_sparseattn
export TORCHINDUCTOR_CACHE_DIR ?= $(INDUCTOR_CACHE)_$(CPU_WIDTH)
# The tests whose results depend on that width, run again as an AVX2-only CPU would run them.
AVX2 := tests/test_flex_cpu.py tests/test_score_mods.py tests/test_flex_interop.py

test: $(STAMP)
	$(VENV)/bin/ruff check sparseattn tests
	$(VENV)/bin/lint-imports
	$(PY) -m pytest
	ATEN_CPU_CAPABILITY=avx2 TORCHINDUCTOR_CACHE_DIR=$(INDUCTOR_CACHE)_avx2 \
		$(PY) -m pytest -p no:cacheprovider $(AVX2)
	$(PY) -m pytest --device guard -p no:cacheprovider $(GUARDED)
	TRITON_INTERPRET=1 $(PY) -m pytest -p no:cacheprovider tests/test_triton_entmax.py

lint: $(STAMP)
	$(VENV)/bin/ruff check sparseattn tests
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff format --check sparseattn tests

format: $(STAMP)
	$(VENV)/bin/ruff format sparseattn tests
	$(VENV)/bin/ruff check --fix sparseattn tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
