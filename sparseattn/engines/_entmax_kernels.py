"""Triton kernels of :mod:`sparseattn.engines.triton_entmax` (imported lazily: needs triton).

α-entmax attention over a block layout, Yun et al. eq. (3) with ρ = α-entmax (Peters et al.
2019): for each query row i, over the key blocks its query block visits,

    p_ij = [z_ij − τ_i]₊^r,  r = 1/(α − 1),  z_ij = (α − 1) · scale · q_i·k_j,  Σ_j p_ij = 1.

* ``_forward``, one program per (query block, batch·head): pass 0 (row max m, key count,
  per-tile maxima), threshold passes for τ of x = z − m ∈ [−1, −n^{1−α}], then a last pass
  accumulating p·V and, for the backward, g·V with g = p^{2−α} and one non-zero byte per
  (pair, head) (docs/engines.md, "Forward"); :mod:`sparseattn.engines._entmax_split` runs the
  same tile loops over the split query blocks.
* ``_backward_dq`` per (query block, batch·head) and ``_backward_dkdv`` per (key block, batch·kv
  head, looping over its GQA group): with dp = dO·Vᵀ and δ_i = Σ_j g_ij dp_ij / Σ_j g_ij,
  ds = g ⊙ (dp − δ); dV = pᵀ dO, dQ = scale · ds K, dK = scale · dsᵀ Q, skipping the pairs
  without non-zeros (docs/engines.md, "Backward"). Shared tiles: :mod:`._entmax_tiles`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._entmax_tiles import (
    _excess,
    _grad_rows,
    _grads,
    _keys_in,
    _masked,
    _mm,
    _mod_at,
    _mod_grads,
    _pairs,
    _program,
    _put,
    _query_block,
    _scored,
    _scores,
    _slopes,
    _tile,
    _unmodify,
    _weights,
    _whole,
)

#: Two steps closer than this (in units of the shifted scores, τ ∈ [−1, 0)) end the search.
TOL = tl.constexpr(2.5e-7)
#: Slack of the exact-support test of sparsemax and 1.5-entmax.
EPS = tl.constexpr(2.5e-7)


@triton.jit
def _insert(top, t, TOPK: tl.constexpr):
    """``t`` (BLOCK,) inserted into ``top``, a tuple of TOPK (BLOCK,) vectors in descending
    order per row, the smallest dropping out: compares and swaps, no reduction."""
    out = ()
    for j in tl.static_range(TOPK):
        out = out + (tl.maximum(top[j], t),)
        t = tl.minimum(top[j], t)
    return out


@triton.jit
def _stack(top, BLOCK: tl.constexpr, TOPK: tl.constexpr):
    """The tuple of TOPK (BLOCK,) vectors as one (BLOCK, TOPK) tile, column j = top[j]."""
    slot = tl.arange(0, TOPK)
    out = tl.full((BLOCK, TOPK), float("-inf"), tl.float32)
    for j in tl.static_range(TOPK):
        out = tl.where(slot[None, :] == j, top[j][:, None], out)
    return out


@triton.jit
def _start(x, R, BLOCK: tl.constexpr, MODE: tl.constexpr, STEPS: tl.constexpr):
    """A lower bound τ₀ ≥ −1 of the threshold from a subset of each row's scores, x (BLOCK, K)
    shifted by the row max (−inf for empty slots), by Newton from the left on the subset
    (dropping entries only lowers the threshold). For α > 2 (f concave) τ₀ = −1."""
    tau = tl.full((BLOCK,), -1.0, tl.float32)
    for _ in tl.static_range(STEPS):
        pos = x > tau[:, None]
        d = tl.where(pos, x - tau[:, None], 0.0)
        if MODE == 2:
            new = tau + (tl.sum(d, 1) - 1.0) / tl.maximum(tl.sum(pos.to(tl.float32), 1), 1.0)
        elif MODE == 1:
            nrm = tl.sqrt(tl.sum(d * d, 1))
            new = tau + (nrm - 1.0) * nrm / tl.maximum(tl.sum(d, 1), 1e-30)
        else:
            s1 = tl.sum(_weights(d, R, 0), 1)
            nrm = tl.exp2(tl.log2(tl.maximum(s1, 1e-30)) / R)
            new = tau + (nrm - 1.0) * s1 / tl.maximum(nrm * tl.sum(_slopes(d, R, 0), 1), 1e-30)
            new = tl.where(R > 1.0, new, -1.0)
        tau = tl.maximum(tau, new)
    return tau


@triton.jit
def _pass0(start, end, TMAX_b, PAIR_KB, PAIR_MASK, MASKS, q, K_h, KEY_OK_b, row_ok, rows_in, n_k,
           mul, mod, D: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr,
           HAS_KEY_OK: tl.constexpr, PARTIAL: tl.constexpr, PREC: tl.constexpr,
           UPCAST: tl.constexpr, MODE: tl.constexpr, TOPK: tl.constexpr,
           MOD: tl.constexpr):  # fmt: skip
    """Pass 0 over the pairs [start, end): each row's max m (−inf without keys), its number
    of keys (α ∉ {1.5, 2} only: it bounds τ from above), its TOPK largest per-tile maxima (a
    subset of the row: a start for τ; a tuple of (BLOCK,) vectors, :func:`_insert`), and each
    tile's largest score, stored at TMAX_b + p."""
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    cnt = tl.zeros((BLOCK,), tl.float32)
    top = ()  # TOPK (BLOCK,) vectors, descending: (BLOCK,) vectors stay in the scores' layout
    for _ in tl.static_range(TOPK):
        top = top + (tl.full((BLOCK,), float("-inf"), tl.float32),)
    for p in range(start, end):
        s, ok, whole, k, cols, th = _scores(
            p, PAIR_KB, PAIR_MASK, MASKS, q, K_h, KEY_OK_b, row_ok, rows_in, n_k, mul, mod,
            D, BD, BLOCK, HAS_KEY_OK, PARTIAL, PREC, UPCAST, MOD,
        )  # fmt: skip
        s = _masked(s, ok, whole, -float("inf"))
        t = tl.max(s, 1)
        m = tl.maximum(m, t)
        if MODE == 0:
            cnt += tl.sum((s > float("-inf")).to(tl.float32), 1)  # from s: in its layout
        tl.store(TMAX_b + p, tl.max(t, 0))
        top = _insert(top, t, TOPK)
    return m, cnt, top


@triton.jit
def _floor(done, m, tau, lo, MODE: tl.constexpr):
    """τ only grows (Newton from the left; for α > 2 the bracket's lo): a tile whose largest
    score is below every open row's m + τ holds none of their supports."""
    return tl.min(tl.where(~done, m + (lo if MODE == 0 else tau), float("inf")), 0)


@triton.jit
def _sums(start, end, TMAX_b, PAIR_KB, PAIR_MASK, MASKS, q, K_h, KEY_OK_b, row_ok, rows_in, n_k,
          mul, mod, t_abs, floor, R, D: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr,
          HAS_KEY_OK: tl.constexpr, PARTIAL: tl.constexpr, PREC: tl.constexpr,
          UPCAST: tl.constexpr, MODE: tl.constexpr, SKIP: tl.constexpr,
          MOD: tl.constexpr):  # fmt: skip
    """A threshold pass over the pairs [start, end) at the absolute threshold t_abs = m + τ:
    per row |S|, Σ d^r (Σ d), Σ d^{r−1} (Σ d²) and the least y of S, with y = x − τ,
    d = [y]₊, S = {y > 0}. ``SKIP``: tiles whose largest score is below ``floor`` skipped."""
    c0 = tl.zeros((BLOCK,), tl.float32)
    s1 = tl.zeros((BLOCK,), tl.float32)
    s2 = tl.zeros((BLOCK,), tl.float32)
    y_in = tl.full((BLOCK,), float("inf"), tl.float32)
    for p in range(start, end):
        visit = True
        if SKIP:
            visit = tl.load(TMAX_b + p) > floor
        if visit:
            s, ok, whole, k, cols, th = _scores(
                p, PAIR_KB, PAIR_MASK, MASKS, q, K_h, KEY_OK_b, row_ok, rows_in, n_k, mul, mod,
                D, BD, BLOCK, HAS_KEY_OK, PARTIAL, PREC, UPCAST, MOD,
            )  # fmt: skip
            y = _masked(s - t_abs[:, None], ok, whole, -float("inf"))  # x − τ, x = z − m
            d = tl.maximum(y, 0.0)
            pos = y > 0.0
            c0 += tl.sum(pos.to(tl.float32), 1)
            if MODE == 0:
                s1 += tl.sum(_weights(d, R, 0), 1)
                s2 += tl.sum(_slopes(d, R, 0), 1)
            else:
                s1 += tl.sum(d, 1)
                s2 += tl.sum(d * d, 1)
                y_in = tl.minimum(y_in, tl.min(tl.where(pos, y, float("inf")), 1))
    return c0, s1, s2, y_in


@triton.jit
def _update(tau, lo, hi, done, m, c0, s1, s2, y_in, AM1, R, MODE: tl.constexpr):
    """One step of the threshold search from a pass's sums (:func:`_sums`) at τ; returns
    (τ, lo, hi, done). The closed form τ_S on S = {x > τ} is exact when S keeps every x ≥ τ_S
    and no x < τ_S: the scores outside S are ≤ τ, so τ ≤ τ_S (true from the left) replaces
    their max."""
    c0 = tl.maximum(c0, 1.0)
    x_in = tau + y_in  # the least score of S, shifted by m
    if MODE == 2:  # Michelot: the Newton step is the closed form on S
        new = tau + (s1 - 1.0) / c0
        exact = (tau <= new + EPS) & (new <= x_in + EPS)
    elif MODE == 1:
        disc = s1 * s1 - c0 * (s2 - 1.0)
        t_s = tau + (s1 - tl.sqrt(tl.maximum(disc, 0.0))) / c0
        exact = (disc >= 0) & (tau <= t_s + EPS) & (t_s <= x_in + EPS)
        nrm = tl.sqrt(s2)
        new = tl.where(exact, t_s, tau + (nrm - 1.0) * nrm / tl.maximum(s1, 1e-30))
    else:
        f = s1 - 1.0
        lo = tl.where(f >= 0, tl.maximum(lo, tau), lo)
        hi = tl.where(f < 0, tl.minimum(hi, tau), hi)
        # r > 1: Newton on the convex ‖d‖_r − 1 (monotone from the left); r < 1: on f
        nrm = tl.exp2(AM1 * tl.log2(tl.maximum(s1, 1e-30)))  # (Σ d^r)^{1/r}
        step_g = (nrm - 1.0) * s1 / tl.maximum(nrm * s2, 1e-30)
        step_f = f / tl.maximum(R * s2, 1e-30)
        new = tau + tl.where(R > 1.0, step_g, step_f)
        keep = ((new > lo) & (new < hi)) | (tl.abs(new - tau) <= TOL)  # False for NaN
        new = tl.where(keep, new, 0.5 * (lo + hi))
        exact = f == 0
    # converged: exact, or a step below TOL or below two float spacings of the absolute
    # threshold m + τ, on which the passes compare (it exceeds TOL for |m| > 1)
    conv = exact | (tl.abs(new - tau) <= TOL + 2.4e-7 * tl.abs(m))
    return tl.where(done, tau, new), lo, hi, done | conv


@triton.jit
def _last(start, end, TMAX_b, NZ_b, PAIR_KB, PAIR_MASK, MASKS, q, K_h, V_h, KEY_OK_b, row_ok,
          rows_in, n_k, mul, mod, tau_abs, R, D: tl.constexpr, DV: tl.constexpr,
          BD: tl.constexpr, BDV: tl.constexpr, BLOCK: tl.constexpr, HAS_KEY_OK: tl.constexpr,
          PARTIAL: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, MODE: tl.constexpr,
          NEED_GRAD: tl.constexpr, MOD: tl.constexpr):  # fmt: skip
    """The last pass over the pairs [start, end): Σ p V and Σ p per row, and for the backward
    Σ g V, Σ g (g = p^{2−α}) and one byte per pair at NZ_b + p, whether it holds a non-zero.
    Tiles below every row's threshold skip both products."""
    acc = tl.zeros((BLOCK, BDV), tl.float32)
    g_acc = tl.zeros((BLOCK, BDV), tl.float32)
    g_sum = tl.zeros((BLOCK,), tl.float32)
    p_sum = tl.zeros((BLOCK,), tl.float32)
    floor = tl.min(tau_abs, 0)
    for p in range(start, end):
        nz = tl.load(TMAX_b + p) > floor
        if nz:  # else no row has a weight in this tile: skip both products
            s, ok, whole, k, cols, th = _scores(
                p, PAIR_KB, PAIR_MASK, MASKS, q, K_h, KEY_OK_b, row_ok, rows_in, n_k, mul, mod,
                D, BD, BLOCK, HAS_KEY_OK, PARTIAL, PREC, UPCAST, MOD,
            )  # fmt: skip
            d = _excess(s, ok, whole, tau_abs)
            nz = tl.max(tl.max(d, 1), 0) > 0
            if nz:
                v = _tile(V_h, cols, cols < n_k, DV, BDV)
                w = _weights(d, R, MODE)
                p_sum += tl.sum(w, 1)
                acc += _mm(w.to(v.dtype), v, PREC, UPCAST)
                if NEED_GRAD:
                    sl = _slopes(d, R, MODE)
                    g_sum += tl.sum(sl, 1)
                    g_acc += _mm(sl.to(v.dtype), v, PREC, UPCAST)
        if NEED_GRAD:
            tl.store(NZ_b + p, nz.to(tl.int8))
    return acc, g_acc, g_sum, p_sum


@triton.jit
def _finish(O, TAU, GV, bh, rows, row_ok, n_q, acc, g_acc, g_sum, p_sum, tau_abs, open_,
            DV: tl.constexpr, BDV: tl.constexpr, MODE: tl.constexpr, NEED_GRAD: tl.constexpr,
            OPEN: tl.constexpr):  # fmt: skip
    """Store a query block's output rows, τ, and for the backward Σ g V / Σ g. The rows are
    divided by Σ p for α ∉ {1.5, 2} and, with ``OPEN``, where a row is still ``open_`` (not
    converged; the main kernel leaves ``OPEN`` off: a live ``done`` cost its last pass 410
    SASS instructions per tile instead of 367)."""
    renorm = p_sum > 0
    if MODE != 0:
        if OPEN:  # noqa: SIM108 (a compile-time branch)
            renorm = renorm & open_
        else:
            renorm = renorm & False
    acc = tl.where(renorm[:, None], acc / tl.where(renorm, p_sum, 1.0)[:, None], acc)
    o_base = bh.to(tl.int64) * n_q * DV
    _put(O + o_base, rows, row_ok, acc, DV, BDV)
    tl.store(TAU + bh.to(tl.int64) * n_q + rows, tau_abs, mask=row_ok)
    if NEED_GRAD:
        g_acc = g_acc / tl.where(g_sum > 0, g_sum, 1.0)[:, None]
        _put(GV + o_base, rows, row_ok, g_acc, DV, BDV)


@triton.jit
def _forward(
    Q, K, V, O, TAU, GV, NZ, TMAX, PASSES,
    ROW_PTR, ROW_END, ORDER, PAIR_KB, PAIR_MASK, MASKS, GIDX, KEY_OK,
    n_q, n_k, H, HKV, nbq, n_pairs,
    mul, AM1, R,
    MB, mb_b, mb_h, mb_i, mb_j, MSL, m_cap, m_scale, m_am1, MDB, MDSL,
    D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    BLOCK: tl.constexpr, MODE: tl.constexpr, HAS_KEY_OK: tl.constexpr, PARTIAL: tl.constexpr,
    NEED_GRAD: tl.constexpr,
    MAX_IT: tl.constexpr, TOPK: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
    SKIP: tl.constexpr, LONGEST_FIRST: tl.constexpr, MOD: tl.constexpr,
):  # fmt: skip
    qb, bh = _query_block(ORDER, GIDX, nbq, LONGEST_FIRST)
    start, end = _pairs(ROW_PTR, ROW_END, GIDX, bh, qb, nbq)
    rows, row_ok, rows_in, K_h, V_h, KEY_OK_b = _program(qb, bh, K, V, KEY_OK, H, HKV, n_q, n_k,
                                                         D, DV, BLOCK)  # fmt: skip
    mod = _mod_at(bh, H, rows, MB, mb_b, mb_h, mb_i, mb_j, MSL, m_cap, m_scale, m_am1,
                  MDB, MDSL, MOD)  # fmt: skip
    q = _tile(Q + bh.to(tl.int64) * n_q * D, rows, row_ok, D, BD)
    TMAX_b = TMAX + bh.to(tl.int64) * n_pairs
    m, cnt, top = _pass0(
        start, end, TMAX_b, PAIR_KB, PAIR_MASK, MASKS, q, K_h, KEY_OK_b, row_ok, rows_in, n_k,
        mul, mod, D, BD, BLOCK, HAS_KEY_OK, PARTIAL, PREC, UPCAST, MODE, TOPK, MOD,
    )  # fmt: skip
    has = m > float("-inf")
    m = tl.where(has, m, 0.0)

    # threshold τ of x = z − m: f(−1) ≥ 0 ≥ f(−n^{1−α}); start at the subset's lower bound
    tau = _start(_stack(top, BLOCK, TOPK) - m[:, None], R, BLOCK, MODE, TOPK)
    lo = tau
    hi = tl.where(has, -tl.exp2(-AM1 * tl.log2(tl.maximum(cnt, 1.0))), 0.0)
    done = ~has
    it = 0
    while (it < MAX_IT) & (tl.sum((~done).to(tl.int32), 0) > 0):
        c0, s1, s2, y_in = _sums(
            start, end, TMAX_b, PAIR_KB, PAIR_MASK, MASKS, q, K_h, KEY_OK_b, row_ok, rows_in, n_k,
            mul, mod, m + tau, _floor(done, m, tau, lo, MODE), R,
            D, BD, BLOCK, HAS_KEY_OK, PARTIAL, PREC, UPCAST, MODE, SKIP, MOD,
        )  # fmt: skip
        tau, lo, hi, done = _update(tau, lo, hi, done, m, c0, s1, s2, y_in, AM1, R, MODE)
        it += 1

    tau_abs = tl.where(has, m + tau, float("inf"))
    acc, g_acc, g_sum, p_sum = _last(
        start, end, TMAX_b, NZ + bh.to(tl.int64) * n_pairs, PAIR_KB, PAIR_MASK, MASKS, q, K_h,
        V_h, KEY_OK_b, row_ok, rows_in, n_k, mul, mod, tau_abs, R,
        D, DV, BD, BDV, BLOCK, HAS_KEY_OK, PARTIAL, PREC, UPCAST, MODE, NEED_GRAD, MOD,
    )  # fmt: skip
    _finish(O, TAU, GV, bh, rows, row_ok, n_q, acc, g_acc, g_sum, p_sum, tau_abs, None,
            DV, BDV, MODE, NEED_GRAD, False)  # fmt: skip
    tl.store(PASSES + bh.to(tl.int64) * nbq + qb, it + tl.zeros((), tl.int32))


@triton.jit
def _dq(start, end, NZ_b, PAIR_KB, PAIR_MASK, MASKS, q, do, tau, delta, K_h, V_h, KEY_OK_b, row_ok,
        rows_in, n_k, mul, mod, R, D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr,
        BDV: tl.constexpr, BLOCK: tl.constexpr, MODE: tl.constexpr, HAS_KEY_OK: tl.constexpr,
        PARTIAL: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, MOD: tl.constexpr,
        MOD_GRAD: tl.constexpr):  # fmt: skip
    """Σ ds K over the pairs [start, end) that hold a non-zero (flags at NZ_b + p), and the
    score modifier's gradients (:func:`_mod_grads`: the bias's written, the ALiBi slope's
    sum returned)."""
    dq = tl.zeros((BLOCK, BD), tl.float32)
    slope = tl.zeros((), tl.float32)
    for p in range(start, end):
        if tl.load(NZ_b + p) != 0:
            s, ok, whole, k, cols, th = _scores(
                p, PAIR_KB, PAIR_MASK, MASKS, q, K_h, KEY_OK_b, row_ok, rows_in, n_k, mul, mod,
                D, BD, BLOCK, HAS_KEY_OK, PARTIAL, PREC, UPCAST, MOD,
            )  # fmt: skip
            v = _tile(V_h, cols, cols < n_k, DV, BDV)
            d, ds = _grads(s, ok, whole, tau, do, v, delta, R, MODE, PREC, UPCAST)
            if MOD_GRAD != 0:
                slope += _mod_grads(ds, th, ok, cols, mod, MOD, MOD_GRAD)
            if MOD != 0:
                ds = _unmodify(ds, th, MOD)
            dq += _mm(ds.to(k.dtype), k, PREC, UPCAST)
    return dq, slope


@triton.jit
def _slope_grad(mod, slope, MOD_GRAD: tl.constexpr):
    """Add a program's sum to its head's ALiBi slope gradient (``MOD_GRAD`` bit 2)."""
    if ((MOD_GRAD >> 2) & 1) != 0:
        tl.atomic_add(mod[9], slope)


@triton.jit
def _backward_dq(
    Q, K, V, DO, DQ, TAU, DELTA, NZ,
    ROW_PTR, ROW_END, ORDER, PAIR_KB, PAIR_MASK, MASKS, GIDX, KEY_OK,
    n_q, n_k, H, HKV, nbq, n_pairs,
    mul, scale, R,
    MB, mb_b, mb_h, mb_i, mb_j, MSL, m_cap, m_scale, m_am1, MDB, MDSL,
    D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    BLOCK: tl.constexpr, MODE: tl.constexpr, HAS_KEY_OK: tl.constexpr, PARTIAL: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, LONGEST_FIRST: tl.constexpr, MOD: tl.constexpr,
    MOD_GRAD: tl.constexpr,
):  # fmt: skip
    qb, bh = _query_block(ORDER, GIDX, nbq, LONGEST_FIRST)
    start, end = _pairs(ROW_PTR, ROW_END, GIDX, bh, qb, nbq)
    rows, row_ok, rows_in, K_h, V_h, KEY_OK_b = _program(qb, bh, K, V, KEY_OK, H, HKV, n_q, n_k,
                                                         D, DV, BLOCK)  # fmt: skip
    mod = _mod_at(bh, H, rows, MB, mb_b, mb_h, mb_i, mb_j, MSL, m_cap, m_scale, m_am1,
                  MDB, MDSL, MOD)  # fmt: skip
    q, do, tau, delta = _grad_rows(Q, DO, TAU, DELTA, bh, rows, row_ok, n_q, D, DV, BD, BDV)
    dq, slope = _dq(
        start, end, NZ + bh.to(tl.int64) * n_pairs, PAIR_KB, PAIR_MASK, MASKS, q, do, tau, delta,
        K_h, V_h, KEY_OK_b, row_ok, rows_in, n_k, mul, mod, R,
        D, DV, BD, BDV, BLOCK, MODE, HAS_KEY_OK, PARTIAL, PREC, UPCAST, MOD, MOD_GRAD,
    )  # fmt: skip
    _put(DQ + bh.to(tl.int64) * n_q * D, rows, row_ok, dq * scale, D, BD)
    _slope_grad(mod, slope, MOD_GRAD)


@triton.jit
def _backward_dkdv(
    Q, K, V, DO, DK, DV_, TAU, DELTA, NZ,
    COL_PTR, COL_PAIR, COL_QB, PAIR_MASK, MASKS, GIDX, KEY_OK,
    n_q, n_k, H, HKV, nbk, n_pairs,
    mul, scale, R,
    MB, mb_b, mb_h, mb_i, mb_j, MSL, m_cap, m_scale, m_am1, MDB, MDSL,
    D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    BLOCK: tl.constexpr, GROUP: tl.constexpr, MODE: tl.constexpr, HAS_KEY_OK: tl.constexpr,
    PARTIAL: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, MOD: tl.constexpr,
):  # fmt: skip
    kb = tl.program_id(0)
    bkv = tl.program_id(1)
    b = bkv // HKV
    kvh = bkv % HKV

    offs = tl.arange(0, BLOCK)
    cols = kb * BLOCK + offs
    col_ok = cols < n_k
    K_h = K + bkv.to(tl.int64) * n_k * D
    V_h = V + bkv.to(tl.int64) * n_k * DV
    k = _tile(K_h, cols, col_ok, D, BD)
    v = _tile(V_h, cols, col_ok, DV, BDV)
    col_in = _keys_in(KEY_OK + b.to(tl.int64) * n_k, cols, n_k, HAS_KEY_OK)
    dk = tl.zeros((BLOCK, BD), tl.float32)
    dv = tl.zeros((BLOCK, BDV), tl.float32)
    for t in tl.static_range(GROUP):
        bh = b * H + kvh * GROUP + t
        g = tl.load(GIDX + bh)
        start = tl.load(COL_PTR + g * nbk + kb)
        end = tl.load(COL_PTR + g * nbk + kb + 1)
        for c in range(start, end):
            pair = tl.load(COL_PAIR + c)
            if tl.load(NZ + bh.to(tl.int64) * n_pairs + pair) != 0:
                qb = tl.load(COL_QB + c)
                rows = qb * BLOCK + offs
                row_ok = rows < n_q
                q, do, tau, delta = _grad_rows(
                    Q, DO, TAU, DELTA, bh, rows, row_ok, n_q, D, DV, BD, BDV
                )
                midx = tl.load(PAIR_MASK + pair)
                mod = _mod_at(bh, H, rows, MB, mb_b, mb_h, mb_i, mb_j, MSL, m_cap, m_scale, m_am1,
                              MDB, MDSL, MOD)  # fmt: skip
                s, ok, th = _scored(
                    q, k, row_ok, col_in, cols, MASKS, midx, mul, mod, BLOCK, PARTIAL, PREC,
                    UPCAST, MOD,
                )  # fmt: skip
                whole = _whole(kb, midx, n_k, (qb + 1) * BLOCK <= n_q, BLOCK, HAS_KEY_OK)
                d, ds = _grads(s, ok, whole, tau, do, v, delta, R, MODE, PREC, UPCAST)
                if MOD != 0:
                    ds = _unmodify(ds, th, MOD)
                w = _weights(d, R, MODE)
                dv += _mm(tl.trans(w.to(do.dtype)), do, PREC, UPCAST)
                dk += _mm(tl.trans(ds.to(q.dtype)), q, PREC, UPCAST)
    _put(DK + bkv.to(tl.int64) * n_k * D, cols, col_ok, dk * scale, D, BD)
    _put(DV_ + bkv.to(tl.int64) * n_k * DV, cols, col_ok, dv, DV, BDV)
