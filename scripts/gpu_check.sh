#!/usr/bin/env bash
# The GPU checks in one prepared device call, each step under its own time limit so that the
# script always ends by packing what it measured:
#   0. `scripts/host_overhead.py --device cuda`: the host time per call of the user path against
#      FlexAttention by hand (about 30 s, mostly compiling; at most $HOST_S s, 90 by default,
#      HOST_S=0 skips it);
#   1. each bench suite named, `sparseattn bench SUITE` for at most SECONDS (rows are saved as
#      they come: a cut suite keeps its rows);
#   2. the CUDA test suite, `pytest tests --device cuda -m "not slow" -n $WORKERS` (pytest-xdist
#      is in the GPU image; the whole suite took 112 s that way on an H200, 120-143 s on an H100).
# What comes back (the device tool returns at most 8 files): $OUT/machine.txt, pytest.log,
# junit.xml, host-overhead-cuda.json, summary.md (every suite's results.md and the end of its
# log) and runs.tgz (each suite's folder: results.json, results.md, gpu.png, bench.log).
#
# Usage (repository root, on the GPU machine):
#   scripts/gpu_check.sh [TEST_SECONDS [SUITE:SECONDS ...]]   (WORKERS=12, HOST_S=90 by default)
#   defaults: 100 gpu-overhead:80 gpu-decode:120 gpu-models:110 (at most 500 s with the host
#   step, plus about 15 s of wheel installs)
# The next device session's calls (15 minutes of device time in all, the machine's start about
# 45 s of it; the two calls back to back keep the machine warm; 865 s at most in all, so there
# is no room for a retry: if the first call fails early, fix and rerun it instead of the second):
#   1. issue 43 items 1 and 4, issue 40's GPU rows, and the tests:
#        run(command="scripts/gpu_check.sh", carry=[".whl"], timeout_s=520)
#   2. issue 43 item 2, α-entmax beside softmax and AdaSplash at 32768 and 131072, then the
#      Triton kernels' knobs (AdaSplash's Triton autotuning takes 30-80 s per length):
#        run(command="cp .whl/extra/*.whl .whl/ && HOST_S=0 scripts/gpu_check.sh 0 gpu-entmax:270",
#            carry=[".whl"], timeout_s=300)
# Earlier calls: `scripts/gpu_check.sh 150 gpu-quick:330` took 493 s on an H100 (commit
# 30ba68f), the bench its whole 330 s, cut inside the tiles sweep.
# Wheels for the project's pins that the image lacks (transformers 5.24, entmax 1.3) travel in
# .whl/ (ignored by git via .git/info/exclude), fetched here beforehand with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux2014_x86_64 -d .whl transformers==5.24.0 \
#     entmax==1.3
# and the same line with -d .whl/extra adasplash==0.2.2 (all pure-Python wheels; AdaSplash's
# kernels are Triton). The MiniLM package (83 MB) cannot travel: its tests skip with that reason.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
tests_s=${1:-100}
shift $(( $# > 0 ? 1 : 0 ))
suites=("$@")
[ ${#suites[@]} -gt 0 ] || suites=(gpu-overhead:80 gpu-decode:120 gpu-models:110)
workers=${WORKERS:-12}
host_s=${HOST_S:-90}
out=${OUT:-/tmp/out}
runs=/tmp/gpu-runs
mkdir -p "$out" "$runs"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
else
  export PYTHONPATH=$PWD
fi
{
  git log -1 --format='commit %H %cd' 2>/dev/null
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'transformers', transformers.__version__, 'triton', triton.__version__)"
  python3 -c "import entmax; print('entmax', entmax.__version__)" 2>&1 | tail -1
} 2>&1 | tee "$out/machine.txt"
if [ "$host_s" -gt 0 ]; then
  timeout "$host_s" python3 scripts/host_overhead.py --device cuda \
    --out "$out/host-overhead-cuda.json" 2>&1 | tail -2
fi
: >"$out/summary.md"
for item in "${suites[@]}"; do
  suite=${item%%:*}
  seconds=${item#*:}
  [ "$seconds" != "$item" ] || seconds=300
  dir=$runs/$suite
  mkdir -p "$dir"
  start=$(date +%s)
  timeout "$seconds" python3 -m sparseattn.lab.cli bench "$suite" --out "$runs" --run "$suite" \
    >"$dir/bench.log" 2>&1
  echo "bench $suite: exit $? after $(( $(date +%s) - start )) s" | tee -a "$dir/bench.log"
  {
    echo "# $suite"
    cat "$dir/results.md" 2>/dev/null \
      || echo "(no results.md: the suite was cut or failed, see its log; rows in runs.tgz)"
    echo '```'
    tail -40 "$dir/bench.log"
    echo '```'
  } >>"$out/summary.md"
  tail -25 "$dir/bench.log"
done
tar czf "$out/runs.tgz" -C "$runs" .
if [ "$tests_s" -gt 0 ]; then
  start=$(date +%s)
  timeout "$tests_s" python3 -m pytest tests --device cuda -m "not slow" -o addopts="" -q \
    -n "$workers" -p no:cacheprovider --timeout 120 -rfE --junitxml="$out/junit.xml" \
    >"$out/pytest.log" 2>&1
  echo "pytest: exit $? after $(( $(date +%s) - start )) s" | tee -a "$out/pytest.log"
  grep -E "^(FAILED|ERROR)|passed|failed" "$out/pytest.log" | tail -40
fi
