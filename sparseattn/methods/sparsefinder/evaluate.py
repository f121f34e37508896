"""Sparsefinder's metrics (eqs. 4–5), sweeps and Pareto frontiers (Treviso et al. 2022).

* recall(Ĝ; G) = |Ĝ ∩ G| / |G| (eq. 4), per head;
* sparsity(Ĝ) = 1 − |Ĝ| / #pairs (eq. 5), pairs = real-token pairs (i, j), j ≤ i when causal, so
  the denominator is n(n+1)/2 for a causal sequence of n real tokens (footnote 2);
* exact = share of real queries whose recall is 1 — for them entmax on Ĝ equals full entmax
  (Proposition 1).

Counts are pooled per (layer, head) over all sequences, then recall and sparsity are averaged
over heads and layers (the paper's "averaged across all layers and heads").

The downstream effect inside a model (the teacher run on predicted graphs, with
:mod:`sparseattn.lab.fidelity`'s metrics) is the lab's:
:mod:`sparseattn.lab.experiments.sparsefinder_downstream`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from ...graph import AttentionGraph
from ...validate import check_bool, check_finite_float, check_positive, check_tensor
from .extract import GraphBatch, LayerGraphs
from .predictors import FixedParts, GraphPredictor

__all__ = [
    "Tally",
    "best_at_least",
    "dominance",
    "exact_fraction",
    "frontier_value",
    "gold_summary",
    "pair_mask",
    "pareto_frontier",
    "recall",
    "sparsity",
    "sweep",
]


def _dense(name: str, graph: AttentionGraph | Tensor) -> Tensor:
    """The bool mask (..., n_q, n_k) of a graph or a bool tensor."""
    if isinstance(graph, AttentionGraph):
        return graph.to_dense()
    check_tensor(name, graph, dtype=torch.bool)
    if graph.dim() < 2:
        raise ValueError(f"{name} must have shape (..., n_q, n_k), got {tuple(graph.shape)}")
    return graph


def _same(names: str, a: Tensor, b: Tensor) -> None:
    """Graphs of the same size (n_q, n_k) whose batch dims broadcast."""
    try:
        if a.shape[-2:] != b.shape[-2:]:
            raise RuntimeError("sizes differ")
        torch.broadcast_shapes(a.shape, b.shape)
    except RuntimeError as err:
        raise ValueError(
            f"{names} must have broadcastable shapes, got {tuple(a.shape)}, {tuple(b.shape)}"
        ) from err


def _valid(valid: Tensor | None, n: int) -> None:
    if valid is not None:
        check_tensor("valid", valid, dtype=torch.bool, dim=2)
        if valid.shape[1] != n:
            raise ValueError(f"valid must have shape (B, {n}), got {tuple(valid.shape)}")


def pair_mask(n: int, valid: Tensor | None = None, causal: bool = False) -> Tensor:
    """The pairs eq. 5 counts: (B, 1, n, n) real × real (j ≤ i when causal), or (n, n)."""
    n = check_positive("n", n)
    _valid(valid, n)
    causal = check_bool("causal", causal)
    mask = torch.ones(n, n, dtype=torch.bool)
    if causal:
        mask = mask.tril()
    if valid is None:
        return mask
    return (valid[:, :, None] & valid[:, None, :])[:, None] & mask


def recall(pred: AttentionGraph | Tensor, gold: AttentionGraph | Tensor) -> Tensor:
    """Eq. 4 per graph: |Ĝ ∩ G| / |G|. Graphs or bool masks (..., n, n) → (...) float64.

    A graph with no gold edge has recall 1 (Ĝ misses none of them), not 0/0."""
    p, g = _dense("pred", pred), _dense("gold", gold)
    _same("pred and gold", p, g)
    gold_edges = g.sum((-2, -1)).double()
    hits = (p & g).sum((-2, -1)).double()
    return torch.where(gold_edges > 0, hits / gold_edges.clamp_min(1), 1.0)


def sparsity(
    pred: AttentionGraph | Tensor, valid: Tensor | None = None, causal: bool = False
) -> Tensor:
    """Eq. 5 per graph: 1 − |Ĝ ∩ pairs| / |pairs|, pairs from :func:`pair_mask`. → (...).

    A graph without pairs (no real token) has sparsity 1."""
    p = _dense("pred", pred)
    if p.shape[-2] != p.shape[-1]:
        raise ValueError(f"pred must be square (..., n, n), got {tuple(p.shape)}")
    pairs = pair_mask(p.shape[-1], valid, causal)
    _same("pred and valid's pairs", p, pairs)
    total = pairs.expand_as(p).sum((-2, -1)).double().clamp_min(1)
    return 1 - (p & pairs).sum((-2, -1)).double() / total


def exact_fraction(
    pred: AttentionGraph | Tensor, gold: AttentionGraph | Tensor, valid: Tensor | None = None
) -> Tensor:
    """Per graph, the share of real queries whose whole gold row lies in Ĝ (recall 1);
    1 for a graph without real queries."""
    p, g = _dense("pred", pred), _dense("gold", gold)
    _same("pred and gold", p, g)
    covered = ~(g & ~p).any(-1)  # (..., n)
    if valid is None:
        return covered.double().mean(-1)
    _valid(valid, covered.shape[-1])
    if covered.dim() != 3:
        raise ValueError(
            f"with valid, pred and gold must be (B, H, n, n), got "
            f"{tuple(covered.shape) + (g.shape[-1],)}"
        )
    real = valid[:, None, :].expand_as(covered)
    count = real.sum(-1).double()
    return torch.where(count > 0, (covered & real).sum(-1).double() / count.clamp_min(1), 1.0)


class Tally:
    """Counts pooled per (layer, head): gold edges, predicted edges on valid pairs, hits, pairs,
    exact queries, real queries."""

    FIELDS = ("gold", "pred", "hit", "pairs", "exact", "queries")

    def __init__(self, layers: int, heads: int) -> None:
        layers, heads = check_positive("layers", layers), check_positive("heads", heads)
        self.counts = {f: torch.zeros(layers, heads, dtype=torch.float64) for f in self.FIELDS}

    def add(self, layer: int, pred: Tensor, batch: GraphBatch, causal: bool = False) -> None:
        """pred: bool (b, H, n, n) (or broadcastable) predicted mask for ``batch``."""
        pairs = pair_mask(batch.n, batch.valid, causal)
        p = pred & pairs
        g = batch.gold
        heads = g.shape[1]
        c = self.counts
        c["gold"][layer] += g.sum((0, 2, 3)).double()
        c["pred"][layer] += p.expand_as(g).sum((0, 2, 3)).double()
        c["hit"][layer] += (p & g).sum((0, 2, 3)).double()
        c["pairs"][layer] += float(pairs.expand(g.shape[0], 1, -1, -1).sum())
        real = batch.valid[:, None, :].expand(-1, heads, -1)
        covered = ~(g & ~p).any(-1)
        c["exact"][layer] += (covered & real).sum((0, 2)).double()
        c["queries"][layer] += real.sum((0, 2)).double()

    def summary(self) -> dict:
        """recall / sparsity per (layer, head) and their means; exact over all real queries."""
        c = self.counts
        rec = c["hit"] / c["gold"].clamp_min(1)
        spa = 1 - c["pred"] / c["pairs"].clamp_min(1)
        return {
            "recall": float(rec.mean()),
            "sparsity": float(spa.mean()),
            "exact": float(c["exact"].sum() / c["queries"].sum()),
            "recall_per_layer": rec.mean(1).tolist(),
            "sparsity_per_layer": spa.mean(1).tolist(),
            "recall_per_head": rec.tolist(),
            "sparsity_per_head": spa.tolist(),
        }


def gold_summary(layers: Sequence[LayerGraphs], causal: bool = False) -> dict:
    """Sparsity of the gold graphs themselves (the dashed line of Figs. 2 and 4)."""
    tally = Tally(len(layers), layers[0].heads)
    for li, graphs in enumerate(layers):
        for batch in graphs.batches:
            tally.add(li, batch.gold, batch, causal)
    return tally.summary()


@torch.no_grad()
def sweep(
    layers: Sequence[LayerGraphs],
    make: Callable[[int], GraphPredictor],
    fixed: Sequence[FixedParts | None],
    causal: bool = False,
) -> list[dict]:
    """Evaluate one predictor setting with several fixed parts on every layer's graphs.

    ``make(i)`` gives the predictor for ``layers[i]`` (a layer's fitted projection etc.). Each
    batch is predicted once; every ``fixed`` variant is unioned on the dense mask. Returns one
    :meth:`Tally.summary` per entry of ``fixed``.
    """
    if (
        isinstance(layers, str)
        or not isinstance(layers, Sequence)
        or not layers
        or not all(isinstance(x, LayerGraphs) for x in layers)
    ):
        raise TypeError("layers must be a non-empty sequence of LayerGraphs")
    if not callable(make):
        raise TypeError(f"make must be callable (layer index -> predictor), got {make!r}")
    if (
        isinstance(fixed, str)
        or not isinstance(fixed, Sequence)
        or not all(f is None or isinstance(f, FixedParts) for f in fixed)
    ):
        raise TypeError("fixed must be a sequence of FixedParts or None")
    causal = check_bool("causal", causal)
    tallies = [Tally(len(layers), layers[0].heads) for _ in fixed]
    for li, graphs in enumerate(layers):
        predictor = make(li)
        for batch in graphs.batches:
            pred = predictor.predict(batch.q, batch.k, batch.valid).to_dense()
            for tally, parts in zip(tallies, fixed, strict=True):
                extra = None if parts is None else parts.graph(batch.n, batch.lengths)
                mask = pred if extra is None else pred | extra.to_dense()
                tally.add(li, mask, batch, causal)
    return [t.summary() for t in tallies]


# --------------------------------------------------------------------------- Pareto
def pareto_frontier(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """Non-dominated (sparsity, recall) points, by increasing sparsity (recall then decreases).

    A point is dominated when another has sparsity ≥ and recall ≥, one of them strictly.
    """
    points = _points("points", points)
    best: list[tuple[float, float]] = []
    for s, r in sorted(points, key=lambda p: (-p[0], -p[1])):  # high sparsity first
        if not best or r > best[-1][1]:
            best.append((s, r))
    return best[::-1]


def frontier_value(frontier: Sequence[tuple[float, float]], s: float) -> float | None:
    """Recall of the frontier at sparsity s, linear between its points; None outside its range."""
    frontier = _points("frontier", frontier)
    s = check_finite_float("s", s)
    if not frontier or s < frontier[0][0] or s > frontier[-1][0]:
        return None
    xs = [p[0] for p in frontier]
    ys = [p[1] for p in frontier]
    return float(np.interp(s, xs, ys))


def _points(name: str, points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """(sparsity, recall) pairs of finite reals."""
    if isinstance(points, str | bytes) or not isinstance(points, Sequence):
        raise TypeError(
            f"{name} must be a sequence of (sparsity, recall) pairs, got {type(points).__name__}"
        )
    out = []
    for i, point in enumerate(points):
        if isinstance(point, str | bytes) or not isinstance(point, Sequence) or len(point) != 2:
            raise TypeError(f"{name}[{i}] must be a (sparsity, recall) pair, got {point!r}")
        out.append(
            (
                check_finite_float(f"{name}[{i}][0]", point[0]),
                check_finite_float(f"{name}[{i}][1]", point[1]),
            )
        )
    return out


def best_at_least(points: Sequence[tuple[float, float]], s: float) -> float | None:
    """Highest recall among settings whose sparsity is at least s (None if there is none)."""
    points, s = _points("points", points), check_finite_float("s", s)
    vals = [r for sp, r in points if sp >= s]
    return max(vals) if vals else None


def dominance(
    method: Sequence[tuple[float, float]], base: Sequence[tuple[float, float]], grid: int = 101
) -> dict:
    """How ``method``'s Pareto frontier compares with ``base``'s.

    ``dominated_base_points``: share of base frontier points with some method point of sparsity ≥
    and recall ≥ theirs. On the common sparsity range of both frontiers, recall gaps
    (method − base) of the interpolated curves: min, mean and max over ``grid`` points.
    """
    grid = check_positive("grid", grid)
    fm, fb = pareto_frontier(method), pareto_frontier(base)
    if not fm or not fb:
        raise ValueError("method and base must each hold at least one (sparsity, recall) point")
    dominated = sum(any(s >= bs and r >= br for s, r in fm) for bs, br in fb)
    lo, hi = max(fm[0][0], fb[0][0]), min(fm[-1][0], fb[-1][0])
    out = {"dominated_base_points": dominated / len(fb), "overlap": [lo, hi]}
    if lo <= hi:
        xs = np.linspace(lo, hi, grid)
        gaps = [frontier_value(fm, x) - frontier_value(fb, x) for x in xs]
        out |= {
            "gap_min": float(min(gaps)),
            "gap_mean": float(np.mean(gaps)),
            "gap_max": float(max(gaps)),
        }
    return out
