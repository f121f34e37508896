#!/usr/bin/env bash
# The GPU checks of issue 18, run on the lent H200 in one call (see docs/benchmarks.md, "GPU").
# Usage (from the repository root, on the GPU machine): scripts/gpu_check.sh TEST_SECONDS BENCH_SUITE
# Wheels for the project's pins that the image lacks (transformers, entmax) travel in .whl/.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
tests_s=${1:-240}; suite=${2:-gpu-quick}; out=${OUT:-/tmp/out}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'triton', triton.__version__)"
if [ "$tests_s" -gt 0 ]; then
  timeout "$tests_s" python3 -m pytest tests --device cuda -m "not slow" -o addopts="" -q \
    -p no:cacheprovider --timeout 120 -rfE 2>&1 | tee "$out/pytest.log" | tail -60
fi
if [ "$suite" != none ]; then
  python3 -m sparseattn.cli bench "$suite" --out "$out" --run "$suite" 2>&1 | tee "$out/bench.log" | tail -80
fi
