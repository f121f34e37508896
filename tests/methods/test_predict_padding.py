"""Predicted patterns honour key padding (issue 16 item 8): on real tokens a padded batch gives the
graph of the unpadded sequences — for every predictor, for PredictedPattern.build with a mask, and
for PredictedPattern inside ``hf.sparsify`` on a padded batch. References: quantization and
Routing written out on the real tokens alone (ranks by sorting, sets by loops), and the unpadded
sequence run on its own."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from sparseattn import hf
from sparseattn.methods.sparsefinder.baselines import (
    BigBirdBaseline,
    LongformerBaseline,
    LSHBaseline,
    RoutingBaseline,
    StridedBaseline,
    WindowBaseline,
)
from sparseattn.methods.sparsefinder.pattern import PredictedPattern, key_padding
from sparseattn.methods.sparsefinder.predictors import (
    ChunkedPredictor,
    DistancePredictor,
    FixedParts,
    KMeansPredictor,
    QuantizationPredictor,
)
from sparseattn.methods.sparsefinder.projection import QKProjection

LENGTHS = (12, 9, 5)
N, H, D = 12, 2, 4


def _padded(seed: int = 0):
    """q, k (3, H, 12, D) whose padding positions hold large, unrelated vectors; valid (3, 12)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(len(LENGTHS), H, N, D, generator=gen) for _ in range(2))
    valid = torch.arange(N) < torch.tensor(LENGTHS)[:, None]
    pad = ~valid[:, None, :, None]
    q = torch.where(pad, 4 * torch.randn(q.shape, generator=gen) + 3, q)
    k = torch.where(pad, 4 * torch.randn(k.shape, generator=gen) - 3, k)
    return q, k, valid


def _projection() -> QKProjection:
    """A QKProjection with fixed weights (the padding logic does not depend on how it was fit)."""
    gen = torch.Generator().manual_seed(5)
    proj = QKProjection(r=3)
    proj.weight_q_, proj.weight_k_ = (
        torch.randn(H, D, 3, generator=gen),
        torch.randn(H, D, 3, generator=gen),
    )
    proj.bias_q_, proj.bias_k_ = torch.randn(H, 3, generator=gen), torch.randn(H, 3, generator=gen)
    return proj


def _predictors():
    gen = torch.Generator().manual_seed(3)
    q_train, k_train = torch.randn(H, 200, D, generator=gen), torch.randn(H, 200, D, generator=gen)
    proj = _projection()
    chunk_v2 = ChunkedPredictor(3, 2, proj, "v2", n_clusters=2)
    chunk_v2.centroids_ = torch.randn(H, 2, 3, generator=gen)
    return {
        "quantization": QuantizationPredictor(3),
        "quantization, projected": QuantizationPredictor(2, proj),
        "k-means": KMeansPredictor(3, 2).fit(q_train, k_train),
        "distance": DistancePredictor(2.0),
        "reformer": LSHBaseline(4, seed=1),
        "reformer, separate": LSHBaseline(4, seed=1, mode="separate"),
        "routing": RoutingBaseline(3).fit(q_train, k_train),
        "chunked v1": ChunkedPredictor(3, 2, proj, "v1"),
        "chunked v2": chunk_v2,
        "window": WindowBaseline(2),
        "bigbird": BigBirdBaseline(2, seed=1),
        "longformer": LongformerBaseline(2, seed=1),
        "strided": StridedBaseline(3),
    }


def _real(graph: torch.Tensor, b: int) -> torch.Tensor:
    """(B, H, n, n) → sequence b's real × real block (H, L, L)."""
    length = LENGTHS[b]
    return graph[b, :, :length, :length]


@pytest.mark.parametrize("name", list(_predictors()))
def test_padded_equals_unpadded_on_real_tokens(name):
    """PredictedPattern.build with the key padding mask: each sequence's real × real block is the
    graph of that sequence run alone (fixed parts with its own last token included)."""
    predictor = _predictors()[name]
    q, k, valid = _padded()
    pattern = PredictedPattern(predictor, FixedParts(1, True, True))
    padded = pattern.build(q, k, key_padding_mask=~valid).to_dense()
    for b, length in enumerate(LENGTHS):
        alone = pattern.build(q[b : b + 1, :, :length], k[b : b + 1, :, :length]).to_dense()[0]
        assert torch.equal(_real(padded, b), alone), (name, b)
    # padding keys are never predicted (only fixed parts may reach them)
    bare = predictor.predict(q, k, valid).to_dense().expand(len(LENGTHS), H, N, N)
    if name not in ("window", "bigbird", "longformer", "strided"):
        assert not bool(bare[~valid[:, None, None, :].expand_as(bare)].any()), name


@pytest.mark.parametrize("name", ["chunked v1", "chunked v2"])
def test_chunked_padding_joins_no_chunk(name):
    """Lengths 5 and 9 with chunks of 3 leave a chunk of real tokens and padding: real queries
    get no edge to its padding keys and padding queries no edges at all (as with the bucket
    predictors), while a real query still takes every real key of a chunk it attends."""
    predictor = _predictors()[name]
    q, k, valid = _padded()
    graph = predictor.predict(q, k, valid).to_dense().expand(len(LENGTHS), H, N, N)
    assert not bool((graph & ~valid[:, None, None, :]).any()), name
    assert not bool((graph & ~valid[:, None, :, None]).any()), name
    block = predictor.block
    for b, length in enumerate(LENGTHS):
        for start in range(0, length, block):
            keys = graph[b, :, :length, start : min(length, start + block)]
            assert torch.equal(keys.all(-1), keys.any(-1)), (name, b, start)


def test_last_global_token_is_the_last_real_one():
    q, k, valid = _padded()
    pattern = PredictedPattern(DistancePredictor(0.0), FixedParts(None, False, True))
    with key_padding(valid.long()):  # a tokenizer's 0/1 attention_mask
        graph = pattern.build(q, k).to_dense()
    for b, length in enumerate(LENGTHS):
        assert bool(graph[b, :, :length, length - 1].all())  # every real query → [SEP]
        assert bool(graph[b, :, length - 1, :length].all())


def test_without_the_mask_padding_changes_real_pairs():
    """The issue's symptom, kept as a control: with no mask quantization ranks padding among the
    real tokens and [SEP] is replaced by the padded last position."""
    q, k, valid = _padded()
    for predictor in (QuantizationPredictor(3), DistancePredictor(0.0)):
        pattern = PredictedPattern(predictor, FixedParts(None, False, True))
        blind = pattern.build(q, k).to_dense()
        seen = pattern.build(q, k, ~valid).to_dense()
        assert not torch.equal(_real(blind, 2), _real(seen, 2))


def _quantization_reference(q, k, valid, bins):
    """§4.4 on the real tokens only: per coordinate, rank by sorting (ties by position), bin
    = rank // ⌈L/β⌉; an edge where a query and a key share a bin in some coordinate."""
    out = torch.zeros(q.shape[0], q.shape[1], q.shape[2], q.shape[2], dtype=torch.bool)
    for b, h in itertools.product(range(q.shape[0]), range(q.shape[1])):
        length = int(valid[b].sum())
        size = math.ceil(length / bins)

        def bins_of(x, length=length, size=size):
            res = []
            for c in range(x.shape[-1]):
                order = sorted(range(length), key=lambda i, c=c: (float(x[i, c]), i))
                rank = {i: r for r, i in enumerate(order)}
                res.append([rank[i] // size for i in range(length)])
            return res

        bq, bk = bins_of(q[b, h]), bins_of(k[b, h])
        for i, j in itertools.product(range(length), range(length)):
            out[b, h, i, j] = any(bq[c][i] == bk[c][j] for c in range(len(bq)))
    return out


def _routing_reference(q, k, valid, centroids):
    """Routing on the real tokens only: each centroid takes its ⌈L/C⌉ most cosine-similar real
    queries and real keys; an edge inside each centroid's pair of sets."""
    out = torch.zeros(q.shape[0], q.shape[1], q.shape[2], q.shape[2], dtype=torch.bool)
    clusters = centroids.shape[1]
    for b, h in itertools.product(range(q.shape[0]), range(q.shape[1])):
        length = int(valid[b].sum())
        per = math.ceil(length / clusters)
        qn = torch.nn.functional.normalize(q[b, h, :length], dim=-1) @ centroids[h].T
        kn = torch.nn.functional.normalize(k[b, h, :length], dim=-1) @ centroids[h].T
        for m in range(clusters):
            qs = sorted(range(length), key=lambda i, m=m: -float(qn[i, m]))[:per]
            ks = sorted(range(length), key=lambda j, m=m: -float(kn[j, m]))[:per]
            for i, j in itertools.product(qs, ks):
                out[b, h, i, j] = True
    return out


def test_quantization_and_routing_rank_real_tokens_only():
    """Against the brute-force transcriptions on the real tokens: padding takes no rank and no
    bin, and the bin / cluster size is ⌈L/β⌉ / ⌈L/C⌉ with L the real length, not n."""
    q, k, valid = _padded(seed=2)
    for bins in (2, 3, 5):
        got = QuantizationPredictor(bins).predict(q, k, valid).to_dense()
        assert torch.equal(got, _quantization_reference(q, k, valid, bins)), bins
    gen = torch.Generator().manual_seed(4)
    route = RoutingBaseline(3).fit(
        torch.randn(H, 100, D, generator=gen), torch.randn(H, 100, D, generator=gen)
    )
    got = route.predict(q, k, valid).to_dense()
    assert torch.equal(got, _routing_reference(q, k, valid, route.centroids_))


def test_bad_masks_are_refused():
    q, k, valid = _padded()
    pattern = PredictedPattern(QuantizationPredictor(2))
    with pytest.raises(ValueError, match="right padding"):
        pattern.build(q, k, ~valid.flip(-1))
    with pytest.raises(ValueError, match="key_padding_mask has shape"):
        pattern.build(q, k, ~valid[:2])
    with pytest.raises(TypeError, match="key_padding_mask"):
        pattern.build(q, k, valid.float())
    with pytest.raises(TypeError, match="True for padding"):  # a tokenizer's 0/1 mask
        pattern.build(q, k, valid.long())
    with pytest.raises(ValueError, match="0/1"), key_padding(valid.long() * 2):
        pass
    with key_padding(valid[:2]), pytest.raises(ValueError, match=r"key_padding\(...\) mask"):
        pattern.build(q, k)


def _run(model, batch, records_out=None):
    """Last hidden state and each layer's allowed real pairs (B, H, n, n)."""
    with torch.no_grad(), hf.capture_attention(model) as records:
        out = model(**batch).last_hidden_state
        allowed = [r.allowed.expand(r.scores.shape).clone() for r in records]
        if records_out is not None:
            records_out.extend(records)
    return out, allowed


def test_predicted_pattern_in_hf_sparsify_on_a_padded_batch(tiny_bert):
    """A padded batch through a sparsified model: every layer's graph on real tokens and the
    real tokens' outputs equal those of each sequence run alone, with or without a
    ``key_padding`` block (hf.sparsify hands the model's padding mask over itself); the same
    pattern built on the padded batch without any mask changes the real pairs (the bug)."""
    model = tiny_bert
    lengths = (20, 13)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 99, (2, 20), generator=gen)
    mask = (torch.arange(20) < torch.tensor(lengths)[:, None]).long()
    ids = ids.masked_fill(mask == 0, 0)
    head_dim = 8
    route = RoutingBaseline(3).fit(
        torch.randn(4, 100, head_dim, generator=gen), torch.randn(4, 100, head_dim, generator=gen)
    )
    for predictor in (QuantizationPredictor(3), route):
        hf.sparsify(
            model,
            PredictedPattern(predictor, FixedParts(1, True, True)),
            "entmax15",
            engine="dense",
        )
        try:
            batch = {"input_ids": ids, "attention_mask": mask}
            with key_padding(mask):
                out, allowed = _run(model, batch)
            records = []
            auto_out, auto = _run(model, batch, records)
            torch.testing.assert_close(auto_out, out)
            assert all(torch.equal(a, b) for a, b in zip(auto, allowed, strict=True))
            pattern = PredictedPattern(predictor, FixedParts(1, True, True))
            blind = [pattern.build(r.q, r.k).to_dense().expand(r.scores.shape) for r in records]
            changed = False
            for b, length in enumerate(lengths):
                alone_out, alone = _run(
                    model,
                    {
                        "input_ids": ids[b : b + 1, :length],
                        "attention_mask": mask[b : b + 1, :length],
                    },
                )
                torch.testing.assert_close(out[b, :length], alone_out[0], atol=1e-5, rtol=1e-5)
                for layer in range(2):
                    real = allowed[layer][b, :, :length, :length]
                    assert torch.equal(real, alone[layer][0]), (type(predictor), b, layer)
                    changed |= not torch.equal(blind[layer][b, :, :length, :length], real)
            assert changed  # without the mask, padding leaks into the real pairs
        finally:
            hf.restore(model)
