"""``hf.attention_sparsity`` counts the exact zeros of sparse maps (issue 28, item 6).

The reference count is independent of the engines: each layer's scores are captured
(``capture_attention``) and the ``entmax`` package's map is applied to them in float64 on the
allowed real pairs; its zeros among the real pairs are the expected sparsity.
"""

from __future__ import annotations

import math

import entmax
import pytest
import torch
from tiny_models import WIDE_BERT, tiny_bert, tiny_llama

import sparseattn as sa
from sparseattn import hf

PACKAGE = {"entmax15": entmax.entmax15, "sparsemax": entmax.sparsemax}


def _bert(spread: float = 1.0):
    """A tiny BERT; ``spread`` scales its query projections (wider scores: sparser maps, as
    in a trained model)."""
    model = tiny_bert(**WIDE_BERT)
    for layer in model.encoder.layer:
        layer.attention.self.query.weight.data *= spread
    return model


def _expected(records, rho, causal=False):
    """Per layer: 1 − (non-zero weights of the package's map) / (real pairs the model allows)."""
    nonzero, pairs = {}, {}
    for r in records:
        s = r.scores.double().masked_fill(~r.allowed, -math.inf)
        s = s.masked_fill(~r.allowed.any(-1, keepdim=True), 0.0)  # padding rows: not counted
        p = PACKAGE[rho](s, dim=-1)
        keep = ~r.key_padding_mask  # the record's mask is True for padding
        real = keep[:, None, :, None] & keep[:, None, None, :]
        if causal:
            real = real & torch.ones(s.shape[-2:], dtype=torch.bool).tril()
        real = real.expand_as(p)
        nonzero[r.layer] = nonzero.get(r.layer, 0) + int(((p > 0) & real).sum())
        pairs[r.layer] = pairs.get(r.layer, 0) + int(real.sum())
    return {layer: 1 - nonzero[layer] / pairs[layer] for layer in pairs}


@pytest.mark.parametrize(
    ("pattern", "rho", "engine"),
    [
        (sa.dense(), "entmax15", "auto"),  # full rows, no graph
        (sa.longformer(16, 2), "sparsemax", "block"),
        (sa.window(24), "entmax15", "gather"),
    ],
)
def test_an_encoder_counts_the_zeros_of_a_sparse_map(pattern, rho, engine):
    """Padded batch: before, ``attention_sparsity`` gave 0.0 for entmax on the dense pattern
    (the graph's sparsity) although most weights are exactly zero."""
    model = _bert(spread=30.0)
    ids = torch.randint(1, 100, (2, 48), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 48, dtype=torch.long)
    mask[1, 30:] = 0
    hf.sparsify(model, pattern, rho, engine=engine, count_weights=True)
    with torch.no_grad(), hf.capture_attention(model) as records:
        model(input_ids=ids, attention_mask=mask)
    weights = hf.attention_sparsity(model)
    graph = hf.attention_sparsity(model, of="graph")
    expected = _expected(records, rho)
    assert weights == pytest.approx(expected, abs=2e-3)
    assert all(weights[layer] > graph[layer] + 0.2 for layer in weights)
    if pattern == sa.dense():
        assert graph == pytest.approx({0: 0.0, 1: 0.0})


def test_a_decoder_with_grouped_queries_counts_the_zeros():
    """A Llama (two query heads per key/value head: the queries are stacked) with a causal
    window and 1.5-entmax."""
    model = tiny_llama()
    ids = torch.randint(1, 100, (2, 64), generator=torch.Generator().manual_seed(0))
    hf.sparsify(model, sa.sliding_window(16, 2), "entmax15", engine="block", count_weights=True)
    with torch.no_grad(), hf.capture_attention(model) as records:
        model(input_ids=ids)
    expected = _expected(records, "entmax15", causal=True)
    assert hf.attention_sparsity(model, reset=True) == pytest.approx(expected, abs=2e-3)
    assert hf.attention_sparsity(model) == {}


def test_softmax_weights_and_graph_agree_and_of_is_checked():
    model = _bert()
    hf.sparsify(model, sa.window(8))
    with torch.no_grad():
        model(input_ids=torch.randint(1, 100, (1, 40)))
    assert hf.attention_sparsity(model) == hf.attention_sparsity(model, of="graph")
    with pytest.raises(ValueError, match="of"):
        hf.attention_sparsity(model, of="edges")


def test_the_zeros_of_a_sparse_map_are_counted_only_when_asked(monkeypatch):
    """Counting a sparse map's non-zeros costs one more pass of the attention per call, so a
    model counts them only with ``count_weights=True``: without it the pass never runs, the
    graph is still counted, and ``of="weights"`` refuses the layers it could not count (a
    softmax layer's weights are its graph's); switching the count on starts the counts again."""
    from sparseattn.hf import adapter

    model = _bert(spread=30.0)
    ids = torch.randint(1, 100, (2, 48), generator=torch.Generator().manual_seed(0))
    hf.sparsify(model, sa.window(16))
    hf.sparsify(model, sa.dense(), "entmax15", layers=[1])
    with monkeypatch.context() as patched, torch.no_grad():
        patched.setattr(adapter, "nonzero_weights", lambda *a, **k: pytest.fail("a pass ran"))
        model(input_ids=ids)
    graph = hf.attention_sparsity(model, of="graph")
    assert sorted(graph) == [0, 1] and graph[1] == 0.0
    with pytest.raises(ValueError, match=r"layers \[1\] .*count_weights=True"):
        hf.attention_sparsity(model)
    hf.sparsify(model, layers=[], count_weights=True)
    assert hf.attention_sparsity(model, of="graph") == {}  # started again
    with torch.no_grad():
        model(input_ids=ids)
    weights = hf.attention_sparsity(model)
    assert weights[0] == graph[0] and weights[1] > 0.5
    hf.sparsify(model, layers=[])  # None: the setting stays
    assert hf.attention_sparsity(model) == weights
    with pytest.raises(TypeError, match="count_weights"):
        hf.sparsify(model, layers=[], count_weights=1)


def test_counting_under_autocast():
    """Under bf16 autocast the layers run in bf16; the support counts stay float32 (exact
    integers), so the sparsity is that of the bf16 weights: close to the float32 run's."""
    model = _bert(spread=30.0)
    ids = torch.randint(1, 100, (2, 48), generator=torch.Generator().manual_seed(0))
    hf.sparsify(model, sa.dense(), "entmax15", count_weights=True)
    with torch.no_grad():
        model(input_ids=ids)
        exact = hf.attention_sparsity(model, reset=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=ids)
    assert hf.attention_sparsity(model) == pytest.approx(exact, abs=0.03)


@pytest.mark.parametrize("n", [50, 64, 130])
def test_real_key_counts_from_block_pairs_equal_an_edge_by_edge_count(n):
    """The accounting counts each row's real keys from the graph's block pairs (whole pairs by
    block, partial ones edge by edge): equal to counting every edge, for token-level and block
    layouts, per-head and per-item graphs, queries at an offset, lengths off the block."""
    from sparseattn.graph import AttentionGraph
    from sparseattn.hf.accounting import _real_key_counts

    gen = torch.Generator().manual_seed(n)
    q = torch.randn(1, 4, n, 8, generator=gen)
    per_item = torch.rand(3, 1, n, n, generator=gen) < 0.1
    graphs = [
        *(p.build(q, q) for p in (sa.window(10), sa.longformer(16, 3), sa.strided(7))),
        sa.bigbird_blocks(2, 1, heads=4, seed=1, max_seqlen=512).build(q, q),
        sa.sliding_window(8, 2).build(q[:, :, :5], q),
        AttentionGraph.from_dense(per_item | torch.eye(n, dtype=torch.bool)),
    ]
    for graph in graphs:
        real = torch.rand(3, graph.n_k, generator=gen) < 0.8
        g_b, g_h = (1,) * (2 - len(graph.batch_shape)) + graph.batch_shape
        dense = graph.to_dense().reshape(g_b, g_h, graph.n_q, graph.n_k)
        expected = (dense & real.view(-1 if g_b > 1 else 3, 1, 1, graph.n_k)).sum(-1)
        got = _real_key_counts(graph, real, 3)
        assert torch.equal(got, expected.double().expand(3, g_h, graph.n_q))
