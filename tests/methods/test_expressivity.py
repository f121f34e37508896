"""Tests for sparseattn.methods.likhosherstov.expressivity (Likhosherstov et al.) and d_min.

References are independent of the code under test: loop transcriptions of eqs. (1), (2), (4),
(7), (8) and CSAM, an exhaustive LP decider for Algorithm 1, hand-evaluated eq. (6).
"""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from sparseattn.methods.likhosherstov.expressivity import (
    construct_sam,
    construction_weights,
    csam,
    least_construct_d,
    random_sparse_stochastic,
    ratio_errors,
    sam,
    theorem_d,
    theorem_slope,
    try_weak_approx,
    usam,
    weak_sam_approx_d1,
    weak_sam_approx_d1_lp,
    weakly_approximates,
)
from sparseattn.patterns import window

F64 = torch.float64


# ---------------------------------------------------------------- loop transcriptions
def usam_loops(X, W_q, W_k):
    """eq. (1): exp of (X W_q W_k^T X^T)_ij, entry by entry."""
    n, d_hid = X.shape
    d = W_q.shape[1]
    out = torch.empty(n, n, dtype=F64)
    for i in range(n):
        for j in range(n):
            s = 0.0
            for a in range(d_hid):
                for b in range(d_hid):
                    w = sum(float(W_q[a, c] * W_k[b, c]) for c in range(d))
                    s += float(X[i, a]) * w * float(X[j, b])
            out[i, j] = math.exp(s)
    return out


def ratio_checks(M, A, eps1, eps2, causal=False):
    """Eqs. (7), (8) (or (23), (24) with causal: columns j <= i only), pair by pair.
    Returns (worst eq. 7 ratio, worst eq. 8 |log error|, whether both hold)."""
    n = A.shape[0]
    worst7, worst8, ok = 0.0, 0.0, True
    for i in range(n):
        cols = range(i + 1) if causal else range(n)
        for j1 in cols:
            for j2 in cols:
                if A[i, j2] == 0:
                    continue
                ratio = float(M[i, j1] / M[i, j2])
                if A[i, j1] == 0:
                    worst7 = max(worst7, ratio)
                    ok &= ratio < eps1
                else:
                    target = float(A[i, j1] / A[i, j2])
                    worst8 = max(worst8, abs(math.log(ratio) - math.log(target)))
                    ok &= target * math.exp(-eps2) < ratio < target * math.exp(eps2)
    return worst7, worst8, ok


def weak_loops(M, S):
    """Definition 0.1, eq. (4), row by row with plain Python min/max."""
    for i in range(S.shape[0]):
        on = [float(M[i, j]) for j in range(S.shape[1]) if S[i, j]]
        off = [float(M[i, j]) for j in range(S.shape[1]) if not S[i, j]]
        if off and not min(on) > max(off):
            return False
    return True


def all_supports(n):
    rows = [r for r in itertools.product((0, 1), repeat=n) if any(r)]
    for choice in itertools.product(rows, repeat=n):
        yield torch.tensor(choice)


def relabelled(S):
    """S under every simultaneous permutation of rows and columns (the same token relabelling
    for queries and keys, i.e. permuting the rows of X): the answer cannot change."""
    for perm in itertools.permutations(range(S.shape[0])):
        p = torch.tensor(perm)
        yield S[p][:, p]


def orbit_representatives(n):
    """One support per relabelling class (the lexicographically smallest)."""
    seen = set()
    for S in all_supports(n):
        key = min(tuple(T.flatten().tolist()) for T in relabelled(S))
        if key not in seen:
            seen.add(key)
            yield torch.tensor(key).view(n, n)


# ---------------------------------------------------------------- eqs. (1), (2), CSAM
def test_sam_usam_csam_match_equations():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(5, 4, generator=g, dtype=F64)
    W_q, W_k = torch.randn(2, 4, 3, generator=g, dtype=F64) * 0.7
    U = usam_loops(X, W_q, W_k)
    torch.testing.assert_close(usam(X, W_q, W_k), U)
    torch.testing.assert_close(sam(X, W_q, W_k), U / U.sum(1, keepdim=True))  # RN(USAM)
    tril = torch.tril(U)  # M' = tril(USAM); CSAM = diag(M' 1)^-1 M'
    torch.testing.assert_close(csam(X, W_q, W_k), tril / tril.sum(1, keepdim=True))
    # no 1/sqrt(d) scale, and the row index is the query: M_ij uses query i and key j
    M = sam(X, W_q, W_k)
    i, j = 1, 3
    q, k = X[i] @ W_q, X @ W_k
    torch.testing.assert_close(M[i, j], torch.softmax(k @ q, 0)[j])


def test_weakly_approximates_and_ratio_errors_definitions():
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        M = torch.softmax(torch.randn(6, 6, generator=g, dtype=F64) * 3, 1)
        A = torch.rand(6, 6, generator=g, dtype=F64) * (torch.rand(6, 6, generator=g) < 0.5)
        A[:, 0] += 0.1  # a nonzero in every row
        S = A > 0
        assert weakly_approximates(M, S) == weak_loops(M, S)
        e = ratio_errors(M, A)
        w7, w8, _ = ratio_checks(M, A, 1.0, 1.0)
        assert e.eps1 == pytest.approx(w7, rel=1e-12)
        assert e.eps2 == pytest.approx(w8, rel=1e-9, abs=1e-12)
    # a hand case: row 0 keeps {0, 1} above 2; row 1 fails
    M = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]], dtype=F64)
    M = torch.cat([M, torch.tensor([[0.2, 0.3, 0.5]], dtype=F64)])
    S = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    assert not weakly_approximates(M, S)
    S[1] = torch.tensor([0, 1, 1])
    assert weakly_approximates(M, S)
    e = ratio_errors(M, S.double())
    assert e.eps1 == pytest.approx(max(0.2 / 0.3, 0.1 / 0.3))
    assert e.eps2 == pytest.approx(max(math.log(0.5 / 0.3), math.log(0.6 / 0.3), math.log(2.5)))


# ---------------------------------------------------------------- Algorithm 1
def test_algorithm1_is_invariant_under_relabelling_n3():
    for S in all_supports(3):
        for d_hid in (1, 2):
            answers = {weak_sam_approx_d1(T, d_hid) for T in relabelled(S)}
            assert len(answers) == 1, (S.tolist(), d_hid)


def test_algorithm1_agrees_with_lp_on_every_support_up_to_n3():
    """Every S with n <= 3 up to relabelling (with the invariance test above: every S)."""
    answers = set()
    for n in (1, 2, 3):
        for S in orbit_representatives(n):
            for d_hid in (1, 2):
                lp = weak_sam_approx_d1_lp(S, d_hid)
                assert weak_sam_approx_d1(S, d_hid) == lp.found, (S.tolist(), d_hid)
                if lp.found:  # the witness itself is checked through eq. (2) and Def. 0.1
                    assert lp.W_q.shape == (d_hid, 1)
                    assert weak_loops(sam(lp.X, lp.W_q, lp.W_k), S)
                answers.add((d_hid, lp.found))
    assert answers == {(1, True), (1, False), (2, True), (2, False)}


@pytest.mark.slow
def test_algorithm1_agrees_with_lp_on_every_support_n4():
    """All 15^4 = 50625 supports with n = 4 (about an hour of LPs on 2 busy cores)."""
    for S in all_supports(4):
        for d_hid in (1, 2):
            assert weak_sam_approx_d1(S, d_hid) == weak_sam_approx_d1_lp(S, d_hid).found


def test_algorithm1_agrees_with_lp_on_random_n4():
    g = torch.Generator().manual_seed(4)
    counts = {True: 0, False: 0}
    for t in range(120):
        density = (0.3, 0.5, 0.75)[t % 3]
        S = torch.rand(4, 4, generator=g) < density
        S[torch.arange(4), torch.randint(0, 4, (4,), generator=g)] = True
        d_hid = 1 + t % 3
        lp = weak_sam_approx_d1_lp(S, d_hid)
        assert weak_sam_approx_d1(S, d_hid) == lp.found, (S.int().tolist(), d_hid)
        counts[lp.found] += 1
    assert min(counts.values()) >= 10  # both yes and no instances were exercised


def test_algorithm1_printed_steps_9_10_miss_a_representable_pattern():
    S = torch.tensor([[0, 0, 1], [1, 0, 0], [1, 1, 1]])
    # representable with d = d_hid = 1: x = (-1, 1, 2), W_q W_k = -1
    X = torch.tensor([[-1.0], [1.0], [2.0]], dtype=F64)
    assert weak_loops(sam(X, torch.ones(1, 1, dtype=F64), -torch.ones(1, 1, dtype=F64)), S)
    assert weak_sam_approx_d1_lp(S, 1).found
    assert weak_sam_approx_d1(S, 1)
    assert not weak_sam_approx_d1(S, 1, literal=True)  # K2 = {1}: T = K2, V \ K2 do not fit
    # relabelled so that K2 = {0} (the other component): the printed steps say True
    perm = torch.tensor([1, 0, 2])
    assert weak_sam_approx_d1(S[perm][:, perm], 1, literal=True)


def test_algorithm1_simple_cases():
    assert weak_sam_approx_d1(torch.ones(5, 5), 1)  # K0 empty
    assert weak_sam_approx_d1(torch.eye(2), 1)  # x = (1, -1), W_q W_k = 1
    band = window(3).graph(6).to_dense()  # sliding windows are pairwise non-nested
    assert not weak_sam_approx_d1(band, 1) and not weak_sam_approx_d1(band, 5)
    prefix = torch.ones(6, 6).tril()  # nested prefixes: one chain
    assert weak_sam_approx_d1(prefix, 1)


# ---------------------------------------------------------------- d > 1: search
def test_try_weak_approx_finds_a_window_witness():
    S = window(4).graph(16).to_dense()
    res = try_weak_approx(S, 2, seed=0)
    assert res.found and res.margin > 0
    M = sam(res.X, res.W_q, res.W_k)  # recomputed here, not taken from the result
    assert weak_loops(M, S) and weakly_approximates(M, S)
    assert res.W_q.shape == (4, 2) and res.X.shape == (16, 4)


def test_try_weak_approx_never_claims_impossible():
    S = window(4).graph(10).to_dense()
    assert not weak_sam_approx_d1(S, 2)  # Algorithm 1: impossible at d = 1
    res = try_weak_approx(S, 1, restarts=1, steps=100, seed=0)
    assert not res.found and res.message == "not found within budget" and res.X is None


# ---------------------------------------------------------------- Theorem 0.4 / Corollary 0.7
def b_loops(A, eps1, eps2):
    """eq. (9) entry by entry."""
    n = A.shape[0]
    B = torch.zeros(n, n, dtype=F64)
    for i in range(n):
        alpha = min(float(A[i, j]) for j in range(n) if A[i, j] > 0)
        for j in range(n):
            if A[i, j] > 0:
                B[i, j] = math.log(float(A[i, j]) / (eps1 * alpha)) + eps2
    return B


def test_construct_sam_meets_eqs_7_8_checked_from_sam():
    A = random_sparse_stochastic(32, 2, 2.0, seed=3)
    eps1, eps2 = 0.25, 2.0
    res = construct_sam(A, 56, eps1, eps2, d_hid=60, seed=0)
    assert res.success and res.draws <= 32
    M = sam(res.X, res.W_q, res.W_k)  # independent of res.M and res.eps1/eps2
    w7, w8, ok = ratio_checks(M, A, eps1, eps2)
    assert ok and w7 < eps1 and w8 < eps2
    assert weak_loops(M, A > 0)  # Remark 0.5
    assert res.X.shape == (32, 60) and res.W_q.shape == (60, 56)
    torch.testing.assert_close(res.X[:, 56:], torch.zeros(32, 4, dtype=F64))  # eq. (15)
    # eqs. (16), (17): W_q, W_k do not depend on A
    other = construct_sam(random_sparse_stochastic(32, 1, 3.0, seed=9), 56, eps1, eps2, d_hid=60)
    assert torch.equal(other.W_q, res.W_q) and torch.equal(other.W_k, res.W_k)


def test_construction_is_exact_at_d_2n():
    A = random_sparse_stochastic(12, 2, 3.0, seed=5)
    res = construct_sam(A, 24, 0.1, 0.3, redraws=1, seed=1)
    logits = (res.X @ res.W_q) @ (res.X @ res.W_k).T
    torch.testing.assert_close(logits, b_loops(A, 0.1, 0.3), atol=1e-10, rtol=0)  # Y Y^T = I
    assert res.success


def test_construction_weights_are_eqs_16_17():
    W_q, W_k = construction_weights(4, 6)
    X = torch.arange(18, dtype=F64).reshape(3, 6)
    # X W_q W_k^T X^T = X1 X2^T with X1 = X[:, :2], X2 = X[:, 2:4]
    torch.testing.assert_close((X @ W_q) @ (X @ W_k).T, X[:, :2] @ X[:, 2:4].T)


def test_construct_csam_corollary_0_7():
    A = random_sparse_stochastic(24, 1, 2.0, seed=2, causal=True)
    assert torch.equal(A, A.tril())
    eps1, eps2 = 0.25, 2.0
    d, res = least_construct_d(A, eps1, eps2, range(8, 49, 8), causal=True)
    assert res.success and res.causal and d <= 48
    M = csam(res.X, res.W_q, res.W_k)
    assert torch.equal(M.triu(1), torch.zeros_like(M))
    w7, w8, ok = ratio_checks(M, A, eps1, eps2, causal=True)
    assert ok
    with pytest.raises(ValueError, match="lower triangular"):
        construct_sam(A.T.contiguous(), 8, eps1, eps2, causal=True)


def eq18_worst(logits, B, causal=False):
    """Lemma 0.6, eq. (18): max over i and j1 != j2 of |L_ij1 - L_ij2 - B_ij1 + B_ij2|, which is
    the largest spread max_j - min_j of (L - B)_i over the row (columns j <= i when causal)."""
    worst = 0.0
    for i, row in enumerate((logits - B).tolist()):
        cols = row[: i + 1] if causal else row
        worst = max(worst, max(cols) - min(cols))
    return worst


def ratio_worst(M, A, causal=False):
    """Eqs. (7), (8) (causal: (23), (24)) row by row in O(n^2): the worst zero/nonzero ratio
    max_{A=0} M / min_{A!=0} M and the worst pair error max - min of log(M / A) over nonzeros."""
    worst7 = worst8 = 0.0
    for i, (m_row, a_row) in enumerate(zip(M.tolist(), A.tolist(), strict=True)):
        cols = range(i + 1) if causal else range(len(a_row))
        on = [j for j in cols if a_row[j] > 0]
        off = [m_row[j] for j in cols if a_row[j] == 0]
        if off:
            worst7 = max(worst7, max(off) / min(m_row[j] for j in on))
        r = [math.log(m_row[j] / a_row[j]) for j in on]
        worst8 = max(worst8, max(r) - min(r))
    return worst7, worst8


def _theorem_at_its_own_d(A, d, eps1, eps2, draws, causal):
    """The construction at d = eq. (6): eqs. (7)/(8) (or (23)/(24)) from M and eq. (18) from
    L = X W_q W_k^T X^T, then the per-draw rate of Lemma 0.6 over ``draws`` single-draw runs."""
    n = A.shape[0]
    B = b_loops(A, eps1, eps2)
    res = construct_sam(A, d, eps1, eps2, seed=0, causal=causal)
    M = (csam if causal else sam)(res.X, res.W_q, res.W_k)
    w7, w8 = ratio_worst(M, A, causal)
    logits = res.X @ res.W_q @ res.W_k.T @ res.X.T
    assert res.success and w7 < eps1 and w8 < eps2
    assert eq18_worst(logits, B, causal) < eps2
    hits = 0
    for seed in range(draws):  # each run draws one Y: its X either meets eq. (18) or not
        one = construct_sam(A, d, eps1, eps2, redraws=1, seed=seed, causal=causal)
        hits += eq18_worst(one.X @ one.W_q @ one.W_k.T @ one.X.T, B, causal) < eps2
    assert hits / draws >= 1 / (n + 2)  # Lemma 0.6
    return hits


def test_theorem_0_4_at_its_own_d_smallest_feasible_n():
    """Issue 16 item 5: Theorem 0.4 applied where it makes a claim, d = eq. (6) <= 2n. For
    k = 1, gamma = 2, eps = (0.9, 20) the least such n is 310 (d = 620); at n = 320, d = 624.
    k = 1 makes eq. (8) vacuous (one nonzero per row), so eqs. (7) and (18) carry the test;
    k = 2 needs n >= 1577 (the slow test). Causal: the only lower-triangular, right stochastic,
    1-nonzero-bounded A is the identity (row i must use column i, the others being taken)."""
    n, k, gamma, eps1, eps2 = 320, 1, 2.0, 0.9, 20.0
    d = theorem_d(n, k, gamma, eps1, eps2)
    assert d == 624 <= 2 * n
    assert (
        theorem_d(310, k, gamma, eps1, eps2) == 620 and theorem_d(309, k, gamma, eps1, eps2) > 618
    )
    A = random_sparse_stochastic(n, k, gamma, seed=0)
    assert _theorem_at_its_own_d(A, d, eps1, eps2, draws=12, causal=False) == 12
    eye = torch.eye(n, dtype=F64)
    assert _theorem_at_its_own_d(eye, d, eps1, eps2, draws=4, causal=True) == 4


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
def test_theorem_0_4_at_its_own_d_with_two_nonzeros(causal):
    """k = 2 (causal: one permutation plus the diagonal, at most 2 nonzeros per row and column),
    gamma = 2, eps = (0.9, 20) at the least n with eq. (6) <= 2n: n = 1577, d = 3154 = 2n."""
    n, gamma, eps1, eps2 = 1577, 2.0, 0.9, 20.0
    d = theorem_d(n, 2, gamma, eps1, eps2)
    assert d == 3154 <= 2 * n and theorem_d(n - 1, 2, gamma, eps1, eps2) > 2 * (n - 1)
    A = random_sparse_stochastic(n, 1 if causal else 2, gamma, seed=1, causal=causal)
    assert int((A > 0).sum(1).max()) == 2 and int((A > 0).sum(0).max()) <= 2
    assert _theorem_at_its_own_d(A, d, eps1, eps2, draws=2, causal=causal) == 2


def test_construct_sam_reports_failure_honestly():
    A = random_sparse_stochastic(24, 1, 2.0, seed=0)
    res = construct_sam(A, 2, 0.1, 0.5, redraws=4, seed=0)
    assert not res.success and res.draws == 4
    _, _, ok = ratio_checks(sam(res.X, res.W_q, res.W_k), A, 0.1, 0.5)
    assert not ok


def test_theorem_d_by_hand():
    # n=512, k=1, gamma=2, eps1=0.1, eps2=1: c = ln2 + ln10 + 1 = 3.99573;
    # 16 c^2 (2 ln 512 + ln 511 + ln 2) = 255.454 * 19.4061 = 4957.38 -> 2 * 4958
    assert theorem_d(512, 1, 2.0, 0.1, 1.0) == 9916
    # n=16, k=2, gamma=3, eps1=eps2=0.5: c = (ln3 + ln2)/0.5 + 1 = 4.58352;
    # 64 c^2 (2 ln 16 + ln 15 + ln 2) = 1344.55 * 8.94641 = 12028.9 -> 2 * 12029
    assert theorem_d(16, 2, 3.0, 0.5, 0.5) == 24058
    # n=1000, k=3, gamma=1, eps1=0.01, eps2=2: c = ln100/2 + 1 = 3.30259;
    # 144 c^2 (2 ln 1000 + ln 999 + ln 2) = 1570.63 * 21.4148 = 33635.4 -> 2 * 33636
    assert theorem_d(1000, 3, 1.0, 0.01, 2.0) == 67272
    # the slope in ln n that the d_min plots compare against: 2 * 16 k^2 c^2 * (2 + 1)
    n1, n2 = 10**6, 10**7
    secant = (theorem_d(n2, 2, 3.0, 0.5, 0.5) - theorem_d(n1, 2, 3.0, 0.5, 0.5)) / math.log(10)
    assert theorem_slope(2, 3.0, 0.5, 0.5) == pytest.approx(96 * 4 * 4.58351893845611**2)
    assert secant == pytest.approx(theorem_slope(2, 3.0, 0.5, 0.5), rel=1e-3)


def test_random_sparse_stochastic_is_in_the_theorem_class():
    A = random_sparse_stochastic(40, 3, 2.5, seed=7)
    torch.testing.assert_close(A.sum(1), torch.ones(40, dtype=F64))
    assert int((A > 0).sum(0).max()) <= 3 and int((A > 0).sum(1).max()) <= 3
    for i in range(40):
        row = A[i][A[i] > 0]
        assert float(row.max() / row.min()) <= 2.5 + 1e-12


# ---------------------------------------------------------------- validation
def test_bad_inputs_name_the_argument():
    A = random_sparse_stochastic(8, 1, 2.0)
    with pytest.raises(ValueError, match="A must be a non-empty square"):
        construct_sam(A[:, :5], 4, 0.1, 1.0)
    with pytest.raises(ValueError, match="eps1"):
        construct_sam(A, 4, 1.5, 1.0)
    with pytest.raises(ValueError, match="eps2"):
        construct_sam(A, 4, 0.1, 0.0)
    with pytest.raises(ValueError, match="^d must"):
        construct_sam(A, 0, 0.1, 1.0)
    with pytest.raises(ValueError, match="^d must be even"):
        construct_sam(A, 3, 0.1, 1.0)
    with pytest.raises(ValueError, match="d_hid"):
        construct_sam(A, 4, 0.1, 1.0, d_hid=2)
    with pytest.raises(ValueError, match="A must be finite"):
        construct_sam(A.masked_fill(A > 0, math.nan), 4, 0.1, 1.0)
    with pytest.raises(ValueError, match="S needs at least one 1"):
        weak_sam_approx_d1(torch.zeros(3, 3), 1)
    with pytest.raises(ValueError, match="d_hid"):
        weak_sam_approx_d1(torch.eye(3), 0)
    with pytest.raises(ValueError, match="^d must"):
        try_weak_approx(torch.eye(3), 0)
    with pytest.raises(ValueError, match="^n must"):
        theorem_d(1, 1, 2.0, 0.1, 1.0)
    with pytest.raises(ValueError, match="gamma"):
        theorem_d(8, 1, 0.5, 0.1, 1.0)
    with pytest.raises(ValueError, match="W_q"):
        sam(
            torch.randn(4, 3, dtype=F64), torch.randn(2, 2, dtype=F64), torch.randn(2, 2, dtype=F64)
        )


# ---------------------------------------------------------------- the d_min experiment
def test_dmin_experiment_writes_and_resumes(tmp_path):
    from sparseattn.lab.experiments.dmin import DminConfig, run

    config = DminConfig(ns=(8, 16), draws=2, d_step=4, out_dir=str(tmp_path), progress=False)
    first = run(config)
    folder = tmp_path / config.run_name()
    assert {p.name for p in folder.iterdir()} == {"config.json", "metrics.json", "dmin.png"}
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["complete"] and len(metrics["cells"]) == 4
    for cell in metrics["cells"].values():
        assert 4 <= cell["d_min"] <= 2 * cell["n"] and cell["d_min"] % 2 == 0
        assert cell["eps1_achieved"] < 0.25 and cell["eps2_achieved"] < 2.0
    fit = first["summary"]["1"]["fit"]
    assert fit is not None and "slope" in fit
    again = run(config)  # every cell finished: nothing is recomputed
    assert again["cells"] == first["cells"]
    with pytest.raises(ValueError, match="different config"):
        run(DminConfig(ns=(8,), draws=1, out_dir=str(tmp_path), run=config.run_name()))


def test_coarse_to_fine_scan_follows_its_rule():
    """Issue 16 item 4: with per-d seeds, success(d) is fixed; the ascending scan returns the
    least d that succeeds, the coarse-to-fine scan the least success at or below the first
    succeeding coarse value, above the last failing one. Reference: success(d) of every d from
    construct_sam with the same seed, scanned by hand."""
    for n, k, seed, causal in ((40, 1, 0, False), (48, 2, 1, False), (40, 1, 3, True)):
        A = random_sparse_stochastic(n, k, 2.0, seed=seed, causal=causal)
        grid = list(range(4, 2 * n + 1, 4))
        ok = {
            v: construct_sam(
                A,
                v,
                0.25,
                2.0,
                redraws=n,
                seed=torch.Generator().manual_seed(seed * 100_003 + v),
                causal=causal,
            ).success
            for v in grid
        }
        assert least_construct_d(A, 0.25, 2.0, grid, seed=seed, causal=causal)[0] == min(
            v for v in grid if ok[v]
        )
        for coarse in (3, 8):
            lo = 0
            for hi in [*range(coarse - 1, len(grid), coarse), len(grid) - 1]:
                if ok[grid[hi]]:
                    expect = next(v for v in grid[lo : hi + 1] if ok[v])
                    break
                lo = hi + 1
            d, res = least_construct_d(A, 0.25, 2.0, grid, seed=seed, coarse=coarse, causal=causal)
            assert d == expect and res.success


def test_least_construct_d_device_argument():
    A = random_sparse_stochastic(16, 1, 2.0, seed=0)
    assert least_construct_d(A, 0.25, 2.0, device="cpu")[0] == least_construct_d(A, 0.25, 2.0)[0]
    with pytest.raises(ValueError, match="device"):
        least_construct_d(A, 0.25, 2.0, device="nonsense")
    with pytest.raises(ValueError, match="coarse"):
        least_construct_d(A, 0.25, 2.0, coarse=0)
    from sparseattn.lab.experiments.dmin import DminConfig

    with pytest.raises(ValueError, match="device"):
        DminConfig(device="nonsense").validate()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            DminConfig(device="cuda").validate()


def test_dmin_summary_bound_fits_and_causal_k():
    """The theory columns: min(eq. 6, 2n), where eq. (6) <= 2n, k + 1 for causal A; both fits'
    slope, intercept and R² against numpy least squares."""
    import numpy as np

    from sparseattn.lab.experiments.dmin import DminConfig, summarise

    cells = {}
    for i, (n, d) in enumerate([(512, 160), (1024, 190), (2048, 226), (3072, 250), (1024, 196)]):
        cells[str(i)] = {"q": 1.0, "n": n, "draw": i, "d_min": d}
    for causal, k_theory in ((False, 1), (True, 2)):
        config = DminConfig(ns=(512, 1024, 2048, 3072), eps1=0.9, eps2=20.0, causal=causal)
        s = summarise(config, cells)["1"]
        assert s["k_in_theory"] == k_theory
        for row in s["table"]:
            eq6 = theorem_d(row["n"], k_theory, 2.0, 0.9, 20.0)
            assert row["theorem_d"] == eq6 and row["bound"] == min(eq6, 2 * row["n"])
            assert row["theorem_applies"] == (eq6 <= 2 * row["n"])
        expect = [n for n in config.ns if theorem_d(n, k_theory, 2.0, 0.9, 20.0) <= 2 * n]
        assert s["theorem_applies_at"] == expect
        ns = np.array([c["n"] for c in cells.values()], dtype=float)
        ds = np.array([c["d_min"] for c in cells.values()], dtype=float)
        for key, x in (("fit", np.log(ns)), ("fit_sqrt", np.sqrt(ns))):
            slope, intercept = np.polyfit(x, ds, 1)
            r2 = 1 - ((ds - slope * x - intercept) ** 2).sum() / ((ds - ds.mean()) ** 2).sum()
            assert s[key]["slope"] == pytest.approx(slope)
            assert s[key]["intercept"] == pytest.approx(intercept)
            assert s[key]["r2"] == pytest.approx(r2)
    assert theorem_d(1024, 2, 2.0, 0.9, 20.0) > 2048 >= theorem_d(1024, 1, 2.0, 0.9, 20.0)


def test_cli_bound_and_dmin(tmp_path):
    from typer.testing import CliRunner

    from sparseattn.lab.cli import app

    runner = CliRunner()
    out = runner.invoke(
        app, ["expressivity", "bound", "--n", "512", "--eps1", "0.1", "--eps2", "1"]
    )
    assert out.exit_code == 0 and "9916" in out.output
    args = ["expressivity", "dmin", "--n", "8", "--draws", "1", "--out-dir", str(tmp_path)]
    out = runner.invoke(app, args)
    assert out.exit_code == 0, out.output
    assert list(tmp_path.glob("*/metrics.json"))
    args = ["expressivity", "weak", "--pattern", "window", "--param", "w=4", "--n", "10"]
    out = runner.invoke(app, [*args, "--d", "1"])
    assert out.exit_code == 0 and "no" in out.output and "Algorithm 1" in out.output
