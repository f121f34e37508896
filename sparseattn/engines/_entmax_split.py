"""Triton kernels for the query blocks that :mod:`sparseattn.engines.triton_entmax` splits
(``SPLIT_LONG``): the same passes as :mod:`sparseattn.engines._entmax_kernels`' ``_forward``
and ``_backward_dq``, over chunks of a query block's pairs (imported lazily: needs triton).

A long query block (global tokens; any query block when decoding) has its pairs cut into
chunks (``split_plan``), one program per (chunk, batch·head), each pass one launch: a chunk
kernel writes each row's partial sums to PART (B·H, chunks, 4, BLOCK), and a merge kernel (one
program per split query block and batch·head) adds them and updates the row's state in STATE
(6, B·H, n_q): m, τ, lo, hi, done, has. Chunk c covers pairs CH_START[c] : CH_END[c] of row
block CH_RB[c]; split row block r is LONG_RB[r], its chunks LONG_C0[r] : LONG_C1[r].
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._entmax_kernels import (
    _dq,
    _finish,
    _floor,
    _insert,
    _last,
    _pass0,
    _slope_grad,
    _stack,
    _start,
    _sums,
    _update,
)
from ._entmax_tiles import (
    _grad_rows,
    _mod_at,
    _program,
    _put,
    _tile,
)


@triton.jit
def _chunk(CH_RB, CH_START, CH_END, GIDX, K, V, KEY_OK, H, HKV, nbq, n_q, n_k, D: tl.constexpr,
           DV: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """What a program on chunk c = program_id(0) of batch·head bh = program_id(1) works on:
    (c, bh, whether the chunk belongs to bh's layout graph, its first and end pair, then
    :func:`_program`'s rows, row_ok, rows_in, K_h, V_h, KEY_OK_b)."""
    c = tl.program_id(0)
    bh = tl.program_id(1)
    rb = tl.load(CH_RB + c)
    mine = rb // nbq == tl.load(GIDX + bh)
    rows, row_ok, rows_in, K_h, V_h, KEY_OK_b = _program(
        rb % nbq, bh, K, V, KEY_OK, H, HKV, n_q, n_k, D, DV, BLOCK
    )
    start, end = tl.load(CH_START + c), tl.load(CH_END + c)
    return c, bh, mine, start, end, rows, row_ok, rows_in, K_h, V_h, KEY_OK_b


@triton.jit
def _long(LONG_RB, LONG_C0, LONG_C1, GIDX, nbq, n_q, BLOCK: tl.constexpr):
    """What a merging program on split row block r = program_id(0) of batch·head bh =
    program_id(1) works on: (r, bh, whether the block belongs to bh's layout graph, its query
    block, rows, row_ok, and its chunks' range)."""
    r = tl.program_id(0)
    bh = tl.program_id(1)
    rb = tl.load(LONG_RB + r)
    rows = (rb % nbq) * BLOCK + tl.arange(0, BLOCK)
    mine = rb // nbq == tl.load(GIDX + bh)
    return r, bh, mine, rb % nbq, rows, rows < n_q, tl.load(LONG_C0 + r), tl.load(LONG_C1 + r)


@triton.jit
def _state(STATE, bh, rows, row_ok, n_q, BH):
    """The rows' (m, τ, lo, hi, done, has) from STATE."""
    at = STATE + bh.to(tl.int64) * n_q + rows
    plane = BH.to(tl.int64) * n_q
    m = tl.load(at, mask=row_ok, other=0.0)
    tau = tl.load(at + plane, mask=row_ok, other=0.0)
    lo = tl.load(at + 2 * plane, mask=row_ok, other=0.0)
    hi = tl.load(at + 3 * plane, mask=row_ok, other=0.0)
    done = tl.load(at + 4 * plane, mask=row_ok, other=1.0) != 0
    has = tl.load(at + 5 * plane, mask=row_ok, other=0.0) != 0
    return m, tau, lo, hi, done, has


@triton.jit
def _put_state(STATE, bh, rows, row_ok, n_q, BH, m, tau, lo, hi, done, has):
    at = STATE + bh.to(tl.int64) * n_q + rows
    plane = BH.to(tl.int64) * n_q
    tl.store(at, m, mask=row_ok)
    tl.store(at + plane, tau, mask=row_ok)
    tl.store(at + 2 * plane, lo, mask=row_ok)
    tl.store(at + 3 * plane, hi, mask=row_ok)
    tl.store(at + 4 * plane, done.to(tl.float32), mask=row_ok)
    tl.store(at + 5 * plane, has.to(tl.float32), mask=row_ok)


@triton.jit
def _split_pass0(
    Q, K, V, TMAX, PART, TOP,
    CH_RB, CH_START, CH_END, PAIR_KB, PAIR_MASK, MASKS, GIDX, KEY_OK,
    n_q, n_k, H, HKV, nbq, n_pairs, n_chunks,
    mul,
    MB, mb_b, mb_h, mb_i, mb_j, MSL, m_cap, m_scale, m_am1, MDB, MDSL,
    D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr,
    MODE: tl.constexpr, HAS_KEY_OK: tl.constexpr, PARTIAL: tl.constexpr, TOPK: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, MOD: tl.constexpr,
):  # fmt: skip
    """Pass 0 of one chunk: its rows' max and key count (to PART) and their TOPK largest
    per-tile maxima (to TOP, (B·H, chunks, TOPK, BLOCK))."""
    c, bh, mine, start, end, rows, row_ok, rows_in, K_h, V_h, KEY_OK_b = _chunk(
        CH_RB, CH_START, CH_END, GIDX, K, V, KEY_OK, H, HKV, nbq, n_q, n_k, D, DV, BLOCK
    )
    if mine:
        q = _tile(Q + bh.to(tl.int64) * n_q * D, rows, row_ok, D, BD)
        mod = _mod_at(bh, H, rows, MB, mb_b, mb_h, mb_i, mb_j, MSL, m_cap, m_scale, m_am1,
                      MDB, MDSL, MOD)  # fmt: skip
        m, cnt, top = _pass0(
            start, end, TMAX + bh.to(tl.int64) * n_pairs, PAIR_KB, PAIR_MASK, MASKS, q, K_h,
            KEY_OK_b, row_ok, rows_in, n_k, mul, mod, D, BD, BLOCK, HAS_KEY_OK, PARTIAL, PREC,
            UPCAST, MODE, TOPK, MOD,
        )  # fmt: skip
        offs = tl.arange(0, BLOCK)
        at = bh.to(tl.int64) * n_chunks + c
        tl.store(PART + at * 4 * BLOCK + offs, m)
        tl.store(PART + at * 4 * BLOCK + BLOCK + offs, cnt)
        for j in tl.static_range(TOPK):
            tl.store(TOP + (at * TOPK + j) * BLOCK + offs, top[j])


@triton.jit
def _split_init(
    STATE, PART, TOP, PASSES, LONG_RB, LONG_C0, LONG_C1, GIDX,
    n_q, BH, nbq, n_chunks, AM1, R,
    BLOCK: tl.constexpr, MODE: tl.constexpr, TOPK: tl.constexpr,
):  # fmt: skip
    """Merge pass 0 of a split query block's chunks: m = max, n = Σ, the TOPK largest of
    their per-tile maxima and from them τ's start (as the main kernel's: the same start), the
    bracket [τ, −n^{1−α}]; no pass yet."""
    r, bh, mine, qb, rows, row_ok, first, last = _long(
        LONG_RB, LONG_C0, LONG_C1, GIDX, nbq, n_q, BLOCK
    )
    if mine:
        offs = tl.arange(0, BLOCK)
        m = tl.full((BLOCK,), float("-inf"), tl.float32)
        cnt = tl.zeros((BLOCK,), tl.float32)
        top = ()
        for _ in tl.static_range(TOPK):
            top = top + (tl.full((BLOCK,), float("-inf"), tl.float32),)
        for c in range(first, last):
            at = bh.to(tl.int64) * n_chunks + c
            m = tl.maximum(m, tl.load(PART + at * 4 * BLOCK + offs))
            cnt += tl.load(PART + at * 4 * BLOCK + BLOCK + offs)
            for j in tl.static_range(TOPK):
                top = _insert(top, tl.load(TOP + (at * TOPK + j) * BLOCK + offs), TOPK)
        has = m > float("-inf")
        m = tl.where(has, m, 0.0)
        tau = _start(_stack(top, BLOCK, TOPK) - m[:, None], R, BLOCK, MODE, TOPK)
        hi = tl.where(has, -tl.exp2(-AM1 * tl.log2(tl.maximum(cnt, 1.0))), 0.0)
        _put_state(STATE, bh, rows, row_ok, n_q, BH, m, tau, tau, hi, ~has, has)
        tl.store(PASSES + bh.to(tl.int64) * nbq + qb, tl.zeros((), tl.int32))


@triton.jit
def _split_sums(
    Q, K, V, TMAX, PART, STATE,
    CH_RB, CH_START, CH_END, PAIR_KB, PAIR_MASK, MASKS, GIDX, KEY_OK,
    n_q, n_k, H, HKV, nbq, n_pairs, n_chunks, BH,
    mul, R,
    MB, mb_b, mb_h, mb_i, mb_j, MSL, m_cap, m_scale, m_am1, MDB, MDSL,
    D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr,
    MODE: tl.constexpr, HAS_KEY_OK: tl.constexpr, PARTIAL: tl.constexpr, PREC: tl.constexpr,
    UPCAST: tl.constexpr, SKIP: tl.constexpr, MOD: tl.constexpr,
):  # fmt: skip
    """A threshold pass over one chunk (:func:`_sums`), while a row of its block is open."""
    c, bh, mine, start, end, rows, row_ok, rows_in, K_h, V_h, KEY_OK_b = _chunk(
        CH_RB, CH_START, CH_END, GIDX, K, V, KEY_OK, H, HKV, nbq, n_q, n_k, D, DV, BLOCK
    )
    if mine:
        q = _tile(Q + bh.to(tl.int64) * n_q * D, rows, row_ok, D, BD)
        m, tau, lo, hi, done, has = _state(STATE, bh, rows, row_ok, n_q, BH)
        if tl.sum((~done).to(tl.int32), 0) > 0:
            mod = _mod_at(bh, H, rows, MB, mb_b, mb_h, mb_i, mb_j, MSL, m_cap, m_scale, m_am1,
                          MDB, MDSL, MOD)  # fmt: skip
            c0, s1, s2, y_in = _sums(
                start, end, TMAX + bh.to(tl.int64) * n_pairs, PAIR_KB, PAIR_MASK, MASKS, q,
                K_h, KEY_OK_b, row_ok, rows_in, n_k, mul, mod, m + tau,
                _floor(done, m, tau, lo, MODE), R, D, BD, BLOCK, HAS_KEY_OK, PARTIAL, PREC,
                UPCAST, MODE, SKIP, MOD,
            )  # fmt: skip
            part = PART + (bh.to(tl.int64) * n_chunks + c) * 4 * BLOCK + tl.arange(0, BLOCK)
            tl.store(part, c0)
            tl.store(part + BLOCK, s1)
            tl.store(part + 2 * BLOCK, s2)
            tl.store(part + 3 * BLOCK, y_in)


@triton.jit
def _split_update(
    STATE, PART, PASSES, LONG_RB, LONG_C0, LONG_C1, GIDX,
    n_q, BH, nbq, n_chunks, AM1, R,
    BLOCK: tl.constexpr, MODE: tl.constexpr,
):  # fmt: skip
    """Add a pass's chunk sums of a split query block and step its rows' thresholds
    (:func:`_update`), counting the pass, while a row is open."""
    r, bh, mine, qb, rows, row_ok, first, last = _long(
        LONG_RB, LONG_C0, LONG_C1, GIDX, nbq, n_q, BLOCK
    )
    if mine:
        offs = tl.arange(0, BLOCK)
        m, tau, lo, hi, done, has = _state(STATE, bh, rows, row_ok, n_q, BH)
        if tl.sum((~done).to(tl.int32), 0) > 0:
            c0 = tl.zeros((BLOCK,), tl.float32)
            s1 = tl.zeros((BLOCK,), tl.float32)
            s2 = tl.zeros((BLOCK,), tl.float32)
            y_in = tl.full((BLOCK,), float("inf"), tl.float32)
            for c in range(first, last):
                part = PART + (bh.to(tl.int64) * n_chunks + c) * 4 * BLOCK + offs
                c0 += tl.load(part)
                s1 += tl.load(part + BLOCK)
                s2 += tl.load(part + 2 * BLOCK)
                y_in = tl.minimum(y_in, tl.load(part + 3 * BLOCK))
            tau, lo, hi, done = _update(tau, lo, hi, done, m, c0, s1, s2, y_in, AM1, R, MODE)
            _put_state(STATE, bh, rows, row_ok, n_q, BH, m, tau, lo, hi, done, has)
            at = PASSES + bh.to(tl.int64) * nbq + qb
            tl.store(at, tl.load(at) + 1)


@triton.jit
def _split_last(
    Q, K, V, TMAX, NZ, PART, ACC, GACC, STATE,
    CH_RB, CH_START, CH_END, PAIR_KB, PAIR_MASK, MASKS, GIDX, KEY_OK,
    n_q, n_k, H, HKV, nbq, n_pairs, n_chunks, BH,
    mul, R,
    MB, mb_b, mb_h, mb_i, mb_j, MSL, m_cap, m_scale, m_am1, MDB, MDSL,
    D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    BLOCK: tl.constexpr, MODE: tl.constexpr, HAS_KEY_OK: tl.constexpr, PARTIAL: tl.constexpr,
    NEED_GRAD: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, MOD: tl.constexpr,
):  # fmt: skip
    """The last pass over one chunk (:func:`_last`): its partial Σ p V, Σ p (and Σ g V, Σ g)."""
    c, bh, mine, start, end, rows, row_ok, rows_in, K_h, V_h, KEY_OK_b = _chunk(
        CH_RB, CH_START, CH_END, GIDX, K, V, KEY_OK, H, HKV, nbq, n_q, n_k, D, DV, BLOCK
    )
    if mine:
        q = _tile(Q + bh.to(tl.int64) * n_q * D, rows, row_ok, D, BD)
        m, tau, lo, hi, done, has = _state(STATE, bh, rows, row_ok, n_q, BH)
        tau_abs = tl.where(has, m + tau, float("inf"))
        mod = _mod_at(bh, H, rows, MB, mb_b, mb_h, mb_i, mb_j, MSL, m_cap, m_scale, m_am1,
                      MDB, MDSL, MOD)  # fmt: skip
        acc, g_acc, g_sum, p_sum = _last(
            start, end, TMAX + bh.to(tl.int64) * n_pairs, NZ + bh.to(tl.int64) * n_pairs,
            PAIR_KB, PAIR_MASK, MASKS, q, K_h, V_h, KEY_OK_b, row_ok, rows_in, n_k, mul, mod,
            tau_abs, R, D, DV, BD, BDV, BLOCK, HAS_KEY_OK, PARTIAL, PREC, UPCAST, MODE,
            NEED_GRAD, MOD,
        )  # fmt: skip
        at = bh.to(tl.int64) * n_chunks + c
        offs = tl.arange(0, BLOCK)
        tl.store(PART + at * 4 * BLOCK + offs, p_sum)
        tl.store(PART + at * 4 * BLOCK + BLOCK + offs, g_sum)
        _put(ACC + at * BLOCK * BDV, offs, offs < BLOCK, acc, BDV, BDV)
        if NEED_GRAD:
            _put(GACC + at * BLOCK * BDV, offs, offs < BLOCK, g_acc, BDV, BDV)


@triton.jit
def _split_finish(
    O, TAU, GV, STATE, PART, ACC, GACC, LONG_RB, LONG_C0, LONG_C1, GIDX,
    n_q, BH, nbq, n_chunks,
    DV: tl.constexpr, BDV: tl.constexpr, BLOCK: tl.constexpr, MODE: tl.constexpr,
    NEED_GRAD: tl.constexpr,
):  # fmt: skip
    """Add the chunks' last passes of a split query block and store its rows (:func:`_finish`;
    a row still open after the launches' passes is renormalised, as α > 2's are)."""
    r, bh, mine, qb, rows, row_ok, first, last = _long(
        LONG_RB, LONG_C0, LONG_C1, GIDX, nbq, n_q, BLOCK
    )
    if mine:
        offs = tl.arange(0, BLOCK)
        m, tau, lo, hi, done, has = _state(STATE, bh, rows, row_ok, n_q, BH)
        acc = tl.zeros((BLOCK, BDV), tl.float32)
        g_acc = tl.zeros((BLOCK, BDV), tl.float32)
        p_sum = tl.zeros((BLOCK,), tl.float32)
        g_sum = tl.zeros((BLOCK,), tl.float32)
        for c in range(first, last):
            at = bh.to(tl.int64) * n_chunks + c
            p_sum += tl.load(PART + at * 4 * BLOCK + offs)
            g_sum += tl.load(PART + at * 4 * BLOCK + BLOCK + offs)
            acc += _tile(ACC + at * BLOCK * BDV, offs, offs < BLOCK, BDV, BDV)
            if NEED_GRAD:
                g_acc += _tile(GACC + at * BLOCK * BDV, offs, offs < BLOCK, BDV, BDV)
        tau_abs = tl.where(has, m + tau, float("inf"))
        _finish(O, TAU, GV, bh, rows, row_ok, n_q, acc, g_acc, g_sum, p_sum, tau_abs, ~done,
                DV, BDV, MODE, NEED_GRAD, True)  # fmt: skip


@triton.jit
def _split_dq(
    Q, K, V, DO, TAU, DELTA, NZ, DQP,
    CH_RB, CH_START, CH_END, PAIR_KB, PAIR_MASK, MASKS, GIDX, KEY_OK,
    n_q, n_k, H, HKV, nbq, n_pairs, n_chunks,
    mul, R,
    MB, mb_b, mb_h, mb_i, mb_j, MSL, m_cap, m_scale, m_am1, MDB, MDSL,
    D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    BLOCK: tl.constexpr, MODE: tl.constexpr, HAS_KEY_OK: tl.constexpr, PARTIAL: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, MOD: tl.constexpr, MOD_GRAD: tl.constexpr,
):  # fmt: skip
    """dq of a split query block, one chunk of its pairs: the partial Σ ds K, to DQP (and the
    score modifier's gradients of the chunk's pairs)."""
    c, bh, mine, start, end, rows, row_ok, rows_in, K_h, V_h, KEY_OK_b = _chunk(
        CH_RB, CH_START, CH_END, GIDX, K, V, KEY_OK, H, HKV, nbq, n_q, n_k, D, DV, BLOCK
    )
    if mine:
        q, do, tau, delta = _grad_rows(Q, DO, TAU, DELTA, bh, rows, row_ok, n_q, D, DV, BD, BDV)
        mod = _mod_at(bh, H, rows, MB, mb_b, mb_h, mb_i, mb_j, MSL, m_cap, m_scale, m_am1,
                      MDB, MDSL, MOD)  # fmt: skip
        dq, slope = _dq(
            start, end, NZ + bh.to(tl.int64) * n_pairs, PAIR_KB, PAIR_MASK, MASKS, q, do, tau,
            delta, K_h, V_h, KEY_OK_b, row_ok, rows_in, n_k, mul, mod, R,
            D, DV, BD, BDV, BLOCK, MODE, HAS_KEY_OK, PARTIAL, PREC, UPCAST, MOD, MOD_GRAD,
        )  # fmt: skip
        _slope_grad(mod, slope, MOD_GRAD)
        offs = tl.arange(0, BLOCK)
        _put(DQP + (bh.to(tl.int64) * n_chunks + c) * BLOCK * BD, offs, offs < BLOCK, dq, BD, BD)


@triton.jit
def _split_dq_finish(
    DQ, DQP, LONG_RB, LONG_C0, LONG_C1, GIDX, n_q, nbq, n_chunks, scale,
    D: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """dq of a split query block: its chunks' partial sums added, scaled and stored."""
    r, bh, mine, qb, rows, row_ok, first, last = _long(
        LONG_RB, LONG_C0, LONG_C1, GIDX, nbq, n_q, BLOCK
    )
    if mine:
        offs = tl.arange(0, BLOCK)
        dq = tl.zeros((BLOCK, BD), tl.float32)
        for c in range(first, last):
            dq += _tile(DQP + (bh.to(tl.int64) * n_chunks + c) * BLOCK * BD, offs, offs < BLOCK,
                        BD, BD)  # fmt: skip
        _put(DQ + bh.to(tl.int64) * n_q * D, rows, row_ok, dq * scale, D, BD)
