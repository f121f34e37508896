"""Baselines for Sparsefinder's sparsity–recall comparison (§5, appendix C.2), as graph predictors.

Each has the :class:`~.predictors.GraphPredictor` interface, so it is evaluated on the same
extracted graphs with the same metrics, and unioned with the same :class:`~.predictors.FixedParts`
(first token, optionally last, window):

* :class:`WindowBaseline` — keys |i − j| ≤ w only (its knob is w itself).
* :class:`BigBirdBaseline` — ``random_blocks`` random key blocks per query block, block size 1
  (appendix C.2), from :func:`sparseattn.patterns.random_blocks`.
* :class:`LongformerBaseline` — ``global_tokens`` global tokens at random positions.
* :class:`StridedBaseline` — keys j ≡ i (mod s) (Child et al.; the stride half of ``strided``).
* :class:`LSHBaseline` — Reformer: angular LSH, bucket = argmax([xR; −xR]) (Kitaev et al. 2020).
  Default: shared-QK, as the Sparsefinder authors run it — each token hashed once as the
  concatenation [q′; k′], its query and key in the same bucket (a symmetric graph with the
  diagonal); ``mode="separate"`` hashes queries and keys apart with the same rotation.
* :class:`RoutingBaseline` — Routing Transformer: spherical k-means centroids learned online
  (mini-batch exponential moving averages) on unit-normalised train queries and keys; each
  centroid takes its ⌈L/C⌉ nearest queries and keys (balanced clusters, top-k per centroid).

LSH and routing work in the learned projected space (``projection`` given, as the authors' code
does) or on the raw q, k (``projection=None``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ...graph import AttentionGraph
from ...patterns import global_tokens, random_blocks, strided
from ...validate import (
    check_choice,
    check_finite_float,
    check_int,
    check_positive,
    check_tensor,
)
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


def _per_length(
    make: Callable[[int], AttentionGraph], n: int, valid: Tensor | None
) -> AttentionGraph:
    """A static baseline on real tokens only: ``make(n)``, or with ``valid`` (B, n) (right
    padding) each sequence's ``make(L_b)`` in the top-left L_b × L_b corner of its n × n graph
    (``batch_shape`` (B, 1)), so padding changes nothing among real tokens."""
    if valid is None or bool(valid.all()):
        return make(n)
    rows, cols = [torch.zeros(0, dtype=torch.long)], [torch.zeros(0, dtype=torch.long)]
    for b, length in enumerate(valid.sum(-1).tolist()):
        if length:
            graph = make(int(length))
            rows.append(graph.row_indices() + b * n)
            cols.append(graph.col)
    return AttentionGraph.from_edges(torch.cat(rows), torch.cat(cols), n, n, (valid.shape[0], 1))


class WindowBaseline(GraphPredictor):
    """Keys |i − j| ≤ ``window`` (the paper's window size 2·window + 1)."""

    def __init__(self, window: int) -> None:
        self.window = check_int("window", window, 0)

    def params(self) -> dict:
        return {"window": self.window}

    def predict(self, q: Tensor, k: Tensor, valid: Tensor | None = None) -> AttentionGraph:
        self._check(q, k, valid)
        return _per_length(FixedParts(self.window, first=False).graph, q.shape[-2], valid)


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
        pattern = random_blocks(self.random_blocks, self.block, self.seed)
        return _per_length(pattern.graph, q.shape[-2], valid)


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
        return _per_length(self._graph, q.shape[-2], valid)

    def _graph(self, n: int) -> AttentionGraph:
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
        return _per_length(strided(self.stride, part=2).graph, q.shape[-2], valid)


def _unit(x: Tensor) -> Tensor:
    return torch.nn.functional.normalize(x, dim=-1)


class LSHBaseline(GraphPredictor):
    """Reformer's angular LSH (Kitaev et al. 2020, §2 "LSH attention"), as a graph predictor.

    Per head and hashing round a Gaussian rotation R (dim × ⌈buckets/2⌉) drawn from ``seed``;
    h(x) = argmax([x̂R; −x̂R]) for even ``buckets`` (Reformer's rule) or argmax(x̂R) for odd ones,
    x̂ = x/‖x‖ (the argmax does not depend on ‖x‖). ``rounds`` > 1 hashes with that many rotations
    and keeps an edge when any round collides (Reformer's multi-round hashing).

    ``mode="shared"`` (default) — shared-QK attention, as the Sparsefinder authors run their
    Reformer baseline: token i is hashed once, as the concatenation x_i = [q′_i; k′_i] ∈ R^{2r},
    and query i and key i share that bucket, so Ĝ = {(i, j) : h(x_i) = h(x_j)} is symmetric and
    holds the diagonal — the cause of Reformer's "high recall, low sparsity" (Sparsefinder §5).
    ``mode="separate"`` — queries and keys hashed apart with the same rotation:
    Ĝ = {(i, j) : h(q′_i) = h(k′_j)}, neither symmetric nor reflexive.

    One bucket gives the complete graph. Padding (``valid``) gets no bucket.
    """

    MODES = ("shared", "separate")

    def __init__(
        self,
        buckets: int,
        projection: QKProjection | None = None,
        seed: int = 0,
        mode: str = "shared",
        rounds: int = 1,
    ) -> None:
        self.buckets = check_positive("buckets", buckets)
        self.projection, self.seed = _check_projection(projection), _check_seed(seed)
        self.mode = check_choice("mode", mode, self.MODES)
        self.rounds = check_positive("rounds", rounds)

    def params(self) -> dict:
        out = {"buckets": self.buckets, "mode": self.mode}
        return out | ({"rounds": self.rounds} if self.rounds > 1 else {})

    def rotations(self, heads: int, dim: int) -> Tensor:
        """The random rotations: (heads, rounds, dim, ⌈buckets/2⌉) (even buckets) or
        (heads, rounds, dim, buckets) (odd), the same for the same seed."""
        cols = self.buckets // 2 if self.buckets % 2 == 0 else self.buckets
        size = heads * self.rounds * dim * cols
        if size > 1 << 28:
            raise ValueError(
                f"buckets={self.buckets}, rounds={self.rounds} with {heads} heads of "
                f"size {dim} needs a {size:,}-entry rotation; at most 2^28 are "
                "allocated"
            )
        gen = torch.Generator().manual_seed(self.seed)
        return torch.randn(heads, self.rounds, dim, cols, generator=gen)

    def hash(self, x: Tensor) -> Tensor:
        """x (B, H, n, dim) → LongTensor (B, H, n, rounds): bucket ids in [0, buckets)."""
        check_tensor("x", x, dim=4, floating=True)
        rot = self.rotations(x.shape[1], x.shape[-1]).to(x)  # (H, R, dim, c)
        proj = torch.einsum("bhnd,hrdc->bhnrc", _unit(x), rot)
        if self.buckets % 2 == 0:
            proj = torch.cat([proj, -proj], -1)
        return proj.argmax(-1)

    def predict(self, q: Tensor, k: Tensor, valid: Tensor | None = None) -> AttentionGraph:
        qp, kp = self._inputs(q, k, valid)
        if self.mode == "shared":
            if qp.shape[-2] != kp.shape[-2]:
                raise ValueError(
                    f"shared-QK hashing needs n_q == n_k, got {qp.shape[-2]}, {kp.shape[-2]}"
                )
            qb = kb = self._offset(self.hash(torch.cat([qp, kp], -1)), valid)
        else:
            qb, kb = self._offset(self.hash(qp), valid), self._offset(self.hash(kp), valid)
        return bucket_graph(qb.cpu(), kb.cpu(), self.rounds * self.buckets)

    def _offset(self, ids: Tensor, valid: Tensor | None) -> Tensor:
        """Bucket ids (B, H, n, rounds) → distinct ids per round (round · buckets + id), −1 for
        padding."""
        ids = ids + torch.arange(self.rounds, device=ids.device) * self.buckets
        if valid is not None:
            ids = ids.masked_fill(~valid[:, None, :, None].to(ids.device), -1)
        return ids


class RoutingBaseline(GraphPredictor):
    """Routing Transformer: online spherical k-means, balanced top-k per centroid.

    ``fit`` runs mini-batch k-means with exponential moving averages, c ← λc + (1 − λ)·mean of the
    points assigned to c (λ = ``decay``), on unit-normalised train queries and keys, ``epochs``
    shuffled passes of ``batch`` points per head (over at most ``max_points`` of them).
    ``predict``: each centroid takes its ⌈L/C⌉ nearest (by cosine) queries and keys of the
    sequence. Fitted: ``centroids_`` (H, C, dim).
    """

    def __init__(
        self,
        n_clusters: int,
        projection: QKProjection | None = None,
        decay: float = 0.99,
        epochs: int = 1,
        batch: int = 256,
        max_points: int = 16384,
        seed: int = 0,
    ) -> None:
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
