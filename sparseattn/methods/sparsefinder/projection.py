"""Learned low-dimensional projections of queries and keys (Sparsefinder §4.2, eq. 7).

Per head h, two linear maps with bias, g_q, g_k : R^d → R^r (r = 4 by default), are trained so
that the projections q′ = g_q(q), k′ = g_k(k) of an attention edge (i, j) ∈ G_h lie closer than
those of a non-edge, by the hinge loss of eq. 7 with margin ω:

    L = [ω + ‖q′_i − k′_P‖² − ‖q′_i − k′_N‖²]₊ ,

one triplet per positive pair (i, P) ∈ G_h, with the negative key N drawn uniformly from the
non-edges of query i among the real tokens of the same sequence. Adam, lr 0.01, one epoch over all
positive pairs (paper, table 5); every head is trained independently (its own loss and
parameters), all heads in one batched computation.

The estimator follows scikit-learn: ``fit(...)`` returns self, fitted state ends in ``_``,
``transform(q, k)`` is pure.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
from torch import Tensor

from ...validate import (
    check_finite_float,
    check_finite_tensor,
    check_int,
    check_positive,
    check_tensor,
)
from .extract import GraphBatch, LayerGraphs

__all__ = ["Exclude", "QKProjection", "Triplets", "hinge_loss", "sample_triplets"]


def hinge_loss(q: Tensor, k_pos: Tensor, k_neg: Tensor, margin: float = 1.0) -> Tensor:
    """Sparsefinder eq. 7, [ω + ‖q′ − k′_P‖² − ‖q′ − k′_N‖²]₊, per triplet.

    q, k_pos, k_neg: (..., r) projected query, positive key, negative key → (...) losses.
    """
    margin = check_finite_float("margin", margin)
    for name, x in (("q", q), ("k_pos", k_pos), ("k_neg", k_neg)):
        check_tensor(name, x, floating=True)
        if x.dim() == 0 or x.shape[-1] != q.shape[-1]:
            raise ValueError(f"{name} must have shape (..., r) with q's r, got {tuple(x.shape)}")
    try:
        torch.broadcast_shapes(q.shape, k_pos.shape, k_neg.shape)
    except RuntimeError as err:
        raise ValueError(
            f"q, k_pos and k_neg must broadcast, got {tuple(q.shape)}, "
            f"{tuple(k_pos.shape)}, {tuple(k_neg.shape)}"
        ) from err
    d_pos = (q - k_pos).square().sum(-1)
    d_neg = (q - k_neg).square().sum(-1)
    return (margin + d_pos - d_neg).clamp_min(0.0)


@dataclasses.dataclass(frozen=True)
class Triplets:
    """Training triplets of one layer, padded per head: ``query``, ``pos``, ``neg`` (H, M) index
    the layer's flattened real tokens (see :meth:`LayerGraphs.tokens`); ``mask`` (H, M) marks the
    real triplets (heads have different numbers of edges)."""

    query: Tensor
    pos: Tensor
    neg: Tensor
    mask: Tensor

    @property
    def counts(self) -> Tensor:
        return self.mask.sum(-1)


Exclude = Callable[[GraphBatch], Tensor]
"""``exclude(batch)`` → bool (b, 1 or H, n, n): pairs that are always attended (a window, global
tokens), left out of training — neither positives nor negatives."""


def _flat_edges(graphs: LayerGraphs, exclude: Exclude | None) -> tuple[Tensor, ...]:
    """Positive edges (head, query, key) in flattened-token numbering, the flattened keys of all
    blocked pairs (gold ∪ excluded) as sorted (head·N + query)·N + key, and per token the start
    and length of its sequence."""
    heads, queries, keys, blocked, starts, lengths = [], [], [], [], [], []
    offset = 0
    for batch in graphs.batches:
        valid = batch.valid
        flat = torch.cumsum(valid.reshape(-1).long(), 0).view(valid.shape) - 1 + offset
        seq_start = flat.masked_fill(~valid, 1 << 62).amin(-1)  # first real token
        seq_len = valid.sum(-1)
        positive, block = batch.gold, batch.gold
        if exclude is not None:
            fixed = exclude(batch)
            positive, block = batch.gold & ~fixed, batch.gold | (fixed & batch.pair_mask())
        s, h, i, j = positive.nonzero(as_tuple=True)
        heads.append(h)
        queries.append(flat[s, i])
        keys.append(flat[s, j])
        s, h, i, j = block.expand_as(batch.gold).nonzero(as_tuple=True)
        blocked.append((h, flat[s, i], flat[s, j]))
        starts.append(seq_start[:, None].expand(valid.shape)[valid])
        lengths.append(seq_len[:, None].expand(valid.shape)[valid])
        offset += int(valid.sum())
    n_tok = offset
    bh, bq, bk = (torch.cat(x) for x in zip(*blocked, strict=True))
    return (
        torch.cat(heads),
        torch.cat(queries),
        torch.cat(keys),
        ((bh * n_tok + bq) * n_tok + bk).sort().values,
        torch.cat(starts),
        torch.cat(lengths),
    )


def sample_triplets(
    graphs: LayerGraphs,
    gen: torch.Generator,
    max_pairs: int | None = None,
    exclude: Exclude | None = None,
) -> Triplets:
    """One triplet (i, P, N) per gold edge (i, P) of each head, in random order (eq. 7).

    N is uniform over the real keys j of i's sequence with (i, j) ∉ G_h (rejection sampling);
    queries whose row is complete (no non-edge) give no triplet. ``max_pairs`` keeps a uniform
    random subset of at most that many triplets per head. ``exclude`` drops always-attended
    pairs from positives and negatives alike.
    """
    head, query, key, sorted_keys, start, length = _flat_edges(graphs, exclude)
    heads = graphs.heads
    n_tok = start.numel()
    row_of_blocked = torch.div(sorted_keys, n_tok, rounding_mode="floor")
    degree = torch.bincount(row_of_blocked, minlength=heads * n_tok)
    has_negative = degree[head * n_tok + query] < length[query]
    head, query, key = head[has_negative], query[has_negative], key[has_negative]
    neg = torch.empty_like(key)
    todo = torch.arange(key.numel())

    def is_edge(h: Tensor, q: Tensor, j: Tensor) -> Tensor:
        cand = (h * n_tok + q) * n_tok + j
        pos = torch.searchsorted(sorted_keys, cand).clamp_max(sorted_keys.numel() - 1)
        return sorted_keys[pos] == cand

    for _ in range(32):
        if not todo.numel():
            break
        q_t = query[todo]
        draw = start[q_t] + (torch.rand(todo.numel(), generator=gen) * length[q_t]).long()
        ok = ~is_edge(head[todo], q_t, draw)
        neg[todo[ok]] = draw[ok]
        todo = todo[~ok]
    if todo.numel():  # rows with very few non-edges: choose uniformly among all of them
        q_t = query[todo]
        cand = start[q_t, None] + torch.arange(int(length[q_t].max()))
        free = (cand < (start + length)[q_t, None]) & ~is_edge(
            head[todo, None], q_t[:, None], cand.clamp_max(n_tok - 1)
        )
        score = torch.rand(cand.shape, generator=gen).masked_fill(~free, -1.0)
        neg[todo] = cand.gather(1, score.argmax(1, keepdim=True)).squeeze(1)
    counts = torch.bincount(head, minlength=heads)
    per_head = int(counts.max()) if max_pairs is None else min(int(counts.max()), max_pairs)
    out = torch.zeros(3, heads, per_head, dtype=torch.long)
    mask = torch.zeros(heads, per_head, dtype=torch.bool)
    order = torch.argsort(head, stable=True)
    first = torch.cumsum(counts, 0) - counts
    for h in range(heads):
        idx = order[first[h] : first[h] + counts[h]]
        idx = idx[torch.randperm(idx.numel(), generator=gen)[:per_head]]
        m = idx.numel()
        out[0, h, :m], out[1, h, :m], out[2, h, :m] = query[idx], key[idx], neg[idx]
        mask[h, :m] = True
    return Triplets(out[0], out[1], out[2], mask)


class QKProjection:
    """Per-head linear projections g_q, g_k : R^d → R^r with bias (Sparsefinder §4.2).

    Args:
        r: projected dimension (paper: 4).
        margin: ω of eq. 7 (paper: 1.0).
        lr: Adam learning rate (paper: 0.01), in (0, 1e6].
        epochs: passes over the positive pairs (paper: 1); negatives are redrawn each epoch.
        batch_pairs: triplets per head per Adam step.
        max_pairs: at most this many triplets per head and epoch (None: all positive pairs).
        seed: seeds initialisation, negative sampling and order; same seed, same fit.

    Fitted attributes: ``weight_q_``, ``weight_k_`` (H, d, r); ``bias_q_``, ``bias_k_`` (H, r);
    ``loss_curve_`` (mean over heads per step); ``n_pairs_`` (H,) triplets per head and epoch.
    """

    def __init__(
        self,
        r: int = 4,
        margin: float = 1.0,
        lr: float = 0.01,
        epochs: int = 1,
        batch_pairs: int = 2048,
        max_pairs: int | None = None,
        seed: int = 0,
    ) -> None:
        r, epochs = check_positive("r", r), check_positive("epochs", epochs)
        batch_pairs = check_positive("batch_pairs", batch_pairs)
        max_pairs = None if max_pairs is None else check_positive("max_pairs", max_pairs)
        margin = check_finite_float("margin", margin, 0.0, low_open=True)
        lr = check_finite_float("lr", lr, 0.0, 1e6, low_open=True)  # Adam's step ~ lr
        seed = check_int("seed", seed, 0)
        if seed >= 1 << 63:
            raise ValueError(f"seed must be < 2^63, got {seed}")
        self.r, self.margin, self.lr, self.epochs = r, margin, lr, epochs
        self.batch_pairs, self.max_pairs, self.seed = batch_pairs, max_pairs, seed

    def get_params(self) -> dict:
        return {
            "r": self.r,
            "margin": self.margin,
            "lr": self.lr,
            "epochs": self.epochs,
            "batch_pairs": self.batch_pairs,
            "max_pairs": self.max_pairs,
            "seed": self.seed,
        }

    def __repr__(self) -> str:
        return "QKProjection(" + ", ".join(f"{k}={v!r}" for k, v in self.get_params().items()) + ")"

    # ------------------------------------------------------------------ fitting
    def fit(self, graphs: LayerGraphs, exclude: Exclude | None = None) -> QKProjection:
        """Train on the gold graphs of one layer (all heads at once); returns self.

        ``exclude`` (optional): the pairs a fixed pattern adds anyway (§4.7), left out of
        training so that the projection spends its r dimensions on the other edges."""
        if not isinstance(graphs, LayerGraphs):
            raise TypeError(f"graphs must be a LayerGraphs, got {type(graphs).__name__}")
        if not graphs.batches:
            raise ValueError("graphs holds no batches")
        if exclude is not None and not callable(exclude):
            raise TypeError(f"exclude must be callable or None, got {type(exclude).__name__}")
        gen = torch.Generator().manual_seed(self.seed)
        q_all, k_all = graphs.tokens()  # (H, N, d)
        check_finite_tensor("graphs' q", q_all)
        check_finite_tensor("graphs' k", k_all)
        heads, _, d = q_all.shape
        bound = 1 / math.sqrt(d)  # nn.Linear's default initialisation, from our generator

        def init(*shape: int) -> Tensor:
            return ((torch.rand(*shape, generator=gen) * 2 - 1) * bound).requires_grad_()

        params = [
            init(heads, d, self.r),
            init(heads, self.r),
            init(heads, d, self.r),
            init(heads, self.r),
        ]
        opt = torch.optim.Adam(params, lr=self.lr)
        rows = torch.arange(heads)[:, None]
        curve: list[float] = []
        n_pairs = None
        for _ in range(self.epochs):
            trip = sample_triplets(graphs, gen, self.max_pairs, exclude)
            n_pairs = trip.counts
            for s in range(0, trip.mask.shape[1], self.batch_pairs):
                sl = slice(s, s + self.batch_pairs)
                mask = trip.mask[:, sl].to(q_all.dtype)
                qp = self._project(q_all[rows, trip.query[:, sl]], params[0], params[1])
                kp = self._project(k_all[rows, trip.pos[:, sl]], params[2], params[3])
                kn = self._project(k_all[rows, trip.neg[:, sl]], params[2], params[3])
                per_head = (hinge_loss(qp, kp, kn, self.margin) * mask).sum(1)
                per_head = per_head / mask.sum(1).clamp_min(1)
                loss = per_head.sum()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                curve.append(loss.detach().item() / heads)
        diverged = not all(math.isfinite(x) for x in curve)
        if diverged or not all(bool(torch.isfinite(p).all()) for p in params):
            raise ValueError(f"training diverged to NaN/inf weights: lower lr (got {self.lr:g})")
        self.weight_q_, self.bias_q_, self.weight_k_, self.bias_k_ = (
            p.detach().clone() for p in params
        )
        self.loss_curve_ = curve
        self.n_pairs_ = n_pairs
        return self

    @staticmethod
    def _project(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        """x (H, m, d) → (H, m, r)."""
        return torch.baddbmm(bias[:, None, :], x, weight)

    # ------------------------------------------------------------------ prediction
    def _check_fitted(self) -> None:
        if not hasattr(self, "weight_q_"):
            raise RuntimeError("QKProjection is not fitted: call fit(graphs) first")

    def transform(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """Project queries and keys: q (..., H, n_q, d), k (..., H, n_k, d) → (..., H, n, r)."""
        self._check_fitted()
        heads, d = self.weight_q_.shape[:2]
        for name, x in (("q", q), ("k", k)):
            check_tensor(name, x, floating=True)
            if x.dim() < 3 or x.shape[-3] != heads or x.shape[-1] != d:
                raise ValueError(
                    f"{name} must have shape (..., {heads}, n, {d}), got {tuple(x.shape)}"
                )
            check_finite_tensor(name, x)
        wq, bq = self.weight_q_.to(q), self.bias_q_.to(q)
        wk, bk = self.weight_k_.to(k), self.bias_k_.to(k)
        return q @ wq + bq[:, None, :], k @ wk + bk[:, None, :]

    def state_dict(self) -> dict:
        """Parameters and fitted state, for ``torch.save``."""
        self._check_fitted()
        return {
            "params": self.get_params(),
            "weight_q": self.weight_q_,
            "bias_q": self.bias_q_,
            "weight_k": self.weight_k_,
            "bias_k": self.bias_k_,
            "loss_curve": self.loss_curve_,
            "n_pairs": self.n_pairs_,
        }

    @classmethod
    def from_state_dict(cls, state: dict) -> QKProjection:
        out = cls(**state["params"])
        out.weight_q_, out.bias_q_ = state["weight_q"], state["bias_q"]
        out.weight_k_, out.bias_k_ = state["weight_k"], state["bias_k"]
        out.loss_curve_, out.n_pairs_ = state["loss_curve"], state["n_pairs"]
        return out
