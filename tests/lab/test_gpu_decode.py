"""The decode section of the GPU bench (sparseattn/lab/bench/gpu_decode.py).

On the GPU simulated on the CPU (tests/device_guard.py; a fresh one in the plain run, the
run's own under ``--device guard``): the section end to end at tiny sizes through
``run_gpu_suite`` — every decode-step row measured and within bf16 error of the section's
float32 reference, the CUDA-graph rows skipped with their reason (no real CUDA device), the
evicting and the full cache generating the same tokens, the tables written, a re-run measuring
nothing. On a real GPU (``--device cuda``): a decode step replayed from a CUDA graph equals the
eager call, also after new values are copied into its inputs.
"""

from __future__ import annotations

import json

import pytest
import torch
from device_guard import DeviceGuard

import sparseattn as sa
from sparseattn.lab.bench import gpu_decode
from sparseattn.lab.bench.gpu import GpuSuite, run_gpu_suite
from sparseattn.lab.results import ResumableRows

pytestmark = [pytest.mark.device, pytest.mark.guard]

WINDOW, SINKS, N, TOKENS = 64, 4, 128, 4


@pytest.fixture
def simulated_gpu(device, device_guard):
    """The simulated GPU: the run's guard under ``--device guard``, else a fresh one; on a
    real GPU the bench itself is the check (``sparseattn bench gpu-decode``)."""
    if device_guard is not None:
        yield device_guard
    elif device.type == "cuda":
        pytest.skip(
            "on a GPU the section runs for real: python -m sparseattn.lab.cli bench gpu-decode"
        )
    else:
        with DeviceGuard() as guard:
            yield guard


def tiny_suite() -> GpuSuite:
    return GpuSuite.only(
        "decode-smoke",
        decode_ns=(N,),
        generate_tokens=TOKENS,
        decode_window=WINDOW,
        decode_sinks=SINKS,
        generate_samples=1,
        generate_layers=1,
        samples=1,
        min_sample_s=0.0,
    )


def test_the_section_runs_end_to_end_on_the_simulated_gpu(simulated_gpu, tmp_path):
    suite = tiny_suite()
    lines: list[str] = []
    data = run_gpu_suite(suite, tmp_path, log=lines.append)

    decode = [r for r in data["rows"] if r["section"] == "decode"]
    expected = {(t, who) for t in suite.decode_queries for who in gpu_decode._decode_rows(suite)}
    assert sorted((r["t"], r["who"]) for r in decode) == sorted(expected)
    for r in decode:
        if r["who"].endswith("CUDA graph"):
            assert r["skipped"].startswith("RuntimeError: no CUDA graph: "), r
            assert "simulated on the CPU" in r["skipped"], r
            continue
        assert "time_s" in r and "skipped" not in r, r
        if r["who"] != gpu_decode.SDPA_WHOLE:  # bf16 outputs against the float32 reference
            assert r["max_abs_err"] < 2e-2, r
        if r["who"].startswith("sparseattn auto"):
            assert r["engine"] in sa.engines.ENGINES, r
        if "evicting" in r["who"]:  # hf.window_cache's sinks, w − 1 kept keys, t new ones
            assert r["keys"] == SINKS + WINDOW - 1 + r["t"], r

    gen = {r["who"]: r for r in data["rows"] if r["section"] == "generate"}
    assert set(gen) == {gpu_decode.DENSE, gpu_decode.FULL, gpu_decode.EVICTING}
    assert all("skipped" not in r and r["decode_tok_s"] > 0 for r in gen.values()), gen
    evicting, full = gen[gpu_decode.EVICTING], gen[gpu_decode.FULL]
    assert evicting["tokens_equal"] is True
    assert evicting["tokens_sha256"] == full["tokens_sha256"]
    assert evicting["keys_per_layer"] == SINKS + WINDOW - 1
    assert full["keys_per_layer"] == N + TOKENS - 1

    report = (tmp_path / "results.md").read_text()
    assert "## Decode step" in report and "## generate" in report
    table = [line for line in report.splitlines() if line.startswith(f"| {N} | ")]
    assert len(table) == len(decode) + len(gen)
    assert any("| yes |" in line for line in table)  # the evicting cache's equal tokens

    # a re-run finds every row and measures nothing
    rows = ResumableRows(tmp_path / "results.json", {"suite": data["suite"]})
    before = json.dumps(rows.data["rows"])
    again: list[str] = []
    gpu_decode.run(suite, rows, again.append)
    assert again == [] and json.dumps(rows.data["rows"]) == before


def test_a_cuda_graph_on_a_simulated_gpu_says_why_it_cannot_be(simulated_gpu, monkeypatch):
    """With a CUDA build of torch (the guard on a GPU machine) the capture gets as far as a
    first call, whose output is on the CPU behind the simulated device: refused, with the
    reason, before any stream or graph is made."""
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    x = torch.ones(3, device="cuda")
    with pytest.raises(RuntimeError, match="no CUDA graph: the output is not on a CUDA device"):
        gpu_decode.CudaGraphed(lambda: x * 2)()


def test_no_rows_and_no_tables_without_decode_lengths():
    rows: list = []

    class NoRows:
        def find(self, **key):
            raise AssertionError("nothing to look up")

        def add(self, row):
            rows.append(row)

    gpu_decode.run(GpuSuite("none", generate_tokens=8), NoRows(), print)
    assert rows == [] and gpu_decode.markdown([]) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("t", [1, 4])
@pytest.mark.parametrize("cache", ["whole", "evicting"])
def test_a_decode_step_replayed_from_a_cuda_graph_equals_the_eager_call(cache, t):
    pattern = sa.sliding_window(WINDOW, SINKS)
    n = 1024 if cache == "whole" else SINKS + WINDOW - 1 + t
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)

    q, k, v = randn(1, 32, t, 128), randn(1, 8, n, 128), randn(1, 8, n, 128)

    def step():
        return sa.sparse_attention(q, k, v, pattern, enable_gqa=True)

    graphed = gpu_decode.CudaGraphed(step)
    for _ in range(2):  # the capture's replay, then new values in the static inputs
        out = graphed().clone()
        with torch.no_grad():
            eager = step()
        torch.testing.assert_close(out, eager, atol=1e-3, rtol=1.6e-2)
        for x in (q, k, v):
            x.copy_(randn(*x.shape))
    assert graphed.graph is not None
