"""What one self-attention matrix can express (Likhosherstov, Choromanski & Weller, AAAI 2023).

The paper's objects, made computable:

* :func:`usam`, :func:`sam`, :func:`csam` — the (unnormalised / row-normalised / causal)
  self-attention matrix, eqs. (1), (2) and the CSAM definition of §"The Case of Causal
  Self-attention". No ``1/sqrt(d)`` scale: the paper folds it into ``W_q`` or ``W_k``.
* :func:`weakly_approximates` — Definition 0.1 (eq. 4); :func:`ratio_errors` — the smallest
  ``eps1``, ``eps2`` for which eqs. (7)/(8) (and (23)/(24) for causal ``M``) hold.
* :func:`weak_sam_approx_d1` — Algorithm 1, the polynomial decider of (1, d_hid)-WEAK-SAM-APPROX
  (Theorem 0.3); :func:`weak_sam_approx_d1_lp` — an independent exhaustive decider for tiny n
  (sign patterns + LP feasibility) that also returns a witness.
* :func:`try_weak_approx` — for d > 1 the question is NP-hard (Theorem 0.2); this searches for a
  witness by gradient descent and reports "found" or "not found within budget", never "impossible".
* :func:`construct_sam` — the constructive proof of Theorem 0.4 (eqs. 9, 14–17, Lemma 0.6) and of
  Corollary 0.7 (``causal=True``); :func:`theorem_d` — the d of eq. (6)/(22);
  :func:`least_construct_d` — the least d on a grid for which the construction succeeds
  (the d_min of the paper's experiments); :func:`random_sparse_stochastic` — the matrices A of
  those experiments.

Matrices are n × n; ``X`` is (n, d_hid); ``W_q``, ``W_k`` are (d_hid, d). Analysis runs in float64.

One piece: one paper's objects, whose deciders, witness search and construction share the
input checks and the ratio errors they are judged by.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..._extras import require
from ...graph import AttentionGraph
from ...validate import check_bool, check_finite_float, check_finite_tensor, check_int

__all__ = [
    "RatioErrors",
    "SAMConstruction",
    "WeakApproxResult",
    "construct_sam",
    "csam",
    "least_construct_d",
    "random_sparse_stochastic",
    "ratio_errors",
    "sam",
    "theorem_d",
    "try_weak_approx",
    "usam",
    "weak_sam_approx_d1",
    "weak_sam_approx_d1_lp",
    "weakly_approximates",
    "construction_weights",
    "theorem_slope",
]

F64 = torch.float64
_REDRAW_CHUNK = 8  # Y matrices drawn and checked together in construct_sam
#: Most float64 entries of one matrix these functions allocate (2 GiB); more is refused.
MAX_ENTRIES = 1 << 28


# ---------------------------------------------------------------------------- input checks
def _matrix(value: Any, name: str, dtype: torch.dtype = F64) -> Tensor:
    """A finite 2-D tensor from a tensor, array or nested list (an AttentionGraph: its mask)."""
    if isinstance(value, AttentionGraph):
        if value.batch_shape:
            raise ValueError(f"{name} must be a single graph, got batch shape {value.batch_shape}")
        value = value.to_dense()
    try:
        t = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as err:
        raise TypeError(
            f"{name} must be a matrix (tensor, array or nested list of numbers), "
            f"got {type(value).__name__}"
        ) from err
    if t.is_complex():
        raise TypeError(f"{name} must be real, got {t.dtype}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be a 2-D matrix, got shape {tuple(t.shape)}")
    t = t.to(dtype)
    if t.is_floating_point() and not torch.isfinite(t).all():
        raise ValueError(f"{name} must be finite (no NaN or inf)")
    return t


def _square(value: Any, name: str) -> Tensor:
    t = _matrix(value, name)
    if t.shape[0] != t.shape[1] or t.shape[0] < 1:
        raise ValueError(f"{name} must be a non-empty square n x n matrix, got {tuple(t.shape)}")
    return t


def _support(value: Any, name: str) -> Tensor:
    """The 0/1 matrix S of Definition 0.1 as a bool tensor; every row needs a 1."""
    t = _square(value, name)
    if not ((t == 0) | (t == 1)).all():
        raise ValueError(f"{name} must hold only zeros and ones (or booleans)")
    s = t.bool()
    empty = (~s.any(1)).nonzero().flatten()
    if empty.numel():
        raise ValueError(f"{name} needs at least one 1 in every row; row {int(empty[0])} is empty")
    return s


def _nonnegative(value: Any, name: str) -> Tensor:
    """A nonnegative square matrix with a nonzero in every row (row scale is irrelevant)."""
    a = _square(value, name)
    if (a < 0).any():
        raise ValueError(f"{name} must be nonnegative")
    empty = (~(a > 0).any(1)).nonzero().flatten()
    if empty.numel():
        raise ValueError(f"{name} needs a nonzero in every row; row {int(empty[0])} is empty")
    return a


def _positive_int(value: Any, name: str, minimum: int = 1) -> int:
    return check_int(name, value, minimum)


def _entries(count: int, names: str) -> None:
    """Refuse a matrix of more than ``MAX_ENTRIES`` entries (sizes ``names``)."""
    if count > MAX_ENTRIES:
        raise ValueError(
            f"{names} ask for {count:,} entries; at most {MAX_ENTRIES:,} are allocated"
        )


def _eps(eps1: float, eps2: float) -> tuple[float, float]:
    eps1 = check_finite_float("eps1", eps1, 0.0, 1.0, low_open=True, high_open=True)
    return eps1, check_finite_float("eps2", eps2, 0.0, low_open=True)


def _generator(seed: int | torch.Generator, device: torch.device | None = None) -> torch.Generator:
    """A generator from a seed (on ``device``, default CPU), or the given generator."""
    if isinstance(seed, torch.Generator):
        if device is not None and seed.device != device:
            raise ValueError(f"seed is a generator on {seed.device}, but device is {device}")
        return seed
    seed = check_int("seed", seed)
    if not -(1 << 63) <= seed < 1 << 64:
        raise ValueError(f"seed must lie in [-2^63, 2^64), got {seed}")
    return torch.Generator(device=device or "cpu").manual_seed(seed)


def _device(device: Any) -> torch.device:
    """A torch device from a name or device (default CPU); an unavailable one is refused."""
    if device is None:
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (TypeError, RuntimeError) as err:
        raise ValueError(f"device must name a torch device, got {device!r}") from err
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available")
    return dev


def _weights(X: Tensor, W_q: Tensor, W_k: Tensor) -> None:
    for name, t in (("X", X), ("W_q", W_q), ("W_k", W_k)):
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor")
        if t.dtype != X.dtype or t.device != X.device:
            raise TypeError(
                f"{name} must have X's dtype and device ({X.dtype}, {X.device}), "
                f"got {t.dtype}, {t.device}"
            )
        check_finite_tensor(name, t)
    if X.dim() < 2:
        raise ValueError(f"X must have shape (..., n, d_hid), got {tuple(X.shape)}")
    if W_q.dim() != 2 or W_q.shape != W_k.shape:
        raise ValueError(
            f"W_q and W_k must both be (d_hid, d), got {tuple(W_q.shape)} and {tuple(W_k.shape)}"
        )
    if W_q.shape[0] != X.shape[-1]:
        raise ValueError(f"W_q has {W_q.shape[0]} rows but X has d_hid = {X.shape[-1]} columns")


# ---------------------------------------------------------------------------- eqs. (1), (2), CSAM
def _logits(X: Tensor, W_q: Tensor, W_k: Tensor) -> Tensor:
    """X W_q W_k^T X^T, shape (..., n, n): query i times key j in entry (i, j)."""
    return (X @ W_q) @ (X @ W_k).transpose(-1, -2)


def usam(X: Tensor, W_q: Tensor, W_k: Tensor) -> Tensor:
    """USAM(X; d, d_hid, W_q, W_k) = exp[X W_q W_k^T X^T], eq. (1), elementwise exp.

    Shapes: X (..., n, d_hid), W_q and W_k (d_hid, d); returns (..., n, n).
    """
    _weights(X, W_q, W_k)
    return torch.exp(_logits(X, W_q, W_k))


def sam(X: Tensor, W_q: Tensor, W_k: Tensor) -> Tensor:
    """SAM = RN(USAM), eq. (2): each row of eq. (1) divided by its sum (a row softmax of logits).

    Shapes: X (..., n, d_hid), W_q and W_k (d_hid, d); returns (..., n, n), right stochastic.
    Computed as a softmax so that large logits do not overflow.
    """
    _weights(X, W_q, W_k)
    return torch.softmax(_logits(X, W_q, W_k), dim=-1)


def csam(X: Tensor, W_q: Tensor, W_k: Tensor) -> Tensor:
    """CSAM = diag(M' 1_n)^{-1} M' with M' = tril(USAM) (the paper's causal self-attention matrix).

    Shapes as :func:`sam`; the result is lower triangular and right stochastic.
    """
    _weights(X, W_q, W_k)
    logits = _logits(X, W_q, W_k)
    n = logits.shape[-1]
    above = torch.ones(n, n, dtype=torch.bool, device=logits.device).triu(1)
    return torch.softmax(logits.masked_fill(above, -math.inf), dim=-1)


# ---------------------------------------------------------------------------- Def. 0.1, (7), (8)
def weakly_approximates(M: Any, S: Any) -> bool:
    """Definition 0.1 (eq. 4): in every row i, min_{j: S_ij = 1} M_ij > max_{j: S_ij = 0} M_ij.

    ``M``: (n, n) matrix (e.g. :func:`sam` output). ``S``: (n, n) 0/1 or bool matrix with a 1 in
    every row (an :class:`AttentionGraph` is accepted; its mask is used). The max over an empty
    set is -inf, so rows of S that are all ones always pass.
    """
    m = _square(M, "M")
    s = _support(S, "S")
    if m.shape != s.shape:
        raise ValueError(
            f"M and S must have the same shape, got {tuple(m.shape)} and {tuple(s.shape)}"
        )
    low = m.masked_fill(~s, math.inf).amin(1)
    high = m.masked_fill(s, -math.inf).amax(1)
    return bool((low > high).all())


class RatioErrors(NamedTuple):
    """The smallest errors M achieves for A: (7) holds for every eps1 > ``eps1``, (8) for every
    eps2 > ``eps2`` (both are strict inequalities, so ``eps1``/``eps2`` themselves do not)."""

    eps1: float
    eps2: float

    def satisfies(self, eps1: float, eps2: float) -> bool:
        """Whether eqs. (7) and (8) hold with these eps1, eps2."""
        return self.eps1 < eps1 and self.eps2 < eps2


def _ratio_errors_log(log_m: Tensor, a: Tensor) -> tuple[float, float]:
    """(log eps1_hat, eps2_hat) from log M (entries may be -inf) and A >= 0, both (n, n)."""
    nz = a > 0
    low = log_m.masked_fill(~nz, math.inf).amin(1)  # min over nonzeros of A, per row
    high = log_m.masked_fill(nz, -math.inf).amax(1)  # max over zeros of A, per row
    gap = high - low  # log of the worst ratio in eq. (7); nan when both are -inf
    gap = torch.where(torch.isnan(gap), torch.full_like(gap, math.inf), gap)
    log_eps1 = float(gap.max())
    r = torch.where(nz, log_m - torch.log(torch.where(nz, a, torch.ones_like(a))), 0.0)
    spread = r.masked_fill(~nz, -math.inf).amax(1) - r.masked_fill(~nz, math.inf).amin(1)
    spread = torch.where(torch.isnan(spread), torch.full_like(spread, math.inf), spread)
    return log_eps1, float(spread.max())


def ratio_errors(M: Any, A: Any) -> RatioErrors:
    """Worst sides of eqs. (7) and (8) (equivalently (23), (24) for a causal M).

    Returns ``eps1 = max_i max_{A_ij1 = 0, A_ij2 != 0} M_ij1 / M_ij2`` and
    ``eps2 = max_i max_{A_ij1, A_ij2 != 0} |log(M_ij1 / M_ij2) - log(A_ij1 / A_ij2)|``, i.e. the
    smallest eps1, eps2 that M achieves for A (eps1 = 0 when A has no zeros; eps2 = 0 when every
    row of A has one nonzero). Entries of M where A is nonzero must be positive, else the errors
    are inf. A causal M (zeros above the diagonal) compared with a lower-triangular A gives the
    Corollary 0.7 errors, since its zeros only lower eq. (7)'s ratios.

    Shapes: M, A (n, n); A nonnegative with a nonzero in every row (row sums need not be 1).
    """
    m = _square(M, "M")
    a = _nonnegative(A, "A")
    if m.shape != a.shape:
        raise ValueError(
            f"M and A must have the same shape, got {tuple(m.shape)} and {tuple(a.shape)}"
        )
    if (m < 0).any():
        raise ValueError("M must be nonnegative")
    log_eps1, eps2 = _ratio_errors_log(torch.log(m), a)
    return RatioErrors(math.exp(log_eps1), eps2)


# ---------------------------------------------------------------------------- Algorithm 1
def _components(vertices: list[int], adjacent) -> list[frozenset[int]]:
    """Connected components of a graph given by a vertex list and an adjacency predicate,
    each listed by its smallest vertex first."""
    left = set(vertices)
    comps = []
    for v in vertices:
        if v not in left:
            continue
        left.discard(v)
        comp, stack = {v}, [v]
        while stack:
            u = stack.pop()
            nxt = [w for w in left if adjacent(u, w)]
            for w in nxt:
                left.discard(w)
            comp.update(nxt)
            stack.extend(nxt)
        comps.append(frozenset(comp))
    return comps


def weak_sam_approx_d1(S: Any, d_hid: int, *, literal: bool = False) -> bool:
    """Algorithm 1 (Theorem 0.3): decide (1, d_hid)-WEAK-SAM-APPROX for S in polynomial time.

    With d = 1 the logits are ``q_i k_j`` for vectors q = X W_q, k = X W_k; for d_hid >= 2 they
    are arbitrary, for d_hid = 1 they are ``s x_i x_j`` (s = W_q W_k). Steps, as in the paper
    (S: (n, n) 0/1 matrix with a 1 in every row; V = {0, ..., n-1}):

    1. I(i) = {j : S_ij = 1}.  2. K0 = {i : I(i) != V}; K0 empty -> True.
    3–4. H on K0 joins v, w when I(v), I(w) are nested; H must have at most two connected
    components K1, K2 (K1 holds the smallest index of K0; K2 may be empty), else False.
    5. I'(i) = V \\ I(i) for i in K2, else I(i).
    6. The I'(i), i in K0, must form a chain, else False.
    7. d_hid > 1 -> True.  8. Order the I' into a chain C_1 ⊆ ... ⊆ C_n.
    9–10. (d_hid = 1) True when the sign threshold of x fits into the chain.

    Steps 9–10 as printed test only the threshold sets T = K2 (step 9) and T = V \\ K2 (step 10).
    That is exact when K0 = V. When some rows of S are all ones (outside K0), their x_i may fall
    on either side of the threshold; the printed test then depends on which component is named K2
    and can answer False for a representable S — e.g. S = [[0,0,1],[1,0,0],[1,1,1]] with
    d_hid = 1 is representable by x = (-1, 1, 2), W_q W_k = -1, yet the printed steps return False
    with K2 = {1}. By default this function tests every admissible threshold instead: step 9
    asks for a set T with K2 ⊆ T ⊆ V \\ K1 nested with the chain (x > 0 exactly on T, s = -1),
    i.e. some gap C_r ⊆ T ⊆ C_{r+1} (C_0 = ∅, C_{n+1} = V) with K2 ⊆ C_{r+1} and C_r ∩ K1 = ∅;
    step 10 the same with K1 and K2 swapped (s = +1). For K0 = V this is the printed test.
    ``literal=True`` runs steps 9–10 exactly as printed (to reproduce the paper).

    Returns True when RN(S) can be (1, d_hid)-weakly SAM-approximated, else False.
    """
    s = _support(S, "S")
    d_hid = _positive_int(d_hid, "d_hid")
    n = s.shape[0]
    every = (1 << n) - 1  # sets of column indices as bitmasks: bit j <=> column j

    def sub(a: int, b: int) -> bool:  # a ⊆ b
        return a & ~b == 0

    sets = [sum(1 << j for j in s[i].nonzero().flatten().tolist()) for i in range(n)]  # step 1
    k0 = [i for i in range(n) if sets[i] != every]  # step 2
    if not k0:
        return True
    comps = _components(k0, lambda v, w: sub(sets[v], sets[w]) or sub(sets[w], sets[v]))  # 3-4
    if len(comps) > 2:
        return False
    k1 = sum(1 << i for i in comps[0])
    k2 = sum(1 << i for i in comps[1]) if len(comps) == 2 else 0
    flipped = [every ^ sets[i] if k2 >> i & 1 else sets[i] for i in range(n)]  # step 5
    # step 6 (and 8): the I' form a chain iff, sorted by size, each one contains the previous
    chain = sorted(flipped, key=int.bit_count)
    if not all(sub(lo, hi) for lo, hi in zip(chain[:-1], chain[1:], strict=True)):
        return False
    if d_hid > 1:  # step 7
        return True
    if literal:
        step9 = (
            sub(k2, chain[0])
            or sub(chain[-1], k2)
            or any(sub(chain[r], k2) and sub(k2, chain[r + 1]) for r in range(n - 1))
        )
        step10 = (
            sub(k2, every ^ chain[-1])
            or sub(every ^ chain[0], k2)
            or any(
                sub(every ^ chain[r + 1], k2) and sub(k2, every ^ chain[r]) for r in range(n - 1)
            )
        )
        return step9 or step10
    gaps = [0, *chain, every]
    pairs = list(zip(gaps[:-1], gaps[1:], strict=True))
    step9 = any(sub(k2, hi) and not lo & k1 for lo, hi in pairs)
    step10 = any(sub(k1, hi) and not lo & k2 for lo, hi in pairs)
    return step9 or step10


@dataclass(frozen=True)
class WeakApproxResult:
    """Outcome of a weak-approximation search: ``found`` with a witness, or not found.

    ``X`` (n, d_hid), ``W_q``/``W_k`` (d_hid, d) and ``M = sam(X, W_q, W_k)`` are set when
    ``found``; ``margin`` is the smallest log-gap ``min_{S=1} log M - max_{S=0} log M`` over the
    rows (positive iff M weakly approximates RN(S)). ``tries`` counts LPs or restarts used.
    """

    found: bool
    X: Tensor | None
    W_q: Tensor | None
    W_k: Tensor | None
    M: Tensor | None
    margin: float
    tries: int
    message: str


def _row_margin(logits: Tensor, s: Tensor) -> Tensor:
    """Per-row min_{S=1} logit - max_{S=0} logit (inf for rows with no zeros)."""
    return logits.masked_fill(~s, math.inf).amin(-1) - logits.masked_fill(s, -math.inf).amax(-1)


def _witness(
    x: Tensor, w_q: Tensor, w_k: Tensor, s: Tensor, tries: int, how: str
) -> WeakApproxResult:
    m = sam(x, w_q, w_k)
    margin = float(_row_margin(_logits(x, w_q, w_k), s).min())
    return WeakApproxResult(True, x, w_q, w_k, m, margin, tries, how)


def weak_sam_approx_d1_lp(S: Any, d_hid: int) -> WeakApproxResult:
    """Exhaustive decider of (1, d_hid)-WEAK-SAM-APPROX for tiny n, independent of Algorithm 1.

    With d = 1 the logit (i, j) is ``q_i k_j``. The strict row inequalities of eq. (4) are
    positively homogeneous, so after fixing signs they become an LP feasibility problem with
    margin 1 (scipy.optimize.linprog, HiGHS):

    * d_hid >= 2 (q and k free): for each sign pattern of q on the rows that are not all ones,
      find k with ``sign(q_i) (k_j - k_l) >= 1`` for all j in I(i), l not in I(i).
    * d_hid = 1 (q = x, k = s x with s = ±1): for each s and each sign pattern σ of x, find x with
      ``σ_j x_j >= 1`` and ``s σ_i (x_j - x_l) >= 1`` for the same (i, j, l); σ_0 = +1 suffices
      because x and -x give the same logits. (A zero x_j can be moved off zero without breaking
      a strict inequality, so nonzero signs lose nothing.)

    Cost: up to 2^n LPs — meant for n <= 6. Returns a witness (X, W_q, W_k with d = 1) when
    one exists; ``found=False`` then means "impossible" (this search is exhaustive).
    """
    linprog = require("scipy.optimize", "experiments", "this LP-based analysis").linprog

    s = _support(S, "S")
    d_hid = _positive_int(d_hid, "d_hid")
    n = s.shape[0]
    if n > 10:
        raise ValueError(f"S must be tiny for the exhaustive decider (n <= 10), got n = {n}")
    rows = [i for i in range(n) if not bool(s[i].all())]
    triples = [
        (i, j, l)
        for i in rows
        for j in s[i].nonzero().flatten().tolist()
        for l in (~s[i]).nonzero().flatten().tolist()
    ]

    def feasible(a_ub: list[list[float]]) -> Tensor | None:
        if not a_ub:
            return torch.zeros(n, dtype=F64)
        res = linprog(
            c=[0.0] * n,
            A_ub=a_ub,
            b_ub=[-1.0] * len(a_ub),
            bounds=[(None, None)] * n,
            method="highs",
        )
        return torch.tensor(res.x, dtype=F64) if res.status == 0 else None

    def pair_row(i_sign: float, j: int, l: int) -> list[float]:
        row = [0.0] * n  # encodes -(i_sign) (v_j - v_l) <= -1
        row[j] -= i_sign
        row[l] += i_sign
        return row

    tries = 0
    if d_hid >= 2:
        for signs in product((1.0, -1.0), repeat=len(rows)):
            tries += 1
            sign = dict(zip(rows, signs, strict=True))
            k = feasible([pair_row(sign[i], j, l) for i, j, l in triples])
            if k is not None:
                q = torch.tensor([sign.get(i, 1.0) for i in range(n)], dtype=F64)
                x = torch.zeros(n, d_hid, dtype=F64)
                x[:, 0], x[:, 1] = q, k
                w_q = torch.zeros(d_hid, 1, dtype=F64)
                w_k = torch.zeros(d_hid, 1, dtype=F64)
                w_q[0, 0] = w_k[1, 0] = 1.0
                return _witness(x, w_q, w_k, s, tries, "LP witness")
        return WeakApproxResult(False, None, None, None, None, -math.inf, tries, "infeasible")
    for sgn in (1.0, -1.0):
        for rest in product((1.0, -1.0), repeat=n - 1):
            sigma = (1.0, *rest)  # x and -x give the same logits s x x^T: fix sign(x_0) = +1
            tries += 1
            a_ub = [[-sigma[j] if c == j else 0.0 for c in range(n)] for j in range(n)]
            a_ub += [pair_row(sgn * sigma[i], j, l) for i, j, l in triples]
            x = feasible(a_ub)
            if x is not None:
                w_k = torch.full((1, 1), sgn, dtype=F64)
                return _witness(
                    x[:, None], torch.ones(1, 1, dtype=F64), w_k, s, tries, "LP witness"
                )
    return WeakApproxResult(False, None, None, None, None, -math.inf, tries, "infeasible")


# ---------------------------------------------------------------------------- d > 1: search
def try_weak_approx(
    S: Any,
    d: int,
    d_hid: int | None = None,
    *,
    restarts: int = 4,
    steps: int = 1500,
    lr: float = 0.05,
    seed: int | torch.Generator = 0,
) -> WeakApproxResult:
    """Search for X, W_q, W_k with SAM(X; d, d_hid, W_q, W_k) weakly approximating RN(S) (Def. 0.1).

    (d, d_hid)-WEAK-SAM-APPROX is NP-hard for d > 1 (Theorem 0.2), so this is a heuristic:
    Adam on X (n, d_hid), W_q, W_k (d_hid, d) minimising, over the rows of S that are not all ones,
    ``relu(1 - (softmin_{S=1} L_i - logsumexp_{S=0} L_i))`` with L = X W_q W_k^T X^T. The soft
    margin is a lower bound of the true one, and scaling X scales L, so a strictly separating
    solution drives the loss to zero. Restarts from ``restarts`` random initialisations, each up to
    ``steps`` steps; stops at the first witness, checked with :func:`weakly_approximates`.

    ``d_hid`` defaults to 2d (then X W_q and X W_k are independent). The witness X is rescaled so
    that max |L| = 20, which keeps M = SAM free of underflow. Returns ``found=False`` with
    message "not found within budget" otherwise — which says nothing about impossibility.
    """
    s = _support(S, "S")
    d = _positive_int(d, "d")
    d_hid = 2 * d if d_hid is None else _positive_int(d_hid, "d_hid")
    if d_hid < d:
        raise ValueError(
            f"d_hid must be >= d (the paper's W_q, W_k are d_hid x d), got {d_hid} < {d}"
        )
    restarts = _positive_int(restarts, "restarts")
    steps = _positive_int(steps, "steps")
    lr = check_finite_float("lr", lr, 0.0, low_open=True)
    gen = _generator(seed)
    n = s.shape[0]
    _entries(max(n, d) * d_hid, "n, d and d_hid")
    rows = ~s.all(1)
    if not rows.any():
        x = torch.zeros(n, d_hid, dtype=F64)
        w = torch.zeros(d_hid, d, dtype=F64)
        return _witness(x, w, w.clone(), s, 0, "S is all ones: any input works")
    sr = s[rows]
    best = -math.inf
    for attempt in range(1, restarts + 1):
        x = torch.randn(n, d_hid, generator=gen, dtype=F64).requires_grad_()
        w_q = (torch.randn(d_hid, d, generator=gen, dtype=F64) / math.sqrt(d_hid)).requires_grad_()
        w_k = (torch.randn(d_hid, d, generator=gen, dtype=F64) / math.sqrt(d_hid)).requires_grad_()
        opt = torch.optim.Adam([x, w_q, w_k], lr=lr)
        for step in range(steps):
            logits = _logits(x, w_q, w_k)[rows]
            if step % 25 == 0 or step == steps - 1:
                with torch.no_grad():
                    margin = float(_row_margin(logits, sr).min())
                best = max(best, margin)
                if margin > 0:
                    break
            soft_min = -torch.logsumexp((-logits).masked_fill(~sr, -math.inf), dim=-1)
            soft_max = torch.logsumexp(logits.masked_fill(sr, -math.inf), dim=-1)
            loss = torch.relu(1.0 - (soft_min - soft_max)).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        if margin > 0:
            with torch.no_grad():
                scale = math.sqrt(20.0 / float(_logits(x, w_q, w_k).abs().max()))
                xw = (x * scale).detach()
            result = _witness(xw, w_q.detach(), w_k.detach(), s, attempt, "found by search")
            if weakly_approximates(result.M, s):
                return result
    return WeakApproxResult(
        False, None, None, None, None, best, restarts, "not found within budget"
    )


# ---------------------------------------------------------------------------- Theorem 0.4
def theorem_d(n: int, k: int, gamma: float, eps1: float, eps2: float) -> int:
    """The query dimension of Theorem 0.4, eq. (6) (= eq. (22) of Corollary 0.7), natural logs:

    ``d = 2 ceil(16 k^2 ((log gamma - log eps1) / eps2 + 1)^2 (2 log n + log(n - 1) + log 2))``.

    The theorem also asks d <= 2n; at d = 2n the construction is exact, so the useful bound on
    d_min is ``min(theorem_d(...), 2n)``.
    """
    n = _positive_int(n, "n", 2)
    k, c = _theorem_constants(k, gamma, eps1, eps2)
    value = 16 * float(k) ** 2 * c**2 * (2 * math.log(n) + math.log(n - 1) + math.log(2))
    if not math.isfinite(value):
        raise ValueError(f"n={n} with these k, gamma, eps1, eps2 gives a d beyond the float range")
    return 2 * math.ceil(value)


def theorem_slope(k: int, gamma: float, eps1: float, eps2: float) -> float:
    """d(theorem_d)/d(log n) for large n, without the ceiling: 2·16 k² c² · 3 (eq. 6)."""
    k, c = _theorem_constants(k, gamma, eps1, eps2)
    return 96.0 * k**2 * c**2


def _theorem_constants(k: int, gamma: float, eps1: float, eps2: float) -> tuple[int, float]:
    """k and c = (log gamma - log eps1) / eps2 + 1 of eq. (6), validated."""
    k = _positive_int(k, "k")
    gamma = check_finite_float("gamma", gamma, 1.0)
    eps1, eps2 = _eps(eps1, eps2)
    c = (math.log(gamma) - math.log(eps1)) / eps2 + 1.0
    try:
        bound = 96.0 * float(k) ** 2 * c**2
    except OverflowError:
        bound = math.inf
    if not math.isfinite(bound):
        raise ValueError(
            f"k={k}, gamma={gamma:g}, eps1={eps1:g}, eps2={eps2:g} give a dimension beyond "
            "the float range"
        )
    return k, c


@dataclass(frozen=True)
class SAMConstruction:
    """The Theorem 0.4 (or Corollary 0.7) construction for one A.

    ``X`` (n, d_hid) = [X1, X2, 0] (eq. 15); ``W_q``, ``W_k`` (d_hid, d) of eqs. (16), (17) —
    independent of A; ``M`` = SAM (or CSAM) of them; ``eps1``/``eps2`` the errors M achieves
    (:func:`ratio_errors`); ``success`` whether they are below the requested eps1/eps2, i.e.
    whether eqs. (7), (8) hold; ``draws`` how many Stiefel matrices Y were drawn. On failure the
    draw with the smallest max(eps1_hat/eps1, eps2_hat/eps2) is returned.
    """

    X: Tensor
    W_q: Tensor
    W_k: Tensor
    M: Tensor
    eps1: float
    eps2: float
    success: bool
    draws: int
    causal: bool


def construction_weights(d: int, d_hid: int) -> tuple[Tensor, Tensor]:
    """W_q = [I_d 0]^T (eq. 16) and W_k = [[0 I_{d/2}; 0 0] 0]^T (eq. 17), both (d_hid, d)."""
    d = _positive_int(d, "d", 2)
    if d % 2:
        raise ValueError(f"d must be even (eq. 6 makes it 2·ceil(...)), got {d}")
    d_hid = _positive_int(d_hid, "d_hid")
    if d_hid < d:
        raise ValueError(f"d_hid must be >= d, got {d_hid} < {d}")
    _entries(d * d_hid, "d and d_hid")
    h = d // 2
    w_q = torch.zeros(d_hid, d, dtype=F64)
    w_q[:d, :d] = torch.eye(d, dtype=F64)
    w_k_t = torch.zeros(d, d_hid, dtype=F64)  # W_k^T: its top d/2 rows pick X's columns d/2..d
    w_k_t[:h, h:d] = torch.eye(h, dtype=F64)
    return w_q, w_k_t.T.contiguous()


def _b_matrix(a: Tensor, eps1: float, eps2: float) -> Tensor:
    """B of eq. (9): 0 where A = 0, log(A_ij / (eps1 alpha_i)) + eps2 elsewhere."""
    nz = a > 0
    alpha = a.masked_fill(~nz, math.inf).amin(1, keepdim=True)
    ratio = torch.where(nz, a / (eps1 * alpha), torch.ones_like(a))
    return torch.where(nz, torch.log(ratio) + eps2, torch.zeros_like(a))


def _stiefel(count: int, n: int, h: int, gen: torch.Generator) -> Tensor:
    """``count`` Haar-distributed n x h matrices with orthonormal columns: QR of a Gaussian with
    the signs of R's diagonal moved into Q (Stewart 1980). Shape (count, n, h).

    Off the CPU, when h <= n/2, the same Q is computed as G R^{-1} with R^T R = G^T G the
    Cholesky factorisation (R has a positive diagonal, so this is the sign-corrected QR factor);
    G is then well conditioned (cond < 6), and batched GEMMs are far faster than batched QR."""
    g = torch.randn(count, n, h, generator=gen, dtype=F64, device=gen.device)
    if g.device.type != "cpu" and 2 * h <= n:
        r = torch.linalg.cholesky(g.transpose(-1, -2) @ g, upper=True)
        return torch.linalg.solve_triangular(r, g, upper=True, left=False)
    q, r = torch.linalg.qr(g)
    sign = torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))
    sign = torch.where(sign == 0, torch.ones_like(sign), sign)
    return q * sign[:, None, :]


def construct_sam(
    A: Any,
    d: int,
    eps1: float,
    eps2: float,
    d_hid: int | None = None,
    redraws: int | None = None,
    seed: int | torch.Generator = 0,
    *,
    causal: bool = False,
    device: str | torch.device | None = None,
) -> SAMConstruction:
    """Theorem 0.4's construction of X, W_q, W_k with SAM(X) ≈ A in the sense of eqs. (7), (8).

    Steps (float64): B from eq. (9); SVD B = U Σ V^T, D = U Σ; Y (n, d/2) Haar-Stiefel by QR of a
    Gaussian; X1 = (2n/d)^{1/2} D Y, X2 = (2n/d)^{1/2} V Y (eq. 14); X = [X1 X2 0] (eq. 15),
    W_q, W_k of eqs. (16), (17), so that X W_q W_k^T X^T = X1 X2^T. Y is redrawn until (7) and (8)
    hold, at most ``redraws`` times (default Q·n with Q = 1, as in the paper's experiments).

    ``causal=True`` is Corollary 0.7: A must be lower triangular, M = CSAM, and (23), (24) are
    checked for columns j <= i only.

    Args:
        A: (n, n) nonnegative with a nonzero in every row. The theorem assumes A right stochastic;
            rows need not be normalised here because B and eqs. (7)/(8) only see ratios in a row.
        d: query dimension, even, 2 <= d <= 2n (at d = 2n, Y Y^T = I and the construction is exact).
        eps1: in (0, 1). eps2: > 0.
        d_hid: hidden size >= d (default d).
        redraws: most Y draws (default n).
        seed: int or torch.Generator for Y (a generator must live on ``device``).
        device: where B's SVD and the Y draws run (default CPU; e.g. "cuda"). X, W_q, W_k and M
            are returned on the CPU. A CUDA generator draws other numbers than a CPU one, so
            results depend on the device; on CUDA the draws are screened 32 at a time.
    """
    a = _nonnegative(A, "A")
    n = a.shape[0]
    eps1, eps2 = _eps(eps1, eps2)
    d = _positive_int(d, "d")
    if d % 2 or d > 2 * n:
        raise ValueError(f"d must be even and at most 2n = {2 * n} (Theorem 0.4), got {d}")
    d_hid = d if d_hid is None else _positive_int(d_hid, "d_hid")
    _entries(n * d_hid, "n and d_hid")
    redraws = n if redraws is None else _positive_int(redraws, "redraws")
    causal = check_bool("causal", causal)
    if causal and bool(torch.triu(a, 1).any()):
        raise ValueError("A must be lower triangular when causal=True (Corollary 0.7)")
    dev = _device(device)
    gen = _generator(seed, dev)
    prep = _prepare(a, eps1, eps2, causal, dev)
    return _construct(prep, d, d_hid, redraws, gen)


class _Prepared(NamedTuple):
    """What the Theorem 0.4 construction needs of one A, independent of d (on the device):
    B of eq. (9) = D V^T (SVD), A's nonzero columns per row padded by repetition (n, kmax) and
    their log values, the entries eq. (7) ignores (A's nonzeros; causal: also j > i)."""

    a: Tensor
    eps1: float
    eps2: float
    causal: bool
    b: Tensor
    dmat: Tensor
    v: Tensor
    cols: Tensor
    log_a: Tensor
    blocked: Tensor


def _prepare(a: Tensor, eps1: float, eps2: float, causal: bool, dev: torch.device) -> _Prepared:
    n = a.shape[0]
    ad = a.to(dev)
    b = _b_matrix(ad, eps1, eps2)
    u, sigma, vh = torch.linalg.svd(b)
    nz = ad > 0
    kmax = int(nz.sum(1).max())
    order = torch.sort(nz.to(torch.int8), dim=1, descending=True, stable=True).indices
    first = order[:, :1]
    ar = torch.arange(kmax, device=dev)
    cols = torch.where(ar < nz.sum(1, keepdim=True), order[:, :kmax], first)
    log_a = torch.log(ad.gather(1, cols))
    blocked = nz | torch.ones(n, n, dtype=torch.bool, device=dev).triu(1) if causal else nz
    return _Prepared(ad, eps1, eps2, causal, b, u * sigma, vh.T, cols, log_a, blocked)


def _construct(
    prep: _Prepared, d: int, d_hid: int, redraws: int, gen: torch.Generator
) -> SAMConstruction:
    """Draw Y up to ``redraws`` times for one even d <= 2n (arguments already validated)."""
    a, eps1, eps2, causal, b, dmat, v, cols, log_a, blocked = prep  # a: on the device
    n = a.shape[0]
    kmax = cols.shape[1]
    w_q, w_k = construction_weights(d, d_hid)
    chunk = _REDRAW_CHUNK if b.device.type == "cpu" else 4 * _REDRAW_CHUNK
    h, scale = d // 2, math.sqrt(2 * n / d)
    # Screening identity: with W = V Y (Haar-Stiefel whenever Y is, V being orthogonal),
    # X1 X2^T = (2n/d) D Y Y^T V^T = (2n/d) B W W^T: two products per draw instead of three.
    # So W is drawn by QR of a Gaussian and Y = V^T W; the returned X is built from D, V, Y.
    best, best_score, drawn = None, math.inf, 0
    while drawn < redraws:
        count = min(chunk, redraws - drawn)
        w = _stiefel(count, n, h, gen)  # (count, n, d/2)
        logits = (scale * scale) * ((b @ w) @ w.transpose(-1, -2))
        on = logits.gather(2, cols.expand(count, n, kmax))  # logits at A's nonzeros
        logits.masked_fill_(blocked, -math.inf)  # what is left: eq. (7)'s zero entries
        e1 = (logits.amax(-1) - on.amin(-1)).amax(-1)  # log of eq. (7)'s worst ratio, per draw
        r = on - log_a
        e2 = (r.amax(-1) - r.amin(-1)).amax(-1)  # eq. (8)'s worst |log-ratio error|, per draw
        score = torch.maximum(torch.exp(e1) / eps1, e2 / eps2).tolist()
        ok = ((e1 < math.log(eps1)) & (e2 < eps2)).tolist()
        for c in range(count):
            if score[c] < best_score:
                best_score, best = score[c], w[c]
            if ok[c]:
                drawn += c + 1
                break
        else:
            drawn += count
            continue
        break
    y = v.T @ best  # the Stiefel matrix Y of eq. (14)
    x1, x2 = scale * (dmat @ y), scale * (v @ y)
    return _assemble((x1, x2), w_q.to(b.device), w_k.to(b.device), a, prep, drawn, d_hid)


def _assemble(
    xs: tuple[Tensor, Tensor],
    w_q: Tensor,
    w_k: Tensor,
    a: Tensor,
    prep: _Prepared,
    drawn: int,
    d_hid: int,
) -> SAMConstruction:
    """X = [X1 X2 0] (eq. 15) and M = SAM (CSAM) of it, with the errors of eqs. (7), (8)
    recomputed from X itself, on the device of ``xs``; the result is moved to the CPU."""
    x1, x2 = xs
    n, h = x1.shape
    eps1, eps2, causal = prep.eps1, prep.eps2, prep.causal
    x = torch.zeros(n, d_hid, dtype=F64, device=x1.device)
    x[:, :h], x[:, h : 2 * h] = x1, x2  # eq. (15)
    m = csam(x, w_q, w_k) if causal else sam(x, w_q, w_k)
    logits = _logits(x, w_q, w_k)
    if causal:
        above = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        logits = logits.masked_fill(above, -math.inf)
    log_e1, e2 = _ratio_errors_log(torch.log_softmax(logits, -1), a)
    e1 = math.exp(log_e1)
    ok = e1 < eps1 and e2 < eps2
    return SAMConstruction(x.cpu(), w_q.cpu(), w_k.cpu(), m.cpu(), e1, e2, ok, drawn, causal)


def least_construct_d(
    A: Any,
    eps1: float,
    eps2: float,
    d_values: Any = None,
    q: float = 1.0,
    seed: int = 0,
    *,
    causal: bool = False,
    coarse: int = 1,
    device: str | torch.device | None = None,
) -> tuple[int, SAMConstruction]:
    """d_min(eps1, eps2) of the paper's experiments for one A: the least d of an ascending grid
    for which :func:`construct_sam` (with round(q·n) redraws, at least 1) meets eqs. (7), (8).

    ``d_values`` defaults to 2, 4, ..., 2n. The draws for grid point d use the generator seeded
    with (seed, d), so whether d succeeds does not depend on the order in which d are tried.
    ``coarse = 1`` scans the grid in ascending order, as in the paper. ``coarse = m > 1`` first
    tries every m-th grid value, then the values between the last failing and the first
    succeeding one, in ascending order: the same answer as the full scan unless some d below a
    failing coarse value succeeds (success is random near the threshold; the d_min study measures
    how often the two differ), for about sqrt(grid size) instead of grid-size constructions.
    If no grid value succeeds, 2n is tried last (it always succeeds: the construction is exact
    there). ``device`` is passed to :func:`construct_sam`. Returns (d_min, its construction).
    """
    a = _nonnegative(A, "A")
    n = a.shape[0]
    if d_values is None:
        grid = list(range(2, 2 * n + 1, 2))
    else:
        try:
            values = list(d_values)
        except TypeError as err:
            raise TypeError(f"d_values must be an iterable of ints, got {d_values!r}") from err
        grid = sorted({check_int(f"d_values[{i}]", v) for i, v in enumerate(values)})
    for v in grid:
        if v < 2 or v % 2 or v > 2 * n:
            raise ValueError(f"d_values must be even numbers in [2, 2n = {2 * n}], got {v}")
    q = check_finite_float("q", q, 0.0, low_open=True)
    seed = check_int("seed", seed)
    causal = check_bool("causal", causal)
    coarse = _positive_int(coarse, "coarse")
    dev = _device(device)
    redraws = max(1, min(round(q * n), MAX_ENTRIES))
    if not grid or grid[-1] != 2 * n:
        grid.append(2 * n)

    eps1, eps2 = _eps(eps1, eps2)
    if causal and bool(torch.triu(a, 1).any()):
        raise ValueError("A must be lower triangular when causal=True (Corollary 0.7)")
    prep = _prepare(a, eps1, eps2, causal, dev)  # B's SVD once for every d

    def attempt(v: int) -> SAMConstruction:
        return _construct(prep, v, v, redraws, _generator(seed * 100_003 + v, dev))

    lo = 0  # grid[:lo] is known (or, for coarse > 1, assumed) to fail
    for hi in [*range(coarse - 1, len(grid), coarse), len(grid) - 1]:
        res = attempt(grid[hi])
        if res.success:
            for v in grid[lo:hi]:
                fine = attempt(v)
                if fine.success:
                    return v, fine
            return grid[hi], res
        lo = hi + 1
    raise RuntimeError("the exact construction at d = 2n failed; this is a bug")


def random_sparse_stochastic(
    n: int, k: int, gamma: float, seed: int | torch.Generator = 0, *, causal: bool = False
) -> Tensor:
    """A random k-nonzero-bounded, gamma-variation-bounded right stochastic matrix (n, n), float64,
    as in the paper's experiments: the support is the union of k random permutation matrices, each
    nonzero is 1 or gamma by a fair coin flip, rows are then normalised.

    ``causal=True`` keeps the lower triangle and the diagonal (so every row keeps a nonzero): a
    lower-triangular matrix for Corollary 0.7 with at most k + 1 nonzeros per row and column.
    """
    n = _positive_int(n, "n")
    k = _positive_int(k, "k")
    gamma = check_finite_float("gamma", gamma, 1.0)
    causal = check_bool("causal", causal)
    _entries(n * n, "n")
    gen = _generator(seed)
    support = torch.zeros(n, n, dtype=torch.bool)
    rows = torch.arange(n)
    for _ in range(k):
        support[rows, torch.randperm(n, generator=gen)] = True
    if causal:
        support = support.tril() | torch.eye(n, dtype=torch.bool)
    coin = torch.rand(n, n, generator=gen, dtype=F64) < 0.5
    a = torch.where(support, torch.where(coin, float(gamma), 1.0), 0.0).to(F64)
    return a / a.sum(1, keepdim=True)
