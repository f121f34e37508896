"""Sparsefinder (Treviso et al. 2022) on an entmax MiniLM: predict the attention graph, measure
recall against sparsity, and attend exactly on the predicted graph.

Pipeline (each step writes JSON under ``<out_dir>/<run>/``, atomically; finished steps are skipped
when the run is repeated with the same config):

1. ``teacher.json`` — the 1.5-entmax MiniLM teacher (:mod:`.sparsefinder_teacher`, cached
   separately and reused) and its fidelity to the original softmax model before / after adaptation.
2. gold graphs (§4.1) of every layer and head on train and test passages, through hooks
   (recomputed when needed: one forward pass per batch) → ``gold.json`` (gold sparsity).
3. ``fits.pt`` / ``fits.json`` — per layer: the q/k projections (eq. 7, r = 4, Adam lr 0.01, one
   epoch), k-means centroids for every B, Routing centroids, and the chunked (§6.1) projections
   and centroids.
4. ``sweep.json`` — recall (eq. 4), sparsity (eq. 5) and exact-query share of every method over
   its knob grid × window sizes, on the test passages, averaged over layers and heads.
5. ``downstream.json`` — the teacher with predicted graphs plugged into every layer (exact entmax
   on Ĝ, Proposition 1): embedding cosine to the full-entmax teacher and retrieval accuracy.
6. ``padding.json`` — the test passages in padded batches: for a few predictors, the real × real
   entries of Ĝ that differ from the unpadded sequence's graph without and with the key padding
   mask (issue 16 item 8), and the recall of each.
7. ``timing.json`` — prediction + attention on Ĝ vs full entmax attention (one batched call), at
   the teacher's length and at n = 1024, 2048, 4096 (test tokens of one layer concatenated);
   measured again when the timing settings change.
8. ``summary.json``, ``table.md``, ``sparsity_recall.png``, ``sparsity_downstream.png``.

Run: ``sparseattn sparsefinder`` (``--quick`` for a ~2 minute smoke version).

One file per experiment (nanoGPT's rule): the pipeline's steps in order; the teacher, the
downstream run and the fits shared with the decoder run live in the sparsefinder_* modules.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from ... import hf
from ...fastmaps import entmax15_rows
from ...hf.graphs import extract_graphs
from ...maps import entmax
from ...methods.sparsefinder.evaluate import pareto_frontier
from ...methods.sparsefinder.extract import LayerGraphs, token_batches
from ...methods.sparsefinder.pattern import PredictedPattern
from ...methods.sparsefinder.predictors import (
    FixedParts,
)
from ...patterns import dense
from .. import fidelity
from ..corpus import load_corpus
from ..progress import tqdm
from ..results import (
    atomic_write,
    machine_facts,
    read_json,
    save_figure,
    write_json,
)
from .registry import Experiment, SummaryTable, figures_in
from .runner import run_name_digest
from .sparsefinder_downstream import downstream, embed
from .sparsefinder_pipeline import (
    COLORS,
    KNOB_GRIDS,
    METHODS,
    FittedPredictors,
    fit_layers,
    fitted_layers,
    gold_record,
    open_run,
    plot_recall,
    summarise_sweeps,
    sweep_methods,
    threaded,
)
from .sparsefinder_teacher import TeacherConfig, load_teacher, teacher_folder

__all__ = ["EXPERIMENT", "METHODS", "SparsefinderConfig", "quick_config", "run", "summary_tables"]

#: Config fields of the timing step (kept out of the run identity).
TIMING_FIELDS = ("timing_lengths", "timing_layer", "timing_methods", "timing_repeats")
#: Sparsity levels at which the table also reads every method's frontier.
COMMON_SPARSITY = (0.9, 0.8)


@dataclass(frozen=True)
class SparsefinderConfig:
    """Fields above ``run`` define the results (a run with an equal identity resumes)."""

    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    train_passages: int | None = None  # None: the whole train split
    test_passages: int | None = None  # None: the whole test split
    batch_size: int = 8
    # projections (§4.2, table 5)
    r: int = 4
    margin: float = 1.0
    lr: float = 0.01
    epochs: int = 1
    batch_pairs: int = 2048  # triplets per head and Adam step
    max_pairs: int | None = None  # triplets per head and epoch (None: every gold edge)
    # train eq. 7 on the edges outside the fixed parts (window ``train_window``, first and last
    # token), which §4.7 adds anyway; "sf_distance_all_edges" keeps the paper's recipe
    train_window: int | None = 1
    # fixed parts (§4.7): windows |i − j| ≤ w added to every method except the window baseline
    windows: tuple[int, ...] = (0, 1, 3)
    last_token: bool = True  # the last token ([SEP]) is global too, beside the first ([CLS])
    # knob grids (appendix C.2, trimmed / adapted to n ≈ 120)
    window_grid: tuple[int, ...] = (0, 1, 2, 3, 4, 5, 7, 9, 11, 15, 20, 25, 30, 40, 50, 63)
    thresholds: tuple[float, ...] = (0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0)
    bins: tuple[int, ...] = (2, 4, 8, 16)
    clusters: tuple[int, ...] = (2, 4, 6, 8, 12, 16, 20)
    bigbird_blocks: tuple[int, ...] = (2, 4, 8, 12, 16, 24, 32, 48)
    longformer_tokens: tuple[int, ...] = (2, 4, 8, 12, 16, 20, 32)
    strides: tuple[int, ...] = (2, 3, 4, 6, 8, 12, 16, 24)
    lsh_buckets: tuple[int, ...] = (2, 4, 8, 16, 32, 64, 100)
    routing_clusters: tuple[int, ...] = (2, 4, 6, 8, 10, 16)
    chunk_block: int = 4
    chunk_top: tuple[int, ...] = (1, 2, 4, 8)
    chunk_clusters: int = 4
    # downstream: these methods at these knob values, with window ``downstream_window``
    downstream_window: int = 1
    downstream_knobs: tuple[tuple[str, tuple[float, ...]], ...] = (
        ("window", (1, 3, 7)),
        ("bigbird", (4, 16)),
        ("reformer", (8, 32)),
        ("reformer_separate", (8,)),
        ("routing", (2, 4)),
        ("sf_distance", (1.0, 1.5, 2.0)),
        ("sf_kmeans", (4, 8, 16)),
    )
    # padding (issue 16 item 8): these (method, knob) pairs on padded test batches, window
    # ``downstream_window``: the graph on real tokens with and without the key padding mask
    padding_knobs: tuple[tuple[str, float], ...] = (
        ("sf_quantization", 4),
        ("routing", 4),
        ("sf_kmeans", 8),
        ("reformer", 8),
        ("sf_distance", 1.5),
        ("sf_chunked_v1", 2),
    )
    # timing (not part of the run's identity: timing.json records its own settings and is
    # measured again when they change)
    timing_lengths: tuple[int, ...] = (0, 1024, 2048, 4096)  # 0: the teacher's length
    timing_layer: int = 2
    timing_methods: tuple[str, ...] = ("sf_kmeans", "sf_distance")
    timing_repeats: int = 3
    seed: int = 0
    run: str | None = None
    out_dir: str = "results/sparsefinder"
    threads: int = 1
    progress: bool = True

    def identity(self) -> dict:
        d = asdict(self)
        for key in ("run", "out_dir", "threads", "progress", *TIMING_FIELDS):
            d.pop(key)
        return json.loads(json.dumps(d))  # tuples → lists

    def timing_settings(self) -> dict:
        """The fields that define ``timing.json`` (JSON-normalised)."""
        return json.loads(json.dumps({key: getattr(self, key) for key in TIMING_FIELDS}))

    def run_name(self) -> str:
        if self.run:
            return self.run
        return f"minilm-{run_name_digest(self.identity())}"

    def grid(self, method: str) -> tuple[float, ...]:
        """The knob values the sweep tries for ``method``."""
        return getattr(self, KNOB_GRIDS[method])

    def validate(self) -> SparsefinderConfig:
        if self.batch_size < 1 or self.r < 1 or self.threads < 1 or self.timing_repeats < 1:
            raise ValueError("batch_size, r, threads and timing_repeats must be >= 1")
        if any(w < 0 for w in (*self.windows, *self.window_grid)):
            raise ValueError("windows must be >= 0")
        unknown = {m for m, _ in (*self.downstream_knobs, *self.padding_knobs)} - set(METHODS)
        unknown |= set(self.timing_methods) - {"sf_kmeans", "sf_distance"}
        if unknown:
            raise ValueError(f"unknown methods {sorted(unknown)}; choose from {list(METHODS)}")
        return self


def quick_config(**overrides) -> SparsefinderConfig:
    """A ~2 minute smoke run: few passages and knobs; the cached default teacher if present."""
    teacher = TeacherConfig()
    if not (
        teacher_folder(teacher, overrides.get("out_dir", "results/sparsefinder")) / "metrics.json"
    ).exists():
        teacher = TeacherConfig(steps=8, eval_passages=16)
    base = SparsefinderConfig(
        teacher=teacher,
        train_passages=48,
        test_passages=16,
        max_pairs=20_000,
        windows=(1,),
        window_grid=(0, 1, 3, 7, 15, 31),
        thresholds=(0.5, 1.0, 2.0),
        bins=(4, 8),
        clusters=(4, 8),
        bigbird_blocks=(4, 16),
        longformer_tokens=(4, 16),
        strides=(4, 16),
        lsh_buckets=(4, 16),
        routing_clusters=(4, 8),
        chunk_top=(2, 4),
        downstream_knobs=(("window", (3,)), ("sf_kmeans", (4,))),
        padding_knobs=(("sf_quantization", 4), ("routing", 4), ("reformer", 4)),
        timing_lengths=(0, 1024),
        timing_methods=("sf_kmeans",),
        timing_repeats=1,
    )
    return replace(base, **overrides)


# --------------------------------------------------------------------------- data
@dataclass
class _Data:
    model: torch.nn.Module
    tokenizer: object
    teacher_metrics: dict
    rho: object
    train: list[LayerGraphs] | None = None
    test: list[LayerGraphs] | None = None


def _passages(config: SparsefinderConfig):
    corpus = load_corpus(config.teacher.words_per_passage)
    train = list(corpus.train[: config.train_passages])
    test = list(corpus.test[: config.test_passages])
    return train, test


def _extract(data: _Data, config: SparsefinderConfig, bar) -> None:
    train, test = _passages(config)
    hf.sparsify(data.model, dense(), data.rho, engine="dense")
    try:
        for name, passages in (("train", train), ("test", test)):
            bar.set_postfix_str(f"gold graphs ({name})")
            batches = token_batches(
                data.tokenizer,
                [p.text for p in passages],
                config.batch_size,
                config.teacher.max_length,
            )
            setattr(data, name, extract_graphs(data.model, batches))
    finally:
        hf.restore(data.model)


# --------------------------------------------------------------------------- fitting
# --------------------------------------------------------------------------- steps
def _downstream_sets(data: _Data, config: SparsefinderConfig):
    _, test = _passages(config)
    size, length = config.batch_size, config.teacher.max_length
    halves = [p.halves() for p in test]
    return {
        "passages": token_batches(data.tokenizer, [p.text for p in test], size, length),
        "first": token_batches(data.tokenizer, [a for a, _ in halves], size, length),
        "second": token_batches(data.tokenizer, [b for _, b in halves], size, length),
    }


def _teacher_reference(data: _Data, sets: dict) -> dict:
    hf.sparsify(data.model, dense(), data.rho, engine="dense")
    try:
        return {name: embed(data.model, batches) for name, batches in sets.items()}
    finally:
        hf.restore(data.model)


def _full_entmax(q, k, v, scale: float):
    """Full 1.5-entmax attention, the baseline: one batched call over every batch item and head,
    q, k, v (B, H, n, d) → (B, H, n, d); (B, H, n, n) scores in memory."""
    return entmax15_rows((q @ k.transpose(-1, -2)) * scale) @ v


def _full_entmax_per_head(q, k, v, scale: float):
    """The same, one head at a time (the loop the first timing table compared against)."""
    out = torch.empty(*q.shape[:-1], v.shape[-1])
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            out[b, h] = entmax15_rows((q[b, h] @ k[b, h].T) * scale) @ v[b, h]
    return out


def _median_time(fn: Callable[[], object], repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def _closest_knob(points: list[dict], window: int, target: float, grid) -> float:
    """The knob whose sweep point (at this window) has sparsity closest to ``target``."""
    rows = [p for p in points if p["window"] == window and p["knob"] in grid]
    return min(rows, key=lambda p: abs(p["sparsity"] - target))["knob"]


@torch.no_grad()
def _timing(
    data: _Data,
    fitted: FittedPredictors,
    config: SparsefinderConfig,
    sweep_points: dict,
    gold_sparsity: float,
    bar,
) -> dict:
    from ...attention import sparse_attention

    load_before = os.getloadavg()
    layer = data.test[min(config.timing_layer, len(data.test) - 1)]
    q_all, k_all = layer.tokens()  # (H, N, d)
    scale = q_all.shape[-1] ** -0.5
    rows = []
    for n in config.timing_lengths:
        if n == 0:
            batch = max(layer.batches, key=lambda b: b.n)
            q, k = batch.q, batch.k
        else:
            if n > q_all.shape[1]:
                raise ValueError(f"timing length {n} exceeds the {q_all.shape[1]} test tokens")
            q, k = q_all[None, :, :n].contiguous(), k_all[None, :, :n].contiguous()
        v = k.clone()  # values do not change the cost; the layer's own are not extracted
        bar.set_postfix_str(f"timing full entmax, n={q.shape[-2]}")
        t_full, full = _median_time(
            lambda q=q, k=k, v=v: _full_entmax(q, k, v, scale), config.timing_repeats
        )
        t_loop, _ = _median_time(
            lambda q=q, k=k, v=v: _full_entmax_per_head(q, k, v, scale), config.timing_repeats
        )
        gold = None
        if n != 0:  # the gold graph of the synthetic sequence, for recall there
            gold = torch.stack(
                [entmax15_rows((q[0, h] @ k[0, h].T) * scale) > 0 for h in range(q.shape[1])]
            )[None]
        else:
            gold = batch.gold
        for method in config.timing_methods:
            knob = _closest_knob(
                sweep_points[method], config.downstream_window, gold_sparsity, config.grid(method)
            )
            pattern = PredictedPattern(
                fitted.make(method, knob)(layer.layer),
                FixedParts(config.downstream_window, True, config.last_token),
            )
            bar.set_postfix_str(f"timing {method}, n={q.shape[-2]}")
            t_pred, graph = _median_time(
                lambda p=pattern, q=q, k=k: p.build(q, k), config.timing_repeats
            )
            t_att, out = _median_time(
                lambda g=graph, q=q, k=k, v=v: sparse_attention(
                    q, k, v, g, prob_map=data.rho, engine="gather", scale=scale
                ),
                config.timing_repeats,
            )
            dense_graph = graph.to_dense()
            hit = (dense_graph & gold).sum().double() / gold.sum().double()
            covered = ~(gold & ~dense_graph).any(-1)
            rows.append(
                {
                    "n": q.shape[-2],
                    "batch": q.shape[0],
                    "heads": q.shape[1],
                    "method": method,
                    "knob": knob,
                    "window": config.downstream_window,
                    "full_entmax_seconds": t_full,
                    "full_entmax_per_head_loop_seconds": t_loop,
                    "predict_seconds": t_pred,
                    "attention_seconds": t_att,
                    "total_seconds": t_pred + t_att,
                    "ratio_total_to_full": (t_pred + t_att) / t_full,
                    "sparsity": float(1 - dense_graph.sum() / dense_graph.numel()),
                    "gold_sparsity": float(1 - gold.sum() / gold.numel()),
                    "recall": float(hit),
                    "exact_queries": float(covered.double().mean()),
                    "max_abs_diff_exact_rows": float((out - full).abs().amax(-1)[covered].max())
                    if bool(covered.any())
                    else None,
                }
            )
    return {
        "layer": layer.layer,
        "rows": rows,
        "machine": machine_facts(),
        "load_average_before": load_before,
        "settings": config.timing_settings(),
        "note": "median of timing_repeats runs; full entmax: one batched call over all "
        "heads; torch threads as in machine; load averages: 1, 5, 15 min",
    }


PADDING_COUNTS = (
    "sequences",
    "padded_sequences",
    "pairs",
    "gold",
    "hit_alone",
    "changed_without_mask",
    "hit_without_mask",
    "changed_with_mask",
    "hit_with_mask",
)


def _padded_batches(tokenizer, texts: list[str], size: int, length: int) -> list[dict]:
    """The texts in corpus order, ``size`` per batch, padded to the batch's longest (right
    padding, as a tokenizer pads for a user) — unlike ``token_batches``, which cuts instead."""
    out = []
    for start in range(0, len(texts), size):
        enc = tokenizer(
            texts[start : start + size],
            padding=True,
            truncation=True,
            max_length=length,
            return_tensors="pt",
        )
        out.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    return out


def _padding_tally(pattern: PredictedPattern, batch, counts: dict) -> None:
    """Add one padded batch to ``counts``: per sequence, its real × real block of the graph
    built without and with the key padding mask against the graph of the sequence alone."""
    blind = pattern.build(batch.q, batch.k).to_dense()
    seen = pattern.build(batch.q, batch.k, key_padding_mask=~batch.valid).to_dense()
    for b, length in enumerate(batch.lengths.tolist()):
        alone = pattern.build(
            batch.q[b : b + 1, :, :length], batch.k[b : b + 1, :, :length]
        ).to_dense()[0]
        gold = batch.gold[b, :, :length, :length]
        counts["sequences"] += 1
        counts["padded_sequences"] += int(length < batch.n)
        counts["pairs"] += alone.numel()
        counts["gold"] += int(gold.sum())
        counts["hit_alone"] += int((alone & gold).sum())
        for name, graph in (("without_mask", blind), ("with_mask", seen)):
            real = graph[b, :, :length, :length]
            counts[f"changed_{name}"] += int((real != alone).sum())
            counts[f"hit_{name}"] += int((real & gold).sum())


@torch.no_grad()
def _padding_check(data: _Data, fitted: FittedPredictors, config: SparsefinderConfig, bar) -> dict:
    """Issue 16 item 8 on the teacher: test passages in padded batches; for each (method, knob)
    of ``padding_knobs`` (window ``downstream_window`` + [CLS] + [SEP]) the real × real entries
    that differ from the unpadded sequence's graph, without and with the key padding mask, and
    the pooled recall of each (every layer and head; q, k of the real tokens are the padded
    batch's, so only the predictor's treatment of padding differs)."""
    _, test = _passages(config)
    bar.set_postfix_str("padding: gold graphs of padded batches")
    batches = _padded_batches(
        data.tokenizer, [p.text for p in test], config.batch_size, config.teacher.max_length
    )
    hf.sparsify(data.model, dense(), data.rho, engine="dense")
    try:
        layers = extract_graphs(data.model, batches)
    finally:
        hf.restore(data.model)
    fixed = FixedParts(config.downstream_window, True, config.last_token)
    rows = []
    for method, knob in config.padding_knobs:
        bar.set_postfix_str(f"padding {method}={knob}")
        make = fitted.make(method, knob)
        counts = dict.fromkeys(PADDING_COUNTS, 0)
        for layer in layers:
            pattern = PredictedPattern(make(layer.layer), fixed)
            for batch in layer.batches:
                _padding_tally(pattern, batch, counts)
        counts["sequences"] //= len(layers)
        counts["padded_sequences"] //= len(layers)
        rows.append(
            {
                "method": method,
                "knob": knob,
                "window": config.downstream_window,
                **counts,
                **{
                    f"recall_{name}": counts[f"hit_{name}"] / max(counts["gold"], 1)
                    for name in ("alone", "without_mask", "with_mask")
                },
            }
        )
    return {
        "rows": rows,
        "batches": len(batches),
        "layers": len(layers),
        "note": "pairs, gold and hits summed over layers, heads and real × real pairs; "
        "recall pooled (hits / gold edges)",
    }


# --------------------------------------------------------------------------- summary + plots
def _table_md(
    summary: dict, teacher: dict, timing: dict | None, padding: dict | None = None
) -> str:
    s = summary["gold_sparsity"]
    lines = []
    for when in ("before", "after"):
        t = teacher[when]
        lines.append(
            f"Teacher {when} adaptation, vs the softmax model: embedding cosine "
            f"{t['embedding_cosine_mean']:.4f} (min {t['embedding_cosine_min']:.4f}), "
            f"retrieval {t['retrieval_accuracy']:.3f} (softmax "
            f"{t['reference_retrieval_accuracy']:.3f}), zero weights "
            f"{t['weight_sparsity']:.3f}"
        )
    lines += [
        "",
        f"Gold sparsity of the teacher (test passages): {s:.4f}",
        "",
        "| method | recall at gold sparsity (frontier) | best recall, sparsity ≥ gold | "
        "sparsest setting (sparsity, recall) | "
        + " | ".join(f"recall at {s}" for s in COMMON_SPARSITY)
        + " | window frontier points dominated | recall gap vs window (min / mean) |",
        "|---|---|---|---|" + "---|" * len(COMMON_SPARSITY) + "---|---|",
    ]

    def fmt(x):
        return "—" if x is None else f"{x:.3f}"

    for row in summary["methods"].values():
        vs = row.get("vs_window", {})
        dom = fmt(vs.get("dominated_base_points")) if vs else "—"
        gap = f"{fmt(vs.get('gap_min'))} / {fmt(vs.get('gap_mean'))}" if vs else "—"
        sp = row["sparsest"]
        at = " | ".join(fmt(row["recall_at_sparsity"][str(s)]) for s in COMMON_SPARSITY)
        lines.append(
            f"| {row['label']} | {fmt(row['recall_at_gold_sparsity'])} | "
            f"{fmt(row['best_recall_with_sparsity_at_least_gold'])} | "
            f"{sp['sparsity']:.3f}, {sp['recall']:.3f} | {at} | {dom} | {gap} |"
        )
    if timing and timing["rows"]:
        lines += [
            "",
            f"Timing, load average before {timing.get('load_average_before')}, "
            f"after {timing['machine'].get('load_average')}",
            "",
            "| n | method | knob | sparsity | recall | full entmax s (batched) | "
            "per-head loop s | predict s | attention s | ratio to batched |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in timing["rows"]:
            loop = r.get("full_entmax_per_head_loop_seconds")
            lines.append(
                f"| {r['n']} | {r['method']} | {r['knob']} | {r['sparsity']:.3f} | "
                f"{r['recall']:.3f} | {r['full_entmax_seconds']:.3f} | "
                f"{fmt(loop)} | {r['predict_seconds']:.3f}"
                f" | {r['attention_seconds']:.3f} | {r['ratio_total_to_full']:.2f} |"
            )
    if padding:
        lines += [
            "",
            "Padded batches (real × real entries that differ from the unpadded "
            "sequence's graph; pooled recall)",
            "",
            "| method | knob | padded sequences | real pairs | changed, no mask | "
            "changed, with mask | recall alone | recall, no mask | recall, with mask |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in padding["rows"]:
            lines.append(
                f"| {METHODS[r['method']][0]} | {r['knob']} | {r['padded_sequences']} of "
                f"{r['sequences']} | {r['pairs']} | {r['changed_without_mask']} | "
                f"{r['changed_with_mask']} | {r['recall_alone']:.4f} | "
                f"{r['recall_without_mask']:.4f} | {r['recall_with_mask']:.4f} |"
            )
    return "\n".join(lines) + "\n"


def _plot_downstream(rows: dict, reference: dict, gold: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    for key, ax, label in (
        ("embedding_cosine_mean", axes[0], "embedding cosine to teacher"),
        ("retrieval_accuracy", axes[1], "retrieval accuracy"),
    ):
        for method, pts in rows.items():
            color = COLORS[method]
            xy = [(p["graph_sparsity"], p[key]) for p in pts]
            front = pareto_frontier(xy)
            ax.scatter([p[0] for p in xy], [p[1] for p in xy], s=10, color=color, alpha=0.5)
            ax.plot(
                [p[0] for p in front],
                [p[1] for p in front],
                "-" if method.startswith("sf_") else "--",
                color=color,
                lw=1.3,
                label=METHODS[method][0],
            )
        ax.axvline(gold, color="k", ls=":", lw=1)
        star = 1.0 if key == "embedding_cosine_mean" else reference["retrieval_accuracy"]
        ax.plot([gold], [star], "*", color="gold", mec="k", ms=12, label="full-entmax teacher")
        if key == "retrieval_accuracy":
            ax.axhline(reference["retrieval_accuracy"], color="grey", ls="-.", lw=1)
        ax.set_xlabel("graph sparsity used (real tokens)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=6.5, loc="lower left")
    fig.suptitle(
        "Sparsity–downstream: exact entmax on the predicted graph (test passages)", fontsize=9
    )
    fig.tight_layout()
    save_figure(fig, path, dpi=80)


# --------------------------------------------------------------------------- run
def run(config: SparsefinderConfig) -> dict:
    """Run (or resume) the whole pipeline; returns the summary (with ``folder``)."""
    return threaded(config, _run)


def _run(config: SparsefinderConfig) -> dict:
    names = ("teacher", "gold", "fits", "sweep", "downstream", "timing", "padding", "summary")
    folder, paths, clock, sweeps, down = open_run(config, names)
    step = clock.step
    fits_path = folder / "fits.pt"
    down_todo = [
        (m, kn)
        for m, knobs in config.downstream_knobs
        for kn in knobs
        if str(kn) not in down["methods"].get(m, {})
    ]
    sweep_todo = [m for m in METHODS if m not in sweeps]
    timing = read_json(paths["timing"])
    if timing is not None and timing.get("settings") != config.timing_settings():
        timing = None  # measured with other timing settings: measure again
    time_it = timing is None and bool(config.timing_lengths)
    padding = read_json(paths["padding"])
    check_padding = padding is None and bool(config.padding_knobs)
    steps = 2 + len(sweep_todo) + len(down_todo) + time_it + check_padding
    with tqdm(total=steps, desc="sparsefinder", disable=not config.progress) as bar:
        bar.set_postfix_str("teacher")
        with step("teacher"):
            model, tokenizer, tmetrics = load_teacher(
                config.teacher, config.out_dir, progress=config.progress
            )
        data = _Data(model, tokenizer, tmetrics, entmax(config.teacher.alpha))
        write_json(
            paths["teacher"],
            {k: v for k, v in tmetrics.items() if k != "distill_loss"}
            | {"folder": str(teacher_folder(config.teacher, config.out_dir))},
        )
        bar.update(1)
        need_graphs = (
            bool(sweep_todo) or time_it or not paths["gold"].exists() or not fits_path.exists()
        )
        if need_graphs:
            with step("extract"):
                _extract(data, config, bar)
            gold = gold_record(
                data.test,
                data.train,
                train_batches=len(data.train[0].batches),
                train_tokens=int(sum(int(b.valid.sum()) for b in data.train[0].batches)),
                test_batches=len(data.test[0].batches),
                test_tokens=int(sum(int(b.valid.sum()) for b in data.test[0].batches)),
            )
            write_json(paths["gold"], gold)
        gold = read_json(paths["gold"])
        bar.update(1)
        fits = fitted_layers(
            fits_path, paths["fits"], lambda: fit_layers(data.train, config, bar), step
        )
        fitted = FittedPredictors(fits, config)
        sweeps = sweep_methods(
            fitted, sweep_todo, data.test, sweeps, paths["sweep"], step, bar, METHODS
        )
        if down_todo:
            sets = _downstream_sets(data, config)
            ref = _teacher_reference(data, sets)
            down["reference"] = {
                "retrieval_accuracy": fidelity.retrieval_accuracy(ref["first"], ref["second"]),
                "passages": len(ref["passages"]),
            }
            fixed = FixedParts(config.downstream_window, True, config.last_token)
            layers = model.config.num_hidden_layers
            for method, knob in down_todo:
                bar.set_postfix_str(f"downstream {method}={knob}")
                make = fitted.make(method, knob)
                parts = None if method == "window" else fixed
                if method == "window":
                    parts = FixedParts(None, True, config.last_token)
                patterns = [PredictedPattern(make(layer), parts) for layer in range(layers)]
                with step(f"downstream {method}={knob}"):
                    row = downstream(model, sets, ref, patterns, data.rho, engine="dense")
                row |= {
                    "knob": knob,
                    "window": knob if method == "window" else config.downstream_window,
                }
                down["methods"].setdefault(method, {})[str(knob)] = row
                write_json(paths["downstream"], down)
                bar.update(1)
        if check_padding:
            with step("padding"):
                padding = _padding_check(data, fitted, config, bar)
            write_json(paths["padding"], padding)
            bar.update(1)
        if time_it:
            with step("timing"):
                timing = _timing(data, fitted, config, sweeps, gold["sparsity"], bar)
            write_json(paths["timing"], timing)
            bar.update(1)
    down_rows = {m: list(v.values()) for m, v in down["methods"].items()}
    summary = summarise_sweeps(sweeps, gold, down_rows, COMMON_SPARSITY)
    summary["teacher"] = {k: tmetrics[k] for k in ("before", "after", "distill_seconds")}
    summary["downstream_reference"] = down["reference"]
    summary["padding"] = padding
    summary["steps"] = clock.steps
    summary["seconds_after_teacher"] = clock.total(skip=("teacher",))
    write_json(paths["summary"], summary)
    table = _table_md(summary, tmetrics, timing, padding)
    atomic_write(folder / "table.md", lambda tmp: Path(tmp).write_text(table))
    plot_recall(sweeps, gold["sparsity"], folder / "sparsity_recall.png")
    if down_rows:
        _plot_downstream(
            down_rows, down["reference"], gold["sparsity"], folder / "sparsity_downstream.png"
        )
    return summary | {"folder": str(folder)}


# --------------------------------------------------------------------------- the registry's view
def summary_tables(config: SparsefinderConfig, summary: dict) -> list[SummaryTable]:
    """What ``sparseattn sparsefinder`` prints and the tour shows: per method, the recall at
    the gold sparsity, the best recall at a sparsity at least the gold one, and the share of
    the window baseline's frontier points it dominates (``table.md`` has every column)."""

    def fmt(x):
        return "—" if x is None else f"{x:.3f}"

    rows = []
    for row in summary["methods"].values():
        vs = row.get("vs_window", {})
        rows.append(
            (
                row["label"],
                fmt(row["recall_at_gold_sparsity"]),
                fmt(row["best_recall_with_sparsity_at_least_gold"]),
                fmt(vs.get("dominated_base_points")),
            )
        )
    header = (
        "method",
        "recall at gold sparsity",
        "best recall, sparsity ≥ gold",
        "window points dominated",
    )
    title = f"Sparsefinder on the entmax MiniLM (gold sparsity {summary['gold_sparsity']:.3f})"
    return [SummaryTable(title, header, rows)]


EXPERIMENT = Experiment(
    name="sparsefinder",
    config=SparsefinderConfig,
    quick=quick_config,
    run=run,
    summary=summary_tables,
    figures=lambda config, summary: figures_in(
        summary["folder"], "sparsity_recall.png", "sparsity_downstream.png"
    ),
    wrote="wrote {folder}: summary.json, table.md, sweep.json, downstream.json, timing.json, "
    "sparsity_recall.png, sparsity_downstream.png",
)
