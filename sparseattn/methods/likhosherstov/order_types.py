"""An exact decider for (2, d_hid)-WEAK-SAM-APPROX at small n, by planar order types.

Likhosherstov et al. (AAAI 2023), Theorem 0.2: deciding whether RN(S) can be weakly
SAM-approximated (Definition 0.1, eq. 4) is NP-hard for every d_hid >= d > 1. For d = 2 and small
n the question is still finite, and this module answers it exactly.

**Reduction.** With d_hid >= 2d = 4 the logits L = X W_q W_k^T X^T = Q K^T have arbitrary
Q, K in R^{n x 2} (take X = [Q K 0], W_q = [I 0 0]^T, W_k = [0 I 0]^T). Eq. (4) asks, for every
row i with I(i) = {j : S_ij = 1} != V, that ``q_i . k_j > q_i . k_l`` for j in I(i), l not in
I(i): the keys of I(i) must lie in an open half-plane {k : q_i . k > t} that holds no other key.
The rows are independent given the keys, so S is representable iff some placement of n key
points in the plane makes every row set I(i) *linearly separable* from its complement.
The inequalities are strict, so the points may be perturbed into general position (no three
collinear) without breaking any of them; and for points in general position, whether a subset T
is separable depends only on the *order type* (the orientation sign of every triple): by
Kirchberger's theorem T and V \\ T are strictly separable iff no point of one lies in a triangle
of the other and no segment of T crosses a segment of V \\ T (:func:`separable_subsets`).

**Exhaustiveness.** :func:`candidate_chirotopes` lists every sign vector on the triples that
satisfies two necessary conditions of point orientations — the 3-term Grassmann–Plücker
relations and acyclicity (no 4-point linear dependency with coefficients of one sign) — so it
contains every labelled order type. :func:`order_types` then finds, by seeded random integer
points, one realisation of each class up to relabelling and reflection, and refuses to return
unless the realisations' labelled images cover every candidate. Realised ⊆ all ⊆ candidates =
realised: the list is exactly the order types, with no appeal to published counts.
(It finds 1, 1, 2, 3, 16 classes for n = 2 … 6, the known numbers.)

:func:`weak_sam_approx_d2` is then a lookup: S is representable iff its row sets are contained in
the separable family of some labelled order type; on "yes" it returns a witness (X, W_q, W_k)
verified through :func:`~.expressivity.sam` and eq. (4). Points are integers,
so every orientation is exact. n <= 6 (2^20 sign vectors are screened at n = 6).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from itertools import combinations, permutations
from typing import Any

import numpy as np
import torch

from ..._extras import require
from ...validate import check_int
from .expressivity import WeakApproxResult, _support, sam, weakly_approximates

__all__ = [
    "MAX_N",
    "OrderType",
    "candidate_chirotopes",
    "chirotope",
    "order_types",
    "representable_families",
    "separable_subsets",
    "weak_sam_approx_d2",
]

#: Largest n handled (the candidate screen is over 2^C(n,3) sign vectors: 2^20 at n = 6).
MAX_N = 6
_COORD = 1 << 12  # realisations are drawn from {0, ..., 4095}^2
_BATCH = 20_000  # point sets drawn per batch while realising order types
_MAX_BATCHES = 200  # give up (a bug) after this many batches without covering every candidate
F64 = torch.float64


def _check_n(n: Any) -> int:
    n = check_int("n", n, 1)
    if n > MAX_N:
        raise ValueError(f"n must be at most {MAX_N} for the exact order-type decider, got {n}")
    return n


@cache
def _triples(n: int) -> tuple[tuple[int, int, int], ...]:
    """The triples a < b < c of {0, ..., n-1}, lexicographic; a chirotope lists one sign each."""
    return tuple(combinations(range(n), 3))


def _sign_of(n: int, a: int, b: int, c: int) -> tuple[int, int]:
    """(position in :func:`_triples`, parity) of the ordered triple (a, b, c):
    chi(a, b, c) = parity * chi(sorted)."""
    order = sorted((a, b, c))
    inversions = (a > b) + (a > c) + (b > c)
    return _triples(n).index(tuple(order)), -1 if inversions % 2 else 1


# ---------------------------------------------------------------------------- orientations
def _orientations(points: np.ndarray) -> np.ndarray:
    """Signs of det[p_b - p_a, p_c - p_a] for every triple a < b < c, exactly (int64).

    Shapes: points (..., n, 2) integer -> (..., C(n, 3)) in {-1, 0, +1}.
    """
    n = points.shape[-2]
    if n < 3:
        return np.zeros((*points.shape[:-2], 0), dtype=np.int64)
    idx = np.array(_triples(n))
    pa, pb, pc = (points[..., idx[:, t], :] for t in range(3))
    u, v = pb - pa, pc - pa
    return np.sign(u[..., 0] * v[..., 1] - u[..., 1] * v[..., 0])


def chirotope(points: Any) -> tuple[int, ...]:
    """The order type of n labelled points in general position: the orientation sign
    (+1 counter-clockwise, -1 clockwise) of each triple a < b < c, in lexicographic order.

    ``points``: (n, 2) integers (exact). Raises ValueError when three points are collinear.
    """
    pts = np.asarray(points)
    if pts.ndim != 2 or pts.shape[1] != 2 or not np.issubdtype(pts.dtype, np.integer):
        raise ValueError(f"points must be an (n, 2) integer array, got {pts.dtype} {pts.shape}")
    signs = _orientations(pts.astype(np.int64))
    if (signs == 0).any():
        raise ValueError("points must be in general position (no three collinear)")
    return tuple(int(s) for s in signs)


def _code(signs: np.ndarray) -> np.ndarray:
    """A chirotope as an integer: bit t set iff triple t is positive. (..., T) -> (...,)."""
    weights = 1 << np.arange(signs.shape[-1], dtype=np.int64)
    return ((signs > 0).astype(np.int64) * weights).sum(-1)


# ---------------------------------------------------------------------------- candidates
def _relations(n: int) -> tuple[list, list]:
    """Index/parity lists for the 3-term Grassmann–Plücker relations and the 4-point circuits.

    GP: for x and a < b < c < d (all distinct), [xab][xcd] - [xac][xbd] + [xad][xbc] = 0, so the
    three signed products cannot all have one sign. Circuits: the dependency of points
    a < b < c < d has coefficients ([bcd], -[acd], [abd], -[abc]) (Cramer), which for affine
    points sum to zero and so never share one sign (acyclicity).
    """
    gp = []
    for x in range(n):
        others = [v for v in range(n) if v != x]
        for a, b, c, d in combinations(others, 4):
            terms = [((x, a, b), (x, c, d), 1), ((x, a, c), (x, b, d), -1)]
            terms.append(((x, a, d), (x, b, c), 1))
            gp.append([(_sign_of(n, *t1), _sign_of(n, *t2), s) for t1, t2, s in terms])
    circuits = []
    for a, b, c, d in combinations(range(n), 4):
        parts = [((b, c, d), 1), ((a, c, d), -1), ((a, b, d), 1), ((a, b, c), -1)]
        circuits.append([(_sign_of(n, *t), s) for t, s in parts])
    return gp, circuits


@cache
def candidate_chirotopes(n: int) -> frozenset[int]:
    """Codes (bit t set iff triple t is positive) of every sign vector on the C(n, 3) triples
    that satisfies the 3-term Grassmann–Plücker relations and acyclicity — necessary for the
    orientations of n points in general position, so a superset of the labelled order types.

    Exhaustive over all 2^C(n,3) sign vectors (1 048 576 at n = 6).
    """
    n = _check_n(n)
    t = len(_triples(n))
    codes = np.arange(1 << t, dtype=np.int64)
    signs = np.where((codes[:, None] >> np.arange(t)) & 1, 1, -1).astype(np.int8)
    ok = np.ones(len(codes), dtype=bool)
    gp, circuits = _relations(n)
    for terms in gp:
        vals = [s * signs[:, i1] * p1 * signs[:, i2] * p2 for (i1, p1), (i2, p2), s in terms]
        ok &= ~((vals[0] == vals[1]) & (vals[1] == vals[2]))
    for parts in circuits:
        vals = [s * p * signs[:, i] for (i, p), s in parts]
        ok &= ~((vals[0] == vals[1]) & (vals[1] == vals[2]) & (vals[2] == vals[3]))
    return frozenset(int(c) for c in codes[ok])


# ---------------------------------------------------------------------------- realisations
@dataclass(frozen=True)
class OrderType:
    """One planar order type: ``points`` (n, 2) integer coordinates realising it, ``chirotope``
    their triple signs, ``labelled`` how many labelled chirotopes (relabellings and reflections)
    it stands for, ``hull`` how many points lie on the convex hull."""

    points: tuple[tuple[int, int], ...]
    chirotope: tuple[int, ...]
    labelled: int
    hull: int


@cache
def _perms(n: int) -> np.ndarray:
    """All permutations of range(n), shape (n!, n)."""
    return np.array(list(permutations(range(n))), dtype=np.int64).reshape(-1, n)


def _images(points: np.ndarray) -> np.ndarray:
    """Codes of every relabelling and reflection of one point set, shape (2 n!,)."""
    perms = _perms(points.shape[0])
    relabelled = np.empty((len(perms), *points.shape), dtype=np.int64)
    relabelled[np.arange(len(perms))[:, None], perms] = points  # point i gets label perm[i]
    signs = _orientations(relabelled)
    return np.unique(np.concatenate([_code(signs), _code(-signs)]))


def _hull_size(points: np.ndarray) -> int:
    """Points that lie in no triangle of the others (the convex hull's vertices)."""
    n = len(points)
    inside = set()
    for tri in combinations(range(n), 3):
        for p in set(range(n)) - set(tri):
            if _in_triangle(points, tri, p):
                inside.add(p)
    return n - len(inside)


def _orient(points: np.ndarray, u: int, v: int, w: int) -> int:
    """Sign of det[p_v - p_u, p_w - p_u] (exact for integer points)."""
    (ux, uy), (vx, vy), (wx, wy) = (points[i].tolist() for i in (u, v, w))
    det = (vx - ux) * (wy - uy) - (vy - uy) * (wx - ux)
    return (det > 0) - (det < 0)


def _in_triangle(points: np.ndarray, tri: tuple[int, int, int], p: int) -> bool:
    """Whether point p lies strictly inside triangle ``tri`` (general position)."""
    a, b, c = tri
    s = _orient(points, a, b, p), _orient(points, b, c, p), _orient(points, c, a, p)
    return s[0] == s[1] == s[2]


@cache
def order_types(n: int, seed: int = 0) -> tuple[OrderType, ...]:
    """One integer realisation of every order type of n points in general position, up to
    relabelling and reflection, found by seeded random sampling and proved complete: the
    labelled images of the returned realisations equal :func:`candidate_chirotopes` (n).

    Raises RuntimeError if sampling does not cover every candidate (it does for n <= 6).
    """
    n = _check_n(n)
    if n < 3:
        pts = np.array([[0, 0], [1, 0]][:n], dtype=np.int64)
        return (OrderType(tuple(map(tuple, pts.tolist())), (), 1, n),)
    wanted = candidate_chirotopes(n)
    rng = np.random.default_rng(seed)
    covered: set[int] = set()
    found: list[OrderType] = []
    for _ in range(_MAX_BATCHES):
        batch = rng.integers(0, _COORD, size=(_BATCH, n, 2), dtype=np.int64)
        signs = _orientations(batch)
        general = ~(signs == 0).any(-1)
        for pts, code in zip(batch[general], _code(signs[general]), strict=True):
            if int(code) in covered:
                continue
            images = _images(pts)
            covered.update(int(c) for c in images)
            chi = tuple(int(s) for s in _orientations(pts))
            pts_t = tuple(tuple(int(v) for v in p) for p in pts)
            found.append(OrderType(pts_t, chi, len(images), _hull_size(pts)))
        if covered == wanted:
            return tuple(sorted(found, key=lambda o: (-o.hull, o.points)))
        if not covered <= wanted:
            raise RuntimeError("a realised chirotope violates the candidate conditions (a bug)")
    missing = len(wanted - covered)
    raise RuntimeError(f"{missing} candidate chirotopes of n = {n} were not realised")


# ---------------------------------------------------------------------------- separability
def separable_subsets(points: Any) -> frozenset[int]:
    """Every subset T of n points in general position (as a bitmask: bit j <=> point j) that an
    open half-plane cuts off exactly: {p : u . p > t} ∩ points = T, for some u, t. T = V (all
    points) is included, T = ∅ is not (a row of S is never empty).

    By Kirchberger's theorem in the plane (sets of at most d + 2 = 4 points decide), T is
    separable from U = V \\ T iff no point of U lies in a triangle of T, no point of T in a
    triangle of U, and no segment of T crosses a segment of U — all orientation tests, so the
    answer is a function of :func:`chirotope` alone. ``points``: (n, 2) integers.
    """
    pts = np.asarray(points, dtype=np.int64)
    chirotope(pts)  # validates shape and general position
    n = len(pts)
    inside = {tri: _inside_mask(pts, tri) for tri in combinations(range(n), 3)}
    crossing = {pair: _crossing_pairs(pts, pair) for pair in combinations(range(n), 2)}
    every = (1 << n) - 1
    out = set()
    for t in range(1, every + 1):
        if _separable(t, every ^ t, inside, crossing):
            out.add(t)
    return frozenset(out)


def _inside_mask(pts: np.ndarray, tri: tuple[int, int, int]) -> int:
    """Bitmask of the points strictly inside triangle ``tri``."""
    return sum(1 << p for p in range(len(pts)) if p not in tri and _in_triangle(pts, tri, p))


def _crossing_pairs(pts: np.ndarray, pair: tuple[int, int]) -> list[tuple[int, int]]:
    """The segments (c, d) that cross segment ``pair`` (general position: proper crossings)."""
    a, b = pair
    out = []
    for c, d in combinations([v for v in range(len(pts)) if v not in pair], 2):
        crosses_ab = _orient(pts, a, b, c) != _orient(pts, a, b, d)
        if crosses_ab and _orient(pts, c, d, a) != _orient(pts, c, d, b):
            out.append((c, d))
    return out


def _separable(t: int, u: int, inside: dict, crossing: dict) -> bool:
    for (a, b, c), mask in inside.items():
        tri = (1 << a) | (1 << b) | (1 << c)
        if (tri & t == tri and mask & u) or (tri & u == tri and mask & t):
            return False
    for (a, b), segs in crossing.items():
        in_t = t >> a & 1 and t >> b & 1
        if in_t and any(u >> c & 1 and u >> d & 1 for c, d in segs):
            return False
    return True


# ---------------------------------------------------------------------------- the decider
@cache
def representable_families(n: int) -> dict[int, tuple[int, tuple[int, ...]]]:
    """Every labelled family of separable subsets of n keys, each as a 2^n-bit integer (bit T
    set iff subset T is separable), mapped to (index into :func:`order_types` (n), the
    permutation perm with key j placed at that realisation's point perm[j]).

    A 0/1 matrix S is (2, d_hid >= 4)-weakly SAM-representable iff the bits of its row sets are
    all set in one of these families.
    """
    n = _check_n(n)
    perms = _perms(n)
    size = 1 << n
    # moved[p, T] = the subset {perm[p][j] : j in T}: key j sits at point perm[p][j]
    bits = (np.arange(size)[:, None] >> np.arange(n)) & 1  # (2^n, n)
    moved = (bits[None, :, :] << perms[:, None, :]).sum(-1)  # (n!, 2^n)
    out: dict[int, tuple[int, tuple[int, ...]]] = {}
    for index, otype in enumerate(order_types(n)):
        family = np.zeros(size, dtype=bool)
        family[list(separable_subsets(otype.points))] = True
        labelled = family[moved]  # (n!, 2^n): is the image of T separable?
        for p in range(len(perms)):
            key = sum(1 << int(t) for t in np.flatnonzero(labelled[p]))
            out.setdefault(key, (index, tuple(int(v) for v in perms[p])))
    return out


def _row_family(s: torch.Tensor) -> int:
    """S's row sets I(i) != V as one 2^n-bit integer (bit T set iff some row equals T)."""
    n = s.shape[0]
    every = (1 << n) - 1
    out = 0
    for row in s.tolist():
        t = sum(1 << j for j, v in enumerate(row) if v)
        if t != every:
            out |= 1 << t
    return out


def _direction(keys: np.ndarray, t: int) -> np.ndarray:
    """A vector q with q . k_j >= q . k_l + 2 for j in T, l not in T (margin LP, scipy HiGHS)."""
    linprog = require("scipy.optimize", "experiments", "this LP-based analysis").linprog

    n = len(keys)
    inn = [j for j in range(n) if t >> j & 1]
    out = [j for j in range(n) if not t >> j & 1]
    if not out:
        return np.zeros(2)
    # variables (q_x, q_y, c): q . k_j - c >= 1 (j in T), q . k_l - c <= -1 (l not in T)
    a_ub = [[-keys[j][0], -keys[j][1], 1.0] for j in inn]
    a_ub += [[keys[j][0], keys[j][1], -1.0] for j in out]
    res = linprog([0.0] * 3, A_ub=a_ub, b_ub=[-1.0] * n, bounds=[(None, None)] * 3)
    if res.status != 0:
        raise RuntimeError(f"subset {t:b} was listed as separable but the LP failed (a bug)")
    return np.asarray(res.x[:2])


def weak_sam_approx_d2(S: Any, d_hid: int = 4) -> WeakApproxResult:
    """Exact (2, d_hid)-WEAK-SAM-APPROX for d_hid >= 4 and n <= 6 (Definition 0.1, eq. 4;
    the problem Theorem 0.2 shows NP-hard in general).

    ``S``: (n, n) 0/1 or bool matrix with a 1 in every row (an AttentionGraph works too).
    ``d_hid``: hidden size; must be >= 2d = 4, where Q = X W_q and K = X W_k are independent
    (d_hid = 2, 3 tie the queries to the keys and are a different question).

    Returns ``found=True`` with a witness X (n, d_hid), W_q, W_k (d_hid, 2) and M = SAM(X),
    checked with :func:`~sparseattn.methods.likhosherstov.expressivity.weakly_approximates`, or
    ``found=False`` with message "impossible (exhaustive over order types)" — unlike
    :func:`~sparseattn.methods.likhosherstov.expressivity.try_weak_approx`, a "no" here is a proof.
    ``tries`` counts the labelled families scanned.
    """
    s = _support(S, "S")
    d_hid = check_int("d_hid", d_hid, 1)
    if d_hid < 4:
        raise ValueError(
            f"d_hid must be >= 4 (= 2d, where X W_q and X W_k are independent), got {d_hid}"
        )
    n = _check_n(s.shape[0])
    need = _row_family(s)
    families = representable_families(n)
    for tries, (family, (index, perm)) in enumerate(families.items(), start=1):
        if need & ~family == 0:
            return _witness(s, d_hid, order_types(n)[index], perm, tries)
    return WeakApproxResult(
        False, None, None, None, None, -math.inf, len(families), "impossible (exhaustive)"
    )


def _witness(
    s: torch.Tensor, d_hid: int, otype: OrderType, perm: tuple[int, ...], tries: int
) -> WeakApproxResult:
    """X = [Q K 0], W_q = [I 0]^T, W_k = [0 I 0]^T with keys at the order type's points and each
    query the normal of a half-plane that cuts off its row set; logits scaled to max |L| = 20."""
    n = s.shape[0]
    keys = np.array([otype.points[perm[j]] for j in range(n)], dtype=np.float64)
    keys = (keys - keys.mean(0)) / max(1.0, float(np.abs(keys).max()))
    queries = np.zeros((n, 2))
    every = (1 << n) - 1
    for i, row in enumerate(s.tolist()):
        t = sum(1 << j for j, v in enumerate(row) if v)
        if t != every:
            queries[i] = _direction(keys, t)
    logits = queries @ keys.T
    peak = float(np.abs(logits).max())
    scale = 20.0 / peak if peak > 0 else 1.0
    x = torch.zeros(n, d_hid, dtype=F64)
    x[:, :2] = torch.from_numpy(queries * math.sqrt(scale))
    x[:, 2:4] = torch.from_numpy(keys * math.sqrt(scale))
    w_q = torch.zeros(d_hid, 2, dtype=F64)
    w_k = torch.zeros(d_hid, 2, dtype=F64)
    w_q[0, 0] = w_q[1, 1] = w_k[2, 0] = w_k[3, 1] = 1.0
    m = sam(x, w_q, w_k)
    if not weakly_approximates(m, s):
        raise RuntimeError("the order-type witness does not satisfy eq. (4) (a bug)")
    lg = (x @ w_q) @ (x @ w_k).T
    low = lg.masked_fill(~s, math.inf).amin(1)
    high = lg.masked_fill(s, -math.inf).amax(1)
    margin = float((low - high).min())
    return WeakApproxResult(True, x, w_q, w_k, m, margin, tries, "order-type witness")
