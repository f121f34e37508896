"""Sparsefinder on a decoder (Treviso et al. 2022 §5: decoder self-attention), small.

The paper fine-tunes a 6-layer, 16-head translation Transformer with 1.5-entmax in every head,
extracts the gold graphs of the *decoder self-attention* (causal: keys j ≤ i), fits the
projections (eq. 7) and predictors on 10K training sentences, and plots recall (eq. 4) against
sparsity (eq. 5, denominator n(n + 1)/2, footnote 2) and BLEU against sparsity (Fig. 2). Here the
same pipeline runs on the byte-level language model of :mod:`sparseattn.lab.experiments.lm` trained
with 1.5-entmax attention (``LMConfig(prob_map="entmax15")``, dense causal), the teacher:

1. ``teacher.json`` — the teacher is a cell of ``sparseattn lm`` (``dense-s<seed>`` of its run
   folder under ``results/lm``, trained there with ``save_model`` if its weights are missing);
   its validation perplexity and bits per byte beside the softmax twin's (same config and seed,
   ρ = softmax), when that cell exists.
2. ``gold.json`` — gold graphs G_h = {(i, j) : j ≤ i, p_ij > 0} of every layer and head, on
   ``train_windows`` random training windows and on the validation windows (the bytes the LM
   scores), captured with hooks on each block's q/k projection; gold sparsity (causal pairs).
3. ``fits.pt`` / ``fits.json`` — per layer the projections of eq. 7 (r = 4; keys after the query
   are never negatives), k-means centroids for every B, Routing centroids
   (:func:`.sparsefinder_pipeline.fit_layers`, shared with the encoder pipeline).
4. ``sweep.json`` — recall / sparsity / exact-query share of every method over its knob grid ×
   fixed windows, on the validation windows, pairs j ≤ i only, averaged over layers and heads.
5. ``downstream.json`` — the teacher with the predicted graphs in every layer
   (``PredictedPattern(...).causal()``: Ĝ ∪ window ∪ first token ∪ diagonal, then j ≤ i) and exact
   entmax on them (Proposition 1): validation bits per byte against the full teacher's; every
   graph used is checked causal with its diagonal.
6. ``summary.json``, ``table.md``, ``sparsity_recall.png``, ``sparsity_downstream.png``.

Run: ``sparseattn sparsefinder-decoder`` (``--quick`` for a smoke run) or
``run(DecoderSparsefinderConfig())``. Resumable like the encoder pipeline: finished steps, sweep
methods and downstream points are skipped when the same config runs again.

One file per experiment (nanoGPT's rule): the decoder run's steps in order; what it shares
with the encoder run lives in sparsefinder_pipeline.py, the teacher in lm.py.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch import Tensor, nn

from ...attention import attention_weights
from ...methods.sparsefinder.evaluate import frontier_value
from ...methods.sparsefinder.extract import GraphBatch, LayerGraphs
from ...methods.sparsefinder.pattern import PredictedPattern
from ...methods.sparsefinder.predictors import FixedParts
from ...patterns import cycle, dense
from ..progress import tqdm
from ..results import (
    atomic_write,
    machine_facts,
    read_json,
    save_figure,
    write_json,
)
from . import lm
from . import sparsefinder_pipeline as pipeline
from .registry import Experiment, figures_in
from .runner import run_name_digest

__all__ = [
    "DECODER_METHODS",
    "EXPERIMENT",
    "DecoderSparsefinderConfig",
    "check_causal",
    "extract_decoder_graphs",
    "quick_config",
    "run",
]

#: The methods run on the decoder: baselines, then Sparsefinder's three variants (§4.3–4.5).
DECODER_METHODS = (
    "window",
    "bigbird",
    "longformer",
    "strided",
    "reformer",
    "reformer_separate",
    "routing",
    "sf_distance",
    "sf_quantization",
    "sf_kmeans",
)
#: Methods whose graph row i depends on the queries and keys of later positions as well:
#: quantization's balanced bins and Routing's balanced clusters rank all n tokens. They are
#: not usable while decoding token by token; their teacher-forced perplexity is an upper bound
#: of what they could do causally.
USES_LATER_TOKENS = ("sf_quantization", "routing")
#: Sparsity levels at which the table reads every method's recall frontier.
DECODER_SPARSITY = (0.95, 0.9, 0.8)


def default_teacher() -> lm.LMConfig:
    """The 1.5-entmax twin of the 4000-step dense LM of issue 15 item 5 (seed 0)."""
    return lm.LMConfig(
        prob_map="entmax15",
        steps=4000,
        columns=("dense",),
        widths=(16,),
        seeds=(0,),
        save_model=True,
    )


@dataclass(frozen=True)
class DecoderSparsefinderConfig:
    """Fields above ``run`` define the results (a run with an equal identity resumes); the
    teacher's own identity (:meth:`LMConfig.identity`) stands for it."""

    teacher: lm.LMConfig = field(default_factory=default_teacher)
    seed: int = 0  # the teacher cell dense-s<seed>; also seeds the fits and random baselines
    train_windows: int = 64  # random training windows of n bytes for the fits
    valid_windows: int | None = None  # None: every validation window (the bytes the LM scores)
    batch_size: int = 8
    # projections (§4.2, table 5)
    r: int = 4
    margin: float = 1.0
    lr: float = 0.01
    epochs: int = 1
    batch_pairs: int = 2048
    max_pairs: int | None = None
    train_window: int | None = 1  # eq. 7 trained on edges outside this window and token 0
    # fixed parts (§4.7): a causal window j ∈ [i − w, i] and the first byte (a sink) added to
    # every method but the window baseline; no last global token in a decoder
    windows: tuple[int, ...] = (0, 1, 3, 7, 15)
    last_token: bool = False
    # knob grids: the paper's MT grids (§5), extended to n = 256 where it helps
    window_grid: tuple[int, ...] = (0, 1, 2, 3, 5, 7, 11, 15, 23, 31, 47, 63, 95, 127, 191, 255)
    thresholds: tuple[float, ...] = (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0)
    bins: tuple[int, ...] = (2, 4, 6, 8, 12, 16)
    clusters: tuple[int, ...] = (2, 4, 6, 8, 10, 12, 16, 20)
    bigbird_blocks: tuple[int, ...] = (2, 4, 8, 16, 32, 64)
    longformer_tokens: tuple[int, ...] = (2, 4, 8, 16, 32, 64)
    strides: tuple[int, ...] = (2, 4, 8, 16, 32, 64)
    lsh_buckets: tuple[int, ...] = (2, 4, 8, 16, 32, 64)
    routing_clusters: tuple[int, ...] = (2, 4, 6, 8, 10, 16)
    # downstream: these methods at these knobs, each with every fixed window of
    # ``downstream_windows`` + the first byte (the window baseline: its knob is its window)
    downstream_windows: tuple[int, ...] = (1, 7)
    downstream_knobs: tuple[tuple[str, tuple[float, ...]], ...] = (
        ("window", (1, 3, 7, 15, 23, 31, 47)),
        ("bigbird", (8, 32)),
        ("longformer", (8, 32)),
        ("strided", (8,)),
        ("reformer", (8, 32)),
        ("reformer_separate", (8, 32)),
        ("routing", (4, 8)),
        ("sf_distance", (1.5, 2.0, 2.5, 3.0)),
        ("sf_quantization", (8, 16)),
        ("sf_kmeans", (4, 8, 16)),
    )
    run: str | None = None
    out_dir: str = "results/sparsefinder"
    threads: int = 1
    progress: bool = True

    def identity(self) -> dict:
        d = asdict(self)
        for key in ("run", "out_dir", "threads", "progress"):
            d.pop(key)
        d["teacher"] = self.teacher.identity()
        return json.loads(json.dumps(d))  # tuples → lists

    def run_name(self) -> str:
        if self.run:
            return self.run
        return f"decoder-{run_name_digest(self.identity())}"

    def grid(self, method: str) -> tuple[float, ...]:
        """The knob values the sweep tries for ``method``."""
        return getattr(self, pipeline.KNOB_GRIDS[method])

    def validate(self) -> DecoderSparsefinderConfig:
        """Check the fields; raises ValueError naming the field and what was expected."""
        self.teacher.validate()
        if self.teacher.prob_map == "softmax":
            raise ValueError(
                "teacher.prob_map must be sparse (e.g. 'entmax15'): a softmax "
                "teacher's gold graph is complete"
            )
        for name in ("train_windows", "batch_size", "r", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.valid_windows is not None and self.valid_windows < 1:
            raise ValueError(f"valid_windows must be >= 1 or None, got {self.valid_windows}")
        if any(w < 0 for w in (*self.windows, *self.window_grid, *self.downstream_windows)):
            raise ValueError("windows, window_grid and downstream_windows must be >= 0")
        unknown = {m for m, _ in self.downstream_knobs} - set(DECODER_METHODS)
        if unknown:
            raise ValueError(
                f"downstream_knobs name unknown methods {sorted(unknown)}; choose from "
                f"{list(DECODER_METHODS)}"
            )
        return self


def quick_config(**overrides) -> DecoderSparsefinderConfig:
    """A smoke run (seconds): a 150-step n = 64 entmax teacher (20 steps leave its attention
    almost uniform, so the gold graphs complete), few windows and knobs. The teacher is trained
    under ``<out_dir>/lm`` (``out_dir`` from the overrides)."""
    out_dir = overrides.get("out_dir", "results/sparsefinder")
    teacher = lm.quick_config(
        prob_map="entmax15",
        columns=("dense",),
        widths=(4,),
        seeds=(0,),
        steps=150,
        save_model=True,
        out_dir=str(Path(out_dir) / "lm"),
        progress=overrides.get("progress", True),
    )
    base = DecoderSparsefinderConfig(
        teacher=teacher,
        train_windows=8,
        valid_windows=6,
        batch_size=4,
        max_pairs=4000,
        windows=(1, 3),
        downstream_windows=(1,),
        window_grid=(0, 1, 3, 7, 15),
        thresholds=(1.0, 2.0),
        bins=(4,),
        clusters=(4,),
        bigbird_blocks=(4,),
        longformer_tokens=(4,),
        strides=(4,),
        lsh_buckets=(4,),
        routing_clusters=(4,),
        downstream_knobs=(("window", (3,)), ("sf_kmeans", (4,)), ("sf_distance", (2.0,))),
    )
    return replace(base, **overrides)


# --------------------------------------------------------------------------- teacher + graphs
def _teacher(config: DecoderSparsefinderConfig) -> tuple[nn.Module, dict]:
    """The trained teacher (eval mode) and its metrics; trains it (``sparseattn lm``) if its
    weights are missing."""
    cfg = replace(config.teacher, seeds=(config.seed,), columns=("dense",), save_model=True)
    if not lm.model_path(cfg, "dense", None, config.seed).exists():
        lm.run(cfg)
    model = lm.load_model(cfg, "dense", None, config.seed)
    folder = Path(cfg.out_dir) / cfg.run_name()
    cell = read_json(folder / "cells" / f"{lm.cell_name('dense', None, config.seed)}.json")
    keys = ("perplexity", "bits_per_byte", "loss", "eval_bytes", "train_seconds", "steps")
    out = {"lm_run": str(folder), "prob_map": cfg.prob_map} | {k: cell[k] for k in keys}
    twin_cfg = replace(cfg, prob_map="softmax")
    twin = read_json(
        Path(cfg.out_dir) / twin_cfg.run_name() / "cells" / f"dense-s{config.seed}.json"
    )
    out["softmax_twin"] = (
        None
        if twin is None
        else ({"lm_run": str(Path(cfg.out_dir) / twin_cfg.run_name())} | {k: twin[k] for k in keys})
    )
    return model, out


@torch.no_grad()
def extract_decoder_graphs(model: nn.Module, ids: Tensor, batch_size: int = 8) -> list[LayerGraphs]:
    """Gold causal graphs of every layer and head of an :class:`~sparseattn.lab.models.Encoder`
    run with ``dense().causal()`` (Sparsefinder §4.1).

    Args:
        model: the encoder (its blocks' ``rho`` is the teacher's map, e.g. 1.5-entmax).
        ids: LongTensor (m, n) byte windows.
        batch_size: windows per forward pass.
    Returns:
        One :class:`LayerGraphs` per block: q, k (b, H, n, d) as block l's projection produced
        them (unscaled), gold (b, H, n, n) = {p_ij > 0} with p = ρ(QKᵀ/√d on j ≤ i) — what the
        dense engine computes inside the model — and ``valid`` all True (no padding).
    """
    if ids.dim() != 2:
        raise ValueError(f"ids must have shape (m, n), got {tuple(ids.shape)}")
    kept: dict[int, list[GraphBatch]] = {}
    causal = dense().causal()
    handles = []
    for layer, block in enumerate(model.blocks):

        def hook(mod, args, out, layer=layer, block=block):
            bsz, n, _ = out.shape
            q, k, _ = out.view(bsz, n, 3, block.heads, -1).permute(2, 0, 3, 1, 4)
            probs = attention_weights(q, k, causal, prob_map=block.rho)
            gold = (probs > 0) & torch.ones(n, n, dtype=torch.bool).tril()
            valid = torch.ones(bsz, n, dtype=torch.bool)
            kept.setdefault(layer, []).append(
                GraphBatch(q.contiguous(), k.contiguous(), gold, valid)
            )

        handles.append(block.qkv.register_forward_hook(hook))
    was_training = model.training
    model.eval()
    try:
        for start in range(0, ids.shape[0], batch_size):
            model(ids[start : start + batch_size], causal)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return [LayerGraphs(layer, kept[layer]) for layer in sorted(kept)]


def _windows(config: DecoderSparsefinderConfig) -> tuple[Tensor, Tensor]:
    """(training windows (train_windows, n), validation windows (m, n + 1))."""
    n = config.teacher.n
    gen = torch.Generator().manual_seed(10_007 + config.seed)
    train = lm.train_windows(lm.byte_stream("train"), n, config.train_windows, gen)[:, :n]
    valid = lm.eval_windows(lm.byte_stream("validation"), n)
    if config.valid_windows is not None:
        valid = valid[: config.valid_windows]
    return train, valid


def check_causal(pattern: PredictedPattern, graphs: LayerGraphs, rho=None) -> dict:
    """Build ``pattern`` on every batch of ``graphs`` and count what a decoder forbids: edges
    j > i, and rows without their own key (the diagonal). Both must be 0.

    With ``rho`` (the teacher's map) also ``mass``: the teacher's attention weight that falls
    on Ĝ, Σ_{(i,j) ∈ Ĝ} p_ij summed over rows (p = ρ of the causal scores; each row sums to 1,
    so ``mass / rows`` is the mean kept share — recall weighted by attention instead of
    counting edges)."""
    future = missing = rows = 0
    mass = 0.0
    causal = dense().causal()
    for batch in graphs.batches:
        mask = pattern.build(batch.q, batch.k).to_dense()
        n = mask.shape[-1]
        future += int((mask & torch.ones(n, n, dtype=torch.bool).triu(1)).sum())
        missing += int((~mask.diagonal(dim1=-2, dim2=-1)).sum())
        rows += mask.shape[0] * mask.shape[1] * n
        if rho is not None:
            probs = attention_weights(batch.q, batch.k, causal, prob_map=rho)
            mass += float((probs * mask).sum())
    out = {"future_edges": future, "rows_without_diagonal": missing, "rows": rows}
    return out | ({"mass": mass} if rho is not None else {})


# --------------------------------------------------------------------------- steps
def _downstream_point(
    model: nn.Module,
    fitted: pipeline.FittedPredictors,
    config: DecoderSparsefinderConfig,
    method: str,
    knob: float,
    window: int,
    valid: Tensor,
    test: list[LayerGraphs],
) -> dict:
    """Bits per byte of the teacher with Ĝ of ``method`` at ``knob`` ∪ a causal ``window`` ∪
    the first byte in every layer (the window baseline: ``window`` is its knob)."""
    make = fitted.make(method, knob)
    parts = FixedParts(None if method == "window" else window, True, False)
    patterns = [PredictedPattern(make(layer), parts).causal() for layer in range(len(test))]
    rho = model.blocks[0].rho
    checks = [check_causal(p, g, rho) for p, g in zip(patterns, test, strict=True)]
    metrics = lm.evaluate(model, cycle(*patterns), valid, config.teacher)
    return metrics | {
        "knob": knob,
        "window": window,
        "future_edges": sum(c["future_edges"] for c in checks),
        "rows_without_diagonal": sum(c["rows_without_diagonal"] for c in checks),
        "rows_checked": sum(c["rows"] for c in checks),
        "attention_mass_kept": sum(c["mass"] for c in checks) / sum(c["rows"] for c in checks),
    }


def _point_key(knob: float, window: int) -> str:
    """How a downstream point is filed in ``downstream.json``: ``<knob>@w<window>``."""
    return f"{knob}@w{window}"


def _sweep_at(rows: list[dict], knob: float, window: int) -> dict | None:
    """The sweep point of a method at (knob, fixed window), if it was swept."""
    for r in rows:
        if r["knob"] == knob and r["window"] == window:
            return r
    return None


# --------------------------------------------------------------------------- report
def _fmt(x: float | None, digits: int = 3) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def table_markdown(summary: dict) -> str:
    """The decoder table: teacher, gold sparsity, recall per method at the reading points,
    and the downstream bits per byte."""
    t = summary["teacher"]
    twin = t.get("softmax_twin")
    lines = [
        f"Teacher: byte-level LM, ρ = {t['prob_map']}, {t['steps']} steps "
        f"({t['lm_run']}): validation perplexity {t['perplexity']:.3f}, "
        f"{t['bits_per_byte']:.4f} bits per byte"
        + (
            f"; softmax twin (same config and seed) {twin['perplexity']:.3f}, "
            f"{twin['bits_per_byte']:.4f} bits per byte."
            if twin
            else "; softmax twin not trained."
        ),
        "",
        f"Gold sparsity of the teacher (validation windows, causal pairs): "
        f"{summary['gold_sparsity']:.4f} (layers: "
        + ", ".join(f"{s:.4f}" for s in summary["gold_sparsity_per_layer"])
        + ")",
        "",
        "| method | recall at gold sparsity (frontier) | best recall, sparsity ≥ gold | "
        + " | ".join(f"recall at {s}" for s in DECODER_SPARSITY)
        + " | sparsest (sparsity, recall) | window frontier points dominated |",
        "|---|---|---|" + "---|" * len(DECODER_SPARSITY) + "---|---|",
    ]
    for method, row in summary["methods"].items():
        vs = row.get("vs_window", {})
        sp = row["sparsest"]
        at = " | ".join(_fmt(row["recall_at_sparsity"][str(s)]) for s in DECODER_SPARSITY)
        later = " †" if method in USES_LATER_TOKENS else ""
        lines.append(
            f"| {row['label']}{later} | {_fmt(row['recall_at_gold_sparsity'])} | "
            f"{_fmt(row['best_recall_with_sparsity_at_least_gold'])} | {at} | "
            f"{sp['sparsity']:.3f}, {sp['recall']:.3f} | "
            f"{_fmt(vs.get('dominated_base_points')) if vs else '—'} |"
        )
    ref = summary["downstream_reference"]
    if ref:
        lines += [
            "",
            f"Downstream: validation bits per byte with exact {t['prob_map']} on Ĝ in every "
            f"layer; full teacher {ref['bits_per_byte']:.4f} (perplexity "
            f"{ref['perplexity']:.3f}). Sparsity, recall, exact: the sweep's point at that "
            "knob and window (full teacher's q, k); mass: the full teacher's attention weight "
            "on Ĝ (mean over layers, heads and queries).",
            "",
            "| method | knob | window | sparsity | recall | exact queries | mass | "
            "bits per byte | Δ vs full | perplexity | future edges / rows w/o diagonal |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for method, points in summary["downstream"].items():
            later = " †" if method in USES_LATER_TOKENS else ""
            for p in points:
                lines.append(
                    f"| {pipeline.METHODS[method][0]}{later} | {p['knob']} | {p['window']} | "
                    f"{_fmt(p.get('sparsity'))} | {_fmt(p.get('recall'))} | "
                    f"{_fmt(p.get('exact'))} | {_fmt(p.get('attention_mass_kept'))} | "
                    f"{p['bits_per_byte']:.4f} | "
                    f"{p['bits_per_byte'] - ref['bits_per_byte']:+.4f} | "
                    f"{p['perplexity']:.3f} | {p['future_edges']} / "
                    f"{p['rows_without_diagonal']} |"
                )
    lines += [
        "",
        "† the graph of row i depends on later positions' q, k too (balanced bins / clusters "
        "over the whole window): not usable token by token; teacher-forced numbers.",
    ]
    return "\n".join(lines) + "\n"


def _plot_downstream(summary: dict, path: Path) -> None:
    """Bits per byte against sparsity, one line per method and fixed window (the downstream
    points): all of them (left) and the ones within 0.06 bits of the teacher (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6))
    markers = "o^sDv"
    windows = sorted(
        {p["window"] for m, ps in summary["downstream"].items() if m != "window" for p in ps}
    )
    ref = summary["downstream_reference"]["bits_per_byte"]
    gold = summary["gold_sparsity"]
    for ax in axes:
        for method, points in summary["downstream"].items():
            for g in [None] if method == "window" else windows:
                pts = sorted(
                    (p["sparsity"], p["bits_per_byte"])
                    for p in points
                    if "sparsity" in p and (g is None or p["window"] == g)
                )
                if not pts:
                    continue
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    "-" if method.startswith("sf_") else "--",
                    marker="o" if g is None else markers[windows.index(g) % len(markers)],
                    ms=3.5,
                    lw=1.1,
                    color=pipeline.COLORS[method],
                    label=pipeline.METHODS[method][0] + ("" if g is None else f", window {g}"),
                )
        ax.plot([gold], [ref], "*", color="gold", mec="k", ms=12, label="full-entmax teacher")
        ax.axvline(gold, color="k", ls=":", lw=1)
        ax.set_xlabel("sparsity of Ĝ (eq. 5, causal pairs)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("validation bits per byte (lower is better)")
    axes[0].set_title("all downstream points", fontsize=9)
    axes[1].set_ylim(ref - 0.005, ref + 0.06)
    axes[1].set_title("within 0.06 bits per byte of the teacher", fontsize=9)
    axes[0].legend(fontsize=5.5, ncol=2, loc="upper left")
    fig.suptitle("Decoder: exact 1.5-entmax on the predicted causal graph", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi=80)


# --------------------------------------------------------------------------- run
def run(config: DecoderSparsefinderConfig) -> dict:
    """Run (or resume) the decoder pipeline; returns the summary (with ``folder``)."""
    return pipeline.threaded(config, _run)


def _run(config: DecoderSparsefinderConfig) -> dict:
    load_start = os.getloadavg()
    names = ("teacher", "gold", "fits", "sweep", "downstream", "summary")
    folder, paths, clock, sweeps, down = pipeline.open_run(config, names)
    step = clock.step
    fits_path = folder / "fits.pt"
    sweep_todo = [m for m in DECODER_METHODS if m not in sweeps]
    down_todo = [
        (m, kn, w)
        for m, knobs in config.downstream_knobs
        for kn in knobs
        for w in ([int(kn)] if m == "window" else config.downstream_windows)
        if _point_key(kn, w) not in down["methods"].get(m, {})
    ]
    with tqdm(
        total=3 + len(sweep_todo) + len(down_todo),
        desc="sparsefinder decoder",
        disable=not config.progress,
    ) as bar:
        bar.set_postfix_str("teacher")
        with step("teacher"):
            model, teacher = _teacher(config)
        write_json(paths["teacher"], teacher)
        bar.update(1)
        train_ids, valid = _windows(config)
        need = bool(sweep_todo or down_todo) or not paths["gold"].exists()
        train = test = None
        if need or not fits_path.exists():
            bar.set_postfix_str("gold graphs")
            with step("extract"):
                test = extract_decoder_graphs(model, valid[:, :-1], config.batch_size)
                train = extract_decoder_graphs(model, train_ids, config.batch_size)
            gold = pipeline.gold_record(
                test,
                train,
                causal=True,
                valid_windows=int(valid.shape[0]),
                train_windows=int(train_ids.shape[0]),
                n=config.teacher.n,
            )
            write_json(paths["gold"], gold)
        gold = read_json(paths["gold"])
        bar.update(1)
        fits = pipeline.fitted_layers(
            fits_path,
            paths["fits"],
            lambda: pipeline.fit_layers(train, config, bar, causal=True, encoder_rows=False),
            step,
        )
        bar.update(1)
        fitted = pipeline.FittedPredictors(fits, config)
        sweeps = pipeline.sweep_methods(
            fitted, sweep_todo, test, sweeps, paths["sweep"], step, bar, DECODER_METHODS, True
        )
        if down_todo:
            with step("downstream full teacher"):
                down["reference"] = lm.evaluate(model, dense().causal(), valid, config.teacher)
            for method, knob, window in down_todo:
                key = _point_key(knob, window)
                bar.set_postfix_str(f"downstream {method}={key}")
                with step(f"downstream {method}={key}"):
                    row = _downstream_point(
                        model, fitted, config, method, knob, window, valid, test
                    )
                down["methods"].setdefault(method, {})[key] = row
                write_json(paths["downstream"], down)
                bar.update(1)
    down_rows = {m: list(v.values()) for m, v in down["methods"].items()}
    for method, points in down_rows.items():
        for p in points:
            at = _sweep_at(sweeps.get(method, []), p["knob"], p["window"])
            if at is not None:
                p.update({k: at[k] for k in ("sparsity", "recall", "exact")})
    summary = pipeline.summarise_sweeps(sweeps, gold, down_rows)
    for row in summary["methods"].values():  # the decoder's reading levels
        row["recall_at_sparsity"] = {
            str(s): frontier_value(row["frontier"], s) for s in DECODER_SPARSITY
        }
    summary |= {
        "teacher": teacher,
        "downstream_reference": down["reference"],
        "downstream": down_rows,
        "uses_later_tokens": list(USES_LATER_TOKENS),
        "steps": clock.steps,
        "seconds_total": clock.total(),
        "machine": machine_facts(),
        "load_average_start": load_start,
    }
    write_json(paths["summary"], summary)
    table = table_markdown(summary)
    atomic_write(folder / "table.md", lambda tmp: Path(tmp).write_text(table))
    pipeline.plot_recall(
        sweeps,
        gold["sparsity"],
        folder / "sparsity_recall.png",
        title="Sparsity–recall, 1.5-entmax byte-level decoder (validation, causal pairs)",
    )
    if down_rows and down["reference"]:
        _plot_downstream(summary, folder / "sparsity_downstream.png")
    return summary | {"folder": str(folder), "table": table}


EXPERIMENT = Experiment(
    name="sparsefinder-decoder",
    config=DecoderSparsefinderConfig,
    quick=quick_config,
    run=run,
    summary=lambda config, summary: [summary["table"]],  # table.md, as the run wrote it
    figures=lambda config, summary: figures_in(
        summary["folder"], "sparsity_recall.png", "sparsity_downstream.png"
    ),
    wrote="wrote {folder}: table.md, summary.json, sparsity_recall.png",
    markdown=True,
)
