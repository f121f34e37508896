"""Full-row attention (the rows engine and the dense-pattern route of ``sparse_attention``).

References are independent: the ``entmax`` package on hand-masked dense scores, SDPA-free
softmax written out, and gradcheck in float64.
"""

from __future__ import annotations

import math

import entmax
import pytest
import torch
from grad_checks import assert_close_with_grads

import sparseattn as sa
from sparseattn.engines.rows import rows_attention
from sparseattn.maps import ProbabilityMap
from sparseattn.patterns.fixed import Dense

pytestmark = pytest.mark.device

MAPS = {
    "entmax15": entmax.entmax15,
    "sparsemax": entmax.sparsemax,
    "entmax13": lambda s: entmax.entmax_bisect(s, 1.3, n_iter=100),
    "softmax": lambda s: torch.softmax(s, -1),
}
PROB_MAPS = {
    "entmax15": "entmax15",
    "sparsemax": "sparsemax",
    "entmax13": sa.entmax(1.3),
    "softmax": "softmax",
}


def _qkv(b=2, h=3, n=37, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g, dtype=dtype, requires_grad=True) for _ in "qkv"]


def _reference(q, k, v, ref_map, causal=False, key_padding_mask=None):
    """Dense masked attention by hand; masked scores sit far below the rest (exact zeros)."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    allowed = torch.ones(n_q, n_k, dtype=torch.bool)
    if causal:
        allowed = torch.ones(n_q, n_k).tril().bool()
    allowed = allowed.expand(*s.shape)
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask[:, None, None, :]
    s = torch.where(allowed, s, s.detach().amin() - 1e4)
    return ref_map(s) @ v


@pytest.mark.parametrize("name", list(MAPS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_dense_pattern_matches_reference(name, causal, padded):
    q, k, v = _qkv()
    kpm = torch.rand(2, 37, generator=torch.Generator().manual_seed(1)) < 0.3 if padded else None
    pattern = sa.dense().causal() if causal else sa.dense()
    out = sa.sparse_attention(q, k, v, pattern, prob_map=PROB_MAPS[name], key_padding_mask=kpm)
    ref = _reference(q, k, v, MAPS[name], causal, None if kpm is None else ~kpm)
    assert_close_with_grads(out, ref, (q, k, v), (1e-9, 1e-7), (1e-8, 1e-6))


@pytest.mark.parametrize("name", ["entmax15", "softmax"])
def test_an_all_padding_batch_item_is_refused(name):
    """True marks keys to ignore: an item with every key ignored has nothing to attend to (and
    is what a True-for-real-tokens mask gives for an unpadded item), so it is an error."""
    q, k, v = _qkv(n=9)
    kpm = torch.zeros(2, 9, dtype=torch.bool)
    kpm[1] = True
    with pytest.raises(
        ValueError, match=r"key_padding_mask ignores every key of batch item\(s\) \[1\]"
    ):
        sa.sparse_attention(q, k, v, sa.dense(), prob_map=PROB_MAPS[name], key_padding_mask=kpm)


def test_dense_pattern_builds_no_graph(monkeypatch):
    def refuse(self, q, k):
        raise AssertionError("the dense pattern's n² graph was built")

    monkeypatch.setattr(Dense, "build", refuse)
    q, k, v = _qkv(n=16)
    for name in PROB_MAPS.values():
        sa.sparse_attention(q, k, v, sa.dense(), prob_map=name).sum().backward()
        sa.sparse_attention(q, k, v, sa.dense().causal(), prob_map=name).sum().backward()


def _recording_map(seen: list[int]) -> ProbabilityMap:
    """1.5-entmax that records the size of every score tensor it is handed."""
    rho = sa.entmax(1.5)

    def fast(scores, valid):
        seen.append(scores.numel())
        return rho.forward_only(scores, valid)

    def kernel(z, valid):
        seen.append(z.numel())
        return rho._kernel(z, valid)

    return ProbabilityMap("entmax", kernel, sparse=True, fast=fast, alpha=1.5)


def test_chunks_bound_the_score_tensors():
    q, k, v = _qkv(b=1, h=2, n=64)
    seen: list[int] = []
    budget = 2 * 64 * 5  # five query rows of both heads
    out = rows_attention(q, k, v, None, _recording_map(seen), 1 / math.sqrt(8), budget=budget)
    out.sum().backward()
    assert seen and max(seen) <= budget
    torch.testing.assert_close(out, _reference(q, k, v, entmax.entmax15))


def test_graph_rows_match_dense_engine():
    q, k, v = _qkv()
    graph = sa.longformer(6, 2).build(q, k)
    ref = sa.sparse_attention(q, k, v, graph, prob_map="entmax15", engine="dense")
    out = rows_attention(q, k, v, graph, sa.entmax(1.5), 1 / math.sqrt(8), budget=200)
    torch.testing.assert_close(out, ref)
    heads = sa.split_heads(sa.window(4), sa.dense(), sa.window(2))
    ref = sa.sparse_attention(q, k, v, heads, prob_map="sparsemax", engine="dense")
    out = sa.sparse_attention(q, k, v, heads, prob_map="sparsemax", engine="rows")
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("name", ["entmax15", "sparsemax", "entmax13"])
def test_gradcheck(name):
    q, k, v = _qkv(b=1, h=2, n=7, d=3)
    rho = sa.maps.resolve_prob_map(PROB_MAPS[name])

    def f(q, k, v):
        return rows_attention(q, k, v, None, rho, 0.7, causal=True, budget=30)

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_dropout_is_replayed_in_backward():
    q, k, v = _qkv(b=1, h=2, n=8, d=3)
    kpm = torch.tensor([[True] * 6 + [False] * 2])

    def f(q, k, v):
        torch.manual_seed(3)
        return rows_attention(q, k, v, None, sa.entmax(1.5), 0.5, kpm, dropout_p=0.3, budget=40)

    assert torch.autograd.gradcheck(f, (q, k, v))
    assert (f(q, k, v) != rows_attention(q, k, v, None, sa.entmax(1.5), 0.5, kpm)).any()


def test_cross_attention_and_float32():
    q = torch.randn(1, 2, 5, 8)
    k, v = torch.randn(1, 2, 11, 8), torch.randn(1, 2, 11, 4)
    out = sa.sparse_attention(q, k, v, sa.dense(), prob_map="entmax15")
    ref = _reference(q.double(), k.double(), v.double(), entmax.entmax15).float()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_wide_rows_float32_match_package():
    q, k, v = (torch.randn(1, 2, 2048, 64) for _ in range(3))
    for name in ("entmax15", "sparsemax"):
        out = sa.sparse_attention(q, k, v, sa.dense(), prob_map=name)
        ref = _reference(q, k, v, MAPS[name])
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
