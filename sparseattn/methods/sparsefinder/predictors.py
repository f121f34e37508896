"""Sparsefinder's graph predictors (§4.3–4.5, 4.7) and the chunked variant (§6.1, appendix F).

Every predictor maps queries and keys q (B, H, n_q, d), k (B, H, n_k, d) to an
:class:`~sparseattn.graph.AttentionGraph` with ``batch_shape`` (B, H) — the predicted graph Ĝ_h —
optionally first applying a fitted :class:`~sparseattn.methods.sparsefinder.projection.QKProjection`
(q′ = g_q(q), k′ = g_k(k) ∈ R^r). Bucket-based predictors follow eq. 6: with f_q, f_k assigning
each query and key to a set of buckets, Ĝ = {(i, j) : f_q(q_i) ∩ f_k(k_j) ≠ ∅}, built by
:func:`bucket_graph` in O(Σ_b n_b m_b) (no n_q × n_k table).

* :class:`DistancePredictor` (§4.3): Ĝ = {(i, j) : ‖q′_i − k′_j‖₂ ≤ t} — O(n² r).
* :class:`QuantizationPredictor` (§4.4): each coordinate of q′ (and of k′) is cut into β bins of
  equal size ⌈n/β⌉ by rank; q_i and k_j share a bucket if they share a bin in any coordinate.
* :class:`KMeansPredictor` (§4.5, eqs. 8–9): B centroids fitted offline by k-means on projected
  train queries and keys; each query and key joins its top-k nearest centroids.
* :class:`FixedParts` (§4.7): a window and global tokens (first, optionally last) to union with Ĝ.
* :class:`ChunkedPredictor` (§6.1): the same on chunks of z tokens (mean q, k per chunk, with a
  projection trained on the chunk graph); v1 keeps each query chunk's top-k key chunks by
  projected distance, v2 lets each centroid pick its top-k query and key chunks (Routing style).
  The chunk graph is expanded to tokens (whole z × z blocks).

``valid`` (B, n) bool, when given, marks real tokens (right padding); padding gets no bucket.

One piece: the predictors share the bucket graph, the centroid fitting and the
:class:`GraphPredictor` base; the chunked variant is the same predictors on chunk means.
"""

from __future__ import annotations

import abc
import dataclasses
import math

import torch
from torch import Tensor

from ...graph import AttentionGraph
from ...validate import (
    check_bool,
    check_choice,
    check_finite_float,
    check_finite_tensor,
    check_generator,
    check_int,
    check_positive,
    check_tensor,
)
from .extract import GraphBatch, LayerGraphs
from .projection import QKProjection

__all__ = [
    "ChunkedPredictor",
    "DistancePredictor",
    "FixedParts",
    "GraphPredictor",
    "KMeansPredictor",
    "QuantizationPredictor",
    "bucket_graph",
    "centroid_topk_buckets",
    "check_right_padding",
    "chunk_layer",
    "chunk_means",
    "expand_blocks",
    "kmeans",
    "merge_union",
    "nearest_centroids",
    "quantize",
    "union_fixed",
]


# --------------------------------------------------------------------------- buckets → graph
def bucket_graph(q_buckets: Tensor, k_buckets: Tensor, num_buckets: int) -> AttentionGraph:
    """Eq. 6: the graph {(i, j) : some bucket holds query i and key j}.

    Args:
        q_buckets: LongTensor (*batch, n_q, m_q): the buckets of each query, −1 for none.
        k_buckets: LongTensor (*batch, n_k, m_k): the buckets of each key, −1 for none.
        num_buckets: bucket ids lie in [0, num_buckets).
    Returns:
        AttentionGraph with ``batch_shape`` = batch. Cost O(Σ_b n_b m_b + E log E).
    """
    num_buckets = check_positive("num_buckets", num_buckets)
    used = 1  # bucket ids in use lie in [0, used): the slot tables need no more
    for name, b in (("q_buckets", q_buckets), ("k_buckets", k_buckets)):
        check_tensor(name, b)
        if b.is_floating_point() or b.is_complex() or b.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got {b.dtype}")
        if b.dim() < 2:
            raise ValueError(f"{name} must have shape (*batch, n, m), got {tuple(b.shape)}")
        if b.numel():
            low, high = int(b.min()), int(b.max())
            if low < -1 or high >= num_buckets:
                raise ValueError(
                    f"{name} must lie in [-1, num_buckets={num_buckets}), got [{low}, {high}]"
                )
            used = max(used, high + 1)
    *batch, n_q, m_q = q_buckets.shape
    n_k = k_buckets.shape[-2]
    if tuple(k_buckets.shape[:-2]) != tuple(batch):
        raise ValueError(
            f"bucket tables disagree on batch dims: {q_buckets.shape}, {k_buckets.shape}"
        )
    num_buckets = used
    q_buckets, k_buckets = q_buckets.long(), k_buckets.long()
    graphs = math.prod(batch) if batch else 1
    qb = q_buckets.reshape(graphs, n_q, m_q)
    kb = k_buckets.reshape(graphs, n_k, -1)
    g_k, j_k, s_k = (kb >= 0).nonzero(as_tuple=True)
    slot_k = g_k * num_buckets + kb[g_k, j_k, s_k]
    order = torch.argsort(slot_k, stable=True)
    keys_sorted = j_k[order]
    count = torch.bincount(slot_k, minlength=graphs * num_buckets)
    start = torch.cumsum(count, 0) - count
    g_q, i_q, s_q = (qb >= 0).nonzero(as_tuple=True)
    slot_q = g_q * num_buckets + qb[g_q, i_q, s_q]
    sizes = count[slot_q]
    total = int(sizes.sum())
    member = torch.repeat_interleave(torch.arange(slot_q.numel()), sizes, output_size=total)
    offset = torch.arange(total) - (torch.cumsum(sizes, 0) - sizes)[member]
    cols = keys_sorted[start[slot_q][member] + offset]
    if m_q == 1 and _distinct_rows(kb):
        # one bucket per query and no key twice in a bucket: rows come out grouped in order,
        # each row's keys sorted and distinct — the CSR layout, without a sort
        crow = torch.zeros(graphs * n_q + 1, dtype=torch.long)
        crow[1:].index_add_(0, g_q * n_q + i_q, sizes)
        return AttentionGraph(torch.cumsum(crow, 0), cols, n_q, n_k, tuple(batch))
    rows = (g_q * n_q + i_q)[member]
    return AttentionGraph.from_edges(rows, cols, n_q, n_k, tuple(batch))


def _distinct_rows(buckets: Tensor) -> bool:
    """Whether no row of (G, n, m) lists the same bucket (≥ 0) twice."""
    if buckets.shape[-1] == 1:
        return True
    s = buckets.sort(-1).values
    return not bool(((s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)).any())


def _rank(x: Tensor, valid: Tensor | None) -> Tensor:
    """Rank (0-based) of each entry along dim −2 (the token dim), padding ranked last."""
    if valid is not None:
        x = x.masked_fill(~valid[:, None, :, None], math.inf)
    return torch.argsort(torch.argsort(x, dim=-2, stable=True), dim=-2, stable=True)


def quantize(x: Tensor, bins: int, valid: Tensor | None = None) -> Tensor:
    """Balanced bins per coordinate (§4.4): bucket c·β + ⌊rank_c(x_i) / ⌈L/β⌉⌋ in coordinate c.

    x: (B, H, n, r); valid (B, n) or None → LongTensor (B, H, n, r), −1 for padding. Every bin of
    a coordinate but the last holds exactly ⌈L/β⌉ tokens (L real tokens), as if padding had been
    appended to fill the last.
    """
    bins = check_positive("bins", bins)
    r = x.shape[-1]
    n = x.shape[-2]
    lengths = (torch.full((x.shape[0],), n) if valid is None else valid.sum(-1)).to(x.device)
    size = torch.div(lengths + bins - 1, bins, rounding_mode="floor").clamp_min(1)
    ranks = _rank(x, valid)
    bucket = torch.div(ranks, size[:, None, None, None], rounding_mode="floor")
    bucket = bucket + torch.arange(r, device=x.device) * bins
    if valid is not None:
        bucket = bucket.masked_fill(~valid[:, None, :, None], -1)
    return bucket


def nearest_centroids(x: Tensor, centroids: Tensor, top_k: int) -> Tensor:
    """Eqs. 8–9: the top-k nearest centroids of each point.

    x (..., H, n, r); centroids (H, C, r) → LongTensor (..., H, n, min(k, C)).
    """
    dist = _centroid_dist(x, centroids.to(x), "euclidean")
    return dist.topk(min(top_k, centroids.shape[1]), dim=-1, largest=False).indices


def centroid_topk_buckets(
    x: Tensor,
    centroids: Tensor,
    per_centroid: Tensor | int,
    valid: Tensor | None = None,
    metric: str = "euclidean",
) -> Tensor:
    """Routing-Transformer assignment: each centroid takes its ``per_centroid`` nearest points.

    x (B, H, n, r); centroids (H, C, r); ``per_centroid`` an int or a (B,) tensor (per sequence,
    e.g. ⌈L/C⌉ for balanced clusters); ``metric`` "euclidean" or "cosine" (x, centroids unit).
    Returns LongTensor (B, H, n, C): entry c is c when centroid c took the point, else −1 — a point
    may be in several clusters or in none (Sparsefinder footnote 3).
    """
    c = centroids.to(x)
    dist = _centroid_dist(x, c, metric)
    ranks = _rank(dist, valid)  # rank of each point among the sequence's points, per centroid
    limit = torch.as_tensor(per_centroid, device=x.device).reshape(-1, 1, 1, 1)
    taken = ranks < limit
    if valid is not None:
        taken &= valid[:, None, :, None]
    ids = torch.arange(c.shape[1], device=x.device).expand_as(taken)
    return torch.where(taken, ids, -1)


def _centroid_dist(x: Tensor, c: Tensor, metric: str) -> Tensor:
    """Squared distance ("euclidean") or negated dot product ("cosine") of points x (..., H, n, r)
    to centroids c (H, C, r) → (..., H, n, C), summed elementwise over r: each point's value
    does not depend on the other points (a matrix product may round differently for another
    number of rows), so padding a sequence cannot flip a near tie among its real tokens.
    Memory (..., H, n, C, r): meant for the small projected r."""
    x, c = x.unsqueeze(-2), c.unsqueeze(-3)  # (..., H, n, 1, r), (H, 1, C, r)
    if metric == "euclidean":
        return (x - c).square().sum(-1)
    return -(x * c).sum(-1)


def _sq_dist(x: Tensor, c: Tensor) -> Tensor:
    """‖x_i − c_b‖² for x (..., H, n, r) and c (H, C, r) (or (..., H, C, r)) → (..., H, n, C)."""
    return (
        (x * x).sum(-1, keepdim=True) - 2 * x @ c.transpose(-1, -2) + (c * c).sum(-1).unsqueeze(-2)
    ).clamp_min(0.0)


# --------------------------------------------------------------------------- k-means
def kmeans(
    x: Tensor,
    n_clusters: int,
    n_init: int = 3,
    max_iter: int = 100,
    tol: float = 1e-4,
    gen: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Batched k-means (k-means++ seeding, Lloyd iterations), independently for each of G sets.

    x: (G, N, r) points → centroids (G, C, r) and inertia (G,), the best of ``n_init`` runs.
    Stops when no assignment changes, when no centroid moves (squared) more than ``tol`` × the
    mean per-coordinate variance (scikit-learn's rule), or after ``max_iter`` iterations. Empty
    clusters keep their centroid.
    """
    check_tensor("x", x, dim=3, floating=True)
    check_finite_tensor("x", x)
    groups, n_points, r = x.shape
    n_clusters = check_positive("n_clusters", n_clusters)
    if n_clusters > n_points:
        raise ValueError(f"n_clusters must lie in [1, {n_points}], got {n_clusters}")
    n_init, max_iter = check_positive("n_init", n_init), check_positive("max_iter", max_iter)
    tol = check_finite_float("tol", tol, 0.0)
    gen = torch.Generator().manual_seed(0) if check_generator("gen", gen) is None else gen
    pts = x.repeat_interleave(n_init, 0)  # (G·I, N, r)
    runs = pts.shape[0]
    rows = torch.arange(runs)
    first = torch.randint(n_points, (runs,), generator=gen)
    cent = [pts[rows, first]]
    closest = (pts - cent[0][:, None]).square().sum(-1)
    for _ in range(1, n_clusters):
        weights = closest + 1e-12
        pick = torch.multinomial(weights / weights.sum(-1, keepdim=True), 1, generator=gen)[:, 0]
        cent.append(pts[rows, pick])
        closest = torch.minimum(closest, (pts - cent[-1][:, None]).square().sum(-1))
    centroids = torch.stack(cent, 1)  # (G·I, C, r)
    limit = tol * x.var(1).mean(-1).repeat_interleave(n_init)  # (G·I,)
    previous = None
    for _ in range(max_iter):
        assign = _sq_dist(pts, centroids).argmin(-1)  # (G·I, N)
        if previous is not None and torch.equal(assign, previous):
            break
        previous = assign
        sums = torch.zeros_like(centroids).scatter_add_(1, assign[..., None].expand(-1, -1, r), pts)
        counts = torch.zeros(runs, n_clusters, dtype=x.dtype).scatter_add_(
            1, assign, torch.ones_like(assign, dtype=x.dtype)
        )
        new = torch.where(counts[..., None] > 0, sums / counts.clamp_min(1)[..., None], centroids)
        shift = (new - centroids).square().sum(-1).amax(-1)
        centroids = new
        if bool((shift <= limit).all()):
            break
    inertia = _sq_dist(pts, centroids).amin(-1).sum(-1).view(groups, n_init)
    best = inertia.argmin(-1)
    centroids = centroids.view(groups, n_init, n_clusters, r)[torch.arange(groups), best]
    return centroids, inertia[torch.arange(groups), best]


# --------------------------------------------------------------------------- fixed parts
@dataclasses.dataclass(frozen=True)
class FixedParts:
    """Window and global tokens to add to a predicted graph (§4.7, Fig. 1c).

    ``window``: keys |i − j| ≤ window (the paper's window *size* is 2·window + 1); None: no window.
    ``first``: the first token ([CLS]) attends to all and is attended by all.
    ``last``: the same for the last real token ([SEP]).
    """

    window: int | None = 1
    first: bool = True
    last: bool = False

    def __post_init__(self) -> None:
        if self.window is not None:
            check_int("window", self.window, 0)
        check_bool("first", self.first)
        check_bool("last", self.last)

    @property
    def empty(self) -> bool:
        return self.window is None and not self.first and not self.last

    def graph(self, n: int, lengths: Tensor | None = None) -> AttentionGraph | None:
        """The fixed graph at length n: ``batch_shape`` () — or (B, 1) when ``lengths`` (B,)
        differ from n and ``last`` is set. None when there is nothing to add. O(n·window)."""
        n = check_int("n", n, 0)
        if lengths is not None:
            check_tensor("lengths", lengths, dim=1)
            if lengths.is_floating_point() or lengths.dtype == torch.bool:
                raise TypeError(f"lengths must be an integer tensor, got {lengths.dtype}")
            if lengths.numel() and (int(lengths.min()) < 0 or int(lengths.max()) > n):
                raise ValueError(
                    f"lengths must lie in [0, n={n}], got "
                    f"[{int(lengths.min())}, {int(lengths.max())}]"
                )
        if self.empty:
            return None
        window = None if self.window is None else min(int(self.window), n)  # |i − j| < n
        per_item = self.last and lengths is not None and bool((lengths != n).any())
        ends = lengths.tolist() if per_item else [n]
        rows, cols = [], []
        for b, length in enumerate(ends):
            ar = torch.arange(length)
            base = b * n
            if window is not None:
                off = torch.arange(-window, window + 1)
                j = ar[:, None] + off
                ok = (j >= 0) & (j < length)
                rows.append((ar[:, None].expand_as(j) + base)[ok])
                cols.append(j[ok])
            for g in ([0] if self.first else []) + ([length - 1] if self.last else []):
                rows += [torch.full((length,), g + base), ar + base]
                cols += [ar, torch.full((length,), g)]
        batch = (len(ends), 1) if per_item else ()
        return AttentionGraph.from_edges(torch.cat(rows), torch.cat(cols), n, n, batch)


def merge_union(big: AttentionGraph, small: AttentionGraph) -> AttentionGraph:
    """big ∪ small — the same edge set as ``big | small`` — without sorting big's edges.

    Edge keys (row · n_k + key) of a CSR graph are sorted and unique, so the union is a merge of
    two sorted arrays: each key's place is its own rank plus the number of keys of the other
    array below it (``searchsorted``). O(E_big log E_small + E_small log E_big) instead of
    O((E_big + E_small) log(E_big + E_small)). ``small``'s batch shape must broadcast to big's.
    """
    for name, g in (("big", big), ("small", small)):
        if not isinstance(g, AttentionGraph):
            raise TypeError(f"{name} must be an AttentionGraph, got {type(g).__name__}")
    if (big.n_q, big.n_k) != (small.n_q, small.n_k):
        raise ValueError(
            f"graphs have different sizes: {(big.n_q, big.n_k)} vs {(small.n_q, small.n_k)}"
        )
    small = small.expand(big.batch_shape)
    n_k = big.n_k
    kb = big.row_indices() * n_k + big.col
    ks = small.row_indices() * n_k + small.col
    if kb.numel():
        found = kb[torch.searchsorted(kb, ks).clamp_max(kb.numel() - 1)] == ks
        ks = ks[~found]
    merged = torch.empty(kb.numel() + ks.numel(), dtype=torch.long)
    merged[torch.arange(kb.numel()) + torch.searchsorted(ks, kb)] = kb
    merged[torch.arange(ks.numel()) + torch.searchsorted(kb, ks)] = ks
    counts = torch.bincount(torch.div(merged, n_k, rounding_mode="floor"), minlength=big.num_rows)
    crow = torch.zeros(big.num_rows + 1, dtype=torch.long)
    torch.cumsum(counts, 0, out=crow[1:])
    return AttentionGraph(
        crow, merged % n_k, big.n_q, n_k, big.batch_shape, big.causal and small.causal
    )


def union_fixed(
    graph: AttentionGraph, fixed: FixedParts | None, lengths: Tensor | None = None
) -> AttentionGraph:
    """Ĝ ∪ fixed parts (§4.7), by :func:`merge_union` when the fixed graph broadcasts to Ĝ's
    batch shape (the usual case), else by the general union."""
    extra = None if fixed is None else fixed.graph(graph.n_q, lengths)
    if extra is None:
        return graph
    if len(extra.batch_shape) <= len(graph.batch_shape) and all(
        e in (1, g) for e, g in zip(extra.batch_shape[::-1], graph.batch_shape[::-1], strict=False)
    ):
        return merge_union(graph, extra)
    return graph | extra


# --------------------------------------------------------------------------- predictors
def check_right_padding(name: str, valid: Tensor) -> Tensor:
    """``valid`` (B, n) bool must mark right padding: each row True on a prefix, then False
    (the layout of Hugging Face tokenizers; fixed parts and chunks rely on it)."""
    if bool((valid[:, 1:] & ~valid[:, :-1]).any()):
        raise ValueError(
            f"{name} must mark right padding (each row: real tokens first, then "
            "padding); got a row with a real token after padding"
        )
    return valid


class GraphPredictor(abc.ABC):
    """Predicts Ĝ_h from q (B, H, n_q, d), k (B, H, n_k, d); ``projection`` (if any) first."""

    projection: QKProjection | None = None

    @property
    def name(self) -> str:
        return type(self).__name__

    def params(self) -> dict:
        """The predictor's knobs (for reports)."""
        return {}

    def __repr__(self) -> str:
        return f"{self.name}({', '.join(f'{k}={v!r}' for k, v in self.params().items())})"

    @staticmethod
    def _check(q: Tensor, k: Tensor, valid: Tensor | None = None) -> None:
        """q (B, H, n_q, d), k (B, H, n_k, d) floating; ``valid`` (B, n) bool with n_q = n_k."""
        check_tensor("q", q, dim=4, floating=True)
        check_tensor("k", k, dim=4, floating=True)
        if q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
            raise ValueError(
                f"q and k must have shape (B, H, n, d) with the same B, H and d, "
                f"got {tuple(q.shape)}, {tuple(k.shape)}"
            )
        if valid is not None:
            if q.shape[-2] != k.shape[-2]:
                raise ValueError(
                    f"valid needs self-attention (n_q == n_k), got {q.shape[-2]}, {k.shape[-2]}"
                )
            check_tensor("valid", valid, dtype=torch.bool, shape=(q.shape[0], q.shape[-2]))
            check_right_padding("valid", valid)

    def _inputs(self, q: Tensor, k: Tensor, valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Checked (and finite) q, k, projected when a projection is set."""
        self._check(q, k, valid)
        if self.projection is not None:  # transform checks q, k
            return self.projection.transform(q, k)
        return check_finite_tensor("q", q), check_finite_tensor("k", k)

    @abc.abstractmethod
    def predict(self, q: Tensor, k: Tensor, valid: Tensor | None = None) -> AttentionGraph:
        """Ĝ with ``batch_shape`` (B, H) (or one that broadcasts to it)."""


class DistancePredictor(GraphPredictor):
    """§4.3: Ĝ = {(i, j) : ‖q′_i − k′_j‖₂ ≤ t}. Quadratic, but in r instead of d dimensions."""

    def __init__(self, threshold: float, projection: QKProjection | None = None) -> None:
        self.threshold = check_finite_float("threshold", threshold, 0.0)
        self.projection = _check_projection(projection)

    def params(self) -> dict:
        return {"threshold": self.threshold}

    def predict(self, q: Tensor, k: Tensor, valid: Tensor | None = None) -> AttentionGraph:
        qp, kp = self._inputs(q, k, valid)
        sq = (
            (qp * qp).sum(-1, keepdim=True)
            - 2 * qp @ kp.transpose(-1, -2)
            + (kp * kp).sum(-1).unsqueeze(-2)
        )
        mask = sq <= self.threshold**2
        if valid is not None:
            mask &= (valid[:, :, None] & valid[:, None, :])[:, None]
        return AttentionGraph.from_dense(mask.cpu())


class QuantizationPredictor(GraphPredictor):
    """§4.4: β balanced bins per projected coordinate; an edge where q_i and k_j share a bin in
    any coordinate (B = r·β buckets). No fitting beyond the projection."""

    def __init__(self, bins: int, projection: QKProjection | None = None) -> None:
        self.bins = check_positive("bins", bins)
        self.projection = _check_projection(projection)

    def params(self) -> dict:
        return {"bins": self.bins}

    def predict(self, q: Tensor, k: Tensor, valid: Tensor | None = None) -> AttentionGraph:
        qp, kp = self._inputs(q, k, valid)
        r = qp.shape[-1]
        return bucket_graph(
            quantize(qp, self.bins, valid).cpu(),
            quantize(kp, self.bins, valid).cpu(),
            r * self.bins,
        )


class KMeansPredictor(GraphPredictor):
    """§4.5: offline k-means centroids c_1..c_B in the projected space (shared by queries and
    keys, fitted per head); f(x) = top-k nearest centroids (eqs. 8–9); edge iff shared cluster.

    Fitting follows table 5 (k-means++), trimmed: ``n_init`` runs of at most ``max_iter`` Lloyd
    iterations (table 5: 10 and 300) on at most ``max_points`` projected train queries and keys
    per head (a "small portion of the training set", §4.5).
    Fitted: ``centroids_`` (H, B, r), ``inertia_`` (H,).
    """

    def __init__(
        self,
        n_clusters: int,
        top_k: int = 1,
        projection: QKProjection | None = None,
        n_init: int = 2,
        max_iter: int = 50,
        max_points: int = 2048,
        seed: int = 0,
    ) -> None:
        self.n_clusters = check_positive("n_clusters", n_clusters)
        self.top_k = check_positive("top_k", top_k)
        self.projection = _check_projection(projection)
        self.n_init, self.max_iter = (
            check_positive("n_init", n_init),
            check_positive("max_iter", max_iter),
        )
        self.max_points, self.seed = check_positive("max_points", max_points), _check_seed(seed)

    def params(self) -> dict:
        return {"n_clusters": self.n_clusters, "top_k": self.top_k}

    def fit(self, q: Tensor, k: Tensor) -> KMeansPredictor:
        """q, k: (H, N, d) train queries and keys of one layer (projected here if a projection
        is set). Returns self."""
        _check_train(q, k)
        if self.projection is not None:
            q, k = self.projection.transform(q, k)
        self.centroids_, self.inertia_ = _fit_centroids(
            torch.cat([q, k], 1),
            self.n_clusters,
            self.max_points,
            self.seed,
            n_init=self.n_init,
            max_iter=self.max_iter,
        )
        return self

    def with_top_k(self, top_k: int) -> KMeansPredictor:
        """The same fitted centroids with another top-k (a new object)."""
        if not hasattr(self, "centroids_"):
            raise RuntimeError("KMeansPredictor is not fitted: call fit(q, k) first")
        out = KMeansPredictor(
            self.n_clusters,
            top_k,
            self.projection,
            self.n_init,
            self.max_iter,
            self.max_points,
            self.seed,
        )
        out.centroids_, out.inertia_ = self.centroids_, self.inertia_
        return out

    def predict(self, q: Tensor, k: Tensor, valid: Tensor | None = None) -> AttentionGraph:
        if not hasattr(self, "centroids_"):
            raise RuntimeError("KMeansPredictor is not fitted: call fit(q, k) first")
        qp, kp = self._inputs(q, k, valid)
        _check_fitted_shape(qp, self.centroids_)
        qb = nearest_centroids(qp, self.centroids_, self.top_k)
        kb = nearest_centroids(kp, self.centroids_, self.top_k)
        if valid is not None:
            pad = ~valid[:, None, :, None]
            qb, kb = qb.masked_fill(pad, -1), kb.masked_fill(pad, -1)
        return bucket_graph(qb.cpu(), kb.cpu(), self.n_clusters)


def _check_projection(projection: QKProjection | None) -> QKProjection | None:
    if projection is not None and not isinstance(projection, QKProjection):
        raise TypeError(
            f"projection must be a QKProjection or None, got {type(projection).__name__}"
        )
    return projection


def _check_seed(seed: int) -> int:
    seed = check_int("seed", seed, 0)
    if seed >= 1 << 40:
        raise ValueError(f"seed must be < 2^40, got {seed}")
    return seed


def _check_fitted_shape(x: Tensor, centroids: Tensor) -> None:
    """Projected queries (B, H, n, r) must have the H and r the centroids (H, C, r) were fit on."""
    if x.shape[1] != centroids.shape[0] or x.shape[-1] != centroids.shape[-1]:
        raise ValueError(
            f"q and k must have {centroids.shape[0]} heads of size "
            f"{centroids.shape[-1]} (as fitted), got {tuple(x.shape)}"
        )


def _check_train(q: Tensor, k: Tensor) -> None:
    """Train queries and keys of one layer: finite (H, N, d) tensors with the same H and d."""
    check_tensor("q", q, dim=3, floating=True)
    check_tensor("k", k, dim=3, floating=True)
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q and k must be (H, N, d) with the same H and d, got "
            f"{tuple(q.shape)}, {tuple(k.shape)}"
        )
    check_finite_tensor("q", q)
    check_finite_tensor("k", k)


def _fit_centroids(
    points: Tensor, n_clusters: int, max_points: int, seed: int, **kwargs
) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    if points.shape[1] > max_points:
        keep = torch.randperm(points.shape[1], generator=gen)[:max_points]
        points = points[:, keep]
    return kmeans(points.detach().float(), n_clusters, gen=gen, **kwargs)


# --------------------------------------------------------------------------- chunks (§6.1)
def chunk_means(x: Tensor, block: int, valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Mean of x over chunks of ``block`` consecutive real tokens.

    x (B, H, n, d), valid (B, n) → (B, H, ⌈n/z⌉, d) and chunk validity (B, ⌈n/z⌉).
    """
    bsz, heads, n, d = x.shape
    pad = -n % block
    v = torch.ones(bsz, n, dtype=torch.bool) if valid is None else valid
    w = torch.nn.functional.pad(v.to(x.dtype), (0, pad)).view(bsz, 1, -1, block, 1)
    xs = torch.nn.functional.pad(x, (0, 0, 0, pad)).view(bsz, heads, -1, block, d)
    total = (xs * w).sum(-2)
    count = w.sum(-2)
    return total / count.clamp_min(1), count[:, 0, :, 0] > 0


def chunk_layer(graphs: LayerGraphs, block: int) -> LayerGraphs:
    """The chunk-level problem of §6.1: mean q, k per chunk; chunk pair (a, b) is an edge when
    any token pair inside is an edge of the gold graph."""
    out = []
    for batch in graphs.batches:
        q, valid = chunk_means(batch.q, block, batch.valid)
        k, _ = chunk_means(batch.k, block, batch.valid)
        gold = AttentionGraph.from_dense(batch.gold).to_block_layout(block)
        out.append(GraphBatch(q, k, gold & (valid[:, :, None] & valid[:, None, :])[:, None], valid))
    return LayerGraphs(graphs.layer, out)


def expand_blocks(
    chunks: AttentionGraph, block: int, n: int, valid: Tensor | None = None
) -> AttentionGraph:
    """Token graph of a chunk graph: query i attends every key of each chunk its chunk attends.

    ``valid`` (B, n) bool, True for real tokens: a chunk that holds the last real tokens and
    some padding gives no edge to its padding keys, and padding queries get no edges, so
    padding joins no chunk (as it joins no bucket of the other predictors).
    """
    index, ok = chunks.to_neighbours()  # (..., n_c, K)
    tokens = (index[..., :, :, None] * block + torch.arange(block)).flatten(-2)  # (..., n_c, Kz)
    ok = ok.repeat_interleave(block, -1) & (tokens < n)
    rows = torch.arange(n) // block
    tokens, ok = tokens[..., rows, :], ok[..., rows, :]  # (..., n, Kz)
    if valid is not None:
        real = valid.to(ok.device).view(valid.shape[0], *([1] * (ok.dim() - 3)), n)
        real = real.expand(*ok.shape[:-2], n)
        ok = ok & torch.gather(real, -1, tokens.clamp_max(n - 1).flatten(-2)).view_as(ok)
        ok = ok & real[..., :, None]
    return AttentionGraph.from_neighbours(tokens, ok, n)


class ChunkedPredictor(GraphPredictor):
    """Efficient Sparsefinder (§6.1): predict a graph of z × z blocks.

    ``projection`` is trained on the chunk-level graph (:func:`chunk_layer`). Variant ``"v1"``:
    each query chunk keeps the ``top_blocks`` key chunks with the smallest projected distance.
    Variant ``"v2"``: k-means centroids on projected chunks (fit); each centroid takes its
    ``top_blocks`` nearest query chunks and key chunks (Routing Transformer's top-k); chunks that
    share a centroid are connected.
    """

    def __init__(
        self,
        block: int,
        top_blocks: int,
        projection: QKProjection,
        variant: str = "v1",
        n_clusters: int = 4,
        seed: int = 0,
    ) -> None:
        self.block = check_positive("block", block)
        self.top_blocks = check_positive("top_blocks", top_blocks)
        if not isinstance(projection, QKProjection):
            raise TypeError(f"projection must be a QKProjection, got {type(projection).__name__}")
        self.projection = projection
        self.variant = check_choice("variant", variant, ("v1", "v2"))
        self.n_clusters, self.seed = check_positive("n_clusters", n_clusters), _check_seed(seed)

    @property
    def name(self) -> str:
        return f"Chunked{self.variant}"

    def params(self) -> dict:
        out = {"block": self.block, "top_blocks": self.top_blocks}
        return out | ({"n_clusters": self.n_clusters} if self.variant == "v2" else {})

    def fit(self, chunks: LayerGraphs) -> ChunkedPredictor:
        """v2: fit the centroids on projected train chunks (a no-op for v1). Returns self."""
        if not isinstance(chunks, LayerGraphs) or not chunks.batches:
            raise TypeError(
                f"chunks must be a LayerGraphs with batches (see chunk_layer), got "
                f"{type(chunks).__name__}"
            )
        if self.variant == "v2":
            q, k = chunks.tokens()
            q, k = self.projection.transform(q, k)
            self.centroids_, _ = _fit_centroids(
                torch.cat([q, k], 1), self.n_clusters, 2048, self.seed, n_init=2, max_iter=50
            )
        return self

    def with_top_blocks(self, top_blocks: int) -> ChunkedPredictor:
        out = ChunkedPredictor(
            self.block, top_blocks, self.projection, self.variant, self.n_clusters, self.seed
        )
        if hasattr(self, "centroids_"):
            out.centroids_ = self.centroids_
        return out

    def predict(self, q: Tensor, k: Tensor, valid: Tensor | None = None) -> AttentionGraph:
        self._check(q, k, valid)
        if q.shape[-2] != k.shape[-2]:
            raise ValueError(
                f"chunked prediction needs n_q == n_k, got {q.shape[-2]}, {k.shape[-2]}"
            )
        n = q.shape[-2]
        qc, cvalid = chunk_means(q, self.block, valid)
        kc, _ = chunk_means(k, self.block, valid)
        qp, kp = self._inputs(qc, kc)
        n_c = qp.shape[-2]
        if self.variant == "v1":
            dist = _sq_dist(qp, kp).masked_fill(~cvalid[:, None, None, :], math.inf)
            top = dist.topk(min(self.top_blocks, n_c), dim=-1, largest=False).indices
            ok = torch.gather(cvalid[:, None, None, :].expand_as(dist), -1, top)
            ok &= cvalid[:, None, :, None]
            chunks = AttentionGraph.from_neighbours(top.cpu(), ok.cpu(), n_c)
        else:
            if not hasattr(self, "centroids_"):
                raise RuntimeError("ChunkedPredictor v2 is not fitted: call fit(chunks) first")
            _check_fitted_shape(qp, self.centroids_)
            qb = centroid_topk_buckets(qp, self.centroids_, self.top_blocks, cvalid)
            kb = centroid_topk_buckets(kp, self.centroids_, self.top_blocks, cvalid)
            chunks = bucket_graph(qb.cpu(), kb.cpu(), self.centroids_.shape[1])
        return expand_blocks(chunks, self.block, n, valid)
