"""Tests for sparseattn.methods.likhosherstov.order_types: the exact d = 2 weak-approx decider.

The reference is a brute force that shares no code with the module: every placement of n points
in general position on a small integer grid, the subsets a line cuts off enumerated from the
lines through two of the points (any separating line can be turned until it touches a point on
each side), and a row-by-row check of eq. (4) on the witnesses.
"""

from __future__ import annotations

import itertools
import math
from functools import cache

import numpy as np
import pytest
import torch

from sparseattn.methods.likhosherstov.expressivity import sam, try_weak_approx, weak_sam_approx_d1
from sparseattn.methods.likhosherstov.order_types import (
    MAX_N,
    candidate_chirotopes,
    chirotope,
    order_types,
    representable_families,
    separable_subsets,
    weak_sam_approx_d2,
)

F64 = torch.float64


# ---------------------------------------------------------------- brute force
def orient(p, q, r) -> int:
    det = (q[0] - p[0]) * (r[1] - p[1]) - (q[1] - p[1]) * (r[0] - p[0])
    return (det > 0) - (det < 0)


def tangent_family(points) -> set[int]:
    """Subsets cut off by a line, from the lines through two points a, b: the points left of
    a -> b, optionally with a and/or b (tilt or shift the line a little); plus V."""
    n = len(points)
    out = {(1 << n) - 1}
    for a, b in itertools.permutations(range(n), 2):
        left = sum(1 << p for p in range(n) if orient(points[a], points[b], points[p]) > 0)
        for extra in (0, 1 << a, 1 << b, (1 << a) | (1 << b)):
            if left | extra:
                out.add(left | extra)
    return out


def grid_families(n: int, m: int) -> set[int]:
    """Every labelled family (2^n-bit integer) of n points in general position on the m x m grid,
    vectorised over all n-subsets of the grid and then over all relabellings."""
    cells = np.array([(x, y) for x in range(m) for y in range(m)], dtype=np.int64)
    pts = cells[np.array(list(itertools.combinations(range(m * m), n)))]  # (C, n, 2)
    a, b, p = np.meshgrid(np.arange(n), np.arange(n), np.arange(n), indexing="ij")
    u = pts[:, b] - pts[:, a]
    v = pts[:, p] - pts[:, a]
    o = np.sign(u[..., 0] * v[..., 1] - u[..., 1] * v[..., 0])  # (C, n, n, n)
    distinct = (a != b) & (b != p) & (a != p)
    pts_ok = ~((o == 0) & distinct).any((1, 2, 3))
    o = o[pts_ok]
    left = ((o > 0) * (1 << np.arange(n))).sum(-1)  # (C, n, n): bitmask left of a -> b
    ia, ib = (1 << np.arange(n))[:, None], (1 << np.arange(n))[None, :]
    off = ~np.eye(n, dtype=bool)
    fams = np.full(len(o), 1 << ((1 << n) - 1), dtype=np.int64)
    for extra in (0, ia + 0 * ib, ib + 0 * ia, ia | ib):
        t = (left | extra)[:, off]
        fams |= np.bitwise_or.reduce(np.where(t > 0, np.left_shift(1, t), 0), axis=1)
    out = set()
    for fam in {int(f) for f in fams}:
        subsets = [t for t in range(1 << n) if fam >> t & 1]
        for perm in itertools.permutations(range(n)):
            moved = (sum(1 << perm[j] for j in range(n) if t >> j & 1) for t in subsets)
            out.add(sum(1 << t for t in moved))
    return out


@cache
def brute_families(n: int) -> frozenset[int]:
    return frozenset(grid_families(n, {3: 3, 4: 4, 5: 5}[n]))


def brute_decide(s: torch.Tensor) -> bool:
    n = s.shape[0]
    every = (1 << n) - 1
    need = 0
    for row in s.tolist():
        t = sum(1 << j for j, v in enumerate(row) if v)
        if t != every:
            need |= 1 << t
    return any(need & ~f == 0 for f in brute_families(n))


def eq4_loops(M, S) -> bool:
    """Definition 0.1 (eq. 4), row by row."""
    n = S.shape[0]
    for i in range(n):
        on = [float(M[i, j]) for j in range(n) if S[i, j]]
        off = [float(M[i, j]) for j in range(n) if not S[i, j]]
        if off and min(on) <= max(off):
            return False
    return True


def random_support(n: int, gen: torch.Generator, density: float = 0.5) -> torch.Tensor:
    s = torch.rand(n, n, generator=gen) < density
    s[torch.arange(n), torch.randint(0, n, (n,), generator=gen)] = True
    return s


# ---------------------------------------------------------------- order types
def test_order_type_counts_are_the_known_ones():
    # 1, 2, 3, 16 order types of 3..6 points (Aichholzer, Aurenhammer & Krasser 2002);
    # n = 5: 132 labelled order types up to reflection (264 chirotopes).
    assert [len(order_types(n)) for n in range(3, 7)] == [1, 2, 3, 16]
    assert len(candidate_chirotopes(5)) == 264
    assert sum(o.labelled for o in order_types(6)) == len(candidate_chirotopes(6))


def test_random_points_satisfy_the_candidate_conditions():
    rng = np.random.default_rng(3)
    for n in (4, 5, 6):
        cands = candidate_chirotopes(n)
        for _ in range(200):
            pts = rng.integers(-50, 50, size=(n, 2))
            try:
                chi = chirotope(pts)
            except ValueError:
                continue  # collinear triple
            assert sum(1 << t for t, s in enumerate(chi) if s > 0) in cands


def test_a_non_acyclic_sign_vector_is_not_a_candidate():
    # triples (0,1,2) +, (0,1,3) -, (0,2,3) +, (1,2,3) -: the circuit
    # ([123], -[023], [013], -[012]) is (-, -, -, -), a positive dependency no points have
    assert 0b0101 not in candidate_chirotopes(4)
    assert len(candidate_chirotopes(4)) == 14  # 16 sign vectors, this one and its negative out


def test_separable_subsets_agree_with_tangent_lines():
    rng = np.random.default_rng(0)
    for n in range(3, MAX_N + 1):
        for otype in order_types(n):
            assert set(separable_subsets(otype.points)) == tangent_family(otype.points)
        for _ in range(30):
            pts = rng.integers(0, 40, size=(n, 2))
            try:
                fam = separable_subsets(pts)
            except ValueError:
                continue
            assert set(fam) == tangent_family(pts.tolist())


@pytest.mark.parametrize("n", [3, 4, 5])
def test_representable_families_equal_the_grid_brute_force(n):
    assert set(representable_families(n)) == brute_families(n)


# ---------------------------------------------------------------- the decider
def test_every_support_up_to_n4_is_representable_with_d2():
    for n in (3, 4):
        every = (1 << n) - 1
        for rows in itertools.product(range(1, every + 1), repeat=n):
            s = torch.tensor([[t >> j & 1 for j in range(n)] for t in rows], dtype=torch.bool)
            assert brute_decide(s)
        assert weak_sam_approx_d2(torch.eye(n)).found


def test_decider_matches_brute_force_at_n5_with_witnesses():
    gen = torch.Generator().manual_seed(0)
    no = torch.tensor(  # rows {1}, {0,2}, {0,1,2}, {0,3}, {0,1,3}: the least row sets of a "no"
        [[0, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 1, 0], [1, 1, 0, 1, 0]]
    ).bool()
    cases = [no, *(random_support(5, gen, 0.5) for _ in range(120))]
    cases += [random_support(5, gen, 0.3) for _ in range(60)]
    answers = []
    for s in cases:
        res = weak_sam_approx_d2(s)
        assert res.found == brute_decide(s)
        answers.append(res.found)
        if res.found:
            assert res.X.shape == (5, 4) and res.W_q.shape == res.W_k.shape == (4, 2)
            assert eq4_loops(sam(res.X, res.W_q, res.W_k), s)
            assert res.margin > 0
    assert not answers[0] and any(answers) and not all(answers)


def test_witnesses_at_n6_and_invariance_under_relabelling():
    gen = torch.Generator().manual_seed(1)
    for _ in range(25):
        s = random_support(6, gen)
        res = weak_sam_approx_d2(s, d_hid=5)
        perm = torch.randperm(6, generator=gen)
        assert weak_sam_approx_d2(s[perm][:, perm]).found == res.found
        assert weak_sam_approx_d2(s[:, perm]).found == res.found  # keys relabelled only
        if res.found:
            assert res.X.shape == (6, 5)
            assert eq4_loops(sam(res.X, res.W_q, res.W_k), s)


def test_d1_yes_implies_d2_yes():
    gen = torch.Generator().manual_seed(2)
    for n in (4, 5, 6):
        for _ in range(40):
            s = random_support(n, gen)
            if weak_sam_approx_d1(s, d_hid=2):
                assert weak_sam_approx_d2(s).found


def test_search_never_finds_what_the_decider_rules_out():
    no = torch.tensor(
        [[0, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 1, 0], [1, 1, 0, 1, 0]]
    ).bool()
    assert not weak_sam_approx_d2(no).found
    assert not try_weak_approx(no, 2, restarts=1, steps=300, seed=0).found
    yes = no.clone()
    yes[2] = True  # drop the row {0,1,2}: representable
    res = weak_sam_approx_d2(yes)
    assert res.found and try_weak_approx(yes, 2, seed=0).found


def test_all_ones_support_and_small_n():
    for n in (1, 2, 3):
        res = weak_sam_approx_d2(torch.ones(n, n))
        assert res.found and math.isinf(res.margin)


@pytest.mark.parametrize(
    ("kwargs", "err", "match"),
    [
        ({"S": torch.eye(7)}, ValueError, "at most 6"),
        ({"S": torch.eye(4), "d_hid": 3}, ValueError, "d_hid must be >= 4"),
        ({"S": torch.eye(4), "d_hid": 4.0}, TypeError, "d_hid"),
        ({"S": torch.zeros(3, 3)}, ValueError, "row 0 is empty"),
        ({"S": torch.full((3, 3), 2.0)}, ValueError, "zeros and ones"),
        ({"S": torch.ones(2, 3)}, ValueError, "square"),
    ],
)
def test_bad_input(kwargs, err, match):
    with pytest.raises(err, match=match):
        weak_sam_approx_d2(**kwargs)


def test_chirotope_refuses_collinear_and_float_points():
    with pytest.raises(ValueError, match="general position"):
        chirotope([[0, 0], [1, 1], [2, 2]])
    with pytest.raises(ValueError, match="integer"):
        chirotope([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
