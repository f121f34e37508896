"""The tile functions of the Triton α-entmax kernels (:mod:`sparseattn.engines._entmax_kernels`
and :mod:`sparseattn.engines._entmax_split`; imported lazily: needs triton): tile I/O, one
pair's scores with its masks and score modifier, the weights p = d^r and slopes g = d^{r−1},
one tile's backward, and which rows and key/value head a program works on.

Score modifiers come as a description (docs/engines.md, "Score modifiers in the kernels"): the
compile-time ``MOD`` (bits 0-1: the bias, 1 before the softcap or without one, 2 after it;
bits 2-3: ALiBi, the same; bit 4: the softcap; 0 compiles none of it) and a tuple of run-time
arguments (:func:`_mod_at`). Tiles are ``BLOCK`` × ``BLOCK`` (the layout's block), head dims
padded to powers of two, accumulation in float32; fp32 inputs use exact (IEEE) products.
"""

from __future__ import annotations

import triton
import triton.language as tl


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

    A mask tile is one int64 word per row (two for BLOCK = 128), built from (BLOCK,) vectors
    only so that it takes the scores' layout (no layout conversion per tile); full pairs skip
    the bits, layouts without partial pairs (``PARTIAL`` False) leave them out."""
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
    the bias's, stored, added atomically or summed over the rows first (``MOD_GRAD`` bits 0-1:
    1, 2, 3; :func:`sparseattn.engines._entmax_args._mod_grad_code`), and the head's ALiBi
    slope's, −Σ ds·|i − j| (bit 2), returned (0.0 without)."""
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
    """:func:`_scored` for the layout's pair ``p`` of a query block q: its scores, its edges,
    whether the tile is whole (:func:`_whole`), the key tile k (BLOCK, BD) loaded from K, the
    key columns and the softcap's tanh tile."""
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
    """(query block, batch·head) of this program: grid (nbq, B·H) in query-block order, or with
    ``LONGEST_FIRST`` grid (B·H, nbq), every head's query blocks longest first (ORDER)."""
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
