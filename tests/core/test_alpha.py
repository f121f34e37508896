"""α as a tensor: ``entmax(alpha_tensor)``, its gradient in α, the engines, ``learn_alpha``.

Reference: the ``entmax`` package's ``entmax_bisect`` (which differentiates in α, Correia et
al. 2019) on dense masked scores, and gradcheck in float64.
"""

from __future__ import annotations

import math

import entmax
import pytest
import torch
from grad_checks import assert_close_with_grads

import sparseattn as sa
from sparseattn import fastmaps

pytestmark = pytest.mark.device


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _alpha(shape, seed=1):
    return (
        1.1 + 1.3 * torch.rand(shape, generator=_gen(seed), dtype=torch.float64)
    ).requires_grad_()


@pytest.mark.parametrize("shape", [(3, 1, 1), (2, 3, 5, 1), ()])
def test_map_and_alpha_gradient_match_entmax_bisect(shape):
    s = torch.randn(2, 3, 5, 40, generator=_gen(), dtype=torch.float64, requires_grad=True)
    alpha = _alpha(shape)
    p = sa.entmax(alpha)(s)
    ref = entmax.entmax_bisect(s, alpha.expand(2, 3, 5, 1), n_iter=200)
    torch.testing.assert_close(p, ref, atol=1e-12, rtol=1e-10)
    g = torch.randn(p.shape, generator=_gen(2), dtype=torch.float64)
    got = torch.autograd.grad((p * g).sum(), (s, alpha))
    want = torch.autograd.grad((ref * g).sum(), (s, alpha))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8)


def test_gradcheck_in_scores_and_alpha():
    s = torch.randn(2, 3, 6, generator=_gen(), dtype=torch.float64, requires_grad=True)
    alpha = _alpha((2, 1, 1))
    valid = torch.rand(2, 3, 6, generator=_gen(3)) > 0.3
    valid[..., 0] = True
    assert torch.autograd.gradcheck(lambda s, a: sa.entmax(a)(s, valid), (s, alpha))


def test_fastmaps_per_row_alpha_equals_fixed_alpha():
    s = torch.randn(16, 1200, generator=_gen())  # long enough for the tiled start
    for a in (1.5, 2.0, 1.25, 3.0):
        fixed = fastmaps.entmax_rows(s, None, a)
        per_row = fastmaps.entmax_rows(s, None, torch.full((16, 1), a))
        torch.testing.assert_close(per_row, fixed, atol=2e-6, rtol=1e-5)
    mixed = torch.linspace(1.05, 2.8, 16)[:, None]
    ref = entmax.entmax_bisect(s.double(), mixed.double(), n_iter=100).float()
    torch.testing.assert_close(fastmaps.entmax_rows(s, None, mixed), ref, atol=1e-5, rtol=1e-4)


def _attention_reference(q, k, v, alpha, allowed):
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = torch.where(allowed, s, s.detach().amin() - 1e4)
    b, h, n = q.shape[:3]
    return entmax.entmax_bisect(s, alpha.expand(b, h, n, 1), n_iter=200) @ v


PATTERNS = {
    "window": sa.window(9),
    "longformer": sa.longformer(6, 2),
    "causal": sa.window(5).causal(),
    "heads": sa.split_heads(sa.window(4), sa.dense(), sa.window(2)),
    "dense": sa.dense(),
}


@pytest.mark.parametrize("engine", ["dense", "block", "rows", "auto"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("shape", [(3, 1, 1), (2, 3, 45, 1)])
def test_engines_give_the_alpha_gradient(engine, pattern, shape):
    q, k, v = (
        torch.randn(2, 3, 45, 8, generator=_gen(i), dtype=torch.float64, requires_grad=True)
        for i in range(3)
    )
    alpha = _alpha(shape)
    pat = PATTERNS[pattern]
    out = sa.sparse_attention(q, k, v, pat, prob_map=sa.entmax(alpha), engine=engine)
    allowed = sa.attention_weights(q, k, pat, prob_map="softmax") > 0
    ref = _attention_reference(q, k, v, alpha, allowed)
    g = torch.randn(out.shape, generator=_gen(9), dtype=torch.float64)
    assert_close_with_grads(out, ref, (q, k, v, alpha), (1e-10, 1e-8), (1e-9, 1e-7), g=g)


def test_block_engine_gradcheck_with_alpha():
    q, k, v = (
        torch.randn(1, 2, 7, 2, generator=_gen(i), dtype=torch.float64, requires_grad=True)
        for i in range(3)
    )
    alpha = _alpha((2, 1, 1))

    def f(q, a):
        return sa.sparse_attention(q, k, v, sa.window(4), prob_map=sa.entmax(a), engine="block")

    assert torch.autograd.gradcheck(f, (q, alpha), fast_mode=True)


def test_learn_alpha_module(device):
    torch.manual_seed(0)
    layer = sa.SparseAttention(16, 4, sa.dense(), "entmax15", learn_alpha=True)
    layer = layer.to(device, torch.float64)
    torch.testing.assert_close(layer.alpha, torch.full((4,), 1.5, dtype=torch.float64))
    assert any(name == "alpha_logit" for name, _ in layer.named_parameters())
    x = torch.randn(2, 12, 16, dtype=torch.float64, generator=_gen())
    out = layer(x)
    # by hand: projections, per-head entmax_bisect, output projection
    q, k, v = layer.qkv(x).view(2, 12, 3, 4, 4).permute(2, 0, 3, 1, 4)
    s = q @ k.transpose(-1, -2) / 2.0
    ref = entmax.entmax_bisect(s, layer.alpha.view(1, 4, 1, 1).expand(2, 4, 12, 1), n_iter=200)
    ref = layer.out((ref @ v).transpose(1, 2).reshape(2, 12, 16))
    torch.testing.assert_close(out, ref)
    g = torch.randn(out.shape, generator=_gen(5), dtype=torch.float64)
    (got,) = torch.autograd.grad((out * g).sum(), layer.alpha_logit)
    (want,) = torch.autograd.grad((ref * g).sum(), layer.alpha_logit)
    torch.testing.assert_close(got, want)
    assert got.abs().min() > 0


def test_learn_alpha_trains_with_a_sparse_pattern(device):
    torch.manual_seed(0)
    layer = sa.SparseAttention(16, 2, sa.window(6), sa.entmax(1.3), learn_alpha=True).to(device)
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    before = layer.alpha.detach().clone()
    x = torch.randn(2, 20, 16)
    layer(x).square().mean().backward()
    opt.step()
    assert (layer.alpha.detach() != before).all() and (layer.alpha > 1).all()


def test_validation():
    with pytest.raises(ValueError, match="alpha"):
        sa.entmax(torch.tensor([1.5, 1.0]))
    with pytest.raises(ValueError, match="alpha"):
        sa.entmax(torch.tensor([1.5, math.nan]))
    with pytest.raises(TypeError, match="alpha"):
        sa.entmax(torch.tensor([2, 3]))
    with pytest.raises(ValueError, match="alpha"):
        sa.entmax(torch.full((4, 1, 1), 1.5))(torch.randn(2, 3, 5, 7))
    with pytest.raises(ValueError, match="learn_alpha"):
        sa.SparseAttention(16, 2, sa.window(6), "softmax", learn_alpha=True)
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="alpha"):
        sa.sparse_attention(
            q, q, q, sa.window(2), prob_map=sa.entmax(torch.full((2, 1, 1), 1.5)), engine="gather"
        )
