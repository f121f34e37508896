"""Baselines for Sparsefinder's sparsity–recall comparison (§5, appendix C.2), as graph predictors.

Each has the :class:`~sparseattn.predict.predictors.GraphPredictor` interface, so it is evaluated
on the same extracted graphs with the same metrics, and unioned with the same
:class:`~sparseattn.predict.predictors.FixedParts` (first token, optionally last, window):

* :class:`WindowBaseline` — keys |i − j| ≤ w only (its knob is w itself).
* :class:`BigBirdBaseline` — ``random_blocks`` random key blocks per query block, block size 1
  (appendix C.2), from :func:`sparseattn.patterns.random_blocks`.
* :class:`LongformerBaseline` — ``global_tokens`` global tokens at random positions.
* :class:`StridedBaseline` — keys j ≡ i (mod s) (Child et al.; the stride half of ``strided``).
* :class:`LSHBaseline` — Reformer: angular LSH, one random rotation R shared by queries and keys,
  bucket = argmax([xR; −xR]) of the unit-normalised vector (Kitaev et al. 2020); shared buckets
  for queries and keys.
* :class:`RoutingBaseline` — Routing Transformer: spherical k-means centroids learned online
  (mini-batch exponential moving averages) on unit-normalised train queries and keys; each
  centroid takes its ⌈L/C⌉ nearest queries and keys (balanced clusters, top-k per centroid).

LSH and routing work in the learned projected space (``projection`` given, as the authors' code
does) or on the raw q, k (``projection=None``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..graph import AttentionGraph
from ..patterns import global_tokens, random_blocks, strided
from ..validate import check_finite_float, check_int, check_positive, check_tensor
from .predictors import (
    FixedParts,
    GraphPredictor,
    _check_fitted_shape,
    _check_projection,
    _check_seed,
    _check_train,
    bucket_graph,
    centroid_topk_buckets,
)
from .projection import QKProjection

__all__ = [
    "BigBirdBaseline",
    "LSHBaseline",
    "LongformerBaseline",
    "RoutingBaseline",
    "StridedBaseline",
    "WindowBaseline",
]


class WindowBaseline(GraphPredictor):
    """Keys |i − j| ≤ ``window`` (the paper's window size 2·window + 1)."""

    def __init__(self, window: int) -> None:
        self.window = check_int("window", window, 0)

    def params(self) -> dict:
        return {"window": self.window}

    def predict(self, q: Tensor, k: Tensor, valid: Tensor | None = None) -> AttentionGraph:
        self._check(q, k, valid)
        return FixedParts(self.window, first=False).graph(q.shape[-2])


class BigBirdBaseline(GraphPredictor):
    """BigBird's random part: every query attends ``random_blocks`` random keys (block size 1)."""

    def __init__(self, random_blocks: int, block: int = 1, seed: int = 0) -> None:
        self.random_blocks = check_positive("random_blocks", random_blocks)
        self.block = check_positive("block", block)
        self.seed = _check_seed(seed)

    def params(self) -> dict:
        return {"random_blocks": self.random_blocks, "block": self.block}

    def predict(self, q: Tensor, k: Tensor, valid: Tensor | None = None) -> AttentionGraph:
        self._check(q, k, valid)
        return random_blocks(self.random_blocks, self.block, self.seed).graph(q.shape[-2])


class LongformerBaseline(GraphPredictor):
    """Longformer's global attention at ``global_tokens`` random positions (drawn per length n
    from ``seed``): each attends to all keys and is attended by all queries."""

    def __init__(self, global_tokens: int, seed: int = 0) -> None:
        self.global_tokens = check_positive("global_tokens", global_tokens)
        self.seed = _check_seed(seed)

    def params(self) -> dict:
        return {"global_tokens": self.global_tokens}

    def predict(self, q: Tensor, k: Tensor, valid: Tensor | None = None) -> AttentionGraph:
        self._check(q, k, valid)
        n = q.shape[-2]
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + n)
        positions = torch.randperm(n, generator=gen)[: self.global_tokens].tolist()
        return global_tokens(positions).graph(n)


class StridedBaseline(GraphPredictor):
    """Strided attention (Child et al.): keys j with (j − i) divisible by ``stride``."""

    def __init__(self, stride: int) -> None:
        self.stride = check_positive("stride", stride)

    def params(self) -> dict:
        return {"stride": self.stride}

    def predict(self, q: Tensor, k: Tensor, valid: Tensor | None = None) -> AttentionGraph:
        self._check(q, k, valid)
        return strided(self.stride, part=2).graph(q.shape[-2])


def _unit(x: Tensor) -> Tensor:
    return torch.nn.functional.normalize(x, dim=-1)


class LSHBaseline(GraphPredictor):
    """Reformer LSH: ``buckets`` angular hash buckets shared by queries and keys.

    Per head one Gaussian rotation R (dim × ⌈buckets/2⌉) drawn from ``seed``; bucket(x) =
    argmax([x̂R; −x̂R]) (even ``buckets``) or argmax(x̂R) (odd), with x̂ = x/‖x‖. One bucket gives
    the complete graph.
    """

    def __init__(self, buckets: int, projection: QKProjection | None = None,
                 seed: int = 0) -> None:
        self.buckets = check_positive("buckets", buckets)
        self.projection, self.seed = _check_projection(projection), _check_seed(seed)

    def params(self) -> dict:
        return {"buckets": self.buckets}

    def hash(self, x: Tensor) -> Tensor:
        """x (B, H, n, dim) → LongTensor (B, H, n) bucket ids in [0, buckets)."""
        check_tensor("x", x, dim=4, floating=True)
        heads, dim = x.shape[1], x.shape[-1]
        half = self.buckets % 2 == 0
        cols = self.buckets // 2 if half else self.buckets
        if heads * dim * cols > 1 << 28:
            raise ValueError(f"buckets={self.buckets} with {heads} heads of size {dim} needs a "
                             f"{heads * dim * cols:,}-entry rotation; at most 2^28 are allocated")
        gen = torch.Generator().manual_seed(self.seed)
        rot = torch.randn(heads, dim, cols, generator=gen).to(x)
        proj = _unit(x) @ rot
        if half:
            proj = torch.cat([proj, -proj], -1)
        return proj.argmax(-1)

    def predict(self, q: Tensor, k: Tensor, valid: Tensor | None = None) -> AttentionGraph:
        qp, kp = self._inputs(q, k, valid)
        qb, kb = self.hash(qp)[..., None], self.hash(kp)[..., None]
        if valid is not None:
            pad = ~valid[:, None, :, None]
            qb, kb = qb.masked_fill(pad, -1), kb.masked_fill(pad, -1)
        return bucket_graph(qb.cpu(), kb.cpu(), self.buckets)


class RoutingBaseline(GraphPredictor):
    """Routing Transformer: online spherical k-means, balanced top-k per centroid.

    ``fit`` runs mini-batch k-means with exponential moving averages, c ← λc + (1 − λ)·mean of the
    points assigned to c (λ = ``decay``), on unit-normalised train queries and keys, ``epochs``
    shuffled passes of ``batch`` points per head (over at most ``max_points`` of them).
    ``predict``: each centroid takes its ⌈L/C⌉ nearest (by cosine) queries and keys of the
    sequence. Fitted: ``centroids_`` (H, C, dim).
    """

    def __init__(self, n_clusters: int, projection: QKProjection | None = None,
                 decay: float = 0.99, epochs: int = 1, batch: int = 256,
                 max_points: int = 16384, seed: int = 0) -> None:
        self.n_clusters = check_positive("n_clusters", n_clusters)
        self.decay = check_finite_float("decay", decay, 0.0, 1.0, high_open=True)
        self.projection = _check_projection(projection)
        self.epochs, self.batch = check_positive("epochs", epochs), check_positive("batch", batch)
        self.max_points, self.seed = check_positive("max_points", max_points), _check_seed(seed)

    def params(self) -> dict:
        return {"n_clusters": self.n_clusters}

    def fit(self, q: Tensor, k: Tensor) -> RoutingBaseline:
        """q, k: (H, N, d) train queries and keys of one layer. Returns self."""
        _check_train(q, k)
        if self.projection is not None:
            q, k = self.projection.transform(q, k)
        points = _unit(torch.cat([q, k], 1).detach().float())  # (H, N, dim)
        gen = torch.Generator().manual_seed(self.seed)
        if points.shape[1] > self.max_points:
            points = points[:, torch.randperm(points.shape[1], generator=gen)[: self.max_points]]
        total = points.shape[1]
        if total < self.n_clusters:
            raise ValueError(f"n_clusters={self.n_clusters} exceeds the {total} train points")
        cent = points[:, torch.randperm(total, generator=gen)[: self.n_clusters]].clone()
        for _ in range(self.epochs):
            order = torch.randperm(total, generator=gen)
            for s in range(0, total, self.batch):
                x = points[:, order[s : s + self.batch]]  # (H, b, dim)
                assign = (x @ _unit(cent).transpose(-1, -2)).argmax(-1)  # (H, b)
                onehot = torch.nn.functional.one_hot(assign, self.n_clusters).to(x)
                counts = onehot.sum(1)  # (H, C)
                means = onehot.transpose(1, 2) @ x / counts.clamp_min(1)[..., None]
                moved = self.decay * cent + (1 - self.decay) * means
                cent = torch.where(counts[..., None] > 0, moved, cent)
        self.centroids_ = _unit(cent)
        return self

    def predict(self, q: Tensor, k: Tensor, valid: Tensor | None = None) -> AttentionGraph:
        if not hasattr(self, "centroids_"):
            raise RuntimeError("RoutingBaseline is not fitted: call fit(q, k) first")
        qp, kp = self._inputs(q, k, valid)
        _check_fitted_shape(qp, self.centroids_)
        n = q.shape[-2]
        lengths = torch.full((q.shape[0],), n) if valid is None else valid.sum(-1)
        per = -(-lengths // self.n_clusters)  # ⌈L/C⌉: balanced clusters
        qb = centroid_topk_buckets(_unit(qp), self.centroids_, per, valid, metric="cosine")
        kb = centroid_topk_buckets(_unit(kp), self.centroids_, per, valid, metric="cosine")
        return bucket_graph(qb.cpu(), kb.cpu(), self.n_clusters)
