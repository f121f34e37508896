"""AttentionGraph: conversions and set algebra against boolean masks (hypothesis)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sparseattn as sa
from sparseattn.graph import AttentionGraph


@st.composite
def masks(draw, batch_shape=None):
    n_q = draw(st.integers(1, 9))
    n_k = draw(st.integers(1, 9))
    shape = batch_shape if batch_shape is not None else draw(st.sampled_from([(), (2,), (2, 3)]))
    seed = draw(st.integers(0, 10_000))
    p = draw(st.floats(0.0, 1.0))
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(*shape, n_q, n_k, generator=gen) < p


@settings(max_examples=60, deadline=None)
@given(masks())
def test_dense_round_trip_and_counts(mask):
    graph = AttentionGraph.from_dense(mask)
    assert torch.equal(graph.to_dense(), mask)
    edges = mask.sum((-1, -2))
    if mask.dim() == 2:
        assert graph.num_edges == int(edges)
        assert graph.density == pytest.approx(float(edges) / mask[0].numel() / mask.shape[0])
    else:
        assert torch.equal(graph.num_edges, edges)
    index, valid = graph.to_neighbours()
    assert AttentionGraph.from_neighbours(index, valid, mask.shape[-1]) == graph
    assert torch.equal(graph.degrees, mask.sum(-1))


@settings(max_examples=60, deadline=None)
@given(masks(batch_shape=()), masks(batch_shape=()), st.integers(0, 2))
def test_union_intersection_match_boolean_algebra(a, b, shape_case):
    n_q, n_k = a.shape
    b = b[:n_q, :n_k] if b.shape[0] >= n_q and b.shape[1] >= n_k else (torch.rand(n_q, n_k) < 0.5)
    if shape_case == 1:  # broadcast a static graph against a per-head one
        b = torch.stack([b, ~b, b & a])
    ga, gb = AttentionGraph.from_dense(a), AttentionGraph.from_dense(b)
    assert torch.equal((ga | gb).to_dense(), a | b)
    assert torch.equal((ga & gb).to_dense(), a & b)
    assert (ga | gb) == (gb | ga)
    assert (ga & gb) == (gb & ga)


@settings(max_examples=40, deadline=None)
@given(masks(batch_shape=()))
def test_csr_block_layout_allows_and_tril(mask):
    graph = AttentionGraph.from_dense(mask)
    assert torch.equal(graph.to_csr().to_dense() > 0, mask)
    block = 2
    n_q, n_k = mask.shape
    layout = torch.zeros(-(-n_q // block), -(-n_k // block), dtype=torch.bool)
    for i, j in mask.nonzero().tolist():
        layout[i // block, j // block] = True
    assert torch.equal(graph.to_block_layout(block), layout)
    qi, kj = torch.meshgrid(torch.arange(n_q), torch.arange(n_k), indexing="ij")
    assert torch.equal(graph.allows(qi, kj), mask)
    if n_q == n_k:
        tril = graph.tril()
        assert torch.equal(tril.to_dense(), mask.tril()) and tril.causal


def test_causal_density_uses_triangle():
    n = 10
    graph = sa.window(4).causal().graph(n)
    edges = int(graph.to_dense().sum())
    assert graph.density == pytest.approx(edges / (n * (n + 1) / 2))
    assert sa.window(4).graph(n).density == pytest.approx(
        int(sa.window(4).graph(n).to_dense().sum()) / n**2
    )
    assert sa.dense().causal().graph(n).sparsity == pytest.approx(0.0)


def test_indexing_and_expand():
    mask = torch.rand(2, 3, 5, 6) < 0.5
    graph = AttentionGraph.from_dense(mask)
    assert torch.equal(graph[1, 2].to_dense(), mask[1, 2])
    assert torch.equal(graph[1].to_dense(), mask[1])
    static = AttentionGraph.from_dense(mask[0, 0])
    assert torch.equal(static.expand((2, 3)).to_dense(), mask[0, 0].expand(2, 3, 5, 6))
    with pytest.raises(ValueError, match="cannot expand"):
        graph.expand((4, 3))
    with pytest.raises(IndexError):
        graph[2]
    with pytest.raises(ValueError, match="unbatched"):
        graph.to_csr()


def test_bad_graph_inputs():
    with pytest.raises(TypeError, match="bool"):
        AttentionGraph.from_dense(torch.ones(3, 3))
    with pytest.raises(ValueError, match="key indices"):
        AttentionGraph.from_neighbours(torch.tensor([[0, 5]]), None, n_k=3)
    with pytest.raises(ValueError, match="different sizes"):
        sa.window(2).graph(4) | sa.window(2).graph(5)
