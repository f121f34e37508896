"""Triton kernels of :mod:`sparseattn.engines.triton_entmax` (imported lazily: needs triton).

α-entmax attention over a block layout, Yun et al. eq. (3) with ρ = α-entmax (Yun et al.
appendix B.3; Peters et al. 2019, whose closed form of α-entmax this is): for each query row i,

    p_ij = [z_ij − τ_i]₊^r,  r = 1/(α − 1),  z_ij = (α − 1) · scale · q_i·k_j,  Σ_j p_ij = 1,

with j running over the key blocks the row's query block visits (elements masked out by a
partial block's tile, key padding or the sequence ends take no part). The kernels:

* ``_forward``: one program per (query block, batch·head). Pass 0 finds each row's max m_i, number
  of keys and each tile's largest score; then τ (shifted by m, so τ ∈ [−1, −n^{1−α}]) by passes over
  the row's key tiles, each pass recomputing the tile's scores: sparsemax (α = 2) by Newton from the
  left = Michelot's iteration; 1.5-entmax by Newton from the left on G(τ) = ‖[x − τ]₊‖₂ − 1, with
  the closed form on the current support S, τ_S = τ + (ΣS d − sqrt((ΣS d)² − |S|(ΣS d² − 1)))/|S|,
  accepted when τ ≤ τ_S ≤ min_{x∈S} x (the scores outside S are ≤ τ, so then f(τ_S) = 1: τ_S is the
  threshold); any other α by safeguarded Newton on ‖[x − τ]₊‖_r − 1 (r > 1) or Σ[x − τ]₊^r − 1 (r <
  1) inside the bracket [−1, −n^{1−α}] (bisection when a step leaves it) to float precision. τ only
  grows, so tiles whose largest score lies below every open row's m + τ are skipped (``SKIP``;
  without it the passes visit every tile, a loop without a branch, whose loads Triton can pipeline).
  A last pass accumulates p·V over the tiles that hold a non-zero (the others skip the value
  product) and, when gradients are needed, g·V with g = p^{2−α}, Σg and one byte per (row block, key
  block) pair: whether the pair holds a non-zero weight.
* the split query blocks (``triton_entmax.SPLIT_LONG``: the global tokens' block, decoding)
  run the same passes over chunks of their pairs, by the kernels of
  :mod:`sparseattn.engines._entmax_split`, which call the tile loops below.
* ``_backward_dq``: one program per (query block, batch·head); ``_backward_dkdv``: one per (key
  block, batch·kv head), looping over the query heads of its GQA group and over the query blocks
  that visit the key block (the layout's columns). Both reuse τ and skip the pairs without
  non-zeros. The closed-form gradient of α-entmax (Peters et al. 2019): with g = p^{2−α}, dp =
  dO·Vᵀ and δ_i = Σ_j g_ij dp_ij / Σ_j g_ij (= dO_i · (Σ_j g_ij v_j)/Σ_j g_ij, from the
  forward), ds = g ⊙ (dp − δ); dV = pᵀ dO, dQ = scale · ds K, dK = scale · dsᵀ Q.

Score modifiers (:mod:`sparseattn.score_mods`) reach the kernels as a description, not as
code: the compile-time ``MOD`` says which of a bias tensor, ALiBi and a softcap apply and in
which order (bits 0-1: the bias, 1 before the softcap or without one, 2 after it; bits 2-3:
ALiBi, the same; bit 4: the softcap), and a tuple of run-time arguments holds the bias
pointer and strides, the slopes, the cap and the gradients' buffers (:func:`_mod_at`). The
scores are then z = (α − 1) · f(scale · q_i·k_j) (:func:`_modify`); the backward multiplies ds
by f' (the softcap's 1 − tanh², :func:`_unmodify`) and, in the dq kernels, writes the bias's
gradient (ds at the bias, summed where it broadcasts: atomic adds) and adds the ALiBi slopes'
(−Σ ds·|i − j| per head) (:func:`_mod_grads`). ``MOD`` = 0 compiles none of it.

Tiles are square, ``BLOCK`` × ``BLOCK`` (the layout's block); head dims are padded to powers
of two. Accumulation in float32; fp32 inputs use exact (IEEE) products, bf16/fp16 inputs cast
the weights to the input type for the value products, as flash attention does.
Only plain loads/stores, ``tl.dot``, ``tl.where``, reductions and ``range`` loops: accepted
by triton 3.6 and 3.9.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Two steps closer than this (in units of the shifted scores, τ ∈ [−1, 0)) end the search.
TOL = tl.constexpr(2.5e-7)
#: Slack of the exact-support test of sparsemax and 1.5-entmax.
EPS = tl.constexpr(2.5e-7)


@triton.jit
def _tile(P, idx, ok, C: tl.constexpr, BC: tl.constexpr):
    """Rows ``idx`` of the row-major (·, C) matrix at P as a (len(idx), BC) tile: 0 in the
    rows that are not ``ok`` and in the columns past C (BC is C padded to a power of two)."""
    col = tl.arange(0, BC)
    return tl.load(
        P + idx[:, None] * C + col[None, :], mask=ok[:, None] & (col[None, :] < C), other=0.0
    )


@triton.jit
def _put(P, idx, ok, x, C: tl.constexpr, BC: tl.constexpr):
    """Store the tile x, cast to P's type, into rows ``idx`` of the (·, C) matrix at P (the
    rows that are ``ok``, the columns below C): the inverse of :func:`_tile`."""
    col = tl.arange(0, BC)
    tl.store(
        P + idx[:, None] * C + col[None, :],
        x.to(P.dtype.element_ty),
        mask=ok[:, None] & (col[None, :] < C),
    )


@triton.jit
def _keys_in(KEY_OK, cols, n_k, HAS_KEY_OK: tl.constexpr):
    """Which key columns ``cols`` are keys: inside the sequence and, with a key padding mask
    (KEY_OK at this batch's row), not padding."""
    col_in = cols < n_k
    if HAS_KEY_OK:
        kp = tl.load(KEY_OK + cols, mask=col_in, other=0)
        col_in = col_in & (kp != 0)
    return col_in


@triton.jit
def _scored(q, k, row_ok, col_in, cols, MASKS, midx, mul, mod, BLOCK: tl.constexpr,
            PARTIAL: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
            MOD: tl.constexpr):  # fmt: skip
    """Scores z = mul · q kᵀ of one (query block, key block) pair, (BLOCK, BLOCK) float32, the
    bool tile of the entries that are edges: rows ``row_ok``, key columns ``col_in`` and the
    pair's mask tile ``midx`` of MASKS (a full block when midx < 0), and the softcap's tanh
    tile for the backward (0.0 without one). With a score modifier (``MOD``, context ``mod``
    from :func:`_mod_at`, key columns ``cols``), z = (α − 1) · f(scale · q kᵀ) instead.

    A mask tile is one int64 word per row (two for BLOCK = 128): bit c of the row's word is
    key column c. The tile is built from (BLOCK,) vectors only, so it takes the layout of the
    scores; a (BLOCK, BLOCK) load would be laid out apart and cost a layout conversion of
    every tile the scores meet. Full pairs skip the bits (a scalar branch), and layouts
    without partial pairs (``PARTIAL`` False: the dense layout) leave them out."""
    qk = _mm(q, tl.trans(k), PREC, UPCAST)
    if MOD == 0:  # before the mask (the order compiled before score modifiers: same SASS)
        s = qk * mul
    ok = row_ok[:, None] & col_in[None, :]
    if PARTIAL:  # noqa: SIM102 (a compile-time test, then a run-time one)
        if midx >= 0:
            offs = tl.arange(0, BLOCK)
            if BLOCK <= 64:
                word = tl.load(MASKS + midx.to(tl.int64) * BLOCK + offs)[:, None]
                shift = offs[None, :].to(tl.int64)
            else:
                row = MASKS + (midx.to(tl.int64) * BLOCK + offs) * 2
                low, high = tl.load(row), tl.load(row + 1)
                word = tl.where(offs[None, :] < 64, low[:, None], high[:, None])
                shift = (offs[None, :] % 64).to(tl.int64)
            ok = ok & (((word >> shift) & 1) != 0)
    if MOD == 0:
        t = 0.0
    else:
        s, t = _modify(qk * mod[7], ok, cols, mod, MOD)
        s = s * mod[8]
    return s, ok, t


@triton.jit
def _mod_at(bh, H, rows, BIAS, mb_b, mb_h, mb_i, mb_j, SLOPES, cap, scale, am1, DBIAS, DSLOPES,
            MOD: tl.constexpr):  # fmt: skip
    """The score modifier's context for query rows ``rows`` of batch·head bh (H query heads):
    the bias and its gradient at (b, h) (strides mb_*, 0 where the bias broadcasts), the rows
    and the query/key strides, the head's ALiBi slope, the cap, scale, α − 1, the head's
    slope gradient and 1 / cap. A tuple: one argument through the tile loops."""
    b = bh // H
    h = bh % H
    at = b.to(tl.int64) * mb_b + h.to(tl.int64) * mb_h
    slope = 0.0
    if ((MOD >> 2) & 3) != 0:
        slope = tl.load(SLOPES + h).to(tl.float32)
    return (BIAS + at, DBIAS + at, rows, mb_i, mb_j, slope, cap, scale, am1, DSLOPES + h,
            1.0 / cap)  # fmt: skip


@triton.jit
def _bias_at(P, rows, cols, mod):
    """Pointers of the (rows, cols) tile of the bias (or its gradient) at P, this (b, h)'s."""
    return P + rows[:, None].to(tl.int64) * mod[3] + cols[None, :].to(tl.int64) * mod[4]


@triton.jit
def _distance(rows, cols):
    """|i − j| of the tile, float32 (ALiBi's)."""
    return tl.abs(rows[:, None] - cols[None, :]).to(tl.float32)


@triton.jit
def _tanh(x):
    """tanh, float32: the odd series to x¹¹ below |x| = 1/4 (no cancellation near 0), else
    (1 − e^{−2|x|}) / (1 + e^{−2|x|}) with x's sign, the division by a reciprocal square root
    (one instruction on a GPU; the whole is ~20 SASS instructions per score)."""
    ax = tl.abs(x)
    e = tl.exp2(-2.8853900817779268 * ax)  # e^{−2|x|}
    x2 = x * x
    series = x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (
        62.0 / 2835.0 - x2 * (1382.0 / 155925.0)))))  # fmt: skip
    far = (1.0 - e) * tl.rsqrt((1.0 + e) * (1.0 + e))  # no division: 1 + e ∈ (1, 2]
    t = tl.where(ax < 0.25, ax + ax * series, far)
    return tl.where(x < 0, -t, t)


@triton.jit
def _modify(s, ok, cols, mod, MOD: tl.constexpr):
    """The score modifier on the scaled scores s: the bias and ALiBi placed before the softcap
    (or without one), the softcap c·tanh(s/c), then those placed after it (``MOD``'s bits).
    Returns (f(s), the tanh tile: 0.0 without a softcap). The bias is read on the edges
    ``ok`` only."""
    rows = mod[2]
    if (MOD & 3) == 1:
        s += tl.load(_bias_at(mod[0], rows, cols, mod), mask=ok, other=0.0).to(tl.float32)
    if ((MOD >> 2) & 3) == 1:
        s -= mod[5] * _distance(rows, cols)
    t = 0.0
    if ((MOD >> 4) & 1) != 0:
        t = _tanh(s * mod[10])
        s = mod[6] * t
    if (MOD & 3) == 2:
        s += tl.load(_bias_at(mod[0], rows, cols, mod), mask=ok, other=0.0).to(tl.float32)
    if ((MOD >> 2) & 3) == 2:
        s -= mod[5] * _distance(rows, cols)
    return s, t


@triton.jit
def _unmodify(ds, t, MOD: tl.constexpr):
    """The scores' gradient ds with respect to the modified scores → with respect to the scaled
    scores: times f' (the softcap's 1 − tanh²; the bias and ALiBi add)."""
    if ((MOD >> 4) & 1) != 0:
        ds = ds * (1.0 - t * t)
    return ds


@triton.jit
def _mod_grads(ds, t, ok, cols, mod, MOD: tl.constexpr, MOD_GRAD: tl.constexpr):
    """The modifier's own gradients from ds (with respect to the modified scores) of one tile:
    the bias's, ds times the derivative of what follows it (the softcap's 1 − tanh² when the
    bias comes first), stored (``MOD_GRAD`` bits 0-1 = 1: each entry has one owner), added
    atomically (2: the bias broadcasts over batch, heads or keys) or summed over the tile's
    rows first (3: over the queries); and the head's ALiBi slope's, −Σ ds·|i − j| (bit 2),
    returned (0.0 without)."""
    rows = mod[2]
    if (MOD_GRAD & 3) != 0:
        gb = ds
        if (MOD & 3) == 1:
            gb = _unmodify(ds, t, MOD)
        if (MOD_GRAD & 3) == 1:
            tl.store(_bias_at(mod[1], rows, cols, mod), gb, mask=ok)
        elif (MOD_GRAD & 3) == 2:
            tl.atomic_add(_bias_at(mod[1], rows, cols, mod), gb, mask=ok)
        else:
            col_ok = tl.max(ok.to(tl.int32), 0) > 0
            tl.atomic_add(mod[1] + cols.to(tl.int64) * mod[4], tl.sum(gb, 0), mask=col_ok)
    slope = 0.0
    if ((MOD_GRAD >> 2) & 1) != 0:
        ga = ds
        if ((MOD >> 2) & 3) == 1:
            ga = _unmodify(ds, t, MOD)
        slope = -tl.sum(tl.sum(ga * _distance(rows, cols), 1), 0)
    return slope


@triton.jit
def _scores(
    p, PAIR_KB, PAIR_MASK, MASKS, q, K, KEY_OK, row_ok, rows_in, n_k, mul, mod,
    D: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr, HAS_KEY_OK: tl.constexpr,
    PARTIAL: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, MOD: tl.constexpr,
):  # fmt: skip
    """:func:`_scored` for the layout's pair ``p`` of a query block q: its scores, the bool
    tile of its edges (mask tile, key padding, sequence ends), whether the tile is whole
    (:func:`_whole`; ``rows_in``: the query block is inside the sequence), the key tile k
    (BLOCK, BD) loaded from K (this key/value head's keys), the key columns and the softcap's
    tanh tile (:func:`_scored`)."""
    kb = tl.load(PAIR_KB + p)
    cols = kb * BLOCK + tl.arange(0, BLOCK)
    k = _tile(K, cols, cols < n_k, D, BD)
    col_in = _keys_in(KEY_OK, cols, n_k, HAS_KEY_OK)
    midx = tl.load(PAIR_MASK + p)
    s, ok, t = _scored(q, k, row_ok, col_in, cols, MASKS, midx, mul, mod, BLOCK, PARTIAL, PREC,
                       UPCAST, MOD)  # fmt: skip
    return s, ok, _whole(kb, midx, n_k, rows_in, BLOCK, HAS_KEY_OK), k, cols, t


@triton.jit
def _whole(kb, midx, n_k, rows_in, BLOCK: tl.constexpr, HAS_KEY_OK: tl.constexpr):
    """Whether every entry of a tile is an edge: key block kb inside the sequence, a full pair
    (mask tile ``midx`` < 0), no key padding, and ``rows_in`` (the query block is inside).
    Then its scores need no mask."""
    return rows_in & ((kb + 1) * BLOCK <= n_k) & (midx < 0) & (not HAS_KEY_OK)


@triton.jit
def _masked(s, ok, whole, other):
    """s on the edges ``ok``, ``other`` elsewhere; a whole tile (:func:`_whole`) skips the
    select, one instruction per score."""
    if whole:  # noqa: SIM108 (a branch: a conditional expression would select per element)
        out = s
    else:
        out = tl.where(ok, s, other)
    return out


@triton.jit
def _excess(s, ok, whole, tau):
    """d = [z − τ]₊ on the edges ``ok``, 0 elsewhere (τ per row, absolute; a whole tile
    skips the mask)."""
    return tl.maximum(_masked(s - tau[:, None], ok, whole, 0.0), 0.0)


@triton.jit
def _grads(s, ok, whole, tau, do, v, delta, R, MODE: tl.constexpr, PREC: tl.constexpr,
           UPCAST: tl.constexpr):  # fmt: skip
    """The backward of one tile: d = [z − τ]₊ and ds = g ⊙ (dp − δ), dp = dO vᵀ."""
    d = _excess(s, ok, whole, tau)
    dp = _mm(do, tl.trans(v), PREC, UPCAST)
    return d, _slopes(d, R, MODE) * (dp - delta[:, None])


@triton.jit
def _grad_rows(Q, DO, TAU, DELTA, bh, rows, row_ok, n_q, D: tl.constexpr, DV: tl.constexpr,
               BD: tl.constexpr, BDV: tl.constexpr):  # fmt: skip
    """What the backward reads of query rows ``rows`` of batch·head bh: q, dO, τ (+inf past
    the end: no weights) and δ."""
    q = _tile(Q + bh.to(tl.int64) * n_q * D, rows, row_ok, D, BD)
    do = _tile(DO + bh.to(tl.int64) * n_q * DV, rows, row_ok, DV, BDV)
    tau = tl.load(TAU + bh.to(tl.int64) * n_q + rows, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + bh.to(tl.int64) * n_q + rows, mask=row_ok, other=0.0)
    return q, do, tau, delta


@triton.jit
def _mm(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with float32 accumulation; ``UPCAST`` multiplies in float32 (set under the
    interpreter, whose bfloat16 ``tl.dot`` is wrong in triton 3.9: the products of bf16
    values are exact in float32, so this is what the GPU computes)."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=PREC)
    return out


@triton.jit
def _weights(d, R, MODE: tl.constexpr):
    """p = d^r for d = [z − τ]₊ ≥ 0 (r = 1 sparsemax, 2 for 1.5-entmax, else 1/(α − 1))."""
    if MODE == 2:
        w = d
    elif MODE == 1:
        w = d * d
    else:
        w = tl.where(d > 0, tl.exp2(R * tl.log2(d)), 0.0)
    return w


@triton.jit
def _slopes(d, R, MODE: tl.constexpr):
    """g = p^{2−α} = d^{r−1} on the support, 0 elsewhere (the backward's weights)."""
    if MODE == 2:
        w = (d > 0).to(tl.float32)
    elif MODE == 1:
        w = d
    else:
        w = tl.where(d > 0, tl.exp2((R - 1.0) * tl.log2(d)), 0.0)
    return w


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
    shifted by the row max (−inf for empty slots). Dropping entries only lowers the threshold,
    and Newton from the left on the subset's convex function stays below the subset's
    threshold, so every step is a lower bound of the row's τ. For α > 2 (r < 1, f concave)
    τ₀ = −1."""
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
def _program(qb, bh, K, V, KEY_OK, H, HKV, n_q, n_k, D: tl.constexpr, DV: tl.constexpr,
             BLOCK: tl.constexpr):  # fmt: skip
    """What a program on query block qb of batch·head bh works on: its query rows, which are
    inside the sequence, whether the whole block is, and K, V and KEY_OK moved to its key/value
    head (b·HKV + h // (H / HKV)) and batch."""
    b = bh // H
    bkv = b * HKV + (bh % H) // (H // HKV)
    rows = qb * BLOCK + tl.arange(0, BLOCK)
    K_h = K + bkv.to(tl.int64) * n_k * D
    V_h = V + bkv.to(tl.int64) * n_k * DV
    return rows, rows < n_q, (qb + 1) * BLOCK <= n_q, K_h, V_h, KEY_OK + b.to(tl.int64) * n_k


@triton.jit
def _query_block(ORDER, GIDX, nbq, LONGEST_FIRST: tl.constexpr):
    """(query block, batch·head) of this program. Grid (nbq, B·H) in query-block order, or
    with ``LONGEST_FIRST`` grid (B·H, nbq): every head's query blocks by decreasing number of
    pairs (ORDER, per layout graph), so that the GPU, which starts programs in grid order,
    starts the long ones first and the short ones fill the end."""
    if LONGEST_FIRST:
        bh = tl.program_id(0)
        qb = tl.load(ORDER + tl.load(GIDX + bh) * nbq + tl.program_id(1))
    else:
        qb = tl.program_id(0)
        bh = tl.program_id(1)
    return qb, bh


@triton.jit
def _pairs(ROW_PTR, ROW_END, GIDX, bh, qb, nbq):
    """The range [start, end) of query block qb's pairs in bh's layout graph (``ROW_END``:
    each row block's end, ``ROW_PTR + 1`` unless some are left to the split kernels)."""
    g = tl.load(GIDX + bh)
    return tl.load(ROW_PTR + g * nbq + qb), tl.load(ROW_END + g * nbq + qb)


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
    """A threshold pass over the pairs [start, end) at the absolute threshold t_abs = m + τ
    (one fused multiply-add per score, which rounds τ to the float spacing of m): per row
    |S|, Σ d^r (Σ d), Σ d^{r−1} (Σ d²) and the least y of S, with y = x − τ, d = [y]₊ and
    S = {y > 0}. ``SKIP``: tiles whose largest score is below ``floor`` are skipped (a branch
    per tile, so their loads cannot be pipelined)."""
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
    divided by Σ p for α ∉ {1.5, 2} (τ to float precision, as bisection does) and, with
    ``OPEN``, where a row is still ``open_`` (not converged in the passes allowed; the main
    kernel leaves ``OPEN`` off: keeping its ``done`` live through the last pass made that
    loop 410 instructions per whole tile instead of 367 in ``scripts/triton_sass.py``,
    triton 3.9 for sm_90)."""
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
