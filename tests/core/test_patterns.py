"""Every pattern's edge set against a brute-force O(n²) transcription of its equation.

The references below are written from the papers with 1-based indices ([n] = {1, …, n}) and
plain Python sets, independently of the library's 0-based neighbour-list construction.
"""

from __future__ import annotations

import math

import pytest
import torch

import sparseattn as sa
from sparseattn.graph import AttentionGraph

LENGTHS = [1, 2, 3, 5, 7, 16, 33, 64]
WIDTHS = [1, 2, 3, 4, 8, 40]


def to_mask(sets: dict[int, set[int]], n: int) -> torch.Tensor:
    """{k: A_k} with 1-based k and keys → bool (n, n) mask with 0-based indices."""
    mask = torch.zeros(n, n, dtype=torch.bool)
    for k, keys in sets.items():
        for j in keys:
            mask[k - 1, j - 1] = True
    return mask


def ref_window(n, w):  # Yun eq. (4), A¹
    full = set(range(1, n + 1))
    return {k: full & set(range(k - math.ceil(w / 2), k + w // 2 + 1)) for k in full}


def ref_stride(n, w):  # Yun eq. (4), A²
    full = set(range(1, n + 1))
    return {k: {j for j in full if (j - k) % w == 0} for k in full}


def ref_fixed1(n, w):  # Yun eq. (5), A¹
    full = set(range(1, n + 1))
    return {
        k: full & set(range(math.ceil(k / w) * w - w + 1, math.ceil(k / w) * w + 1)) for k in full
    }


def ref_fixed2(n, w):  # Yun eq. (5), A²
    full = set(range(1, n + 1))
    return {k: full & ({k} | set(range(w, n + 1, w))) for k in full}


def ref_star(n, w):  # Yun eq. (6)
    sets = {n: set(range(1, n + 1))}
    for k in range(1, n):
        sets[k] = {n} | {(i - 1) % (n - 1) + 1 for i in range(k - w, k + w + 1)}
    return sets


def ref_global(n, tokens):
    g = set(range(1, min(tokens, n) + 1))
    return {k: set(range(1, n + 1)) if k in g else set(g) for k in range(1, n + 1)}


def union_sets(*refs):
    return {k: set().union(*(r[k] for r in refs)) for k in refs[0]}


def check(pattern: sa.Pattern, reference: dict[int, set[int]], n: int) -> None:
    expected = to_mask(reference, n)
    graph = pattern.graph(n)
    assert torch.equal(graph.to_dense(), expected), (pattern, n)
    q, kv = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    assert torch.equal(pattern.allows(q, kv, n), expected), ("allows", pattern, n)
    # causal variant = tril of the bidirectional pattern, for the graph and the predicate
    causal = pattern.causal()
    assert torch.equal(causal.graph(n).to_dense(), expected.tril()), ("causal", pattern, n)
    assert torch.equal(causal.allows(q, kv, n), expected.tril())
    assert causal.graph(n).causal


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("w", WIDTHS)
def test_yun_patterns_match_their_equations(n, w):
    check(sa.window(w), ref_window(n, w), n)
    check(sa.strided(w, part=1), ref_window(n, w), n)
    check(sa.strided(w, part=2), ref_stride(n, w), n)
    check(sa.strided(w), union_sets(ref_window(n, w), ref_stride(n, w)), n)
    check(sa.fixed(w, part=1), ref_fixed1(n, w), n)
    check(sa.fixed(w, part=2), ref_fixed2(n, w), n)
    check(sa.fixed(w), union_sets(ref_fixed1(n, w), ref_fixed2(n, w)), n)
    check(sa.block_local(w), ref_fixed1(n, w), n)
    if n >= 2:
        check(sa.star(w), ref_star(n, w), n)


@pytest.mark.parametrize("n", LENGTHS)
def test_longformer_and_global_tokens(n):
    for w, g in [(2, 1), (4, 3), (9, 2), (40, 5)]:
        check(sa.global_tokens(g), ref_global(n, g), n)
        check(sa.longformer(w, g), union_sets(ref_window(n, w), ref_global(n, g)), n)
    explicit = {0, 3, 100}  # 0-based; positions >= n are dropped
    pos1 = {p + 1 for p in explicit if p < n}
    ref = {k: set(range(1, n + 1)) if k in pos1 else set(pos1) for k in range(1, n + 1)}
    check(sa.global_tokens(sorted(explicit)), ref, n)


@pytest.mark.parametrize("n", [1, 5, 16, 37, 64])
@pytest.mark.parametrize("block,r", [(4, 1), (8, 2), (16, 3)])
def test_bigbird_random_blocks_match_their_block_table(n, block, r):
    blocks = sa.random_blocks(r, block, seed=3)
    table = blocks.block_table(n)
    nb = -(-n // block)
    assert table.shape == (nb, min(r, nb))
    for row in table.tolist():  # distinct blocks per query block
        assert len(set(row)) == len(row) and all(0 <= b < nb for b in row)
    ref = {
        k: {j for j in range(1, n + 1) if (j - 1) // block in set(table[(k - 1) // block].tolist())}
        for k in range(1, n + 1)
    }
    check(blocks, ref, n)
    w, g = 4, 2
    big = sa.bigbird(w, g, r, block, seed=3)
    check(big, union_sets(ref_window(n, w), ref_global(n, g), ref), n)


def test_random_pattern_is_uniform_seeded_and_exact_k():
    n, k = 200, 7
    pattern = sa.random(k=k, seed=1)
    graph = pattern.graph(n)
    assert (graph.degrees == k).all()
    assert graph == sa.random(k=k, seed=1).graph(n)
    assert graph != sa.random(k=k, seed=2).graph(n)
    # uniform over keys: every key chosen about n·k/n = k times (chi-square, generous bound)
    counts = torch.bincount(graph.col, minlength=n).double()
    chi2 = ((counts - k) ** 2 / k).sum()
    assert chi2 < n + 6 * math.sqrt(2 * n)
    dense_regime = sa.random(density=0.8, seed=0).graph(20)
    assert (dense_regime.degrees == 16).all()
    q, kv = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    assert torch.equal(pattern.allows(q, kv, n), graph.to_dense())


def test_dense_pattern():
    for n in (1, 4, 9):
        check(sa.dense(), {k: set(range(1, n + 1)) for k in range(1, n + 1)}, n)


def brute_topk(q, k, keep, causal):
    scores = q @ k.transpose(-1, -2)
    n_q, n_k = scores.shape[-2:]
    mask = torch.zeros_like(scores, dtype=torch.bool)
    for b in range(scores.shape[0]):
        for h in range(scores.shape[1]):
            for i in range(n_q):
                row = [(scores[b, h, i, j].item(), j) for j in range(n_k) if not causal or j <= i]
                for _, j in sorted(row, reverse=True)[:keep]:
                    mask[b, h, i, j] = True
    return mask


@pytest.mark.parametrize("causal", [False, True])
def test_topk_keeps_the_k_largest_scores(causal):
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 11, 4), torch.randn(2, 3, 11, 4)  # continuous: no ties
    pattern = sa.topk(4).causal() if causal else sa.topk(4)
    graph = pattern.graph(11, q, k)
    assert graph.batch_shape == (2, 3)
    assert torch.equal(graph.to_dense(), brute_topk(q, k, 4, causal))
    cross = sa.topk(20).build(q, torch.randn(2, 3, 7, 4))  # k > n_k keeps all keys
    assert (cross.degrees == 7).all()
    with pytest.raises(TypeError, match="data-dependent"):
        sa.topk(3).graph(11)


def test_yun_table1_sparsity_levels():
    """Yun Table 1 (n = 256, w = 16): UNION ≈ 87%, single parts ≈ 93%, STAR ≈ 87%."""
    n, w = 256, 16
    sp = {
        "strided union": sa.strided(w).graph(n).sparsity,
        "strided A1": sa.strided(w, 1).graph(n).sparsity,
        "strided A2": sa.strided(w, 2).graph(n).sparsity,
        "fixed union": sa.fixed(w).graph(n).sparsity,
        "fixed A1": sa.fixed(w, 1).graph(n).sparsity,
        "fixed A2": sa.fixed(w, 2).graph(n).sparsity,
        "star w=15": sa.star(15).graph(n).sparsity,
    }
    # exact values, from the edge counts of the equations:
    # strided: A1 has 17 keys except near the borders (4280 edges), A2 n/w = 16 keys
    assert sp["strided A1"] == pytest.approx(1 - 4280 / 65536)  # 93.47%
    assert sp["strided A2"] == pytest.approx(1 - 16 / 256)  # 93.75%
    assert sp["strided union"] == pytest.approx(1 - 8120 / 65536)  # 87.61%
    assert sp["fixed A1"] == pytest.approx(1 - 16 / 256)  # 93.75%
    assert sp["fixed A2"] == pytest.approx(1 - (256 * 17 - 16) / 65536)  # 93.38%
    assert sp["fixed union"] == pytest.approx(1 - 7936 / 65536)  # 87.89%
    # STAR with w = 15: 255 ordinary rows of 2w + 1 + relay = 32 keys, relay row 256 keys
    assert sp["star w=15"] == pytest.approx(1 - (255 * 32 + 256) / 65536)  # 87.16%
    for name, value in sp.items():
        target = 0.87 if ("union" in name or "star" in name) else 0.93
        assert abs(value - target) < 0.01, (name, value)


def test_compositions_union_cycle_split():
    n = 40
    a, b = sa.strided(8, 1), sa.strided(8, 2)
    u = sa.union(a, b)
    assert u.graph(n) == a.graph(n) | b.graph(n)
    assert torch.equal(u.graph(n).to_dense(), a.graph(n).to_dense() | b.graph(n).to_dense())
    assert (a | b).graph(n) == u.graph(n)
    cyc = sa.cycle(a, b)
    assert [cyc[layer] for layer in range(5)] == [a, b, a, b, a]
    split = sa.split_heads(a, b)
    graph = split.graph(n, num_heads=5)  # 3 heads of a, 2 of b
    assert graph.batch_shape == (5,)
    dense = graph.to_dense()
    for h in range(5):
        expected = (a if h < 3 else b).graph(n).to_dense()
        assert torch.equal(dense[h], expected)
    head = torch.arange(5)[:, None, None]
    qi, ki = torch.arange(n)[:, None], torch.arange(n)
    assert torch.equal(split.allows_head(head, qi, ki, n, 5), dense)
    with pytest.raises(ValueError, match="do not add up"):
        sa.split_heads(a, b, sizes=(1, 1)).graph(n, num_heads=5)


@pytest.mark.parametrize(
    "factory,kwargs,error",
    [
        (sa.window, {"w": 0}, ValueError),
        (sa.window, {"w": -3}, ValueError),
        (sa.window, {"w": 2.5}, TypeError),
        (sa.strided, {"w": 0}, ValueError),
        (sa.strided, {"w": 4, "part": 3}, ValueError),
        (sa.fixed, {"w": 0}, ValueError),
        (sa.star, {"w": 0}, ValueError),
        (sa.random, {}, ValueError),
        (sa.random, {"k": 3, "density": 0.1}, ValueError),
        (sa.random, {"density": 1.5}, ValueError),
        (sa.bigbird, {"w": 4, "block": 0}, ValueError),
        (sa.longformer, {"w": 4, "global_tokens": -1}, ValueError),
        (sa.topk, {"k": 0}, ValueError),
    ],
)
def test_bad_pattern_parameters(factory, kwargs, error):
    with pytest.raises(error):
        factory(**kwargs)


def test_longformer_has_no_global_token_by_default():
    """As the Longformer model, whose global tokens come per call: window(w) alone."""
    for n in (5, 16):
        want = sa.window(4).graph(n).to_dense()
        assert torch.equal(sa.longformer(4).graph(n).to_dense(), want)
        assert torch.equal(sa.longformer(4, []).graph(n).to_dense(), want)


def test_graph_length_must_be_positive():
    with pytest.raises(ValueError, match="n must be >= 1"):
        sa.window(4).graph(0)


def test_static_graph_construction_scales_linearly():
    """Large n without an n² scan: n = 65536 would need 4·10⁹ cells as a dense mask."""
    n = 65536
    graph = sa.longformer(64, 4).graph(n)
    assert isinstance(graph, AttentionGraph)
    window_edges = 65 * n - 32 * 33  # keys i−32 … i+32 inside [0, n)
    global_edges = 2 * 4 * n - 4 * 4  # 4 full rows + 4 full columns
    overlap = 2 * (33 + 34 + 35 + 36) - 4 * 4  # window edges inside those rows/columns
    assert graph.num_edges == window_edges + global_edges - overlap
    assert graph.max_degree == n


def test_longformer_global_tokens_per_item_equal_the_dense_mask():
    """``longformer(w, mask)`` with a (B, n) bool mask (Longformer's global_attention_mask) or
    one list of positions per item: window ∪ item b's global rows and columns, a graph of
    batch shape (B, 1), on every engine; its config round-trips (JSON lists of lists)."""
    import json

    from sparseattn.engines.flex import flex_available
    from sparseattn.serialize import pattern_config, pattern_from_config

    n, bsz = 30, 3
    glob = torch.zeros(bsz, n, dtype=torch.bool)
    glob[0, 0], glob[1, [0, 7]] = True, True  # item 2: none
    pattern = sa.longformer(6, glob)
    assert pattern == sa.longformer(6, [[0], [0, 7], []])
    i = torch.arange(n)
    dense = ((i[:, None] - i[None, :]).abs() <= 3) | glob[:, None, :, None] | glob[:, None, None, :]
    assert pattern.graph(n).batch_shape == (bsz, 1)
    assert torch.equal(pattern.graph(n).to_dense(), dense)
    assert torch.equal(pattern.allows(i[:, None], i[None, :], n).expand(bsz, 1, n, n), dense)
    q, k, v = torch.randn(3, bsz, 2, n, 8, generator=torch.Generator().manual_seed(0))
    ref = sa.sparse_attention(q, k, v, sa.AttentionGraph.from_dense(dense), engine="dense")
    engines = ["block", "gather", "rows"] + (["flex"] if flex_available() is None else [])
    for engine in engines:
        out = sa.sparse_attention(q, k, v, pattern, engine=engine)
        assert float((out - ref).abs().max()) < 1e-5, engine
    config = json.loads(json.dumps(pattern_config(pattern)))
    assert pattern_from_config(config) == pattern
    with pytest.raises(ValueError, match="broadcast"):  # 3 items, a batch of 2
        sa.sparse_attention(q[:2], k[:2], v[:2], pattern)
    with pytest.raises(TypeError, match="tokens"):
        sa.longformer(6, [[0], "a"])
