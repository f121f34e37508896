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
    """q_rows (m, b, d); k_src (N, b, d); key_idx/valid (m, K) → out (m, b, d_v)."""
    kk = k_src[key_idx]  # (m, K, b, d)
    vv = v_src[key_idx]
    scores = torch.einsum("mbd,mkbd->mbk", q_rows, kk) * scale
    mask = valid[:, None, :]
    if key_ok is not None:  # (N, b) real-key flags, gathered like K
        mask = mask & key_ok[key_idx].transpose(1, 2)
    weights = prob_map(scores, mask)
    if dropout_p:
        weights = F.dropout(weights, dropout_p)
    return torch.einsum("mbk,mkbd->mbd", weights, vv)


def gather_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    graph: AttentionGraph,
    prob_map: ProbabilityMap,
    scale: float,
    key_padding_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    budget: int = 1 << 16,
) -> Tensor:
    """Sparse attention over neighbour lists (same contract as ``dense_attention``).

    A static graph (``batch_shape == ()``) is shared by all (batch, head) pairs, which ride
    along as one axis of size B·H; a batched graph is expanded to (B, H) and every flattened
    row gathers from its own (batch, head) slice.
    """
    bsz, heads, n_q, d = q.shape
    n_k, d_v = k.shape[-2], v.shape[-1]
    bh = bsz * heads
    key_ok = None
    if graph.batch_shape == ():
        q_src = q.reshape(bh, n_q, d).transpose(0, 1)  # (n_q, BH, d)
        k_src = k.reshape(bh, n_k, d).transpose(0, 1)
        v_src = v.reshape(bh, n_k, d_v).transpose(0, 1)
        if key_padding_mask is not None:
            key_ok = key_padding_mask.repeat_interleave(heads, 0).transpose(0, 1)  # (n_k, BH)
        offset_of = None
    else:
        graph = graph.expand((bsz, heads))
        q_src = q.reshape(bh * n_q, 1, d)
        k_src = k.reshape(bh * n_k, 1, d)
        v_src = v.reshape(bh * n_k, 1, d_v)
        if key_padding_mask is not None:
            key_ok = key_padding_mask.repeat_interleave(heads, 0).reshape(bh * n_k, 1)
        offset_of = n_k
    b = q_src.shape[1]
    use_ckpt = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    outs, rows_all = [], []
    for rows in chunk_rows(graph.degrees.reshape(-1), max(1, budget // b)):
        idx, valid = graph.neighbours(rows)
        if offset_of is not None:
            idx = idx + (rows // n_q * n_k)[:, None]
        idx, valid = idx.to(q.device), valid.to(q.device)
        args = (q_src[rows.to(q.device)], k_src, v_src, idx, valid, prob_map, scale, dropout_p,
                key_ok)
        if use_ckpt:
            outs.append(checkpoint(_chunk, *args, use_reentrant=False))
        else:
            outs.append(_chunk(*args))
        rows_all.append(rows)
    out = torch.cat(outs)  # rows in chunk order
    inverse = torch.empty_like(torch.cat(rows_all))
    inverse[torch.cat(rows_all)] = torch.arange(inverse.numel())
    out = out[inverse.to(q.device)]  # (R, b, d_v) in row order
    if offset_of is None:
        return out.transpose(0, 1).reshape(bsz, heads, n_q, d_v)
    return out.reshape(bsz, heads, n_q, d_v)
