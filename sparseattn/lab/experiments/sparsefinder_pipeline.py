"""The Sparsefinder (Treviso et al. 2022) pipeline shared by the encoder and decoder experiments.

Part of the lab, over the method's package :mod:`sparseattn.methods.sparsefinder`:
``sparseattn.lab.experiments.sparsefinder`` (MiniLM, an encoder) and
``sparseattn.lab.experiments.sparsefinder_lm`` (a byte-level decoder) run the same steps on their
own gold graphs: :func:`fit_layers` fits each layer's projections (eq. 7) and centroids,
:class:`FittedPredictors` turns the fitted state into predictors per method and knob,
:func:`sweep_method` measures recall (eq. 4) and sparsity (eq. 5) over a method's knob grid ×
fixed windows, :func:`summarise_sweeps` reads the frontiers, and :func:`plot_recall` draws them.
``config`` is either experiment's config: the fields read are ``r``, ``margin``, ``lr``,
``epochs``, ``batch_pairs``, ``max_pairs``, ``seed``, ``train_window``, ``last_token``,
``windows``, ``clusters``, ``routing_clusters``, ``grid(method)`` and, for the encoder's chunked
rows, ``chunk_block`` and ``chunk_clusters``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from ...methods.sparsefinder import baselines as bl
from ...methods.sparsefinder import predictors as pr
from ...methods.sparsefinder.evaluate import (
    best_at_least,
    dominance,
    frontier_value,
    gold_summary,
    pareto_frontier,
    sweep,
)
from ...methods.sparsefinder.extract import LayerGraphs
from ...methods.sparsefinder.projection import QKProjection
from ..results import (
    StepClock,
    atomic_write,
    read_json,
    run_folder,
    save_figure,
    torch_threads,
    write_json,
)

__all__ = [
    "COLORS",
    "KNOB_GRIDS",
    "METHODS",
    "FittedPredictors",
    "fit_layers",
    "open_run",
    "plot_recall",
    "summarise_sweeps",
    "sweep_method",
    "sweep_methods",
    "sweep_points",
    "threaded",
]

#: Method name → (label in plots and tables, knob name).
METHODS: dict[str, tuple[str, str]] = {
    "window": ("window", "window"),
    "bigbird": ("BigBird", "random_blocks"),
    "longformer": ("Longformer", "global_tokens"),
    "strided": ("strided", "stride"),
    "reformer": ("Reformer (LSH, shared QK)", "buckets"),
    "reformer_separate": ("Reformer, q and k hashed apart", "buckets"),
    "routing": ("Routing Transformer", "n_clusters"),
    "sf_distance": ("Sparsefinder distance", "threshold"),
    "sf_distance_all_edges": ("Sparsefinder distance, eq. 7 on all edges", "threshold"),
    "sf_quantization": ("Sparsefinder quantization", "bins"),
    "sf_kmeans": ("Sparsefinder k-means", "n_clusters"),
    "sf_chunked_v1": ("Sparsefinder chunked v1", "top_blocks"),
    "sf_chunked_v2": ("Sparsefinder chunked v2", "top_blocks"),
}
#: Method name → the config field holding its knob grid (shared with the decoder pipeline).
KNOB_GRIDS: dict[str, str] = {
    "window": "window_grid",
    "bigbird": "bigbird_blocks",
    "longformer": "longformer_tokens",
    "strided": "strides",
    "reformer": "lsh_buckets",
    "reformer_separate": "lsh_buckets",
    "routing": "routing_clusters",
    "sf_distance": "thresholds",
    "sf_distance_all_edges": "thresholds",
    "sf_quantization": "bins",
    "sf_kmeans": "clusters",
    "sf_chunked_v1": "chunk_top",
    "sf_chunked_v2": "chunk_top",
}

#: Plot colours: baselines (dashed lines) and Sparsefinder variants (solid lines).
COLORS: dict[str, str] = {
    "window": "black",
    "bigbird": "tab:olive",
    "longformer": "tab:pink",
    "strided": "tab:gray",
    "reformer": "tab:purple",
    "reformer_separate": "plum",
    "routing": "tab:brown",
    "sf_distance": "tab:red",
    "sf_distance_all_edges": "salmon",
    "sf_quantization": "tab:green",
    "sf_kmeans": "tab:blue",
    "sf_chunked_v1": "tab:orange",
    "sf_chunked_v2": "tab:cyan",
}


def fit_layers(
    train: list[LayerGraphs],
    config,
    bar,
    causal: bool = False,
    encoder_rows: bool = True,
) -> dict:
    """Fitted state per layer of the ``train`` graphs (plain tensors and dicts, for torch.save).

    ``causal`` (decoder self-attention): keys after the query are left out of eq. 7's training
    (never sampled as negatives). ``encoder_rows=False`` skips the fits that only the encoder
    table uses: eq. 7 on all edges and the chunked (§6.1) predictors."""
    fits: dict = {
        "projection": [],
        "projection_all_edges": [],
        "kmeans": {},
        "routing": {},
        "chunk_projection": [],
        "chunk_v2": [],
        "seconds": {},
    }
    names = ("r", "margin", "lr", "epochs", "batch_pairs", "max_pairs", "seed")
    kwargs = {name: getattr(config, name) for name in names}  # QKProjection's arguments
    timer = {
        "projection": 0.0,
        "projection_all_edges": 0.0,
        "kmeans": 0.0,
        "routing": 0.0,
        "chunked": 0.0,
    }
    excluded = pr.FixedParts(config.train_window, True, config.last_token)

    def future(batch):
        return torch.ones(batch.n, batch.n, dtype=torch.bool).triu(1)

    def exclude(batch):
        fixed = excluded.graph(batch.n, batch.lengths).to_dense()
        return fixed | future(batch) if causal else fixed

    for layer in train:
        bar.set_postfix_str(f"projections, layer {layer.layer}")
        t = time.perf_counter()
        proj = QKProjection(**kwargs).fit(layer, exclude=exclude)
        timer["projection"] += time.perf_counter() - t
        fits["projection"].append(proj.state_dict())
        if encoder_rows:
            t = time.perf_counter()
            everything = QKProjection(**kwargs).fit(layer, exclude=future if causal else None)
            fits["projection_all_edges"].append(everything.state_dict())
            timer["projection_all_edges"] += time.perf_counter() - t
        q, k = layer.tokens()
        t = time.perf_counter()
        for c in config.clusters:
            km = pr.KMeansPredictor(c, 1, proj, seed=config.seed).fit(q, k)
            fits["kmeans"].setdefault(c, []).append(km.centroids_)
        timer["kmeans"] += time.perf_counter() - t
        t = time.perf_counter()
        for c in config.routing_clusters:
            rt = bl.RoutingBaseline(c, proj, seed=config.seed).fit(q, k)
            fits["routing"].setdefault(c, []).append(rt.centroids_)
        timer["routing"] += time.perf_counter() - t
        if not encoder_rows:
            continue
        t = time.perf_counter()
        chunks = pr.chunk_layer(layer, config.chunk_block)
        cproj = QKProjection(**kwargs).fit(chunks)  # chunk-level: fixed parts not excluded
        fits["chunk_projection"].append(cproj.state_dict())
        v2 = pr.ChunkedPredictor(
            config.chunk_block, 1, cproj, "v2", config.chunk_clusters, config.seed
        ).fit(chunks)
        fits["chunk_v2"].append(v2.centroids_)
        timer["chunked"] += time.perf_counter() - t
    fits["seconds"] = timer
    return fits


class FittedPredictors:
    """Predictor factories from the fitted state."""

    def __init__(self, fits: dict, config) -> None:
        self.config = config
        self.proj = [QKProjection.from_state_dict(s) for s in fits["projection"]]
        self.proj_all = [QKProjection.from_state_dict(s) for s in fits["projection_all_edges"]]
        self.cproj = [QKProjection.from_state_dict(s) for s in fits["chunk_projection"]]
        self.fits = fits

    def make(self, method: str, knob: float) -> Callable[[int], pr.GraphPredictor]:
        c, seed = self.config, self.config.seed
        if method == "window":
            return lambda _l: bl.WindowBaseline(int(knob))
        if method == "bigbird":
            return lambda _l: bl.BigBirdBaseline(int(knob), 1, seed)
        if method == "longformer":
            return lambda _l: bl.LongformerBaseline(int(knob), seed)
        if method == "strided":
            return lambda _l: bl.StridedBaseline(int(knob))
        if method in ("reformer", "reformer_separate"):
            mode = "shared" if method == "reformer" else "separate"
            return lambda l: bl.LSHBaseline(int(knob), self.proj[l], seed, mode)
        if method == "routing":

            def routing(l: int) -> pr.GraphPredictor:
                out = bl.RoutingBaseline(int(knob), self.proj[l], seed=seed)
                out.centroids_ = self.fits["routing"][int(knob)][l]
                return out

            return routing
        if method == "sf_distance":
            return lambda l: pr.DistancePredictor(float(knob), self.proj[l])
        if method == "sf_distance_all_edges":
            return lambda l: pr.DistancePredictor(float(knob), self.proj_all[l])
        if method == "sf_quantization":
            return lambda l: pr.QuantizationPredictor(int(knob), self.proj[l])
        if method == "sf_kmeans":

            def kmeans(l: int) -> pr.GraphPredictor:
                out = pr.KMeansPredictor(int(knob), 1, self.proj[l], seed=seed)
                out.centroids_ = self.fits["kmeans"][int(knob)][l]
                return out

            return kmeans
        if method in ("sf_chunked_v1", "sf_chunked_v2"):
            variant = method[-2:]

            def chunked(l: int) -> pr.GraphPredictor:
                out = pr.ChunkedPredictor(
                    c.chunk_block, int(knob), self.cproj[l], variant, c.chunk_clusters, seed
                )
                if variant == "v2":
                    out.centroids_ = self.fits["chunk_v2"][l]
                return out

            return chunked
        raise ValueError(f"unknown method {method!r}")

    def fixed_variants(self, method: str) -> list[tuple[int | None, pr.FixedParts]]:
        last = self.config.last_token
        if method == "window":  # the baseline's own window is its knob
            return [(None, pr.FixedParts(None, True, last))]
        return [(w, pr.FixedParts(w, True, last)) for w in self.config.windows]


def sweep_method(
    fitted: FittedPredictors, method: str, test: list[LayerGraphs], causal: bool = False
) -> list[dict]:
    """Recall / sparsity of ``method`` at every knob × fixed window (pairs j ≤ i if causal)."""
    variants = fitted.fixed_variants(method)
    points = []
    for knob in fitted.config.grid(method):
        results = sweep(test, fitted.make(method, knob), [f for _, f in variants], causal)
        for (w, _), res in zip(variants, results, strict=True):
            if method == "window":
                w = int(knob)
            points.append({"knob": knob, "window": w, **res})
    return points


def sweep_methods(
    fitted: FittedPredictors,
    todo: list[str],
    test: list[LayerGraphs],
    sweeps: dict[str, list[dict]],
    path: Path,
    step: Callable,
    bar: Any,
    order: Iterable[str],
    causal: bool = False,
) -> dict[str, list[dict]]:
    """:func:`sweep_method` for each method of ``todo`` into ``sweeps``: one ``step`` and one
    ``bar`` update each, ``sweeps`` rewritten to ``path`` after each (a run resumes from it).
    Returns the swept methods in the order of ``order``."""
    for method in todo:
        bar.set_postfix_str(f"sweep {method}")
        with step(f"sweep {method}"):
            sweeps[method] = sweep_method(fitted, method, test, causal)
        write_json(path, sweeps)
        bar.update(1)
    return {m: sweeps[m] for m in order if m in sweeps}


def open_run(config: Any, names: Sequence[str]) -> tuple[Path, dict, StepClock, dict, dict]:
    """The folder of a pipeline run (``config.out_dir`` / its run name, its identity pinned),
    the paths of its JSON results ``names`` (``<name>.json``; among them ``sweep`` and
    ``downstream``), its step clock, and what an earlier run left: the sweeps and the
    downstream points (``{"reference": None, "methods": {}}`` when none)."""
    folder = run_folder(Path(config.out_dir) / config.run_name(), config.identity())
    paths = {name: folder / f"{name}.json" for name in names}
    down = read_json(paths["downstream"]) or {"reference": None, "methods": {}}
    return folder, paths, StepClock(folder / "steps.json"), read_json(paths["sweep"]) or {}, down


def gold_record(
    test: Sequence[LayerGraphs], train: Sequence[LayerGraphs], causal: bool = False, **facts: Any
) -> dict:
    """What ``gold.json`` holds: the sparsity of the test set's gold graphs
    (:func:`~sparseattn.methods.sparsefinder.evaluate.gold_summary`), ``facts`` about the data,
    and under ``train`` the training set's sparsity (overall and per layer)."""
    trained = gold_summary(train, causal=causal)
    keep = ("sparsity", "sparsity_per_layer")
    return gold_summary(test, causal=causal) | facts | {"train": {k: trained[k] for k in keep}}


def fitted_layers(path: Path, record: Path, fit: Callable[[], dict], step: Callable) -> dict:
    """The per-layer fits saved at ``path``; else ``fit()`` (timed as the step "fit"), saved
    there, with ``record`` (``fits.json``) holding its seconds and, per layer, the projection's
    training pairs per head, first and last loss (none where no gold row had a non-edge) and
    steps."""
    if path.exists():
        return torch.load(path, weights_only=False)
    with step("fit"):
        fits = fit()
    atomic_write(path, lambda tmp: torch.save(fits, tmp))
    projection = fits["projection"]
    summary = {
        "seconds": fits["seconds"],
        "projection_pairs_per_head": [s["n_pairs"].tolist() for s in projection],
        "projection_loss_first_last": [
            s["loss_curve"][:1] + s["loss_curve"][-1:] for s in projection
        ],
        "projection_steps": [len(s["loss_curve"]) for s in projection],
    }
    write_json(record, summary)
    return fits


def threaded(config: Any, body: Callable[[Any], dict]) -> dict:
    """``body(config.validate())`` with ``config.threads`` torch threads (restored after)."""
    config = config.validate()
    with torch_threads(config.threads):
        return body(config)


def sweep_points(rows: list[dict]) -> list[tuple[float, float]]:
    """The (sparsity, recall) pairs of a method's sweep rows."""
    return [(r["sparsity"], r["recall"]) for r in rows]


def summarise_sweeps(
    sweeps: dict, gold: dict, downstream_rows: dict, levels: tuple[float, ...] = (0.9, 0.8)
) -> dict:
    """Per method: frontier recall at the gold sparsity and at each of ``levels``, the sparsest
    setting, the frontier, and the dominance over the window baseline."""
    s_gold = gold["sparsity"]
    table = {}
    for method, rows in sweeps.items():
        pts = sweep_points(rows)
        front = pareto_frontier(pts)
        sparsest = max(rows, key=lambda r: (r["sparsity"], r["recall"]))
        table[method] = {
            "label": METHODS[method][0],
            "recall_at_gold_sparsity": frontier_value(front, s_gold),
            "best_recall_with_sparsity_at_least_gold": best_at_least(pts, s_gold),
            "recall_at_sparsity": {str(s): frontier_value(front, s) for s in levels},
            "sparsest": {k: sparsest[k] for k in ("knob", "window", "sparsity", "recall")},
            "frontier": front,
        }
        if method != "window" and "window" in sweeps:
            table[method]["vs_window"] = dominance(pts, sweep_points(sweeps["window"]))
    return {
        "gold_sparsity": s_gold,
        "gold_sparsity_per_layer": gold["sparsity_per_layer"],
        "methods": table,
        "downstream_points": sum(len(v) for v in downstream_rows.values()),
    }


def plot_recall(
    sweeps: dict,
    gold: float,
    path: Path,
    title: str = "Sparsity–recall, 1.5-entmax MiniLM (test, mean of layers × heads)",
) -> None:
    """Every method's sweep points and Pareto frontier in the sparsity–recall plane."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    for method, rows in sweeps.items():
        color = COLORS[method]
        style = "-" if method.startswith("sf_") else "--"
        pts = sweep_points(rows)
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=6, color=color, alpha=0.25)
        front = pareto_frontier(pts)
        ax.plot(
            [p[0] for p in front],
            [p[1] for p in front],
            style,
            color=color,
            lw=1.4,
            marker="o",
            ms=2.5,
            label=METHODS[method][0],
        )
    ax.axvline(gold, color="k", ls=":", lw=1, label=f"gold sparsity {gold:.3f}")
    ax.set_xlabel("sparsity (eq. 5)")
    ax.set_ylabel("recall (eq. 4)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6.5, loc="lower left", ncol=2)
    fig.tight_layout()
    save_figure(fig, path, dpi=80)
