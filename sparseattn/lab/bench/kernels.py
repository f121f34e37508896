"""``sparseattn bench``: engines against dense SDPA, compiled FlexAttention and the entmax package.

For each pattern and length n the suite times, on (batch, heads, n, d) fp32 inputs:

* forward (no grad) and forward+backward of the engines (``block``, ``gather``);
* dense ``scaled_dot_product_attention`` with the same mask as a boolean ``attn_mask``;
* compiled FlexAttention on the same graph (forward only on CPU; compile time reported apart);
* 1.5-entmax: the block engine against ``entmax.entmax15`` over the full masked score matrix
  (one head at a time, so that its memory is that of one head), and the largest difference
  of the outputs;

plus the machine's dense matmul rate (measured at the start and the end of the run) and each
engine's useful FLOP rate, 4·E·d·B·H / time for the forward (E edges per graph), and a table of
the row maps on rows of K entries against the entmax package.

Times are medians of ``repeats`` calls after a warm-up call (which builds and caches plans and
compiles). Peak memory is the largest increase of the C heap in use (glibc ``mallinfo2``,
sampled every 0.5 ms by a thread, the call's output included) during one extra call; a
kernel that holds the GIL (compiled FlexAttention) is seen only before and after it runs.
Baselines that would exceed the memory cap (estimated before running) or whose previous length
exceeded the time cap are reported as skipped with the reason, not dropped. Results go to
``results/bench/<run>/``: ``results.json`` (written after every measurement; a re-run with the
same run name and suite resumes), ``results.md`` and ``bench.png``.

One file: one suite (its cases, the timing of each engine and baseline, the JSON and the
table), read top to bottom; the timing primitives live in lab/measure.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from sparseattn.lab.measure import HEAP, matmul_gflops, measure, peak_memory
from sparseattn.lab.results import machine_facts

__all__ = ["SUITES", "Suite", "run_suite"]


@dataclasses.dataclass(frozen=True)
class Suite:
    """What one bench run measures."""

    name: str
    ns: tuple[int, ...]
    patterns: tuple[str, ...]
    engines: tuple[str, ...] = ("block", "gather")
    heads: int = 8
    d: int = 64
    batch: int = 1
    repeats: int = 3
    flex: bool = True
    entmax_ns: tuple[int, ...] = (1024, 2048, 4096, 8192)
    time_cap_s: float = 30.0
    mem_cap_gb: float = 8.0
    map_rows: int = 1 << 16


SUITES = {
    "full": Suite(
        "full",
        ns=(1024, 2048, 4096, 8192, 16384, 32768, 65536),
        patterns=("longformer", "bigbird", "strided", "random"),
    ),
    "quick": Suite(
        "quick",
        ns=(1024, 4096),
        patterns=("longformer", "random"),
        repeats=2,
        flex=False,
        entmax_ns=(1024,),
        time_cap_s=10.0,
        map_rows=1 << 13,
    ),
}


def make_pattern(name: str):
    """The suite's patterns: K stays about 530 (strided: 257 + n/256) as n grows."""
    import sparseattn as sa

    return {
        "longformer": lambda: sa.longformer(512, 16),  # window ±256 + 16 global tokens
        "bigbird": lambda: sa.bigbird(448, 16, random_blocks=1, block=64),
        "strided": lambda: sa.strided(256),
        "random": lambda: sa.random(k=512, seed=0),
    }[name]()


# ----------------------------------------------------------------------------- measuring
def machine() -> dict:
    """CPU model, threads, torch version, memory and load."""
    mem_gb = None
    with contextlib.suppress(OSError, ValueError):
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        **machine_facts(),
        "memory_gb": mem_gb,
        "memory_measure": HEAP.kind,
        "env": {
            k: os.environ[k]
            for k in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
            if k in os.environ
        },
    }


# ----------------------------------------------------------------------------- the suite
def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


class _Recorder:
    """Rows of results keyed by (section, pattern, n, engine, mode); resumable."""

    def __init__(self, path: Path, header: dict) -> None:
        self.path = path
        self.data = {**header, "rows": []}
        if path.exists():
            old = json.loads(path.read_text())
            if old.get("suite") == json.loads(json.dumps(header["suite"])):  # tuples → lists
                self.data["rows"] = old.get("rows", [])
        self.skip_from: dict[tuple, int] = {}

    def key(self, row: dict) -> tuple:
        return (
            row["section"],
            row.get("pattern"),
            row.get("n"),
            row.get("engine"),
            row.get("mode"),
        )

    def done(self, **key) -> dict | None:
        k = self.key(key)
        return next((r for r in self.data["rows"] if self.key(r) == k), None)

    def add(self, row: dict) -> None:
        self.data["rows"].append(row)
        self.save()

    def save(self) -> None:
        _write_atomic(self.path, json.dumps(self.data, indent=1))


def run_suite(
    suite: Suite,
    out_dir: Path,
    log: Callable[[str], None] = print,
    ns: tuple[int, ...] | None = None,
    patterns: tuple[str, ...] | None = None,
) -> dict:
    """Run ``suite`` (optionally restricted to ``ns``/``patterns``), write JSON, markdown and
    PNG into ``out_dir``; return the results dict."""
    if ns or patterns:
        suite = dataclasses.replace(
            suite, ns=tuple(ns or suite.ns), patterns=tuple(patterns or suite.patterns)
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    header = {
        "suite": dataclasses.asdict(suite),
        "machine": machine(),
        "load_start": os.getloadavg(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    rec = _Recorder(out_dir / "results.json", header)
    rec.data["matmul_gflops_start"] = matmul_gflops()
    log(
        f"machine: {header['machine']}; matmul {rec.data['matmul_gflops_start']:.0f} GFLOP/s; "
        f"load {header['load_start']}"
    )
    _maps_section(suite, rec, log)
    for name in suite.patterns:
        _pattern_section(suite, name, rec, log)
    rec.data["matmul_gflops_end"] = matmul_gflops()
    rec.data["load_end"] = os.getloadavg()
    rec.data["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    rec.save()
    _write_atomic(out_dir / "results.md", markdown(rec.data))
    _plot(rec.data, out_dir / "bench.png")
    return rec.data


def _maps_section(suite: Suite, rec: _Recorder, log) -> None:
    """Row maps on ``map_rows`` rows of K = 576 random scores: package vs ours vs softmax."""
    import entmax as package

    from sparseattn import fastmaps
    from sparseattn.maps import entmax

    rows = suite.map_rows
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(0))
    cases = {
        "softmax (torch)": lambda: torch.softmax(x, -1),
        "entmax15 (entmax 1.3)": lambda: package.entmax15(x, -1),
        "entmax15 (fastmaps)": lambda: fastmaps.entmax15_rows(x),
        "entmax15 (maps, autograd map)": lambda: entmax(1.5)(x),
        "sparsemax (entmax 1.3)": lambda: package.sparsemax(x, -1),
        "sparsemax (fastmaps)": lambda: fastmaps.sparsemax_rows(x),
        "entmax α=1.3 (entmax 1.3 bisect)": lambda: package.entmax_bisect(x, 1.3, -1),
        "entmax α=1.3 (fastmaps)": lambda: fastmaps.entmax_rows(x, None, 1.3),
    }
    for label, fn in cases.items():
        if rec.done(section="maps", engine=label):
            continue
        res = measure(fn, suite.repeats, suite.time_cap_s)
        rec.add({"section": "maps", "engine": label, "rows": rows, "K": 576, **res})
        log(f"maps  {label:34s} {res['time_s'] * 1e3:9.1f} ms")
    checks = {
        "entmax15": (fastmaps.entmax15_rows(x), package.entmax15(x.double(), -1)),
        "sparsemax": (fastmaps.sparsemax_rows(x), package.sparsemax(x.double(), -1)),
        "entmax α=1.3": (
            fastmaps.entmax_rows(x, None, 1.3),
            package.entmax_bisect(x.double(), 1.3, -1, n_iter=100),
        ),
    }
    rec.data["maps_max_abs_diff"] = {
        k: float((a.double() - b).abs().max()) for k, (a, b) in checks.items()
    }


def _qkv(suite: Suite, n: int, grad: bool):
    gen = torch.Generator().manual_seed(n)
    shape = (suite.batch, suite.heads, n, suite.d)
    return [torch.randn(shape, generator=gen).requires_grad_(grad) for _ in range(3)]


def _pattern_section(suite: Suite, name: str, rec: _Recorder, log) -> None:
    pattern = make_pattern(name)
    stopped: dict[tuple[str, str], int] = {}  # (engine, mode) -> n where the time cap hit
    for n in suite.ns:
        start = time.perf_counter()
        graph = pattern.graph(n)
        setup = time.perf_counter() - start
        log(f"{name} n={n}: K={graph.col.numel() / n:.0f}, graph built in {setup:.1f} s")
        _one_length(suite, name, n, graph, rec, log, stopped)
        graph.uncache()  # its plans and block masks: the next length's memory


def _one_length(suite, name, n, graph, rec, log, stopped) -> None:
    from sparseattn.engines import ENGINES
    from sparseattn.engines.flex import flex_available
    from sparseattn.maps import entmax, softmax

    rho = softmax()
    scale = 1 / math.sqrt(suite.d)
    bh = suite.batch * suite.heads
    edges = int(graph.col.numel())
    useful = 4 * edges * suite.d * bh
    base = {"section": "attention", "pattern": name, "n": n, "K": edges / n, "edges": edges}

    def record(engine: str, mode: str, fn=None, skip: str | None = None) -> None:
        if rec.done(section="attention", pattern=name, n=n, engine=engine, mode=mode):
            return
        row = {**base, "engine": engine, "mode": mode}
        capped = stopped.get((engine, mode))
        if skip is None and capped is not None:
            skip = f"time cap: a call took > {suite.time_cap_s:.0f} s at n={capped}"
        if skip is not None:
            rec.add({**row, "status": "skipped", "reason": skip})
            log(f"  {engine:8s} {mode:16s} skipped: {skip}")
            return
        try:
            res = measure(fn, suite.repeats, suite.time_cap_s)
        except (RuntimeError, MemoryError, ValueError) as err:
            rec.add({**row, "status": "failed", "reason": f"{type(err).__name__}: {err}"[:300]})
            log(f"  {engine:8s} {mode:16s} failed: {err}")
            return
        flops = useful * (3 if mode.endswith("fwd+bwd") else 1)
        res["useful_gflops"] = flops / res["time_s"] / 1e9
        if res["time_s"] > suite.time_cap_s:
            stopped[(engine, mode)] = n
        rec.add({**row, "status": "ok", **res})
        log(
            f"  {engine:8s} {mode:16s} {res['time_s'] * 1e3:10.1f} ms  "
            f"{res['peak_mb']:8.0f} MiB  {res['useful_gflops']:6.1f} GF/s"
        )

    q, k, v = _qkv(suite, n, grad=False)
    qg, kg, vg = _qkv(suite, n, grad=True)
    grad_out = torch.randn_like(q)

    def backward(out: torch.Tensor) -> None:
        out.backward(grad_out)
        for t in (qg, kg, vg):
            t.grad = None

    for engine in suite.engines:
        fn = ENGINES[engine]
        record(engine, "fwd", lambda fn=fn: _no_grad(fn, q, k, v, graph, rho, scale))
        record(engine, "fwd+bwd", lambda fn=fn: backward(fn(qg, kg, vg, graph, rho, scale)))

    # dense SDPA with the same boolean mask
    est_fwd = n * n / 2**30 * (1 + 4 + 4 * bh)  # bool mask, float mask, weights (math path)
    if est_fwd > suite.mem_cap_gb:
        why = f"memory cap: ~{est_fwd:.0f} GB estimated > {suite.mem_cap_gb:.0f} GB"
        record("sdpa", "fwd", skip=why)
        record("sdpa", "fwd+bwd", skip=why)
    else:
        dense_mask = graph.to_dense()

        def sdpa(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask, scale=scale)

        record("sdpa", "fwd", lambda: _no_grad(sdpa, q, k, v))
        if 2 * est_fwd > suite.mem_cap_gb:
            record("sdpa", "fwd+bwd", skip=f"memory cap: ~{2 * est_fwd:.0f} GB estimated")
        else:
            record("sdpa", "fwd+bwd", lambda: backward(sdpa(qg, kg, vg)))

    # compiled FlexAttention on the same graph
    if suite.flex:
        flex = ENGINES["flex"]
        record(
            "flex", "fwd", lambda: _no_grad(flex, q, k, v, graph, rho, scale), skip=flex_available()
        )
        record("flex", "fwd+bwd", skip="FlexAttention has no backward on CPU")

    # 1.5-entmax: block engine vs the entmax package on full score matrices
    if n in suite.entmax_ns:
        block = ENGINES["block"]
        rho15 = entmax(1.5)
        record("block", "entmax15 fwd", lambda: _no_grad(block, q, k, v, graph, rho15, scale))
        record(
            "block", "entmax15 fwd+bwd", lambda: backward(block(qg, kg, vg, graph, rho15, scale))
        )
        _entmax_full(suite, rec, log, base, graph, q, k, v, scale)


def _no_grad(fn, *args):
    with torch.no_grad():
        return fn(*args)


def _entmax_full(suite, rec, log, base, graph, q, k, v, scale) -> None:
    """entmax 1.3's entmax15 over each head's full n×n masked scores, and its difference to
    the block engine's output."""
    import entmax as package

    from sparseattn.engines import block_attention
    from sparseattn.maps import entmax

    row = {**base, "engine": "entmax 1.3 full", "mode": "entmax15 fwd"}
    if rec.done(
        section="attention",
        pattern=row["pattern"],
        n=row["n"],
        engine=row["engine"],
        mode=row["mode"],
    ):
        return
    per_head_gb = row["n"] ** 2 * 4 * 10 / 2**30  # scores, sorted copy, cumsums, indices
    if per_head_gb > suite.mem_cap_gb:
        rec.add(
            {
                **row,
                "status": "skipped",
                "reason": f"memory cap: ~{per_head_gb:.0f} GB per head estimated",
            }
        )
        log(f"  entmax 1.3 full skipped: ~{per_head_gb:.0f} GB per head")
        return
    mask = graph.to_dense()

    def full_entmax() -> torch.Tensor:
        outs = []
        for h in range(q.shape[1]):  # one head at a time: the memory of one n×n chain
            s = (q[:, h] @ k[:, h].transpose(-1, -2)) * scale
            p = package.entmax15(s.masked_fill_(~mask, -math.inf), dim=-1)
            outs.append(p @ v[:, h])
        return torch.stack(outs, 1)

    with torch.no_grad():
        start = time.perf_counter()
        with peak_memory() as mem:
            full = full_entmax()
        took = time.perf_counter() - start
        ours = block_attention(q, k, v, graph, entmax(1.5), scale)
    diff = float((full - ours).abs().max())
    rec.add(
        {
            **row,
            "status": "ok",
            "time_s": took,
            "times_s": [took],
            "peak_mb": mem["mb"],
            "max_abs_diff_vs_block": diff,
        }
    )
    log(
        f"  entmax 1.3 full  {took * 1e3:10.1f} ms  {mem['mb']:8.0f} MiB  "
        f"(max |diff| to block {diff:.1e})"
    )


# ----------------------------------------------------------------------------- reporting
def _rows(data: dict, **match) -> list[dict]:
    return [r for r in data["rows"] if all(r.get(k) == v for k, v in match.items())]


def _cell(data: dict, pattern: str, n: int, engine: str, mode: str, what: str = "ms") -> str:
    rows = _rows(data, section="attention", pattern=pattern, n=n, engine=engine, mode=mode)
    if not rows:
        return "—"
    row = rows[0]
    if row["status"] != "ok":
        return "skip" if row["status"] == "skipped" else "fail"
    if what == "ms":
        return f"{row['time_s'] * 1e3:.0f}"
    if what == "mb":
        return f"{row['peak_mb']:.0f}"
    return f"{row['useful_gflops']:.0f}"


def _ratio(data: dict, pattern: str, n: int, num: tuple, den: tuple) -> str:
    a, b = _time(data, pattern, n, *num), _time(data, pattern, n, *den)
    return "—" if a is None or b is None else f"{a / b:.1f}×"


def _time(data: dict, pattern: str, n: int, engine: str, mode: str) -> float | None:
    rows = _rows(data, section="attention", pattern=pattern, n=n, engine=engine, mode=mode)
    return rows[0]["time_s"] if rows and rows[0]["status"] == "ok" else None


def _targets(data: dict, pattern: str = "longformer", n: int = 8192) -> list[str]:
    """The issue's targets (window ±256 + 16 globals, 8 heads, d = 64) as measured ratios."""
    t = {
        (e, m): _time(data, pattern, n, e, m)
        for e, m in (
            ("block", "fwd"),
            ("flex", "fwd"),
            ("sdpa", "fwd"),
            ("block", "fwd+bwd"),
            ("sdpa", "fwd+bwd"),
            ("block", "entmax15 fwd"),
            ("entmax 1.3 full", "entmax15 fwd"),
        )
    }
    if t[("block", "fwd")] is None:
        return []

    def ratio(num, den):
        a, b = t[num], t[den]
        return None if a is None or b is None else a / b

    small, big = _time(data, pattern, 4096, "block", "fwd"), None
    top = max(
        (
            r["n"]
            for r in _rows(data, section="attention", pattern=pattern, engine="block", mode="fwd")
            if r["status"] == "ok"
        ),
        default=None,
    )
    if top and top > 4096:
        big = _time(data, pattern, top, "block", "fwd")
    rate = [
        r["useful_gflops"]
        for r in _rows(data, section="attention", pattern=pattern, n=n, engine="block", mode="fwd")
    ]
    mm = data.get("matmul_gflops_start")
    checks = [
        (
            f"fwd: compiled Flex / block at n = {n}",
            ratio(("flex", "fwd"), ("block", "fwd")),
            1.5,
            "≥",
        ),
        (
            f"fwd: SDPA (same mask) / block at n = {n}",
            ratio(("sdpa", "fwd"), ("block", "fwd")),
            10.0,
            "≥",
        ),
        (
            f"fwd+bwd: SDPA / block at n = {n}",
            ratio(("sdpa", "fwd+bwd"), ("block", "fwd+bwd")),
            8.0,
            "≥",
        ),
        (
            f"block fwd time n = {top} / n = 4096",
            big / small if big and small else None,
            18.0 * (top or 0) / 65536,
            "≤",
        ),
        (
            f"useful FLOP rate / matmul rate at n = {n}",
            rate[0] / mm if rate and mm else None,
            0.4,
            "≥",
        ),
        (
            f"1.5-entmax: entmax 1.3 full / block at n = {n}",
            ratio(("entmax 1.3 full", "entmax15 fwd"), ("block", "entmax15 fwd")),
            20.0,
            "≥",
        ),
    ]
    lines = [
        f"## Targets ({pattern}, n = {n})",
        "",
        "| target | measured | goal | met |",
        "|---|---|---|---|",
    ]
    for name, value, goal, op in checks:
        if value is None:
            lines.append(f"| {name} | not measured | {op} {goal:g} | — |")
            continue
        met = value >= goal if op == "≥" else value <= goal
        lines.append(f"| {name} | {value:.2f} | {op} {goal:g} | {'yes' if met else 'NO'} |")
    return [*lines, ""]


def markdown(data: dict) -> str:
    """The results as markdown tables."""
    m = data["machine"]
    suite = data["suite"]
    mm = data.get("matmul_gflops_start", float("nan"))
    lines = [
        f"# sparseattn bench — suite `{suite['name']}`",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} with "
        f"{m['torch_threads']} threads, {m['memory_gb'] or 0:.0f} GiB. Started "
        f"{data.get('started')}, load average at start {data.get('load_start')}, at end "
        f"{data.get('load_end')}. Dense fp32 matmul: {mm:.0f} GFLOP/s at the start, "
        f"{data.get('matmul_gflops_end', float('nan')):.0f} at the end.",
        f"Inputs (B, H, n, d) = ({suite['batch']}, {suite['heads']}, n, {suite['d']}), fp32; "
        f"times are medians of {suite['repeats']} calls in ms; memory is the peak "
        f"{m['memory_measure']} increase in MiB; GF/s is the useful rate 4·E·d·B·H/time "
        "(×3 for fwd+bwd).",
        "",
    ]
    lines += _targets(data)
    for pattern in suite["patterns"]:
        ns = sorted({r["n"] for r in _rows(data, section="attention", pattern=pattern)})
        if not ns:
            continue
        lines += [
            f"## {pattern}",
            "",
            "| n | K | block fwd | gather fwd | flex fwd | SDPA fwd | block f+b | gather f+b "
            "| SDPA f+b | SDPA/block fwd | flex/block fwd | SDPA/block f+b | block MiB fwd "
            "| block MiB f+b | block GF/s (% matmul) |",
            "|" + "---|" * 15,
        ]
        for n in ns:
            k = _rows(data, section="attention", pattern=pattern, n=n)[0]["K"]
            gf = _cell(data, pattern, n, "block", "fwd", "gf")
            pct = f"{float(gf) / mm:.0%}" if gf.replace(".", "").isdigit() else "—"
            lines.append(
                f"| {n} | {k:.0f} | {_cell(data, pattern, n, 'block', 'fwd')} "
                f"| {_cell(data, pattern, n, 'gather', 'fwd')} "
                f"| {_cell(data, pattern, n, 'flex', 'fwd')} "
                f"| {_cell(data, pattern, n, 'sdpa', 'fwd')} "
                f"| {_cell(data, pattern, n, 'block', 'fwd+bwd')} "
                f"| {_cell(data, pattern, n, 'gather', 'fwd+bwd')} "
                f"| {_cell(data, pattern, n, 'sdpa', 'fwd+bwd')} "
                f"| {_ratio(data, pattern, n, ('sdpa', 'fwd'), ('block', 'fwd'))} "
                f"| {_ratio(data, pattern, n, ('flex', 'fwd'), ('block', 'fwd'))} "
                f"| {_ratio(data, pattern, n, ('sdpa', 'fwd+bwd'), ('block', 'fwd+bwd'))} "
                f"| {_cell(data, pattern, n, 'block', 'fwd', 'mb')} "
                f"| {_cell(data, pattern, n, 'block', 'fwd+bwd', 'mb')} "
                f"| {gf} ({pct}) |"
            )
        block = {
            r["n"]: r["time_s"]
            for r in _rows(data, section="attention", pattern=pattern, engine="block", mode="fwd")
            if r["status"] == "ok"
        }
        if 4096 in block and max(block) > 4096:
            top = max(block)
            lines += [
                "",
                f"Block forward time, n = {top} over n = 4096: "
                f"{block[top] / block[4096]:.1f}× for {top // 4096}× the length.",
            ]
        lines.append("")
        reasons = {
            r["reason"]
            for r in _rows(data, section="attention", pattern=pattern)
            if r["status"] != "ok"
        }
        if reasons:
            lines += ["Skipped/failed: " + "; ".join(sorted(reasons)), ""]
    ent = [r for r in _rows(data, section="attention") if r["mode"] == "entmax15 fwd"]
    if ent:
        lines += [
            "## 1.5-entmax: block engine vs entmax 1.3 `entmax15` on the full masked scores",
            "",
            "| pattern | n | block entmax15 fwd ms | block entmax15 f+b ms | entmax 1.3 full ms "
            "| speed-up | full MiB | max abs diff |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for pattern, n in sorted({(r["pattern"], r["n"]) for r in ent}):
            found = _rows(data, section="attention", pattern=pattern, n=n, engine="entmax 1.3 full")
            full = found[0] if found else {"status": "missing", "reason": "—"}
            ok = full["status"] == "ok"
            full_ms = f"{full['time_s'] * 1e3:.0f}" if ok else full.get("reason", "—")
            full_mb = f"{full['peak_mb']:.0f}" if ok else "—"
            diff = f"{full['max_abs_diff_vs_block']:.1e}" if ok else "—"
            speed = _ratio(
                data, pattern, n, ("entmax 1.3 full", "entmax15 fwd"), ("block", "entmax15 fwd")
            )
            lines.append(
                f"| {pattern} | {n} | {_cell(data, pattern, n, 'block', 'entmax15 fwd')} "
                f"| {_cell(data, pattern, n, 'block', 'entmax15 fwd+bwd')} "
                f"| {full_ms} | {speed} | {full_mb} | {diff} |"
            )
        lines.append("")
    maps = _rows(data, section="maps")
    if maps:
        soft = next((r["time_s"] for r in maps if r["engine"].startswith("softmax")), None)
        lines += [
            f"## Row maps on {maps[0]['rows']} rows of K = {maps[0]['K']}",
            "",
            "| map | ms | × softmax |",
            "|---|---|---|",
        ]
        for r in maps:
            rel = f"{r['time_s'] / soft:.1f}" if soft else "—"
            lines.append(f"| {r['engine']} | {r['time_s'] * 1e3:.1f} | {rel} |")
        diffs = data.get("maps_max_abs_diff", {})
        if diffs:
            lines += [
                "",
                "Largest |fastmaps − entmax package (float64)|: "
                + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()),
            ]
        lines.append("")
    return "\n".join(lines)


def plot_runs(results: list[Path], path: Path) -> None:
    """One ``bench.png`` for several runs of the suite (e.g. one ``--only PATTERN`` run each):
    their patterns side by side, the first run's machine in the title."""
    runs = [json.loads(Path(r).read_text()) for r in results]
    merged = dict(runs[0])
    patterns = [p for r in runs for p in r["suite"]["patterns"]]
    merged["suite"] = dict(runs[0]["suite"], patterns=patterns)
    merged["rows"] = [row for r in runs for row in r["rows"]]
    _plot(merged, Path(path))


def _plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    patterns = data["suite"]["patterns"]
    fig, axes = plt.subplots(2, len(patterns), figsize=(4.5 * len(patterns), 7), squeeze=False)
    styles = {"fwd": "-", "fwd+bwd": "--"}
    for col, pattern in enumerate(patterns):
        for engine in ("block", "gather", "flex", "sdpa"):
            for mode, style in styles.items():
                rows = [
                    r
                    for r in _rows(
                        data, section="attention", pattern=pattern, engine=engine, mode=mode
                    )
                    if r["status"] == "ok"
                ]
                if not rows:
                    continue
                ns = [r["n"] for r in rows]
                axes[0][col].loglog(
                    ns, [r["time_s"] for r in rows], style, marker="o", label=f"{engine} {mode}"
                )
                axes[1][col].loglog(
                    ns,
                    [max(r["peak_mb"], 0.1) for r in rows],
                    style,
                    marker="o",
                    label=f"{engine} {mode}",
                )
        for ax in (axes[0][col], axes[1][col]):
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        axes[0][col].set_title(pattern)
        axes[0][col].set_ylabel("time (s)")
        axes[1][col].set_ylabel("peak memory (MiB)")
        axes[1][col].set_xlabel("n")
        axes[0][col].legend(fontsize=7)
    fig.suptitle(
        f"sparseattn bench ({data['machine']['cpu']}, {data['machine']['torch_threads']} threads)",
        fontsize=9,
    )
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
