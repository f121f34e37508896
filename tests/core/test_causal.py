"""Causal patterns as their papers define them, and queries at an offset (docs/causal.md).

References are brute-force transcriptions of the definitions (loops over (i, j) pairs) and,
for the offset queries, the full-length call on the dense engine sliced to its last rows.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from grad_checks import assert_close_with_grads
from torch.nn.attention.flex_attention import flex_attention

import sparseattn as sa
from sparseattn.engines.flex import graph_block_mask
from sparseattn.patterns.causal import CausalRandomBlocks

pytestmark = [pytest.mark.device, pytest.mark.guard]


# ------------------------------------------------------------------ brute-force definitions
def child_strided_1(i, j, w):  # Child et al.: the previous w tokens, including i
    return i - w < j <= i


def child_strided_2(i, j, w):  # Child et al.: (i − j) mod w = 0, j ≤ i
    return j <= i and (i - j) % w == 0


def child_fixed_1(i, j, w):  # own segment, j ≤ i
    return j <= i and j // w == i // w


def child_fixed_2(i, j, w, c):  # last c positions of every segment, j ≤ i; plus i itself
    return j == i or (j <= i and j % w >= w - c)


def causal_global(i, j, positions):
    return j <= i and (i in positions or j in positions)


def brute(pred, n):
    return torch.tensor([[bool(pred(i, j)) for j in range(n)] for i in range(n)])


def check_against(pattern, pred, n):
    want = brute(pred, n)
    graph = pattern.graph(n)
    assert graph.causal
    assert torch.equal(graph.to(want.device).to_dense(), want), (pattern, n)
    i, j = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    assert torch.equal(pattern.allows(i, j, n), want), (pattern, n)  # the mask_mod
    assert graph.possible_edges == n * (n + 1) // 2


LENGTHS = [1, 2, 7, 16, 33]


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("w", [1, 3, 4, 8])
def test_child_strided_matches_definition(n, w):
    check_against(sa.causal_strided(w, 1), lambda i, j: child_strided_1(i, j, w), n)
    check_against(sa.causal_strided(w, 2), lambda i, j: child_strided_2(i, j, w), n)
    check_against(
        sa.causal_strided(w), lambda i, j: child_strided_1(i, j, w) or child_strided_2(i, j, w), n
    )


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize(("w", "c"), [(1, 1), (4, 1), (4, 2), (5, 5), (8, 3)])
def test_child_fixed_matches_definition(n, w, c):
    check_against(sa.causal_fixed(w, 1), lambda i, j: child_fixed_1(i, j, w), n)
    check_against(sa.causal_fixed(w, 2, c=c), lambda i, j: child_fixed_2(i, j, w, c), n)
    check_against(
        sa.causal_fixed(w, c=c),
        lambda i, j: child_fixed_1(i, j, w) or child_fixed_2(i, j, w, c),
        n,
    )


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize(("w", "sinks"), [(1, 0), (4, 0), (4, 2), (3, (0, 5)), (6, (4,))])
def test_sliding_window_with_sinks_matches_definition(n, w, sinks):
    positions = set(range(sinks)) if isinstance(sinks, int) else set(sinks)
    check_against(
        sa.sliding_window(w, sinks),
        lambda i, j: child_strided_1(i, j, w) or causal_global(i, j, positions),
        n,
    )


@pytest.mark.parametrize("n", [1, 9, 40])
@pytest.mark.parametrize(("w", "g", "r", "b"), [(3, 1, 1, 4), (4, 2, 2, 8), (2, (5,), 3, 3)])
def test_causal_bigbird_matches_definition(n, w, g, r, b):
    pattern = sa.causal_bigbird(w, g, r, b, seed=7)
    rand = CausalRandomBlocks(r, b, 7)
    choice = rand.block_choice(0, (n - 1) // b)
    for qb, row in enumerate(choice.tolist()):  # the draw: distinct past blocks, min(r, qb+1)
        picked = [x for x in row if x >= 0]
        assert len(picked) == len(set(picked)) == min(r, qb + 1)
        assert all(0 <= x <= qb for x in picked)
    positions = set(range(g)) if isinstance(g, int) else set(g)
    check_against(
        pattern,
        lambda i, j: (
            child_strided_1(i, j, w)
            or causal_global(i, j, positions)
            or (j <= i and j // b in choice[i // b].tolist())
        ),
        n,
    )


def test_causal_rows_do_not_depend_on_n():
    """Row i depends on i alone: a decoder's rows are the full-length graph's rows."""
    for pattern in (
        sa.causal_strided(4),
        sa.causal_fixed(4),
        sa.sliding_window(4, 2),
        sa.causal_bigbird(3, 1, 2, 4, seed=3),
    ):
        big = pattern.graph(50).to_dense()
        for n in (1, 13, 37):
            assert torch.equal(pattern.graph(n).to_dense(), big[:n, :n]), pattern


def test_causal_bigbird_seed_changes_the_draw():
    a = sa.causal_bigbird(2, 1, 2, 4, seed=0).graph(64).to_dense()
    b = sa.causal_bigbird(2, 1, 2, 4, seed=1).graph(64).to_dense()
    assert not torch.equal(a, b)


def test_tril_reading_keeps_half_the_window():
    """The generic ``.causal()`` of Yun eq. (4) keeps ⌈w/2⌉ + 1 keys; Child's A¹ keeps w."""
    n, w = 64, 16
    assert int(sa.window(w).causal().graph(n).degrees[-1]) == w // 2 + 1
    assert int(sa.causal_strided(w, 1).graph(n).degrees[-1]) == w
    assert int(sa.sliding_window(w).graph(n).degrees[-1]) == w


def reach(masks, n):
    """Boolean reachability through the layers, with the skip connection (i reaches i)."""
    r = torch.eye(n, dtype=torch.bool, device=masks[0].device)
    for m in masks:
        r = (m.to(torch.int32) @ r.to(torch.int32)) > 0
    return r


def test_child_strided_reaches_offset_127_in_two_hops():
    """Issue 15: at n = 256, w = 16 offset 127 = 7·16 + 15 is two hops in Child's STRIDED,
    unreachable in two layers of the tril reading (it keeps offsets 0…8 and multiples of 16)."""
    n, w = 256, 16
    child = sa.causal_strided(w).graph(n).to_dense()
    tril = sa.strided(w).causal().graph(n).to_dense()
    assert reach([child, child], n)[255, 255 - 127]
    assert not reach([child], n)[255, 255 - 127]
    assert not reach([tril, tril], n)[255, 255 - 127]
    a1, a2 = (p.graph(n).to_dense() for p in sa.causal_strided(w).parts)
    assert reach([a1, a2], n)[255, 128]  # SEQUENTIAL: A¹ then A²


def test_named_and_exported():
    from sparseattn.patterns import NAMED

    for name in ("causal_strided", "causal_fixed", "sliding_window", "causal_bigbird"):
        factory, params = NAMED[name]
        assert getattr(sa, name) is factory
        assert factory(**params).is_causal


def test_bad_parameters():
    with pytest.raises(ValueError, match="w"):
        sa.causal_strided(0)
    with pytest.raises(ValueError, match="c must be at most"):
        sa.causal_fixed(4, c=5)
    with pytest.raises(ValueError, match="part"):
        sa.causal_fixed(4, part=3)
    with pytest.raises(ValueError, match="sinks"):
        sa.sliding_window(4, sinks=-1)
    with pytest.raises(TypeError, match="global_tokens"):
        sa.sliding_window(4, sinks="a")


# ------------------------------------------------------------------ queries at an offset
def causal_patterns():
    return {
        "causal_strided": sa.causal_strided(5),
        "causal_strided_2": sa.causal_strided(5, 2),
        "causal_fixed": sa.causal_fixed(5, c=2),
        "sliding_window": sa.sliding_window(6, 2),
        "causal_bigbird": sa.causal_bigbird(4, 1, 2, 8),
        "window_tril": sa.window(6).causal(),
        "longformer_tril": sa.longformer(6, 2).causal(),
        "strided_tril": sa.strided(5).causal(),
        "fixed_tril": sa.fixed(5).causal(),
        "dense_causal": sa.dense().causal(),
    }


@pytest.mark.parametrize("name", list(causal_patterns()))
def test_offset_graph_is_the_last_rows(name):
    pattern = causal_patterns()[name]
    for n in (1, 9, 40):
        full = pattern.graph(n).to_dense()
        for n_q in sorted({1, max(1, n // 3), n - 1, n} - {0}):
            graph = pattern.graph(n, n_q)
            assert (graph.n_q, graph.n_k) == (n_q, n)
            assert torch.equal(graph.to_dense(), full[n - n_q :]), (n, n_q)
            assert graph.causal
            start = n - n_q  # density's denominator counts the keys j <= i of those rows
            assert graph.possible_edges == sum(i + 1 for i in range(start, n))
        assert pattern.graph(n, 1) is pattern.graph(n, 1)  # cached per (n_k, n_q)


def test_offset_graph_does_not_build_the_full_graph():
    n = 1 << 18  # a full graph would take seconds (dense: 2^36 edges)
    for pattern in (
        sa.sliding_window(64, 4),
        sa.causal_strided(1024),
        sa.causal_fixed(1024),
        sa.window(64).causal(),
        sa.dense().causal(),
    ):
        graph = pattern.graph(n, 1)
        row = pattern.allows(n - 1, torch.arange(n), n)
        assert graph.n_q == 1 and torch.equal(graph.to(row.device).col, row.nonzero().squeeze(1))
        assert pattern.memo("graphs").keys() == [(n, 1)]


def test_offset_needs_a_causal_pattern():
    q, k = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 8, 4)
    for pattern in (sa.strided(4), sa.window(4), sa.longformer(4, 1), sa.random(k=2)):
        with pytest.raises(ValueError, match="not causal"):
            pattern.graph(8, 3)
        with pytest.raises(ValueError, match="n_q=3, n_k=8"):
            pattern.build(q, k)
    with pytest.raises(ValueError, match="n_q must be at most"):
        sa.causal_strided(4).graph(3, 8)
    with pytest.raises(ValueError, match="n_q"):
        sa.causal_strided(4).build(k, q)  # 8 queries, 3 keys
    sa.dense().build(q, k)  # cross-attention stays


def test_split_heads_and_topk_at_an_offset():
    a1, a2 = sa.causal_strided(4).parts
    split = sa.split_heads(a1, a2)
    full = split.graph(20, num_heads=2).to_dense()
    assert torch.equal(split.graph(20, num_heads=2, n_q=5).to_dense(), full[:, -5:])
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 2, 20, 8, generator=gen)
    topk = sa.topk(6).causal()
    want = topk.build(q, k).to_dense()[..., -5:, :]
    assert torch.equal(topk.build(q[..., -5:, :], k).to_dense(), want)


ENGINES = ["dense", "gather", "block", "rows", "auto"]


def qkv(n, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 2, n, 8, generator=gen, dtype=dtype) for _ in range(3)]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", list(causal_patterns()))
def test_offset_queries_equal_the_last_rows(name, engine):
    """sparse_attention(q[..., -m:, :], k, v) = the last m rows of the full call, forward and
    backward (q, k, v), for m = 1 (decoding) and a middle value (prefill in pieces)."""
    pattern = causal_patterns()[name]
    n = 40
    q, k, v = qkv(n)
    for m in (1, 17):
        g = torch.randn(2, 2, m, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(m))
        qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
        full = sa.sparse_attention(qf, kf, vf, pattern, engine="dense")[..., -m:, :]
        (full * g).sum().backward()
        qo, ko, vo = (t.clone().requires_grad_() for t in (q[..., -m:, :], k, v))
        out = sa.sparse_attention(qo, ko, vo, pattern, engine=engine)
        torch.testing.assert_close(out, full.detach())
        (out * g).sum().backward()
        torch.testing.assert_close(qo.grad, qf.grad[..., -m:, :])
        torch.testing.assert_close(ko.grad, kf.grad)
        torch.testing.assert_close(vo.grad, vf.grad)


@pytest.mark.parametrize("prob_map", ["softmax", "entmax15", "sparsemax"])
def test_dense_causal_offset_takes_full_rows(prob_map, monkeypatch):
    """dense().causal() at an offset runs on full rows (no (n_q × n_k) graph is built) and
    equals the last rows of the full call, forward and backward; SDPA's top-left causal
    triangle would not."""
    from sparseattn import attention

    pattern, n, m = sa.dense().causal(), 40, 7
    q, k, v = qkv(n)
    full = sa.sparse_attention(q, k, v, pattern, prob_map=prob_map, engine="dense")[..., -m:, :]
    monkeypatch.setattr(attention, "resolve_graph", None)  # any graph build would fail
    qo, ko, vo = (t.clone().requires_grad_() for t in (q[..., -m:, :], k, v))
    out = sa.sparse_attention(qo, ko, vo, pattern, prob_map=prob_map)
    torch.testing.assert_close(out, full)
    out.sum().backward()
    assert ko.grad[..., n - m :, :].abs().sum() > 0 and vo.grad.abs().sum() > 0
    topleft = torch.nn.functional.scaled_dot_product_attention(q[..., -m:, :], k, v, is_causal=True)
    assert not torch.allclose(topleft, full)


@pytest.mark.parametrize("m", [1, 7, 40])
def test_causal_softmax_masked_sdpa_equals_rows_engine(m, monkeypatch):
    """Causal softmax rows at an offset or with key padding go to SDPA with a boolean mask in
    chunks of queries (``_sdpa_causal``): the rows engine's outputs and gradients, with
    chunks of 3 rows, and zeros for a row that sees only padding (left padding)."""
    from sparseattn.engines import rows

    monkeypatch.setattr(rows, "MASK_BUDGET", 3 * 2 * 40)  # 3 rows of both batch items
    q, k, v = qkv(40)
    kpm = torch.zeros(2, 40, dtype=torch.bool)
    kpm[1, :36] = True  # item 1: its first 36 keys are padding
    rho = sa.softmax()
    for padding in (None, kpm):
        valid = None if padding is None else ~padding
        if padding is None and m == 40:
            continue  # no offset, no padding: is_causal
        a = [t.clone().requires_grad_() for t in (q[..., -m:, :], k, v)]
        b = [t.clone().requires_grad_() for t in (q[..., -m:, :], k, v)]
        out = rows.full_rows_attention(*a, rho, 8**-0.5, valid, causal=True)
        ref = rows.rows_attention(*b, None, rho, 8**-0.5, valid, causal=True)
        assert_close_with_grads(out, ref, a, (1e-9, 1e-7), (1e-9, 1e-7), ref_inputs=b)
        if padding is not None and m == 40:
            assert out[1, :, :36].abs().max() == 0  # rows that see padding only


@pytest.mark.parametrize("name", ["causal_strided", "sliding_window", "causal_bigbird"])
def test_offset_block_mask_equals_the_last_rows(name):
    """The flex engine's BlockMask of an offset graph (eager flex_attention; the compiled
    engine is in the slow test below)."""
    pattern = causal_patterns()[name]
    q, k, v = qkv(40, torch.float32)
    want = sa.sparse_attention(q, k, v, pattern, engine="dense")
    for m in (1, 17):
        graph = pattern.graph(40, m)
        mask = graph_block_mask(graph, 1, 1, 16, device=q.device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = flex_attention(q[..., -m:, :], k, v, block_mask=mask)
        torch.testing.assert_close(out, want[..., -m:, :], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_offset_queries_flex_engine():
    from sparseattn.engines.flex import flex_available

    if flex_available() is not None:
        pytest.skip(flex_available())
    pattern = sa.sliding_window(6, 2)
    q, k, v = qkv(40, torch.float32)
    want = sa.sparse_attention(q, k, v, pattern, engine="dense")
    with torch.no_grad():
        for m in (1, 17):
            out = sa.sparse_attention(q[..., -m:, :], k, v, pattern, engine="flex")
            torch.testing.assert_close(out, want[..., -m:, :], atol=1e-5, rtol=1e-5)
