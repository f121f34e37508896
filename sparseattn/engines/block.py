"""Block engine: block-sparse attention as batched matrix products over non-empty blocks
(docs/engines.md, "Block engine").

The graph is laid out in square blocks of ``block`` tokens; a *row block* (``block`` queries of
one graph) attends to the key blocks holding one of its edges, *full* (every pair an edge) or
*partial* (an element mask). Each query's map ρ sees its whole row of selected blocks, the
partial blocks' mask as ``valid`` (Yun et al. eq. 3 on a superset of A_i, masked back to it).
Row blocks go in chunks of ``budget`` score entries (memory O(n·d + budget)), computed by

* **split softmax** (softmax, no dropout, d_v = d, CPU): the full blocks (a run of
  consecutive ones as a strided view, widened by the band's partial blocks under a bias)
  through torch's fused CPU flash kernel — one call per run segment (a whole band), not per
  chunk: the kernel streams the keys — the other partial blocks here (blocks shared by the
  segment's row blocks, e.g. global keys, scored once per segment), merged by their
  log-sum-exps straight into the output; the backward splits the same way (dS = P ⊙ (dP −
  rowsum(dO ⊙ O)) decomposes over any split of the keys), chunk by chunk. Key padding is one
  more mask on each part (:meth:`_Runner.key_mask`: none where a chunk's keys are all real),
  chunk by chunk in the forward too (a band's bias and the padding combined cost a chunk's
  scores, not a whole band's);
* **general** (any map, dropout, a score modifier): ρ on the masked row of all
  blocks; the backward recomputes each chunk (softmax's closed form, autograd for other maps,
  dropout replayed from the saved RNG state).

The plan (:mod:`.layout`) is built once per (graph, block) and cached on the graph. Shapes:
q, k (B, H, n, d), v (B, H, n, d_v) → (B, H, n_q, d_v); inside, each as (L, G·nb, b, e)
(:func:`_blocked`): q read in place where its strides allow (a projection's (B, n, H, d)),
k and v contiguous; the output is laid out like q (a projection's layout stays one).

One piece: the autograd function's forward and backward, the split and general paths and the
runner they share read one plan's chunks in one blocked layout; apart, each would restate it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
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
from .layout import BlockChunk, SegmentRun, block_plan, choose_block, select_blocks
from .precision import compute_dtype

__all__ = ["block_attention"]

#: Score entries per chunk by device type: on CPU small chunks keep the temporaries in cache;
#: on a GPU one chunk must fill the device (2²⁴ fp32 entries = 64 MiB; docs/benchmarks.md).
BUDGET = {"cpu": 1 << 18, "cuda": 1 << 24}

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
#: From this block size on, the full blocks' backward goes through torch's flash backward
#: kernel; below it, the closed form here (`python -m sparseattn.lab.bench.calibrate --blocks 4096`
#: on both: flash 7–30% faster per entry at b ≥ 64, as fast at b = 32, slower at b = 16).
FLASH_BACKWARD_BLOCK = 64


class _Runner:
    """What the per-chunk computations need, shared by forward and backward."""

    def __init__(self, plan, prob_map, scale, key_ok, dropout_p, budget, lead, fused, dtype, width):
        self.plan, self.prob_map, self.scale, self.dtype = plan, prob_map, scale, dtype
        self.key_ok, self.dropout_p, self.lead, self.budget = key_ok, dropout_p, lead, budget
        self.softmax = prob_map.is_softmax
        self.split = self.softmax and not dropout_p and fused
        self.chunks = plan.chunks(lead, budget, self.split)
        # the split path's forward by run segment (``width``: the head dim d), without padding
        self.runs = plan.runs(lead, budget, width) if self.split and key_ok is None else None
        # the split path's key padding, blocked like the keys: 0/1 floats (L, G·nbk, b, 1)
        self.key_ones = None
        if self.split and key_ok is not None:
            self.key_ones = key_ok.unsqueeze(-1).to(dtype)
        self.score_mod, self.mod_tensors, self.sizes = None, (), (1, 1, 1)

    def with_score_mod(self, score_mod: Callable | None, heads: int, n_q: int, n_k: int):
        """Apply ``score_mod`` (general path only) to a call with ``heads`` query heads."""
        if score_mod is not None:
            assert not self.split, "the split path has no score modifier"
            self.score_mod, self.mod_tensors = score_mod, lifted_tensors(score_mod)
            self.sizes = heads, n_q, n_k
        return self

    def modded(self, s: Tensor, rows: Tensor, keys: Tensor) -> Tensor:
        """Scores s (L, m, b, C·b) of row blocks ``rows`` (m,) against key blocks ``keys``
        (m, C) through the score modifier. Riding pair l and graph g = row // nbq are the
        (batch, head) pair l·G + g; indices in the padding of a last block are clamped (their
        entries are masked)."""
        if self.score_mod is None:
            return s
        heads, n_q, n_k = self.sizes
        plan, dev = self.plan, s.device
        offsets = torch.arange(plan.block, device=dev)
        bh = torch.arange(s.shape[0], device=dev).view(-1, 1, 1, 1) * plan.graphs
        bh = bh + (rows // plan.nbq).view(1, -1, 1, 1)
        q_idx = ((rows % plan.nbq) * plan.block).view(1, -1, 1, 1) + offsets.view(-1, 1)
        kv_idx = ((keys % plan.nbk) * plan.block).unsqueeze(-1) + offsets
        kv_idx = kv_idx.view(1, keys.shape[0], 1, -1)
        return self.score_mod(
            s, bh // heads, bh % heads, q_idx.clamp_(max=n_q - 1), kv_idx.clamp_(max=n_k - 1)
        )

    # -- helpers ------------------------------------------------------------------------
    def gather(self, x: Tensor, keys: Tensor) -> Tensor:
        """Key blocks (L, m, C·b, e) of the blocked tensor x (L, G·nbk, b, e)."""
        m, c = keys.shape
        picked = select_blocks(x, keys.reshape(-1))
        return picked.reshape(x.shape[0], m, c * self.plan.block, -1)

    def extra_blocks(self, x: Tensor, chunk: BlockChunk) -> Tensor:
        """The chunk's gathered full blocks (L, m, Ce·b, e): those of its first row expanded
        (stride 0, no copy per row) when every row has the same."""
        if not chunk.extra_shared:
            return self.gather(x, chunk.extra)
        one = self.gather(x, chunk.extra[:1])
        return one.expand(one.shape[0], chunk.extra.shape[0], *one.shape[2:])

    def full_blocks(self, x: Tensor, chunk: BlockChunk) -> Tensor:
        """The chunk's full key blocks of x (L, G·nbk, b, e) (:func:`_blocked`'s layout): a
        strided view (no copy) when they are one run of consecutive blocks moving by a fixed
        step per row block."""
        if chunk.run is None:
            return self.gather(x, chunk.full)
        (m, cf), (start, step) = chunk.full.shape, chunk.run
        s0, s1, s2, s3 = x.stride()
        return x.as_strided(
            (x.shape[0], m, cf * self.plan.block, x.shape[-1]),
            (s0, step * s1, s2, s3),
            x.storage_offset() + start * s1,
        )

    # -- general path -------------------------------------------------------------------
    def general_inputs(self, full: Tensor, part: Tensor, keep: Tensor | None):
        """All key blocks of a chunk side by side, the row's edge mask (uint8 (m, b, C·b) or
        None) and the key-padding mask (bool (L, m, 1, C·b) or None)."""
        keys = torch.cat([full, part], 1)
        if keep is not None and full.shape[1]:
            m, b = keep.shape[:2]
            ones = keep.new_ones(m, b, full.shape[1] * self.plan.block)
            keep = torch.cat([ones, keep], -1)
        ok = None
        if self.key_ok is not None:
            ok = self.gather(self.key_ok.unsqueeze(-1), keys).transpose(-1, -2)
        return keys, keep, ok

    def weights(self, s: Tensor, keep: Tensor | None, ok: Tensor | None, alpha=None) -> Tensor:
        """ρ on the chunk's rows; ``s`` is consumed (the softmax path works in place);
        ``alpha`` (L, m, b, 1): the rows' α of an ``entmax(tensor)`` map."""
        if self.softmax:
            masks = [m.to(s.dtype) for m in (keep, ok) if m is not None]
            p, _, total = masked_exp(s, masks, None)
            return p.div_(torch.where(total > 0, total, 1.0).unsqueeze(-1))  # empty rows → 0
        valid = None if keep is None else keep.bool()
        if ok is not None:
            valid = ok if valid is None else valid & ok
        rho = self.prob_map if alpha is None else self.prob_map.with_alpha(alpha)
        return rho(s) if valid is None else rho(s, valid)

    # -- split softmax path -------------------------------------------------------------
    def key_mask(self, blocks: Callable, ch: BlockChunk) -> Tensor | None:
        """The split path's key padding on the keys that ``blocks`` (one of :meth:`full_blocks`,
        :meth:`extra_blocks`, :meth:`partial_blocks`) takes for chunk ``ch``: 0/1 floats
        (L, m or 1, 1, keys), or None where every one of those keys is real."""
        if self.key_ones is None:
            return None
        ok = blocks(self.key_ones, ch).transpose(-1, -2)
        return None if bool(ok.all()) else ok

    def partial_exp(self, qs, kc, keep: Tensor | None, ok: Tensor | None, lse: Tensor | None):
        """exp(scores − shift) on the partial blocks, exactly 0 where there is no edge
        (``keep`` None: an edge everywhere) or the key is padding (``ok``, of :meth:`key_mask`).

        Forward (``lse`` None): shift is the row max; returns (p, row max, row sum).
        Backward: shift is the merged log-sum-exp; returns (p, None, None).
        """
        s = _mm(qs, kc.transpose(-1, -2))
        masks = [m.to(s.dtype) for m in (keep, ok) if m is not None]
        return masked_exp(s, masks, lse)

    def partial_blocks(self, x: Tensor, ch: BlockChunk) -> Tensor:
        """The chunk's partial key blocks of x: (L, m, Cp·b, e), or (L, 1, ·, e) when shared
        by its row blocks, then only the columns some row uses (``ch.cols``)."""
        if not ch.shared:
            return self.gather(x, ch.part)
        kc = self.gather(x, ch.part[:1])
        return kc if ch.cols is None else kc[:, :, ch.cols]

    def partial_grad(self, g: Tensor, ch: BlockChunk) -> Tensor:
        """A gradient shaped like :meth:`partial_blocks` → (L, m·Cp, b, e) for ``index_add_``
        at ``ch.part`` (the shared block's unused columns get 0)."""
        if ch.shared and ch.cols is not None:
            whole = g.new_zeros(g.shape[0], 1, ch.part.shape[1] * self.plan.block, g.shape[-1])
            g = whole.index_copy_(2, ch.cols, g)
        return _per_block(g, self.plan.block)


class _BlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, q: Tensor, k: Tensor, v: Tensor, alpha, run: _Runner, *_):
        ctx.run, ctx.dtype = run, q.dtype
        # in run.dtype (fp32 for half on CPU); q a view where it can be, k and v contiguous
        qp, kp, vp = _blocked(q, run, view=True), _blocked(k, run), _blocked(v, run)
        # the output in the queries' layout (e.g. a projection's (B, n, H, d)), else dense
        same = v.shape[-1] == q.shape[-1]
        out = torch.empty_like(qp) if same else qp.new_empty(*qp.shape[:-1], v.shape[-1])
        if run.split:
            lse_all = qp.new_empty(qp.shape[:-1])
            if run.runs is None:  # key padding: chunk by chunk
                for ch in run.chunks:
                    _chunk_forward(run, ch, qp, kp, vp, out, lse_all)
            else:
                for seg in run.runs:
                    _segment_forward(run, seg, qp, kp, vp, out, lse_all)
            # a row without any key (output 0): lse 0, so that backward's exp(s − lse) is 0
            lse_all.masked_fill_(lse_all == float("-inf"), 0.0)
            ctx.shapes = q.shape, k.shape, v.shape
            ctx.save_for_backward(qp, kp, vp, out, lse_all)  # blocked: no second copy
            return _unblock(out, q.shape).to(q.dtype)
        if run.dropout_p:
            ctx.rng = rng_state(q.device)
        ap = None if alpha is None else _blocked_alpha(alpha, run)
        for ch in run.chunks:
            rows = ch.rows
            keys, blk, ok = run.general_inputs(ch.full, ch.part, ch.keep)
            qs = select_blocks(qp, rows).mul_(run.scale)
            a = None if ap is None else ap.index_select(1, rows)
            s = run.modded(torch.matmul(qs, run.gather(kp, keys).transpose(-1, -2)), rows, keys)
            p = run.weights(s, blk, ok, a)
            keep = keep_mask(p, run.dropout_p)
            if keep is not None:
                p = p * keep
            _put(out, ch, torch.matmul(p, run.gather(vp, keys)))
        ctx.shapes = q.shape, k.shape, v.shape
        ctx.save_for_backward(qp, kp, vp, ap)
        return _unblock(out, q.shape).to(q.dtype)

    @staticmethod
    def backward(ctx: FunctionCtx, grad_out: Tensor):
        run: _Runner = ctx.run
        qp, kp, vp = ctx.saved_tensors[:3]
        q_shape = ctx.shapes[0]
        gp = _blocked(grad_out, run, view=True)
        dq, dk, dv = torch.zeros_like(qp), torch.zeros_like(kp), torch.zeros_like(vp)
        b = run.plan.block
        if run.split:
            out, lse_all = ctx.saved_tensors[3:]
            for ch in run.chunks:
                _split_backward(run, qp, kp, vp, gp, out, lse_all, dq, dk, dv, ch)
            return (*_unblocked_grads(ctx.dtype, (dq, dk, dv), ctx.shapes), None, None)
        ap = ctx.saved_tensors[3]
        want_alpha = ap is not None and ctx.needs_input_grad[3]
        dap = torch.zeros_like(ap) if want_alpha else None
        d_mod = [torch.zeros_like(t) for t in run.mod_tensors]
        modded = run.score_mod is not None
        with replayed_rng(qp.device, ctx.rng if run.dropout_p else None):
            for ch in run.chunks:
                rows = ch.rows
                keys, blk, ok = run.general_inputs(ch.full, ch.part, ch.keep)
                flat = keys.reshape(-1)
                qs = select_blocks(qp, rows).mul_(run.scale)
                kc, vc = run.gather(kp, keys), run.gather(vp, keys)
                s = torch.matmul(qs, kc.transpose(-1, -2))
                if modded or not run.softmax:
                    s.requires_grad_()
                a = None if ap is None else ap.index_select(1, rows).requires_grad_(want_alpha)
                with torch.enable_grad():
                    sm = run.modded(s, rows, keys)
                    # the softmax path works in place: on a copy where autograd needs sm
                    sm_in = sm.detach().clone() if modded and run.softmax else sm
                    p = run.weights(sm_in, blk, ok, a)
                keep = keep_mask(p, run.dropout_p)
                pd = p.detach() if keep is None else p.detach() * keep
                go = select_blocks(gp, rows)
                dv.index_add_(1, flat, _per_block(torch.matmul(pd.transpose(-1, -2), go), b))
                dp = torch.matmul(go, vc.transpose(-1, -2))
                if keep is not None:
                    dp.mul_(keep)
                grads = ()
                if run.softmax:
                    pp = p.detach()
                    ds = pp * (dp - (pp * dp).sum(-1, keepdim=True))
                    if modded:
                        ds, *grads = mod_grads(sm, s, run.mod_tensors, ds)
                else:
                    ds, *grads = mod_grads(p, s, run.mod_tensors, dp, (a,) if want_alpha else ())
                    if want_alpha:
                        dap.index_copy_(1, rows, grads.pop(0))
                for acc, g in zip(d_mod, grads, strict=True):
                    acc += g
                dq.index_copy_(1, rows, torch.matmul(ds, kc).mul_(run.scale))
                dk.index_add_(1, flat, _per_block(torch.matmul(ds.transpose(-1, -2), qs), b))
        d_alpha = None if dap is None else _unblock(dap, (*q_shape[:3], 1))
        dqkv = _unblocked_grads(ctx.dtype, (dq, dk, dv), ctx.shapes)
        return (*dqkv, d_alpha, None, *d_mod)


def _unblocked_grads(dtype: torch.dtype, grads, shapes) -> tuple[Tensor, ...]:
    """dQ, dK, dV from the blocked layout back to their inputs' shapes, in the inputs' dtype."""
    return tuple(_unblock(g, s).to(dtype) for g, s in zip(grads, shapes, strict=True))


def _blocked_alpha(alpha: Tensor, run: _Runner) -> Tensor:
    """Per-row α (B, H, n_q, 1) → (L, G·nbq, b, 1) like the queries; padded rows get α = 2."""
    b = run.plan.block
    return F.pad(alpha, (0, 0, 0, -alpha.shape[-2] % b), value=2.0).reshape(run.lead, -1, b, 1)


def _per_block(x: Tensor, b: int) -> Tensor:
    """(L, m, C·b, e) → (L, m·C, b, e) for ``index_add_`` over key blocks."""
    return x.reshape(x.shape[0], -1, b, x.shape[-1])


def _segment_forward(run, seg: SegmentRun, qp, kp, vp, out, lse_all) -> None:
    """The split path's forward of one run segment into ``out`` and ``lse_all``: in one call
    when it is ``complete``; else its run through one flash call (when it has one) and the
    rest chunk by chunk, merged with their share of the run's output."""
    whole, done = seg.whole, None
    if seg.complete:
        _chunk_forward(run, whole, qp, kp, vp, out, lse_all)
        return
    if whole is not None:
        qw = whole.take(qp)
        kf, vf = run.full_blocks(kp, whole), run.full_blocks(vp, whole)
        done = _flash(qw, kf, vf, 0.0, False, attn_mask=_bias(whole.bias, qw), scale=run.scale)
    at = 0
    for ch in seg.pieces:
        m = ch.rows.numel()
        part = None if done is None else (done[0][:, at : at + m], done[1][:, at : at + m])
        _chunk_forward(run, ch, qp, kp, vp, out, lse_all, part)
        at += m


def _chunk_forward(run, ch, qp, kp, vp, out, lse_all, run_part=None) -> None:
    """:func:`_split_forward` of one chunk, written into its rows of ``out`` and ``lse_all``
    (in place when they are consecutive)."""
    dst = None if ch.first is None else out[:, ch.first : ch.first + ch.rows.numel()]
    o, lse = _split_forward(run, ch.take(qp), kp, vp, ch, run_part, dst)
    if dst is None:
        out.index_copy_(1, ch.rows, o)
    _put(lse_all, ch, lse)


def _split_forward(run, qc, kp, vp, ch, run_part=None, dst=None):
    """Split-softmax forward of one chunk: (output (L, m, b, d), row log-sum-exp (L, m, b)),
    from up to three parts merged by their log-sum-exps: the run (a strided view, with the
    band's bias; ``run_part``: its (output, log-sum-exp) from the segment's flash call), the
    full blocks off the run, the partial blocks (masked here), written into ``dst`` (a view of
    the engine's output, or None: a new tensor)."""
    halves = [] if run_part is None else [(*run_part, run_part[1])]
    if run_part is None and ch.full.shape[1]:
        kf, vf = run.full_blocks(kp, ch), run.full_blocks(vp, ch)
        ok = run.key_mask(run.full_blocks, ch)
        o, lse = _flash_part(run, qc, kf, vf, ch.bias, ok)
        halves.append((o, lse, lse))
    if ch.extra is not None:
        kx, vx = run.extra_blocks(kp, ch), run.extra_blocks(vp, ch)
        o, lse = _flash_part(run, qc, kx, vx, None, run.key_mask(run.extra_blocks, ch))
        halves.append((o, lse, lse))
    if ch.part.shape[1]:
        kc, vc = run.partial_blocks(kp, ch), run.partial_blocks(vp, ch)
        ok = run.key_mask(run.partial_blocks, ch)
        if ch.shared:
            halves.append(_shared_part(run, qc, kc, vc, ch.keep, ok))
        else:  # unnormalised: its weight exp(lse2 − lse) / total is exp(mx − lse)
            p, mx, total = run.partial_exp(qc * run.scale, kc, ch.keep, ok, None)
            halves.append((_mm(p, vc), mx + total.log(), mx))
    if dst is None:
        dst = qc.new_empty(*qc.shape[:-1], vp.shape[-1])
    return _merge(halves, dst)


def _flash_part(run, qc, kc, vc, bias, ok):
    """One part of the keys through torch's flash kernel: (output, lse) (L, m, b, ·), under
    the band's ``bias`` and the key padding ``ok`` (:meth:`_Runner.key_mask`). A row without
    a real key gets the kernel's output 0 and lse −∞ (the kernel gives 0), so that the merge
    weighs it 0."""
    o, lse = _flash(qc, kc, vc, 0.0, False, attn_mask=_bias(bias, qc, ok), scale=run.scale)
    if ok is not None:
        if bias is None:
            has = ok.amax(-1)
        else:
            has = torch.matmul(ok, (bias == 0).to(ok.device, ok.dtype).t()).squeeze(-2)
        lse.masked_fill_(has == 0, float("-inf"))
    return o, lse


def _shared_part(run, qc, kc, vc, keep, ok):
    """The key blocks shared by all the chunk's row blocks, kc and vc (L, 1, C, e) (e.g. the
    global keys), and their key padding ``ok`` (L, 1, 1, C) or None, for its queries qc
    (L, m, b, d): ((pᵀ (L, C, m·b), v (L, C, e)), lse, max
    (L, m, b)) with p = exp(s − max), its Σ p v left to :func:`_merge` (one product added into
    the output). Scored transposed, (L, C, m·b), one product per riding pair: C is small, so
    the reductions and the products run along the long m·b axis; the scale goes on the
    smaller side, the C keys."""
    lead, m, b, _ = qc.shape
    s = torch.matmul(kc[:, 0] * run.scale, qc.reshape(lead, m * b, -1).transpose(1, 2))
    masks = [] if keep is None else [keep.reshape(m * b, -1).t().to(s.dtype)]
    if ok is not None:
        masks.append(ok.reshape(lead, -1, 1))
    p, mx, total = masked_exp(s, masks, None, dim=-2)
    return (p, vc[:, 0]), (mx + total.log()).view(lead, m, b), mx.view(lead, m, b)


def _merge(halves, dst: Tensor) -> tuple[Tensor, Tensor]:
    """Into ``dst`` (L, m, b, d): Σ_i o_i · exp(shift_i − lse), with lse = log Σ_i exp(lse_i)
    (returned), of parts (o_i, lse_i, shift_i) over disjoint keys: a softmax part has shift =
    its lse, an unnormalised one (Σ exp(s − max) v) its row max; o_i may be (pᵀ, v) of
    :func:`_shared_part`, whose product is added into ``dst``."""
    lse = halves[0][1]
    for _, lse2, _ in halves[1:]:
        lse = torch.logaddexp(lse, lse2)
    if len(halves) == 1 and halves[0][2] is lse:  # one softmax part: as it is
        return dst.copy_(halves[0][0]), lse
    written = False
    for o, _, shift in halves:
        # ≤ 1 where the row has an edge; a row without any (lse −∞) gets 0, not ∞ · 0
        w = (shift - lse).exp_().nan_to_num_(nan=0.0, posinf=0.0)
        if isinstance(o, tuple):
            p, v = o
            lead, m, b = w.shape
            flat = dst.view(lead, m * b, -1)
            if not written:
                flat.zero_()
            flat.baddbmm_(p.mul_(w.view(lead, 1, m * b)).transpose(1, 2), v)
        elif not written:
            torch.mul(o, w.unsqueeze(-1), out=dst)
        else:
            dst.addcmul_(o, w.unsqueeze(-1))
        written = True
    return dst, lse


def _mm(a: Tensor, b: Tensor) -> Tensor:
    """a @ b for a (L, m, r, k) and b (L, m, k, c), or b (L, 1, k, c) shared by the m row
    blocks: then one (L, m·r, k) @ (L, k, c) product instead of m small ones."""
    if b.shape[1] == 1 and a.shape[1] > 1:
        lead, m, r = a.shape[:3]
        return torch.matmul(a.reshape(lead, m * r, -1), b[:, 0]).view(lead, m, r, -1)
    return torch.matmul(a, b)


def _mm_t(a: Tensor, b: Tensor, shared: bool) -> Tensor:
    """aᵀ @ b per row block (L, m, c, e), or summed over the m row blocks (L, 1, c, e)."""
    if not shared:
        return torch.matmul(a.transpose(-1, -2), b)
    lead = a.shape[0]
    return torch.matmul(
        a.reshape(lead, -1, a.shape[-1]).transpose(1, 2), b.reshape(lead, -1, b.shape[-1])
    ).unsqueeze(1)


def _bias(bias: Tensor | None, qc: Tensor, ok: Tensor | None = None) -> Tensor | None:
    """The flash kernel's additive mask (L, m, b, K) for queries qc (L, m, b, d): a band
    bias (b, K) and key padding ``ok`` (0/1, (L, m, 1, K)), each alone broadcast (stride 0),
    together summed into one tensor."""
    if bias is not None:
        bias = bias.to(qc.device, qc.dtype)
    if ok is None:
        return None if bias is None else bias.expand(*qc.shape[:2], *bias.shape)
    pad = torch.zeros(ok.shape, dtype=qc.dtype, device=qc.device).masked_fill_(ok == 0, -math.inf)
    if bias is None:
        return pad.expand(*pad.shape[:2], qc.shape[-2], pad.shape[-1])
    return pad + bias


def _split_backward(run, qp, kp, vp, gp, out, lse_all, dq, dk, dv, ch):
    b, full, part, keep = run.plan.block, ch.full, ch.part, ch.keep
    qc, go, oc, lse = (ch.take(x) for x in (qp, gp, out, lse_all))
    delta = (go * oc).sum(-1, keepdim=True)
    dqc = None
    if full.shape[1]:
        kf, vf = run.full_blocks(kp, ch), run.full_blocks(vp, ch)
        ok = run.key_mask(run.full_blocks, ch)
        dqc, dk1, dv1 = _full_backward(run, qc, go, oc, delta, lse, kf, vf, ch.bias, ok)
        dk.index_add_(1, full.reshape(-1), _per_block(dk1, b))
        dv.index_add_(1, full.reshape(-1), _per_block(dv1, b))
    if ch.extra is not None:
        kc, vc = run.extra_blocks(kp, ch), run.extra_blocks(vp, ch)
        ok = run.key_mask(run.extra_blocks, ch)
        dq2, dk1, dv1 = _full_backward(run, qc, go, oc, delta, lse, kc, vc, None, ok)
        dqc = dq2 if dqc is None else dqc.add_(dq2)
        dk.index_add_(1, ch.extra.reshape(-1), _per_block(dk1, b))
        dv.index_add_(1, ch.extra.reshape(-1), _per_block(dv1, b))
    if part.shape[1]:
        flat = (part[:1] if ch.shared else part).reshape(-1)
        kc, vc = run.partial_blocks(kp, ch), run.partial_blocks(vp, ch)
        qs = qc * run.scale
        p, _, _ = run.partial_exp(qs, kc, keep, run.key_mask(run.partial_blocks, ch), lse)
        dv.index_add_(1, flat, run.partial_grad(_mm_t(p, go, ch.shared), ch))
        ds = p.mul_(_mm(go, vc.transpose(-1, -2)).sub_(delta))
        dq2 = _mm(ds, kc).mul_(run.scale)
        dqc = dq2 if dqc is None else dqc.add_(dq2)
        dk.index_add_(1, flat, run.partial_grad(_mm_t(ds, qs, ch.shared), ch))
    _put(dq, ch, dqc)


def _full_backward(run, qc, go, oc, delta, lse, kf, vf, bias, ok):
    """The full (and band) blocks' share of dQ, dK, dV, given the merged output ``oc`` and
    log-sum-exp: (dQ (L, m, b, d), dK and dV shaped like ``kf``, ``vf``); ``bias`` is the
    band's (b, Cf·b) bias or None, ``ok`` the key padding (:meth:`_Runner.key_mask`) or None.
    From ``FLASH_BACKWARD_BLOCK`` on, torch's flash backward kernel; below it the closed form
    dS = P ⊙ (dP − δ), for as many riding (batch, head) pairs at a time as fit the budget (a
    chunk's band is not cut by it: :meth:`~.layout.BlockPlan.chunks`).
    """
    if qc.shape[-2] >= FLASH_BACKWARD_BLOCK:
        mask = _bias(bias, qc, ok)
        return _flash_backward(go, qc, kf, vf, oc, lse, 0.0, False, attn_mask=mask, scale=run.scale)
    masks = [] if bias is None else [(bias == 0).to(qc.device, qc.dtype)]
    dqc, dk1, dv1 = torch.empty_like(qc), qc.new_empty(kf.shape), qc.new_empty(vf.shape)
    lead, m, b = qc.shape[:3]
    step = max(1, run.budget // (m * b * kf.shape[-2]))
    for i in range(0, lead, step):
        at = slice(i, i + step)
        qs = qc[at] * run.scale
        part_masks = masks if ok is None else [*masks, ok[at]]
        p, _, _ = masked_exp(torch.matmul(qs, kf[at].transpose(-1, -2)), part_masks, lse[at])
        torch.matmul(p.transpose(-1, -2), go[at], out=dv1[at])
        ds = p.mul_(torch.matmul(go[at], vf[at].transpose(-1, -2)).sub_(delta[at]))
        torch.matmul(ds, kf[at], out=dqc[at]).mul_(run.scale)
        torch.matmul(ds.transpose(-1, -2), qs, out=dk1[at])
    return dqc, dk1, dv1


def _blocked(x: Tensor, run: _Runner, view: bool = False) -> Tensor:
    """(B, H, n, e) → (L, G·nb, b, e) in ``run.dtype``, zero-padded to a multiple of the block
    size, in which every block is a dense slice (unit stride along e) and block j + 1 follows
    block j (a run of blocks is one strided view).

    Contiguous, copied once (O(n·e)) where x is not (other strides, padding, half precision
    on CPU: :mod:`.precision`): keys and values are read by every row block whose run holds
    them (the band's width in blocks), the flash kernel streaming up to 512 of them at a time,
    which on a projection's (B, n, H, e) layout would span H times the memory (measured 20%
    slower at H = 12). With ``view``, for tensors read or written once per row block (the
    queries, the output's gradient), a view of x where its strides allow (the projection's
    layout with L = H): no copy."""
    b = run.plan.block
    pad = -x.shape[-2] % b
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    x = x.reshape(run.lead, -1, b, x.shape[-1])
    if x.dtype == run.dtype and (x.is_contiguous() or view and _block_strided(x)):
        return x
    # one copy; not ``x.to(dtype, memory_format=torch.contiguous_format)``, which returns a
    # strided x as it is when the dtype already matches (then every index_select below
    # copies it again: 4x slower on projection-layout inputs)
    return torch.empty(x.shape, dtype=run.dtype, device=x.device).copy_(x)


def _block_strided(x: Tensor) -> bool:
    """Whether x (L, N, b, e) serves as a blocked tensor as it is: unit stride along e, block
    j + 1 right after block j, and no stride 0 (an expanded tensor: the gradients are
    accumulated into tensors shaped like it)."""
    size, stride = x.shape, x.stride()
    return (
        (size[3] == 1 or stride[3] == 1)
        and (size[1] == 1 or stride[1] == size[2] * stride[2])
        and all(st > 0 for n, st in zip(size, stride, strict=True) if n > 1)
    )


def _put(dst: Tensor, ch: BlockChunk, rows: Tensor) -> None:
    """Write a chunk's rows (L, m, ...) into dst (L, G·nb, ...): a slice copy when they are
    consecutive, else ``index_copy_``."""
    if ch.first is None:
        dst.index_copy_(1, ch.rows, rows)
    else:
        dst[:, ch.first : ch.first + rows.shape[1]].copy_(rows)


def _unblock(x: Tensor, shape: torch.Size) -> Tensor:
    return x.reshape(shape[0], shape[1], -1, x.shape[-1])[:, :, : shape[2]]


def _lead_and_graph(graph: AttentionGraph, bsz: int, heads: int) -> tuple[int, AttentionGraph]:
    """How the (B, H) pairs ride along: L = B·H / G, with G the graphs the plan covers."""
    shape = graph.batch_shape
    if math.prod(shape) == 1:
        return bsz * heads, squeezed(graph, len(shape))
    if all(s == 1 for s in shape[:-1]) and shape[-1] == heads:
        return bsz, squeezed(graph, len(shape) - 1)
    return 1, graph.expand((bsz, heads))


def block_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    graph: AttentionGraph,
    prob_map: ProbabilityMap,
    scale: float,
    key_valid: Tensor | None = None,
    dropout_p: float = 0.0,
    block: int | None = None,
    budget: int | None = None,
    score_mod: Callable | None = None,
) -> Tensor:
    """Block-sparse attention, Yun eq. (3) (same contract as ``dense_attention``; any map, a
    static or batched graph). ``block``: the block size, None: :func:`choose_block`'s;
    ``budget``: most score entries per chunk, None: ``BUDGET`` for the inputs' device type.
    """
    bsz, heads = q.shape[:2]
    lead, graph = _lead_and_graph(graph, bsz, heads)
    if block is None:
        train = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        block = choose_block(graph, train)
    plan = block_plan(graph, block).to(q.device)
    key_ok = None
    if key_valid is not None:
        key_ok = key_valid.to(q.device)
        pad = -key_ok.shape[-1] % plan.block
        if pad:
            key_ok = F.pad(key_ok, (0, pad), value=False)
        key_ok = key_ok[:, None, :].expand(bsz, heads, -1).reshape(lead, -1, plan.block)
    budget = BUDGET.get(q.device.type, BUDGET["cuda"]) if budget is None else budget
    fused = q.device.type == "cpu" and q.shape[-1] == v.shape[-1] and score_mod is None
    dtype, width = compute_dtype(q), q.shape[-1]
    run = _Runner(plan, prob_map, scale, key_ok, dropout_p, budget, lead, fused, dtype, width)
    run = run.with_score_mod(score_mod, heads, q.shape[2], k.shape[2])
    alpha = prob_map.row_alpha(bsz, heads, q.shape[2])
    return _BlockAttention.apply(q, k, v, alpha, run, *run.mod_tensors)
