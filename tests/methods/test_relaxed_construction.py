"""Yun et al. Theorem 1 step 3 (appendix F.2): Lemma 7 with ρ[t·] for σ_H, through
sparse_attention in float64, checked against the exact hardmax interpreter (Fractions) and a
plain-Python transcription of the relaxed head ψ̃."""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import pytest
import torch

import sparseattn as sa
from sparseattn.methods.yun import yun_contextual_mapping
from sparseattn.methods.yun.construction import SelectiveShift
from sparseattn.methods.yun.relaxed import (
    _phi_relu,
    check_float64_ids,
    exact_threshold,
    format_relaxed_summary,
    format_relaxed_table,
    grid_inputs,
    hardmax_margin,
    prefix_max,
    relaxed_attention,
    relaxed_context_ids,
    relaxed_error_table,
    step3_eta,
    step3_temperature,
    value_mapping,
)

HALF = Fraction(1, 2)


def strided_cycle():
    return sa.cycle(sa.strided(2, 1), sa.strided(2, 2))


@pytest.fixture(scope="module")
def small():
    """STRIDED w=2 at n = 4, d = 1, δ = 1/2: 16 inputs, its exact ids and its margin ζ_H."""
    cm = yun_contextual_mapping(strided_cycle(), 4, 1, HALF)
    h = grid_inputs(cm)
    exact = torch.tensor([[float(v) for v in cm.context_ids(x)] for x in h], dtype=torch.float64)
    return cm, h, exact, hardmax_margin(cm, h)


def error(small, prob_map, t):
    cm, h, exact, _ = small
    return float((relaxed_context_ids(cm, strided_cycle(), h, prob_map, t) - exact).abs().max())


@pytest.mark.parametrize(
    "patterns,n,d,delta",
    [(strided_cycle(), 4, 1, HALF), (sa.star(1), 5, 1, HALF), (strided_cycle(), 3, 2, HALF)],
)
def test_hardmax_through_sparse_attention_gives_the_exact_ids(patterns, n, d, delta):
    cm = yun_contextual_mapping(patterns, n, d, delta)
    assert check_float64_ids(cm) <= 53
    h = grid_inputs(cm)
    got = relaxed_context_ids(cm, patterns, h, "hardmax", 1.0)
    for ids, x in zip(got.tolist(), h, strict=True):
        assert [Fraction(v) for v in ids] == cm.context_ids(x)  # bit for bit


@pytest.mark.parametrize("prob_map", ["softmax", "sparsemax", "entmax15"])
@pytest.mark.parametrize("engine", ["dense", "gather"])
def test_one_relaxed_selective_shift_matches_a_transcription_of_f2(small, prob_map, engine):
    cm, h, _, _ = small
    layer = next(x for x in cm.layers if isinstance(x, SelectiveShift))
    one = dataclasses.replace(cm, layers=(layer,))
    t = 3.0
    got = relaxed_context_ids(one, strided_cycle(), h, prob_map, t, engine=engine)
    for ids, x in zip(got.tolist(), h, strict=True):
        z = [float(v) for v in cm.column_ids(x)]
        for k, keys in enumerate(cm.attend[layer.layer]):
            heads = [
                psi_tilde(prob_map, [z[j] for j in keys], t * (z[k] - float(b)))
                for b in (layer.b_lo, layer.b_hi)
            ]
            assert ids[k] == pytest.approx(z[k] + float(layer.c) * (heads[0] - heads[1]), abs=1e-9)


def psi_tilde(prob_map: str, values: list[float], scale: float) -> float:
    """ψ̃ = Σ_j v_j ρ[scale · v]_j by hand: softmax; sparsemax and 1.5-entmax by bisection on τ."""
    v = [scale * x for x in values]
    if prob_map == "softmax":
        top = max(v)
        e = [math.exp(x - top) for x in v]
        weights = [x / sum(e) for x in e]
    else:
        power, half = (1, 1.0) if prob_map == "sparsemax" else (2, 0.5)
        lo, hi = half * max(v) - 1, half * max(v)
        for _ in range(200):
            tau = (lo + hi) / 2
            total = sum(max(half * x - tau, 0.0) ** power for x in v)
            lo, hi = (tau, hi) if total > 1 else (lo, tau)
        weights = [max(half * x - lo, 0.0) ** power for x in v]
        weights = [w / sum(weights) for w in weights]
    return sum(w * x for w, x in zip(weights, values, strict=True))


def test_softmax_error_decays_like_exp_of_minus_zeta_h_t(small):
    _, _, _, zeta_h = small
    errors = [error(small, "softmax", t) for t in (4, 8, 16, 32, 48, 64)]
    assert all(b < a for a, b in zip(errors, errors[1:], strict=False))
    rate = math.log(errors[-2] / errors[-1]) / 16  # ψ̃'s runner-up weight ~ exp(−t ζ_H)
    assert 0.8 * float(zeta_h) < rate < 1.2 * float(zeta_h)


@pytest.mark.parametrize("prob_map", ["softmax", "sparsemax", "entmax15"])
@pytest.mark.parametrize("margin", ["run", "delta^2/2"])
def test_f2_bound_holds_at_assumption2_t_with_the_true_margin(small, prob_map, margin):
    cm, _, _, zeta_h = small
    zeta = float(zeta_h) if margin == "run" else float(cm.delta) ** 2 / 2
    t, _ = step3_temperature(cm, prob_map, zeta)
    assert error(small, prob_map, t) <= float(cm.delta) / 4  # F.2: |g̃_c − g_c| ≤ δ̃/4


@pytest.mark.parametrize("prob_map", ["softmax", "sparsemax", "entmax15"])
def test_the_papers_margin_delta_over_2_is_too_large(small, prob_map):
    """F.2 takes ζ = δ/2, but a selective shift's score margin is |z_k − b_Q|·(key gap) = δ²/2."""
    cm, _, _, zeta_h = small
    assert zeta_h == cm.delta**2 / 2 < cm.delta / 2
    t, _ = step3_temperature(cm, prob_map, float(cm.delta) / 2)
    assert error(small, prob_map, t) > float(cm.delta) / 4


@pytest.mark.parametrize("prob_map,alpha", [("sparsemax", 2.0), ("entmax15", 1.5)])
def test_sparse_maps_are_exactly_hardmax_from_a_finite_t(small, prob_map, alpha):
    _, _, _, zeta_h = small
    threshold = exact_threshold(prob_map, zeta_h)
    assert threshold == 1 / ((alpha - 1) * float(zeta_h))
    assert error(small, prob_map, threshold) == 0.0
    assert error(small, prob_map, 4 * threshold) == 0.0
    assert error(small, prob_map, 0.9 * threshold) > 1.0
    assert exact_threshold("softmax", zeta_h) is None


def test_hardmax_margin_is_at_least_delta_squared_over_2():
    for patterns, n, d in [(strided_cycle(), 3, 2), (sa.star(1), 4, 1)]:
        cm = yun_contextual_mapping(patterns, n, d, HALF)
        assert hardmax_margin(cm, grid_inputs(cm)) >= HALF**2 / 2


def test_step3_eta_is_the_least_of_f2s_three_choices():
    cm = yun_contextual_mapping(strided_cycle(), 4, 1, HALF)
    n, s, delta = 4, cm.hops, 0.5
    omega = (
        delta**n
        / (s * n)
        * math.log1p(delta ** (s * (n + 1) + n) * delta / (2 ** (s + 3) * s**s * n ** (s + 1)))
    )
    assert step3_eta(cm) == pytest.approx(omega, rel=1e-12)


def test_table_rows_shrink_with_t_and_end_exact():
    table = relaxed_error_table(strided_cycle(), 4, 1, HALF, ts=(2.0, 8.0, 32.0, 256.0))
    assert table.rows[0].prob_map == "hardmax" and table.rows[0].max_error == 0.0
    for name in ("softmax", "sparsemax", "1.5-entmax"):
        rows = [r for r in table.rows if r.prob_map == name]
        assert rows[0].max_error > 1.0 and not rows[0].within_bound
        assert rows[-1].max_error < 1e-6 and rows[-1].within_bound
        if name != "softmax":  # one-hot at t = 256 > 1/((α − 1)ζ_H): exactly hardmax
            assert rows[-1].max_error == 0.0
        assert rows[-1].property_7_1 and rows[-1].property_7_2
        assert any("t_A2(ζ_H)" in r.label for r in rows)
        assert rows[-1].value_error < 1e-6 and rows[0].value_error > 1.0
    assert "| softmax |" in format_relaxed_table(table)
    summary = format_relaxed_summary(table, ts=(2.0, 256.0)).splitlines()
    assert summary[0] == "| t | softmax | sparsemax | 1.5-entmax |"
    assert summary[3].startswith("| 256 | **") and summary[-1].startswith("| exact from here | — |")


def test_refusals():
    big = yun_contextual_mapping(sa.cycle(sa.strided(3, 1), sa.strided(3, 2)), 8, 1, HALF)
    with pytest.raises(ValueError, match="53"):
        check_float64_ids(big)
    with pytest.raises(ValueError, match="1/2"):
        check_float64_ids(yun_contextual_mapping(sa.star(1), 3, 1, Fraction(1, 3)))
    cm = yun_contextual_mapping(strided_cycle(), 4, 1, HALF)
    h = grid_inputs(cm)
    with pytest.raises(ValueError, match="patterns"):
        relaxed_context_ids(cm, sa.star(1), h, "softmax", 1.0)
    with pytest.raises(ValueError, match="t"):
        relaxed_context_ids(cm, strided_cycle(), h, "softmax", 0.0)


@pytest.mark.parametrize("patterns,n", [(sa.star(1), 5), (strided_cycle(), 4)])
def test_ids_pass_eq10s_bound_but_stay_below_the_float64_bound(patterns, n):
    """Eq. (10) ends with z̃_{γ(n)} ≤ δ^{−nd} − δ; its own middle line gives (n − 1 + δ)δ^{−nd},
    and eq. (11) n δ^{−nd} − δ: the ids overshoot the first and respect the last."""
    cm = yun_contextual_mapping(patterns, n, 1, HALF)
    c = 2 * cm.hops * n * 2 ** (n + 1)
    largest = max(max(cm.context_ids(x)) for x in grid_inputs(cm))
    assert c**cm.hops * 2**n < largest < c**cm.hops * n * 2**n
    assert 2 ** (check_float64_ids(cm) - 1) < c**cm.hops * n * 2**n * 2


# --------------------------------------------------------------------------- Lemma 8 / F.3
def prefix_max_by_hand(cm, x):
    """f̄(G)_k = max_{j ≤ k} G_{r,j} per row r, from the Fractions of H − E."""
    g = [[v - cm.embedding[k] for v in col] for k, col in enumerate(x)]
    return [[float(max(g[j][r] for j in range(k + 1))) for r in range(cm.d)] for k in range(cm.n)]


@pytest.fixture(scope="module")
def two_dim():
    """STRIDED w=2 at n = 3, d = 2, δ = 1/2 (64 inputs) with Lemma 8 for f̄ = prefix max."""
    cm = yun_contextual_mapping(strided_cycle(), 3, 2, HALF)
    h = grid_inputs(cm)
    targets = torch.tensor([prefix_max_by_hand(cm, x) for x in h], dtype=torch.float64)
    return cm, h, targets, value_mapping(cm, h, targets)


def test_prefix_max_matches_by_hand(two_dim):
    cm, h, targets, _ = two_dim
    g = torch.tensor([[[float(v) for v in col] for col in x] for x in h], dtype=torch.float64)
    embedding = torch.tensor(cm.embedding, dtype=torch.float64)[None, :, None]
    assert torch.equal(prefix_max(g - embedding), targets)


@pytest.mark.parametrize("relu", [False, True])
def test_lemma8_maps_the_exact_ids_to_the_targets(two_dim, relu):
    cm, h, targets, values = two_dim
    assert len(values.ids) == len(h) * cm.n  # n δ^{-dn} layers (E.3)
    z = relaxed_attention(cm, strided_cycle(), h, "hardmax", 1.0)
    assert torch.equal(values(z, relu=relu), targets)


def test_lemma8_passes_the_id_error_through_row_one_only(two_dim):
    """F.3: with |g̃_c − g_c| ≤ δ/4, g̃_v(g̃_c(H)) − f̄(G) is that error, in row 1 only."""
    cm, h, targets, values = two_dim
    z = relaxed_attention(cm, strided_cycle(), h, "softmax", 64.0)
    exact = [[[float(v) for v in col] for col in cm.attention(x)] for x in h]
    error = z - torch.tensor(exact, dtype=torch.float64)
    assert 0 < error.abs().max() <= 0.125 and (error[..., 1:] == 0).all()
    out = values(z)
    assert torch.allclose(out - targets, error, atol=1e-4)
    assert (out[..., 1:] == targets[..., 1:]).all()


def test_four_relus_are_f3s_trapezoid():
    delta = 0.5
    for x in [-1.0, -0.25, -0.2, -0.125, 0.0, 0.1, 0.125, 0.2, 0.25, 1.0]:
        if abs(x) >= delta / 2:
            want = 0.0
        elif abs(x) <= delta / 4:
            want = 1.0
        else:
            want = -4 * abs(x) / delta + 2
        got = float(_phi_relu(torch.tensor(x, dtype=torch.float64), delta))
        assert got == pytest.approx(want, abs=1e-12)
