"""Gather engine: attention on neighbour lists, chunked over queries grouped by degree
(docs/engines.md, "Gather engine").

Rows sorted by degree are cut into chunks whose padded neighbour tables hold at most ``budget``
(row, key) pairs (global rows do not pad the others). Per chunk: gather K and V at the
neighbour indices, score, apply ρ, and reduce in pieces of at most ``PIECE`` keys (float32
rounding grows with a sequential sum's length). Backward recomputes each chunk: memory
O(budget · (d + d_v)) beyond the inputs, for training too.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx

from ..graph import AttentionGraph
from ..maps import ProbabilityMap
from ..score_mods import lifted_tensors
from .common import (
    keep_mask,
    masked_exp,
    mod_grads,
    replayed_rng,
    rng_state,
    squeezed,
)
from .precision import compute_dtype

__all__ = ["gather_attention", "chunk_rows", "PIECE"]

#: Longest sequential sum in a row's weighted sum (blocked summation, see the module doc).
PIECE = 128
#: (batch·head, row, key) entries per chunk by device type (None in ``gather_attention``).
BUDGET = {"cpu": 1 << 15, "cuda": 1 << 22}


def chunk_rows(degrees: Tensor, budget: int) -> list[Tensor]:
    """Row ids (LongTensor, one per chunk) by increasing ``degrees`` (LongTensor[R]), each
    chunk's padded table (rows · max degree) at most ``budget`` (a single row may exceed it)."""
    deg_sorted, order = degrees.sort(stable=True)
    deg_sorted = deg_sorted.clamp(min=1)
    chunks, start, total = [], 0, order.numel()
    while start < total:
        # largest m with m * deg_sorted[start + m - 1] <= budget (deg is non-decreasing in m)
        lo, hi = 1, total - start
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if mid * int(deg_sorted[start + mid - 1]) <= budget:
                lo = mid
            else:
                hi = mid - 1
        chunks.append(order[start : start + lo])
        start += lo
    return chunks


def _pad_to_pieces(idx: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """Pad (m, K) neighbour lists with invalid key-0 slots to P·ceil(K/P) columns, where
    P = ceil(K / PIECE), so :func:`_weighted_sum` can cut each row into P equal pieces."""
    kk = idx.shape[1]
    pieces = max(1, -(-kk // PIECE))
    extra = pieces * -(-kk // pieces) - kk
    if extra == 0:
        return idx, valid
    return torch.nn.functional.pad(idx, (0, extra)), torch.nn.functional.pad(valid, (0, extra))


def _weighted_sum(p: Tensor, x: Tensor) -> Tensor:
    """Σ_j p[..., j] · x[..., j, :]: p (b, m, K), x (b, m, K, e) → (b, m, e).

    One matmul per piece of K / P <= PIECE keys (P = ceil(K / PIECE); K is a multiple of P,
    see :func:`_pad_to_pieces`), then a sum over the P pieces.
    """
    b, m, kk = p.shape
    pieces = max(1, -(-kk // PIECE))
    out = torch.matmul(p.view(b, m, pieces, 1, -1), x.view(b, m, pieces, -1, x.shape[-1]))
    return out.squeeze(-2).sum(2)


def _chunks(graph, static, n_q, n_k, rows_budget, device) -> list[tuple[Tensor, Tensor, Tensor]]:
    """(rows, key index, valid) per chunk on ``device``; cached on the graph."""

    def make():
        chunks = []
        for rows in chunk_rows(graph.degrees.reshape(-1), rows_budget):
            idx, valid = _pad_to_pieces(*graph.neighbours(rows))
            if not static:  # flattened row r = (bh, i) reads keys bh·n_k + j
                idx = idx + (rows // n_q * n_k)[:, None]
            chunks.append((rows.to(device), idx.to(device), valid.to(device)))
        return chunks

    return graph.cached(
        ("gather_chunks", static, n_q, n_k, rows_budget, torch.device(device)), make
    )


class _Run:
    """Chunks (rows, key index, valid) and what the per-chunk computation needs."""

    def __init__(
        self, graph, static, n_q, n_k, b, budget, prob_map, scale, key_ok, dropout_p, device
    ):
        self.prob_map, self.scale, self.key_ok, self.dropout_p = prob_map, scale, key_ok, dropout_p
        self.softmax = prob_map.is_softmax
        self.static, self.n_q, self.n_k = static, n_q, n_k
        self.score_mod, self.heads, self.mod_tensors = None, 1, ()
        self.chunks = _chunks(graph, static, n_q, n_k, max(1, budget // b), device)
        self.most = max((i.numel() for _, i, _ in self.chunks), default=0)

    def gather(self, src: Tensor, idx: Tensor, buf: Tensor) -> Tensor:
        """src (b, N, e) at idx (m, K) → (b, m, K, e), written into the flat buffer ``buf``."""
        (b, _, e), (m, kk) = src.shape, idx.shape
        out = buf[: b * m * kk * e].view(b, m * kk, e)
        torch.index_select(src, 1, idx.reshape(-1), out=out)
        return out.view(b, m, kk, e)

    def mask(self, idx: Tensor, valid: Tensor) -> Tensor:
        """Valid (1, m, K) or (b, m, K) with key padding."""
        if self.key_ok is None:
            return valid.unsqueeze(0)
        return valid & self.key_ok.index_select(1, idx.reshape(-1)).view(-1, *idx.shape)

    def with_score_mod(self, score_mod: Callable | None, heads: int) -> _Run:
        """Apply ``score_mod`` to the scores of a call with ``heads`` query heads."""
        if score_mod is not None:
            self.score_mod, self.heads = score_mod, heads
            self.mod_tensors = lifted_tensors(score_mod)
        return self

    def modded(self, s: Tensor, rows: Tensor, idx: Tensor) -> Tensor:
        """Scores s (b, m, K) of the chunk's rows through the score modifier. A static graph:
        the leading axis is (batch, head), rows are queries; a batched one: rows flatten
        (batch, head, query) and idx reads keys bh·n_k + j."""
        if self.score_mod is None:
            return s
        if self.static:
            bh = torch.arange(s.shape[0], device=s.device).view(-1, 1, 1)
            q_idx, kv_idx = rows.view(1, -1, 1), idx.unsqueeze(0)
        else:
            bh = (rows // self.n_q).view(1, -1, 1)
            q_idx, kv_idx = (rows % self.n_q).view(1, -1, 1), (idx % self.n_k).unsqueeze(0)
        return self.score_mod(s, bh // self.heads, bh % self.heads, q_idx, kv_idx)

    def weights(self, s: Tensor, valid: Tensor) -> Tensor:
        if self.softmax:
            p, _, total = masked_exp(s, [valid.to(s.dtype)], None)
            return p.div_(torch.where(total > 0, total, 1.0).unsqueeze(-1))
        return self.prob_map(s, valid)


class _GatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, q_src: Tensor, k_src: Tensor, v_src: Tensor, run: _Run, *_):
        ctx.run = run
        if run.dropout_p:
            ctx.rng = rng_state(q_src.device)
        b, d, d_v = q_src.shape[0], q_src.shape[-1], v_src.shape[-1]
        kbuf, vbuf = q_src.new_empty(b * run.most * d), q_src.new_empty(b * run.most * d_v)
        out = q_src.new_empty(b, q_src.shape[1], d_v)
        for rows, idx, valid in run.chunks:
            qc = q_src.index_select(1, rows).mul_(run.scale).unsqueeze(-2)  # (b, m, 1, d)
            s = torch.matmul(qc, run.gather(k_src, idx, kbuf).transpose(-1, -2)).squeeze(-2)
            p = run.weights(run.modded(s, rows, idx), run.mask(idx, valid))
            keep = keep_mask(p, run.dropout_p)
            if keep is not None:
                p = p * keep
            out.index_copy_(1, rows, _weighted_sum(p, run.gather(v_src, idx, vbuf)))
        ctx.save_for_backward(q_src, k_src, v_src)
        return out

    @staticmethod
    def backward(ctx: FunctionCtx, grad_out: Tensor):
        run: _Run = ctx.run
        q_src, k_src, v_src = ctx.saved_tensors
        b, d, d_v = q_src.shape[0], q_src.shape[-1], v_src.shape[-1]
        kbuf, vbuf = q_src.new_empty(b * run.most * d), q_src.new_empty(b * run.most * d_v)
        dq, dk, dv = torch.zeros_like(q_src), torch.zeros_like(k_src), torch.zeros_like(v_src)
        d_mod = [torch.zeros_like(t) for t in run.mod_tensors]
        modded = run.score_mod is not None
        with replayed_rng(q_src.device, ctx.rng if run.dropout_p else None):
            for rows, idx, valid in run.chunks:
                flat = idx.reshape(-1)
                qc = q_src.index_select(1, rows).mul_(run.scale)  # (b, m, d)
                kk = run.gather(k_src, idx, kbuf)
                vv = run.gather(v_src, idx, vbuf)
                s = torch.matmul(qc.unsqueeze(-2), kk.transpose(-1, -2)).squeeze(-2)
                if modded or not run.softmax:
                    s.requires_grad_()
                with torch.enable_grad():
                    sm = run.modded(s, rows, idx)
                    # the softmax path works in place: on a copy where autograd needs sm
                    sm_in = sm.detach().clone() if modded and run.softmax else sm
                    p = run.weights(sm_in, run.mask(idx, valid))
                keep = keep_mask(p, run.dropout_p)
                pd = p.detach() if keep is None else p.detach() * keep
                go = grad_out.index_select(1, rows)  # (b, m, d_v)
                dv.index_add_(1, flat, (pd.unsqueeze(-1) * go.unsqueeze(-2)).reshape(b, -1, d_v))
                dp = torch.matmul(vv, go.unsqueeze(-1)).squeeze(-1)  # (b, m, K)
                if keep is not None:
                    dp.mul_(keep)
                if run.softmax:
                    pp = p.detach()
                    ds = pp * (dp - (pp * dp).sum(-1, keepdim=True))
                    if modded:
                        ds, *grads = mod_grads(sm, s, run.mod_tensors, ds)
                else:
                    ds, *grads = mod_grads(p, s, run.mod_tensors, dp)
                for acc, g in zip(d_mod, grads if modded else (), strict=True):
                    acc += g
                dq.index_copy_(1, rows, _weighted_sum(ds, kk).mul_(run.scale))
                dk.index_add_(1, flat, (ds.unsqueeze(-1) * qc.unsqueeze(-2)).reshape(b, -1, d))
        return dq, dk, dv, None, *d_mod


def gather_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    graph: AttentionGraph,
    prob_map: ProbabilityMap,
    scale: float,
    key_valid: Tensor | None = None,
    dropout_p: float = 0.0,
    budget: int | None = None,
    score_mod: Callable | None = None,
) -> Tensor:
    """Sparse attention over neighbour lists (same contract as ``dense_attention``).

    A static graph (``batch_shape == ()``) is shared by all (batch, head) pairs, which ride
    along as a leading axis of size B·H; a batched graph is expanded to (B, H) and every
    flattened row gathers from its own (batch, head) slice of the flattened keys.
    ``budget`` bounds (B·H or 1) × rows × K per chunk (default ``BUDGET`` for the device).
    """
    bsz, heads, n_q, d = q.shape
    n_k, d_v = k.shape[-2], v.shape[-1]
    if math.prod(graph.batch_shape) == 1:  # one graph (e.g. grouped queries'): shared
        graph = squeezed(graph, len(graph.batch_shape))
    static = graph.batch_shape == ()
    b = bsz * heads if static else 1
    if not static:
        graph = graph.expand((bsz, heads))
    key_ok = None
    if key_valid is not None:
        key_ok = key_valid.to(q.device).repeat_interleave(heads, 0).reshape(b, -1)
    budget = BUDGET.get(q.device.type, BUDGET["cuda"]) if budget is None else budget
    run = _Run(graph, static, n_q, n_k, b, budget, prob_map, scale, key_ok, dropout_p, q.device)
    run = run.with_score_mod(score_mod, heads)
    dtype = compute_dtype(q)  # half precision on CPU: float32 inside (docs/engines.md)
    out = _GatherAttention.apply(
        q.reshape(b, -1, d).to(dtype),
        k.reshape(b, -1, d).to(dtype),
        v.reshape(b, -1, d_v).to(dtype),
        run,
        *run.mod_tensors,
    )
    return out.reshape(bsz, heads, n_q, d_v).to(q.dtype)
