"""The GPU bench's models section (sparseattn/lab/bench/gpu_models.py) end to end, at tiny sizes.

On the GPU simulated on the CPU (tests/device_guard.py: the section's CUDA paths, flex run
eagerly) — the active guard under ``--device guard``, a fresh one in the plain run — or on a
real GPU under ``--device cuda``: Longformer and BigBird of 1 layer, width 64, 4 heads
(d = 16, the least FlexAttention's GPU kernels take), window 32, blocks of 16, 4 global
tokens, n = 256, both dtypes. Every row is measured, the sparsified outputs equal
transformers' in float32 (relative to the output's scale), the report has the tables, and a
re-run resumes without measuring again.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from device_guard import DeviceGuard

from sparseattn.engines import ENGINES
from sparseattn.lab.bench import gpu_models
from sparseattn.lab.bench.gpu import GpuSuite, run_gpu_suite
from sparseattn.lab.results import ResumableRows

pytestmark = [pytest.mark.device, pytest.mark.guard]

SUITE = GpuSuite.only(
    "t",
    models_ns=(256,),
    models_layers=1,
    models_hidden=64,
    models_heads=4,
    models_window=32,
    models_block=16,
    models_globals=4,
    samples=1,
    min_sample_s=0.0,
)
TOL = 1e-5


@pytest.fixture
def gpu(device_guard, device):
    """A GPU for the bench: the run's guard, a real one (``--device cuda``), or a fresh
    guard."""
    if device_guard is not None or device.type == "cuda":
        yield
        return
    with DeviceGuard():
        yield


def test_the_section_measures_every_row_matches_transformers_and_resumes(gpu, tmp_path):
    logs: list[str] = []
    data = run_gpu_suite(SUITE, tmp_path, log=logs.append)
    rows = data["rows"]
    assert {r["section"] for r in rows} == {"models"}
    groups = {(r["pattern"], r["dtype"], r["n"], r["mode"]) for r in rows}
    assert groups == {
        (kind, dtype, 256, mode)
        for kind in ("longformer", "bigbird")
        for dtype in ("float32", "bfloat16")
        for mode in ("layer fwd", "model fwd")
    }
    assert len(rows) == 3 * len(groups)  # transformers, flex, auto in each
    assert not [(r["pattern"], r["who"], r["mode"], r["skipped"]) for r in rows if "skipped" in r]
    assert all(r["time_s"] > 0 and r["peak_mb"] >= 0 for r in rows)
    for r in rows:
        if r["who"] == "transformers":
            assert "max abs diff" not in r
            continue
        # every sparsified row was compared with transformers' output
        assert r["output scale"] > 0
        bound = (TOL if r["dtype"] == "float32" else 0.1) * r["output scale"]
        assert r["max abs diff"] <= bound, r
        if r["who"] == "sparseattn auto":
            assert r["engines"] and set(r["engines"]) <= set(ENGINES)
    assert sum("max abs diff" in line for line in logs) == 16

    report = (tmp_path / "results.md").read_text()
    lines = gpu_models.markdown(rows)
    assert "\n".join(lines) in report
    for title in ("## Longformer (1 layer,", "## BigBird (1 layer,", "## hf.sparsify's outputs"):
        assert sum(line.startswith(title) for line in lines) == 1, title
    table = [line for line in lines if line.startswith("| ") and "---" not in line]
    # per model a header and 4 rows; the differences: a header and 8 rows
    assert len(table) == 2 * (1 + 4) + 1 + 8
    assert all("–" not in line for line in table)

    # a re-run finds every row in results.json and measures nothing
    logs.clear()
    again = run_gpu_suite(SUITE, tmp_path, log=logs.append)["rows"]
    assert json.dumps(again) == json.dumps(rows)
    assert not [line for line in logs if line.startswith("models")]


def test_no_lengths_no_rows(tmp_path):
    rows = ResumableRows(tmp_path / "results.json", {"suite": {}})
    gpu_models.run(dataclasses.replace(SUITE, models_ns=()), rows, print)
    assert rows.data["rows"] == [] and gpu_models.markdown(rows.data["rows"]) == []
