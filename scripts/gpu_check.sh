#!/usr/bin/env bash
# The GPU checks of issues 25 and 26 in one prepared device call, under 8 minutes in all:
#   1. `sparseattn bench gpu-quick` (or the suite named), which writes results.json,
#      results.md and gpu.png (rows are saved as they come: a timeout keeps them);
#   2. the CUDA test suite, `pytest tests --device cuda -m "not slow" -n 8` (pytest-xdist is in
#      the GPU image; the whole suite took 112 s that way on an H200, 120 s on an H100).
#   0. first, `scripts/host_overhead.py --device cuda`: the host time per call of the user path
#      against FlexAttention by hand (host-overhead-cuda.json).
# Everything it writes lands in $OUT (at most 8 files come back): machine.txt, pytest.log
# (one line per failure, -rfE), junit.xml, bench.log, the bench folder's three files and
# host-overhead-cuda.json.
#
# Usage (repository root, on the GPU machine):
#   scripts/gpu_check.sh [TEST_SECONDS [BENCH_SUITE [BENCH_SECONDS [WORKERS]]]]
#   defaults: 150 gpu-quick 330 12. On an H100 (commit 30ba68f) the call took 493 s: the suite
#   143 s with 12 workers, the bench its whole 330 s, cut inside the tiles sweep (76 s of main's
#   rows were compiling warm-ups); the sparse-map section alone (`0 gpu-entmax 270`) took
#   31 s. The bench runs the tiles sweep last, so a timeout cuts the sweep, not the targets.
# The device tool's call: run(command="scripts/gpu_check.sh", carry=[".whl"], timeout_s=540);
# the machine's start adds about 45 s of device time. With the adasplash wheel in .whl/ the
# bench's entmax section also times AdaSplash, whose Triton autotuning takes 30-80 s per
# length: keep it in .whl/extra/ (not installed) and give it a call of its own,
#   run(command="cp .whl/extra/*.whl .whl/ && scripts/gpu_check.sh 0 gpu-entmax 450",
#       carry=[".whl"], timeout_s=500).
# Wheels for the project's pins that the image lacks (transformers 5.24, entmax 1.3) travel in
# .whl/ (ignored by git via .git/info/exclude), fetched here beforehand with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux2014_x86_64 -d .whl transformers==5.24.0 \
#     entmax==1.3
# and the same line with -d .whl/extra adasplash==0.2.2 (all pure-Python wheels; AdaSplash's
# kernels are Triton). The MiniLM package (83 MB) cannot travel: its tests skip with that reason.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
tests_s=${1:-150}; suite=${2:-gpu-quick}; bench_s=${3:-330}; workers=${4:-12}; out=${OUT:-/tmp/out}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
else
  export PYTHONPATH=$PWD
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'transformers', transformers.__version__, 'triton', triton.__version__)"
  python3 -c "import entmax; print('entmax', entmax.__version__)" 2>&1 | tail -1
} 2>&1 | tee "$out/machine.txt"
# the host time the user path adds per call (about 30 s, mostly compiling)
timeout 90 python3 scripts/host_overhead.py --device cuda --out "$out/host-overhead-cuda.json" \
  2>&1 | tail -2
if [ "$suite" != none ]; then
  timeout "$bench_s" python3 -m sparseattn.lab.cli bench "$suite" --out "$out" --run "$suite" \
    >"$out/bench.log" 2>&1
  echo "bench: exit $?" | tee -a "$out/bench.log"
  tail -60 "$out/bench.log"
fi
if [ "$tests_s" -gt 0 ]; then
  start=$(date +%s)
  timeout "$tests_s" python3 -m pytest tests --device cuda -m "not slow" -o addopts="" -q \
    -n "$workers" -p no:cacheprovider --timeout 120 -rfE --junitxml="$out/junit.xml" \
    >"$out/pytest.log" 2>&1
  echo "pytest: exit $? after $(( $(date +%s) - start )) s" | tee -a "$out/pytest.log"
  grep -E "^(FAILED|ERROR)|passed|failed" "$out/pytest.log" | tail -40
fi
