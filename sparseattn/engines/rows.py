"""Rows engine: attention over full (or wide) rows, a chunk of queries at a time
(docs/engines.md, "Full rows").

For the dense pattern and graphs whose rows hold thousands of keys, a sparse map ρ needs each
query's whole row at once (its threshold depends on all of it). For queries i0..i1,

    s = scale · q[i0:i1] · kᵀ   (B, H, m, n_k),   p = ρ(s) on the allowed keys,   out = p · v,

with ρ's sort-free thresholds (:mod:`sparseattn.fastmaps`). Backward recomputes each chunk.
Memory beyond q, k, v and the output: O(budget) scores. Allowed keys: all, the lower triangle
(``causal``) or a graph's rows, and-ed with the key padding mask.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import FunctionCtx

from ..graph import AttentionGraph
from ..maps import ProbabilityMap
from ..score_mods import lifted_tensors
from .common import grid_indices, keep_mask, mod_grads, replayed_rng, rng_state
from .precision import compute_dtype

__all__ = ["full_rows_attention", "rows_attention"]

#: Score entries per chunk (B·H·m·n_k) by device type: on CPU 8 MB of fp32 scores (in the L3
#: cache, where the two matrix products run fastest); on a GPU a chunk must fill the device.
BUDGET = {"cpu": 1 << 21, "cuda": 1 << 25}
#: Mask entries per chunk (B·m·n_k) of :func:`_sdpa_causal`, the causal softmax rows that
#: ``is_causal`` cannot express (at an offset, or with key padding): 16 MiB of bool.
MASK_BUDGET = 1 << 24


class _Run:
    """The chunks and what each needs, shared by forward and backward."""

    def __init__(
        self, q, k, graph, prob_map, scale, key_valid, dropout_p, causal, budget, score_mod
    ):
        bsz, heads, n_q, _ = q.shape
        self.score_mod = score_mod
        self.mod_tensors = () if score_mod is None else lifted_tensors(score_mod)
        self.n_k, self.shape = k.shape[-2], (bsz, heads)
        self.prob_map, self.scale, self.dropout_p, self.causal = prob_map, scale, dropout_p, causal
        self.offset = self.n_k - n_q if causal else 0  # query i sits at position offset + i
        self.key_ok = None if key_valid is None else key_valid[:, None, None, :]
        if graph is not None:  # its device copy is cached on it: copied once per device
            graph = graph.to(q.device)
        if graph is not None and graph.batch_shape:
            graph = graph.expand((bsz, heads))
        self.graph = graph
        m = max(1, budget // (bsz * heads * self.n_k))
        self.chunks = [(i, min(i + m, n_q)) for i in range(0, n_q, m)]

    def keys(self, i1: int) -> int:
        """How many keys the rows before i1 may see (causal rows stop at their position)."""
        return min(self.offset + i1, self.n_k) if self.causal else self.n_k

    def valid(self, i0: int, i1: int, device: torch.device) -> Tensor | None:
        """Bool mask broadcastable to the chunk's scores (B, H, m, keys), or None (all)."""
        nk = self.keys(i1)
        masks = []
        if self.causal:
            rows = torch.arange(self.offset + i0, self.offset + i1, device=device)
            masks.append(torch.arange(nk, device=device) <= rows[:, None])
        if self.graph is not None:
            masks.append(self._graph_rows(i0, i1))
        if self.key_ok is not None:
            masks.append(self.key_ok[..., :nk])
        if not masks:
            return None
        out = masks[0]
        for mask in masks[1:]:
            out = out & mask
        return out

    def _graph_rows(self, i0: int, i1: int) -> Tensor:
        graph = self.graph
        dev = graph.device
        rows = torch.arange(i0, i1, device=dev)
        if graph.batch_shape:
            first = torch.arange(graph.num_rows // graph.n_q, device=dev)[:, None] * graph.n_q
            rows = (first + rows).reshape(-1)
        idx, ok = graph.neighbours(rows)
        mask = torch.zeros(rows.numel(), self.n_k, dtype=torch.bool, device=dev)
        mask[torch.arange(rows.numel(), device=dev)[:, None].expand_as(idx)[ok], idx[ok]] = True
        return mask.view(*graph.batch_shape, i1 - i0, self.n_k)

    def modded(self, s: Tensor, i0: int) -> Tensor:
        """The chunk's scores (B, H, m, keys) of queries i0… through the score modifier."""
        if self.score_mod is None:
            return s
        rows = torch.arange(i0, i0 + s.shape[-2], device=s.device)
        return self.score_mod(s, *grid_indices(*self.shape, rows, s.shape[-1], s.device))

    def map(self, alpha: Tensor | None, i0: int, i1: int) -> ProbabilityMap:
        return self.prob_map if alpha is None else self.prob_map.with_alpha(alpha[:, :, i0:i1])


class _RowsAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx, q: Tensor, k: Tensor, v: Tensor, alpha: Tensor | None, run: _Run, *_
    ) -> Tensor:
        ctx.run = run
        if run.dropout_p:
            ctx.rng = rng_state(q.device)
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        # one score buffer for all chunks (fresh multi-MB tensors cost page faults); the
        # weights overwrite the scores in it
        size = max((i1 - i0) * run.keys(i1) for i0, i1 in run.chunks) * q.shape[0] * q.shape[1]
        buf = q.new_empty(size)
        for i0, i1 in run.chunks:
            nk = run.keys(i1)
            s = buf[: q.shape[0] * q.shape[1] * (i1 - i0) * nk].view(*q.shape[:2], i1 - i0, nk)
            torch.matmul(q[:, :, i0:i1] * run.scale, k[:, :, :nk].transpose(-1, -2), out=s)
            s = run.modded(s, i0)
            p = run.map(alpha, i0, i1).forward_only(s, run.valid(i0, i1, q.device))
            keep = keep_mask(p, run.dropout_p)
            if keep is not None:
                p = p.mul_(keep)
            out[:, :, i0:i1] = torch.matmul(p, v[:, :, :nk])
        ctx.save_for_backward(q, k, v, alpha)
        return out

    @staticmethod
    def backward(ctx: FunctionCtx, grad_out: Tensor):
        run: _Run = ctx.run
        q, k, v, alpha = ctx.saved_tensors
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        want_alpha = alpha is not None and ctx.needs_input_grad[3]
        d_alpha = torch.zeros_like(alpha) if want_alpha else None
        d_mod = [torch.zeros_like(t) for t in run.mod_tensors]
        with replayed_rng(q.device, ctx.rng if run.dropout_p else None):
            for i0, i1 in run.chunks:
                nk = run.keys(i1)
                qs, kc, vc = q[:, :, i0:i1] * run.scale, k[:, :, :nk], v[:, :, :nk]
                s = torch.matmul(qs, kc.transpose(-1, -2)).requires_grad_()
                a = None
                if alpha is not None:
                    a = alpha[:, :, i0:i1].detach().requires_grad_(want_alpha)
                rho = run.prob_map if a is None else run.prob_map.with_alpha(a)
                valid = run.valid(i0, i1, q.device)
                with torch.enable_grad():
                    sm = run.modded(s, i0)
                    p = rho(sm) if valid is None else rho(sm, valid)
                keep = keep_mask(p, run.dropout_p)
                pd = p.detach() if keep is None else p.detach() * keep
                go = grad_out[:, :, i0:i1]
                dv[:, :, :nk] += torch.matmul(pd.transpose(-1, -2), go)
                dp = torch.matmul(go, vc.transpose(-1, -2))
                if keep is not None:
                    dp.mul_(keep)
                extra = (a,) if want_alpha else ()
                ds, *grads = mod_grads(p, s, run.mod_tensors, dp, extra)
                if want_alpha:
                    d_alpha[:, :, i0:i1] = grads.pop(0)
                for acc, g in zip(d_mod, grads, strict=True):
                    acc += g
                dq[:, :, i0:i1] = torch.matmul(ds, kc).mul_(run.scale)
                dk[:, :, :nk] += torch.matmul(ds.transpose(-1, -2), qs)
        return dq, dk, dv, d_alpha, None, *d_mod


def rows_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    graph: AttentionGraph | None,
    prob_map: ProbabilityMap,
    scale: float,
    key_valid: Tensor | None = None,
    dropout_p: float = 0.0,
    causal: bool = False,
    budget: int | None = None,
    score_mod: Callable | None = None,
) -> Tensor:
    """Full-row attention in chunks of queries, Yun eq. (3) with A_i = all keys (or a graph).

    Same contract as ``dense_attention`` (any map, ``entmax(tensor)`` included); ``graph``:
    None for full rows, or any graph whose rows are wide enough that a (chunk, n_k) mask per
    chunk pays. ``causal``: rows see keys j ≤ i only, with n_q < n_k the queries at positions
    n_k − n_q … n_k − 1. ``budget``: most score entries per chunk, None: ``BUDGET``.
    """
    bsz, heads, n_q, _ = q.shape
    if causal and n_q > k.shape[-2]:
        raise ValueError(f"causal rows need n_q <= n_k, got n_q={n_q}, n_k={k.shape[-2]}")
    dtype = compute_dtype(q)  # half precision on CPU: float32 inside (docs/engines.md)
    alpha = prob_map.row_alpha(bsz, heads, n_q)
    if alpha is not None:
        alpha = alpha.to(dtype)
    key_ok = None if key_valid is None else key_valid.to(q.device)
    budget = BUDGET.get(q.device.type, BUDGET["cuda"]) if budget is None else budget
    run = _Run(q, k, graph, prob_map, scale, key_ok, dropout_p, causal, budget, score_mod)
    out = _RowsAttention.apply(q.to(dtype), k.to(dtype), v.to(dtype), alpha, run, *run.mod_tensors)
    return out.to(q.dtype)


def full_rows_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    prob_map: ProbabilityMap,
    scale: float,
    key_valid: Tensor | None = None,
    dropout_p: float = 0.0,
    causal: bool = False,
    score_mod: Callable | None = None,
) -> Tensor:
    """The dense pattern (all keys, or j ≤ i when ``causal``, queries at an offset when
    n_q < n_k) without building its graph.

    Softmax goes to torch's fused ``scaled_dot_product_attention``: with ``is_causal``, or
    where that does not fit (an offset, key padding) with a boolean mask per chunk of queries
    (:func:`_sdpa_causal`); a ``score_mod`` and other maps go to :func:`rows_attention`.
    """
    if not prob_map.is_softmax or score_mod is not None:
        return rows_attention(
            q, k, v, None, prob_map, scale, key_valid, dropout_p, causal, None, score_mod
        )
    offset = causal and q.shape[-2] != k.shape[-2]
    if offset or (causal and key_valid is not None):
        return _sdpa_causal(q, k, v, scale, key_valid, dropout_p)
    if key_valid is None:
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale
        )
    key_ok = key_valid.to(q.device)
    some = key_ok.any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=(key_ok | ~some)[:, None, None, :], dropout_p=dropout_p, scale=scale
    )
    return out * some[:, :, None, None].to(out.dtype)


def _sdpa_causal(
    q: Tensor, k: Tensor, v: Tensor, scale: float, valid: Tensor | None, dropout_p: float
) -> Tensor:
    """Causal softmax rows at an offset (query i at position n_k − n_q + i) and/or with key
    padding (``valid`` (B, n_k), True for real keys), by SDPA with a boolean mask: chunks of
    queries whose mask holds at most ``MASK_BUDGET`` entries, each reading only the keys its
    last row sees. A row with no real key among those it sees gets zeros (as on every engine).
    """
    bsz, _, n_q, _ = q.shape
    shift = k.shape[-2] - n_q
    if valid is not None:
        valid = valid.to(q.device)[:, None, None, :]
    step = max(1, MASK_BUDGET // (bsz * k.shape[-2]))
    outs = []
    for i0 in range(0, n_q, step):
        i1 = min(n_q, i0 + step)
        end = shift + i1  # the keys row i1 − 1 sees
        rows = torch.arange(shift + i0, end, device=q.device)
        mask = torch.arange(end, device=q.device) <= rows[:, None]
        if valid is not None:
            mask = mask & valid[..., :end]
        has = mask.any(-1, keepdim=True) if valid is not None else None
        out = F.scaled_dot_product_attention(
            q[:, :, i0:i1],
            k[:, :, :end],
            v[:, :, :end],
            attn_mask=mask if has is None else mask | ~has,
            dropout_p=dropout_p,
            scale=scale,
        )
        outs.append(out if has is None else out * has.to(out.dtype))
    return outs[0] if len(outs) == 1 else torch.cat(outs, -2)
