"""``sparseattn bench auto``: is ``engine="auto"`` within 1.3× of the fastest engine everywhere?

Issue 28, item 2. Over a grid of lengths n, batch sizes B and the named patterns, the suite times
forward + backward of ``sparse_attention(q, k, v, pattern, engine=e)`` (softmax, fp32, q, k, v
of shape (B, H, n, d) requiring grad, the pattern *object* as a user passes it) for every engine
``e`` of ``auto, dense, block, gather, rows``, and reports per cell each engine's median, the
engine ``auto`` picked (:func:`sparseattn.choose_engine` on the same call), the fastest engine
and the ratio auto / fastest; cells above ``goal`` (1.3) are the misses.

How it is timed, so that the ratios hold on a shared, loaded machine: ``threads`` torch threads
(one by default), process CPU time per call (not wall time: time the scheduler gives to other
processes does not count), one warm-up call per engine (it builds and caches the graph and the
plans, as a model's first step does), then the engines of the cell **round-robin** (in a new
random order each round: a call's time depends on what ran before it, through the allocator and
the caches), ``repeats`` rounds (fewer for slow cells: a cell's timed rounds are
bounded by ``cell_budget_s``, at least ``min_repeats``), medians.

The patterns take sizes that make sense at each n (:func:`make_pattern`): window, Longformer and
BigBird a window of w = clamp(n/8, 16, 512) (Longformer w/32 global tokens, BigBird also one
random block of w/8 per query block); STRIDED and FIXED (Child et al.) w ≈ √n, a power of two,
as in the issue's toy model (n = 256, w = 16).

Cells are skipped, with the reason in the results, where

* B·n > ``max_tokens`` (a cap on the work of one cell: the full grid stays under ~20 minutes);
* the dense engine's fp32 score matrix B·H·n² · 4 bytes would pass ``dense_mem_gb`` (dense only);
* an engine took more than ``slow_factor`` × the cell's fastest at a shorter length of the
  same (pattern, B, d) series, where the fastest took at least ``slow_min_ms`` (tiny cells are
  noisy) and its cost grows no faster with n than the slow engine's (dense and rows grow as n²,
  block and gather as the edges): it cannot become the fastest at a longer length. ``auto`` is
  always timed.

Results (``out_dir``): ``results.json`` (after every cell; a re-run with the same run name and
suite resumes), ``results.md`` (one table, the misses) and ``autogrid.png``.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..results import (
    ResumableRows,
    machine_facts,
    save_figure,
    torch_threads,
    write_json,
    write_text,
)

__all__ = ["AUTO_SUITES", "AutoSuite", "make_pattern", "run_auto_suite"]

PATTERNS = ("window", "longformer", "bigbird", "strided", "fixed")
ENGINES = ("auto", "dense", "block", "gather", "rows")


@dataclasses.dataclass(frozen=True)
class AutoSuite:
    """One grid: lengths × batch sizes × patterns (× head dims), every engine per cell."""

    name: str
    ns: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
    batches: tuple[int, ...] = (1, 4, 32)
    patterns: tuple[str, ...] = PATTERNS
    engines: tuple[str, ...] = ENGINES
    heads: int = 4
    d: int = 16
    #: extra (n, B) cells measured at head dim ``wide_d`` too (the grid itself is at ``d``)
    wide_cells: tuple[tuple[int, int], ...] = ((256, 32), (1024, 4), (4096, 1))
    wide_d: int = 64
    repeats: int = 15
    min_repeats: int = 3
    cell_budget_s: float = 6.0
    threads: int = 1
    max_tokens: int = 32768
    dense_mem_gb: float = 2.0
    slow_factor: float = 3.0
    slow_min_ms: float = 5.0
    goal: float = 1.3


AUTO_SUITES = {
    "auto": AutoSuite("auto"),
    "auto-quick": AutoSuite(
        "auto-quick",
        ns=(64, 256, 1024),
        batches=(1, 32),
        patterns=("window", "strided"),
        wide_cells=(),
        repeats=9,
        min_repeats=3,
        cell_budget_s=1.0,
        max_tokens=8192,
    ),
}


def _pow2(x: float) -> int:
    return 1 << max(0, round(math.log2(x)))


def make_pattern(name: str, n: int):
    """The grid's pattern ``name`` sized for length n (see the module's docstring)."""
    import sparseattn as sa

    w = min(512, max(16, n // 8))
    s = max(8, _pow2(math.sqrt(n)))  # Child et al.'s stride ≈ √n
    return {
        "window": lambda: sa.window(w),
        "longformer": lambda: sa.longformer(w, max(1, w // 32)),
        "bigbird": lambda: sa.bigbird(w, max(1, w // 32), random_blocks=1, block=max(2, w // 8)),
        "strided": lambda: sa.strided(s),
        "fixed": lambda: sa.fixed(s),
    }[name]()


def _cells(suite: AutoSuite) -> list[tuple[int, int, int]]:
    """(n, B, d) of every cell, the grid at ``d`` and then the ``wide_cells`` at ``wide_d``."""
    grid = [(n, b, suite.d) for b in suite.batches for n in suite.ns]
    return grid + [(n, b, suite.wide_d) for n, b in suite.wide_cells]


def run_auto_suite(
    suite: AutoSuite,
    out_dir: Path,
    log: Callable[[str], None] = print,
    ns: tuple[int, ...] | None = None,
    patterns: tuple[str, ...] | None = None,
) -> dict:
    """Run ``suite`` (optionally only lengths ``ns`` / ``patterns``) into ``out_dir``."""
    if ns or patterns:
        suite = dataclasses.replace(
            suite,
            ns=tuple(ns or suite.ns),
            patterns=tuple(patterns or suite.patterns),
            wide_cells=tuple(c for c in suite.wide_cells if not ns or c[0] in ns),
        )
    unknown = [p for p in suite.patterns if p not in PATTERNS]
    if unknown:
        raise ValueError(f"patterns must be among {list(PATTERNS)}, got {unknown}")
    out_dir.mkdir(parents=True, exist_ok=True)
    with torch_threads(suite.threads):
        header = {
            "suite": dataclasses.asdict(suite),
            "machine": machine_facts(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        rec = ResumableRows(out_dir / "results.json", header)
        log(f"machine: {header['machine']}")
        slow: dict[tuple, int] = {}  # (pattern, B, d, engine) -> n where it was too slow
        for pattern in suite.patterns:
            for n, bsz, d in _cells(suite):
                _cell(suite, pattern, n, bsz, d, rec, log, slow)
    rec.data["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    rec.data["load_end"] = machine_facts()["load_average"]
    write_json(out_dir / "results.json", rec.data)
    write_text(out_dir / "results.md", markdown(rec.data))
    _plot(rec.data, out_dir / "autogrid.png")
    return rec.data


def _cell(suite, pattern_name, n, bsz, d, rec, log, slow) -> None:
    """Time every engine on one (pattern, n, B, d) cell, round-robin; add one row."""
    import sparseattn as sa
    from sparseattn.attention import choose_engine, resolve_graph
    from sparseattn.engines.layout import choose_block, count_pairs

    key = {"pattern": pattern_name, "n": n, "batch": bsz, "d": d}
    done = rec.find(**key)
    if done is not None:
        _remember_slow(suite, done, slow)
        return
    row = {**key, "heads": suite.heads}
    if bsz * n > suite.max_tokens:
        rec.add({**row, "skipped": f"B·n = {bsz * n} > {suite.max_tokens} tokens (cell cap)"})
        return
    pattern = make_pattern(pattern_name, n)
    gen = torch.Generator().manual_seed(n * 1000 + bsz)
    shape = (bsz, suite.heads, n, d)
    q, k, v = (torch.randn(shape, generator=gen).requires_grad_() for _ in range(3))
    graph = resolve_graph(pattern, q, k)
    rho = sa.maps.softmax()
    b = choose_block(graph)
    pairs = count_pairs(graph, b)
    row.update(
        pattern_repr=repr(pattern),
        edges=int(graph.col.numel()),
        block=b,
        block_work=pairs * b * b,
        fill=graph.col.numel() / (pairs * b * b),
        picked=choose_engine(graph, q, k, rho),
    )

    def call(engine: str) -> Callable[[], None]:
        def run() -> None:
            for t in (q, k, v):
                t.grad = None
            sa.sparse_attention(q, k, v, pattern, engine=engine).sum().backward()

        return run

    skipped, calls = {}, {}
    dense_gb = bsz * suite.heads * n * n * 4 / 2**30
    for engine in suite.engines:
        too_slow = slow.get((pattern_name, bsz, d, engine))
        if engine == "dense" and dense_gb > suite.dense_mem_gb:
            skipped[engine] = f"fp32 scores {dense_gb:.1f} GiB > {suite.dense_mem_gb:g} GiB"
        elif engine != "auto" and too_slow is not None:
            skipped[engine] = f"> {suite.slow_factor:g}× the fastest at n = {too_slow}"
        else:
            calls[engine] = call(engine)
    warm = {}
    for engine, fn in calls.items():  # warm-up: graph, plans, caches
        start = time.process_time()
        fn()
        warm[engine] = time.process_time() - start
    rounds = int(suite.cell_budget_s / max(1e-9, sum(warm.values())))
    rounds = max(suite.min_repeats, min(suite.repeats, rounds))
    times: dict[str, list[float]] = {e: [] for e in calls}
    shuffle = random.Random(n * 1000 + bsz * 10 + d).shuffle
    for _ in range(rounds):
        order = list(calls)
        shuffle(order)  # a new order each round: no engine always follows the same one
        for engine in order:
            start = time.process_time()
            calls[engine]()
            times[engine].append(time.process_time() - start)
    ms = {e: round(statistics.median(t) * 1e3, 3) for e, t in times.items()}
    others = {e: t for e, t in ms.items() if e != "auto"}
    fastest = min(others, key=others.get)
    row.update(
        ms=ms,
        range_ms={e: [round(min(t) * 1e3, 2), round(max(t) * 1e3, 2)] for e, t in times.items()},
        warmup_ms={e: round(w * 1e3, 2) for e, w in warm.items()},
        skipped=skipped,
        rounds=rounds,
        fastest=fastest,
        ratio=ms["auto"] / others[fastest],
        # None where auto's pick was not timed on its own (skipped as too slow)
        picked_ratio=others[row["picked"]] / others[fastest] if row["picked"] in others else None,
        load=machine_facts()["load_average"],
    )
    rec.add(row)
    _remember_slow(suite, row, slow)
    shown = "  ".join(f"{e} {t:8.1f}" for e, t in ms.items())
    miss = "  MISS" if row["ratio"] > suite.goal else ""
    log(
        f"{pattern_name:10s} n={n:5d} B={bsz:2d} d={d:2d} picked {row['picked']:6s} {shown}  "
        f"fastest {fastest} auto/fastest {row['ratio']:.2f}{miss}"
    )


#: Engines whose cost grows as n² at a fixed batch (the others grow as the graph's edges).
QUADRATIC = ("dense", "rows")


def _remember_slow(suite, row: dict, slow: dict) -> None:
    """Note the engines of a timed row that cannot catch up with its fastest at longer n."""
    if "ms" not in row:
        return
    best = row["ms"][row["fastest"]]
    if best < suite.slow_min_ms:
        return
    for engine, t in row["ms"].items():
        grows_slower = row["fastest"] in QUADRATIC and engine not in QUADRATIC
        if engine != "auto" and t > suite.slow_factor * best and not grows_slower:
            slow.setdefault((row["pattern"], row["batch"], row["d"], engine), row["n"])


# ----------------------------------------------------------------------------- reporting
def measured(data: dict) -> list[dict]:
    """The rows of cells that were timed."""
    return [r for r in data["rows"] if "ms" in r]


def misses(data: dict) -> list[dict]:
    """Timed cells where auto took more than ``goal`` × the fastest engine."""
    return [r for r in measured(data) if r["ratio"] > data["suite"]["goal"]]


def markdown(data: dict) -> str:
    """The results as markdown: one table of every timed cell, then the misses alone."""
    m, suite = data["machine"], data["suite"]
    engines = [e for e in suite["engines"] if e != "auto"]
    rows = measured(data)
    header = [
        "| pattern | n | B | d | picked | auto | "
        + " | ".join(engines)
        + " | fastest | picked / fastest | ratio |",
        "|" + "---|" * (8 + len(engines)),
    ]
    lines = [
        f"# sparseattn bench {suite['name']} — `auto` against every engine",
        "",
        f"{m['cpu']} ({', '.join(m['vector_extensions'])}; torch CPU capability "
        f"{m['torch_cpu_capability']}), {m['torch_threads']} torch thread(s), torch "
        f"{m['torch']}; load average {_load(m['load_average'])} at the start, "
        f"{_load(data.get('load_end'))} at the end; {data.get('started')} to "
        f"{data.get('finished')}.",
        "",
        f"Forward + backward of `sparse_attention(q, k, v, pattern, engine=e)`, softmax, fp32, "
        f"(B, H, n, d) with H = {suite['heads']}; medians of process CPU time in ms over "
        f"{suite['min_repeats']}–{suite['repeats']} round-robin rounds after a warm-up call. "
        f"picked: the engine auto chose; picked / fastest: that engine's own median over the "
        f"fastest (auto's choice without its own timing noise); ratio: auto / fastest, "
        f"**bold** above {suite['goal']}; "
        f"—: not run (dense: fp32 scores over {suite['dense_mem_gb']:g} GiB; others: more than "
        f"{suite['slow_factor']:g}× the fastest at a shorter length).",
        "",
        f"{len(rows)} cells timed, {len(misses(data))} misses.",
        "",
        *header,
        *(_row(r, engines, suite["goal"]) for r in rows),
        "",
        "## Misses",
        "",
        *(header + [_row(r, engines, suite["goal"]) for r in misses(data)] or ["none"]),
    ]
    skipped = [r for r in data["rows"] if isinstance(r.get("skipped"), str)]
    if skipped:
        cells = ", ".join(f"{r['pattern']} n={r['n']} B={r['batch']}" for r in skipped)
        lines += ["", f"Not run (B·n over {suite['max_tokens']} tokens): {cells}."]
    return "\n".join(lines) + "\n"


def _load(load) -> str:
    return "—" if not load else " / ".join(f"{x:.1f}" for x in load)


def _row(r: dict, engines: list[str], goal: float) -> str:
    times = " | ".join(f"{r['ms'][e]:.1f}" if e in r["ms"] else "—" for e in engines)
    ratio = f"{r['ratio']:.2f}" if r["ratio"] <= goal else f"**{r['ratio']:.2f}**"
    picked = "—" if r.get("picked_ratio") is None else f"{r['picked_ratio']:.2f}"
    return (
        f"| {r['pattern']} | {r['n']} | {r['batch']} | {r['d']} | {r['picked']} | "
        f"{r['ms']['auto']:.1f} | {times} | {r['fastest']} | {picked} | {ratio} |"
    )


def _plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suite = data["suite"]
    batches = suite["batches"]
    fig, axes = plt.subplots(1, len(batches), figsize=(4.5 * len(batches), 3.8), squeeze=False)
    for ax, bsz in zip(axes[0], batches, strict=True):
        for pattern in suite["patterns"]:
            pts = [
                (r["n"], r["ratio"])
                for r in measured(data)
                if r["pattern"] == pattern and r["batch"] == bsz and r["d"] == suite["d"]
            ]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=pattern)
        ax.axhline(suite["goal"], color="red", lw=0.8, ls="--")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"B = {bsz}, H = {suite['heads']}, d = {suite['d']}")
        ax.set_xlabel("n")
        ax.set_ylabel("auto / fastest (fwd+bwd)")
        ax.legend(fontsize=7)
    save_figure(fig, path)
