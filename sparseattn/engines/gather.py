"""Gather engine: attention on neighbour lists, chunked over queries grouped by degree.

Rows are sorted by degree and cut into chunks whose padded neighbour tables hold at most
``budget`` (row, key) pairs, so a few global rows with n keys do not pad the others to n.
Per chunk: gather K and V at the neighbour indices, score, apply ρ on the padded rows, and
reduce. Under autograd each chunk is checkpointed (recomputed in backward), so peak memory
beyond the inputs stays O(budget · (d + d_v)) for training as well as inference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ..graph import AttentionGraph
from ..maps import ProbabilityMap

__all__ = ["gather_attention", "chunk_rows"]


def chunk_rows(degrees: Tensor, budget: int) -> list[Tensor]:
    """Split row ids into chunks, in increasing degree, with (rows · max degree) <= budget.

    Args:
        degrees: LongTensor[R].
        budget: largest padded table (rows × K) per chunk; a single row may exceed it.
    Returns:
        list of LongTensor row ids.
    """
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


def _chunk(q_rows, k_src, v_src, key_idx, valid, prob_map, scale, dropout_p, key_ok):
    """q_rows (b, m, d); k_src (b, N, d); key_idx/valid (m, K) → out (b, m, d_v)."""
    kk = k_src[:, key_idx]  # (b, m, K, d): batch-first keeps the products as plain bmm
    vv = v_src[:, key_idx]
    scores = torch.einsum("bmd,bmkd->bmk", q_rows, kk) * scale
    mask = valid if key_ok is None else valid & key_ok[:, key_idx]  # key_ok: (b, N)
    weights = prob_map(scores, mask)
    if dropout_p:
        weights = F.dropout(weights, dropout_p)
    return torch.einsum("bmk,bmkd->bmd", weights, vv)


def gather_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    graph: AttentionGraph,
    prob_map: ProbabilityMap,
    scale: float,
    key_padding_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    budget: int = 1 << 18,
) -> Tensor:
    """Sparse attention over neighbour lists (same contract as ``dense_attention``).

    A static graph (``batch_shape == ()``) is shared by all (batch, head) pairs, which ride
    along as a leading axis of size B·H; a batched graph is expanded to (B, H) and every
    flattened row gathers from its own (batch, head) slice of the flattened keys.
    ``budget`` bounds (B·H or 1) × rows × K per chunk.
    """
    bsz, heads, n_q, d = q.shape
    n_k, d_v = k.shape[-2], v.shape[-1]
    static = graph.batch_shape == ()
    b = bsz * heads if static else 1
    if not static:
        graph = graph.expand((bsz, heads))
    q_src = q.reshape(b, -1, d)  # (BH, n_q, d) or (1, BH·n_q, d)
    k_src = k.reshape(b, -1, d)
    v_src = v.reshape(b, -1, d_v)
    key_ok = None
    if key_padding_mask is not None:
        key_ok = key_padding_mask.repeat_interleave(heads, 0).reshape(b, -1)
    use_ckpt = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    outs, order = [], []
    for rows in chunk_rows(graph.degrees.reshape(-1), max(1, budget // b)):
        idx, valid = graph.neighbours(rows)
        if not static:  # flattened row r = (bh, i) reads keys bh·n_k + j
            idx = idx + (rows // n_q * n_k)[:, None]
        rows_dev = rows.to(q.device)
        args = (q_src[:, rows_dev], k_src, v_src, idx.to(q.device), valid.to(q.device),
                prob_map, scale, dropout_p, key_ok)
        outs.append(checkpoint(_chunk, *args, use_reentrant=False) if use_ckpt else _chunk(*args))
        order.append(rows_dev)
    order = torch.cat(order)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return torch.cat(outs, 1)[:, inverse].reshape(bsz, heads, n_q, d_v)
