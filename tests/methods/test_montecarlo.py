"""MCA: unbiasedness (Lemma 1), eq. 7 sample sizes, exactness limits, the Theorem 2 bound."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

import sparseattn as sa
from sparseattn.methods.mca import (
    MCAMethod,
    head_weights,
    mc_value_projection,
    mca_attention,
    reference_sample_sizes,
    sample_sizes,
)

pytestmark = [pytest.mark.device, pytest.mark.guard]


def data(b=2, n=12, d_in=20, heads=2, d_head=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, n, d_in, generator=gen, dtype=torch.float64)
    # rows of W with very different norms, so importance sampling matters
    w = torch.randn(heads, d_in, d_head, generator=gen, dtype=torch.float64)
    w = w * torch.linspace(0.1, 3.0, d_in, dtype=torch.float64)[None, :, None]
    q, k = (torch.randn(b, heads, n, 5, generator=gen, dtype=torch.float64) for _ in range(2))
    return x, w, q, k


def exact_values(x, w, bias=None):
    h = torch.einsum("bnd,hde->bhne", x, w)
    return h if bias is None else h + bias[None, :, None, :]


def test_unbiased_at_the_monte_carlo_rate():
    x, w, _, _ = data()
    exact = exact_values(x, w)
    r = torch.full((2, 2, 12), 3)
    gen = torch.Generator().manual_seed(1)
    draws = torch.stack([mc_value_projection(x, w, r, generator=gen) for _ in range(1600)])
    err_small = (draws[:100].mean(0) - exact).norm()
    err_large = (draws.mean(0) - exact).norm()
    # 16× the draws → about 4× smaller error (1/√N), allow a wide band for randomness
    assert 2.0 < err_small / err_large < 8.0
    # the mean squared error is Lemma 1's closed form (eq. 3, before the last inequality):
    # E‖H̃_j − X_j W‖² = (‖X_j‖²‖W‖_F² − ‖X_j W‖²) / r_j  ≤  ‖X_j‖²‖W‖_F² / r_j
    mse = (draws - exact).pow(2).sum(-1).mean(0)  # (B, H, n)
    w_fro2 = w.pow(2).sum((1, 2))[None, :, None]
    closed = (x.norm(dim=-1)[:, None, :] ** 2 * w_fro2 - exact.pow(2).sum(-1)) / 3
    assert 0.8 < float(mse.sum() / closed.sum()) < 1.2


def test_each_token_draws_its_own_samples_and_seed_reproduces():
    x, w, _, _ = data(b=1, n=4)
    x[0, 1] = x[0, 0]  # two identical tokens
    r = torch.full((1, 2, 4), 2)
    a = mc_value_projection(x, w, r, generator=torch.Generator().manual_seed(5))
    b = mc_value_projection(x, w, r, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(a, b)
    assert not torch.allclose(a[0, :, 0], a[0, :, 1])


def test_sample_sizes_follow_eq7():
    attn = torch.tensor([[[[0.5, 0.5, 0.0], [0.1, 0.1, 0.8], [0.3, 0.3, 0.4]]]])  # (1,1,3,3)
    r = sample_sizes(attn, alpha=0.5, d_in=10)
    # column max: 0.5, 0.5, 0.8 → (3·max/0.5)² = 9, 9, 23.04 → min(⌊·⌋, 10)
    assert r.tolist() == [[[9, 9, 10]]]
    assert sample_sizes(attn, 0.0, 10).tolist() == [[[10, 10, 10]]]
    tiny = torch.tensor([[[[1.0, 1e-6], [1.0, 0.0]]]])
    assert sample_sizes(tiny, 0.5, 10).tolist() == [[[10, 1]]]  # attended: never 0
    unattended = torch.tensor([[[[1.0, 0.0], [1.0, 0.0]]]])
    assert sample_sizes(unattended, 0.5, 10).tolist() == [[[10, 0]]]  # no query attends: 0
    with pytest.raises(ValueError, match="alpha"):
        sample_sizes(attn, -0.1, 10)


@pytest.mark.parametrize("pattern,rho", [(sa.dense(), "softmax"), (sa.window(4), "entmax15")])
def test_full_sample_size_is_exact_and_small_alpha_converges(pattern, rho):
    x, w, q, k = data(d_in=400)
    bias = torch.randn(2, 6, dtype=torch.float64)
    exact = sa.attention_weights(q, k, pattern, prob_map=rho) @ exact_values(x, w, bias)
    out = mca_attention(x, q, k, w, bias, 0.0, pattern, rho)
    torch.testing.assert_close(out.out, exact)
    assert out.macs_kept == 1.0
    gen = torch.Generator().manual_seed(0)
    errors = []
    for alpha in (2.0, 0.5, 0.2, 0.05, 1e-4):
        res = mca_attention(x, q, k, w, bias, alpha, pattern, rho, generator=gen)
        errors.append(float((res.out - exact).norm() / exact.norm()))
    assert errors[-1] == 0.0  # α small enough: every r_j = d_in
    assert errors[0] > errors[2] > errors[3] >= errors[4]


def test_theorem2_bound_holds_in_expectation():
    """E‖Ỹ_i − Y_i‖ ≤ α β ‖W_h‖_F per head; floor in eq. 7 can cost up to √2 (see module doc)."""
    x, w, q, k = data(b=1, n=16, d_in=64, heads=2, d_head=8, seed=3)
    attn = sa.attention_weights(q, k, sa.dense())
    exact = attn @ exact_values(x, w)
    beta = x.norm(dim=-1).mean()
    gen = torch.Generator().manual_seed(0)
    for alpha in (0.5, 1.0, 2.0):
        r = sample_sizes(attn, alpha, 64)  # the same r as mca_attention uses
        assert (r < 64).any()
        draws = [attn @ mc_value_projection(x, w, r, generator=gen) for _ in range(200)]
        errs = torch.stack([(y - exact).norm(dim=-1) for y in draws]).mean(0)  # E‖Ỹ_i − Y_i‖
        bound = alpha * beta * w.pow(2).sum((1, 2)).sqrt()  # (H,)
        assert (errs[0] <= math.sqrt(2) * bound[:, None]).all(), (alpha, errs.max(), bound)


def test_padding_costs_nothing_and_macs_fraction():
    x, w, q, k = data(b=2, n=10)
    keep = torch.arange(10) < torch.tensor([[6], [10]])
    res = mca_attention(
        x,
        q,
        k,
        w,
        None,
        0.5,
        sa.dense(),
        key_padding_mask=~keep,
        generator=torch.Generator().manual_seed(0),
    )
    assert (res.r[0, :, 6:] == 0).all()
    assert res.macs_kept == pytest.approx(float(res.r.sum()) / (16 * 2 * 20))


def _peaked(n=10, d_in=20, heads=2, seed=0):
    """Every query the same, keys along it with decreasing strength: 1.5-entmax puts all weight
    on the first few keys, so the others are attended by no query."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, n, d_in, generator=gen, dtype=torch.float64)
    w = torch.randn(heads, d_in, 6, generator=gen, dtype=torch.float64)
    u = torch.randn(heads, 1, 5, generator=gen, dtype=torch.float64)
    q = u.expand(heads, n, 5)[None] * 3
    strength = torch.linspace(2.0, -2.0, n, dtype=torch.float64)
    k = (u * strength[:, None])[None] + 0.05 * torch.randn(
        1, heads, n, 5, generator=gen, dtype=torch.float64
    )
    return x, w, q, k


def test_tokens_no_query_attends_get_no_samples_and_stay_exact():
    """Issue 16 item 10: r_j = 0 where every query gives token j zero weight (entmax zeros) — eq.
    7 written out per token as the reference — and the output does not depend on those tokens'
    inputs (their value rows never reach Ỹ), so skipping them is exact."""
    x, w, q, k = _peaked()
    alpha, d_in = 0.3, 20
    res = mca_attention(
        x, q, k, w, None, alpha, sa.dense(), "entmax15", generator=torch.Generator().manual_seed(0)
    )
    a = res.weights
    n = a.shape[-1]
    expected = torch.zeros_like(res.r)
    for h, j in itertools.product(range(a.shape[1]), range(n)):
        top = max(float(a[0, h, i, j]) for i in range(n))
        if top > 0:
            expected[0, h, j] = max(1, min(math.floor((n * top / alpha) ** 2), d_in))
    assert torch.equal(res.r, expected)
    unattended = (a == 0).all(-2)  # (B, H, n)
    assert bool(unattended.any()) and bool((~unattended).any())
    assert res.macs_kept == pytest.approx(float(expected.sum()) / (n * 2 * d_in))
    dead = unattended.all(1)[0]  # tokens no head attends to
    assert bool(dead.any())
    x2 = x.clone()
    x2[0, dead] = 1e3 * torch.randn(int(dead.sum()), d_in, dtype=torch.float64)
    res2 = mca_attention(
        x2, q, k, w, None, alpha, sa.dense(), "entmax15", generator=torch.Generator().manual_seed(0)
    )
    torch.testing.assert_close(res2.out, res.out)


def test_reference_accounting_counts_padding_as_free_positions():
    """The reference code's r_j, written out: n = the padded length, max over every query row
    (padding queries too), ⌊(n · max / α)²⌋ capped at d_in with no lower bound; padding keys
    (zero columns) get 0. Its average over all positions is diluted by the padding."""
    gen = torch.Generator().manual_seed(3)
    b, heads, n, d_in, alpha = 2, 2, 16, 50, 0.4
    lengths = (5, 16)
    real = torch.arange(n) < torch.tensor(lengths)[:, None]
    scores = torch.randn(b, heads, n, n, generator=gen, dtype=torch.float64) * 2
    a = torch.softmax(scores.masked_fill(~real[:, None, None, :], -math.inf), -1)
    got = reference_sample_sizes(a, alpha, d_in)
    for bb, h, j in itertools.product(range(b), range(heads), range(n)):
        top = max(float(a[bb, h, i, j]) for i in range(n))
        assert int(got[bb, h, j]) == min(math.floor((n * top / alpha) ** 2), d_in)
    assert bool((got[0, :, 5:] == 0).all())  # padding: no samples
    ours = sample_sizes(a, alpha, d_in, real)
    assert bool((ours[0, :, :5] <= got[0, :, :5]).all())  # n = 5 real tokens, not 16
    assert reference_sample_sizes(a, 0.0, d_in).unique().tolist() == [d_in]


def test_mca_hook_reports_both_accountings(tiny_bert):
    """Inside a padded BERT batch: the reference metric averages the reference r over every
    position (padding at 0), so it equals its real-token average × the real share of positions;
    ours counts real tokens only."""
    from sparseattn import hf

    model = tiny_bert
    ids = torch.randint(1, 99, (2, 24))
    mask = (torch.arange(24) < torch.tensor([[6], [9]])).long()
    hook = MCAMethod(alpha=0.5)
    hf.sparsify(model, method=hook)
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    finally:
        hf.restore(model)
    share = float(mask.sum()) / mask.numel()
    assert hook.macs_kept_reference == pytest.approx(hook.macs_kept_reference_real * share)
    assert 0 < hook.macs_kept <= 1 and 0 < hook.macs_kept_reference_real <= 1


def test_head_weights_and_bad_input(device):
    lin = torch.nn.Linear(20, 12).to(device)
    w = head_weights(lin.weight, 3)
    x = torch.randn(2, 5, 20)
    torch.testing.assert_close(
        torch.einsum("bnd,hde->bhne", x, w),
        (x @ lin.weight.T).view(2, 5, 3, 4).transpose(1, 2),
    )
    with pytest.raises(ValueError, match="divisible"):
        head_weights(lin.weight, 5)
    xx, ww, q, k = data()
    with pytest.raises(ValueError, match="x must have shape"):
        mca_attention(xx[0], q, k, ww, None, 0.1, sa.dense())


def test_mca_hook_inside_a_hugging_face_bert(tiny_bert):
    from sparseattn import hf
    from sparseattn.methods.mca import MCAMethod

    model = tiny_bert
    ids = torch.randint(1, 99, (2, 20))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[0, 15:] = 0
    with torch.no_grad():
        exact = model(input_ids=ids, attention_mask=mask).last_hidden_state
        hook = MCAMethod(alpha=0.0)
        hf.sparsify(model, method=hook)
        same = model(input_ids=ids, attention_mask=mask).last_hidden_state
        hf.sparsify(model, method="mca", alpha=2.0, seed=1, track_error=True)
        approx = model(input_ids=ids, attention_mask=mask).last_hidden_state
        hf.restore(model)
    real = mask.bool()
    torch.testing.assert_close(same[real], exact[real], atol=1e-5, rtol=1e-5)
    assert hook.macs_kept == 1.0
    assert not torch.allclose(approx[real], exact[real], atol=1e-3)
    with pytest.raises(ValueError, match="method must be one of"):
        hf.sparsify(model, method="magic")
    with pytest.raises(TypeError, match="named method"):
        hf.sparsify(model, alpha=0.2)


def test_mca_sweep_refuses_a_run_folder_with_another_configuration(tmp_path):
    from sparseattn.lab.experiments.mca import MCAConfig
    from sparseattn.lab.experiments.mca import run as run_mca
    from sparseattn.lab.results import write_json

    saved = MCAConfig(max_passages=48, run="r", out=str(tmp_path))
    write_json(tmp_path / "r" / "config.json", dataclasses.asdict(saved))
    with pytest.raises(ValueError, match="another configuration"):
        run_mca(MCAConfig(max_passages=8, run="r", out=str(tmp_path)))
