"""Sparsefinder on a decoder (issue 15 item 6): the 1.5-entmax LM teacher, causal predicted graphs,
the causal metrics (recall eq. 4, sparsity eq. 5 over n(n + 1)/2 pairs), and the pipeline end to
end. References: the `entmax` package on explicitly masked scores, dense boolean masks built by
hand, closed forms of the causal denominator, and Proposition 1 (a graph holding the gold graph
gives the full teacher's output exactly)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import entmax as entmax_pkg
import pytest
import torch

from sparseattn.graph import AttentionGraph
from sparseattn.lab.experiments import lm
from sparseattn.lab.experiments.sparsefinder_lm import (
    DECODER_METHODS,
    check_causal,
    extract_decoder_graphs,
    quick_config,
    run,
)
from sparseattn.maps import resolve_prob_map
from sparseattn.methods.sparsefinder.baselines import (
    BigBirdBaseline,
    LongformerBaseline,
    LSHBaseline,
    RoutingBaseline,
    StridedBaseline,
    WindowBaseline,
)
from sparseattn.methods.sparsefinder.evaluate import gold_summary, sparsity, sweep
from sparseattn.methods.sparsefinder.extract import GraphBatch, LayerGraphs
from sparseattn.methods.sparsefinder.pattern import PredictedPattern
from sparseattn.methods.sparsefinder.predictors import (
    DistancePredictor,
    FixedParts,
    GraphPredictor,
    KMeansPredictor,
    QuantizationPredictor,
)


def _predictors(q: torch.Tensor, k: torch.Tensor) -> dict[str, GraphPredictor]:
    """One unprojected predictor per decoder method (fitted on q, k where needed)."""
    qt, kt = q.transpose(0, 1).flatten(1, 2), k.transpose(0, 1).flatten(1, 2)  # (H, N, d)
    return {
        "window": WindowBaseline(2),
        "bigbird": BigBirdBaseline(3, seed=1),
        "longformer": LongformerBaseline(3, seed=1),
        "strided": StridedBaseline(4),
        "reformer": LSHBaseline(4, seed=1),
        "reformer_separate": LSHBaseline(4, seed=1, mode="separate"),
        "routing": RoutingBaseline(3, seed=1).fit(qt, kt),
        "sf_distance": DistancePredictor(4.0),
        "sf_quantization": QuantizationPredictor(4),
        "sf_kmeans": KMeansPredictor(3, seed=1).fit(qt, kt),
    }


def test_every_decoder_method_predicts_a_causal_graph_with_its_diagonal():
    """``PredictedPattern(...).causal()`` = tril(Ĝ ∪ fixed ∪ diagonal), by dense masks."""
    torch.manual_seed(0)
    n = 24
    q, k = torch.randn(2, 3, n, 8), torch.randn(2, 3, n, 8)
    predictors = _predictors(q, k)
    assert set(predictors) == set(DECODER_METHODS)
    below = torch.ones(n, n, dtype=torch.bool).tril()
    eye = torch.eye(n, dtype=torch.bool)
    for name, predictor in predictors.items():
        for fixed in (FixedParts(1, True, False), None):
            free = PredictedPattern(predictor, fixed).build(q, k).to_dense()
            graph = PredictedPattern(predictor, fixed).causal().build(q, k)
            mask = graph.to_dense()
            assert graph.causal, name
            assert not bool((mask & ~below).any()), f"{name}: an edge j > i"
            assert bool(mask.diagonal(dim1=-2, dim2=-1).all()), f"{name}: a row without i"
            assert torch.equal(mask, (free | eye) & below), name


def test_check_causal_counts_future_edges_and_missing_diagonals():
    torch.manual_seed(1)
    q = torch.randn(1, 2, 10, 4)
    gold = torch.zeros(1, 2, 10, 10, dtype=torch.bool)
    graphs = LayerGraphs(0, [GraphBatch(q, q, gold, torch.ones(1, 10, dtype=torch.bool))])
    free = PredictedPattern(WindowBaseline(1), None)  # |i − j| ≤ 1: 9 edges above per head
    assert check_causal(free, graphs) == {
        "future_edges": 18,
        "rows_without_diagonal": 0,
        "rows": 20,
    }
    off = PredictedPattern(StridedBaseline(3), None)  # j − i ≡ 0 mod 3 holds the diagonal
    assert check_causal(off, graphs)["future_edges"] > 0
    assert check_causal(off.causal(), graphs)["future_edges"] == 0
    # the kept attention mass against the entmax package: keys i − 1 and i of each row
    scores = (q @ q.transpose(-1, -2) / 2).masked_fill(~torch.ones(10, 10).bool().tril(), -1e9)
    p = entmax_pkg.entmax15(scores, dim=-1)
    kept = sum(float(p[..., i, max(i - 1, 0) : i + 1].sum()) for i in range(10))
    mass = check_causal(free.causal(), graphs, resolve_prob_map("entmax15"))["mass"]
    assert mass == pytest.approx(kept, rel=1e-5)


class _Fixed(GraphPredictor):
    """Returns a given dense mask (B, H, n, n) whatever q and k are."""

    def __init__(self, mask: torch.Tensor) -> None:
        self.mask = mask

    def predict(self, q, k, valid=None):
        return AttentionGraph.from_dense(self.mask)


def _layer(gold: torch.Tensor) -> LayerGraphs:
    b, h, n, _ = gold.shape
    q = torch.randn(b, h, n, 4)
    return LayerGraphs(0, [GraphBatch(q, q, gold, torch.ones(b, n, dtype=torch.bool))])


def test_recall_is_one_when_the_prediction_holds_the_causal_gold_graph():
    torch.manual_seed(2)
    n = 16
    gold = (torch.rand(2, 3, n, n) < 0.3).tril() | torch.eye(n, dtype=torch.bool)
    extra = torch.rand(2, 3, n, n) < 0.2  # some of it above the diagonal, never counted
    layers = [_layer(gold)]
    (full,) = sweep(layers, lambda _l: _Fixed(gold | extra), [None], causal=True)
    assert full["recall"] == 1.0 and full["exact"] == 1.0
    missing = gold.clone()
    missing[0, 0, 5, :] = False  # one row's gold edges dropped
    (part,) = sweep(layers, lambda _l: _Fixed(missing), [None], causal=True)
    lost = int(gold[0, 0, 5].sum())
    head0 = 1 - lost / int(gold[:, 0].sum())
    assert part["recall"] == pytest.approx((head0 + 2) / 3)
    assert part["exact"] == pytest.approx(1 - 1 / (2 * 3 * n))


def test_causal_sparsity_divides_by_n_n_plus_1_over_2():
    n = 12
    diagonal = torch.eye(n, dtype=torch.bool).expand(1, 2, n, n)
    complete = torch.ones(1, 2, n, n, dtype=torch.bool)
    assert float(sparsity(diagonal, causal=True)[0, 0]) == pytest.approx(1 - 2 / (n + 1))
    assert float(sparsity(diagonal)[0, 0]) == pytest.approx(1 - 1 / n)
    assert float(sparsity(complete, causal=True)[0, 0]) == 0.0  # j > i is not a pair
    (res,) = sweep([_layer(diagonal.clone())], lambda _l: _Fixed(complete), [None], causal=True)
    assert res["sparsity"] == 0.0
    summary = gold_summary([_layer(diagonal.clone())], causal=True)
    assert summary["sparsity"] == pytest.approx(1 - 2 / (n + 1))


def _spread(model: torch.nn.Module) -> None:
    """Larger q/k weights, so that the scores spread and entmax has zeros to show."""
    with torch.no_grad():
        for block in model.blocks:
            block.qkv.weight.mul_(40)


def test_the_entmax_teacher_has_exact_zeros_where_the_entmax_package_does():
    """LMConfig(prob_map="entmax15") builds 1.5-entmax heads: the captured gold graph is the
    support of entmax.entmax15 on the causally masked scores; the softmax twin's is complete."""
    config = lm.quick_config(prob_map="entmax15")
    torch.manual_seed(0)
    model = lm.make_model(config).eval()
    _spread(model)
    ids = torch.randint(256, (3, config.n))
    layers = extract_decoder_graphs(model, ids, batch_size=2)
    assert len(layers) == config.layers
    n = config.n
    below = torch.ones(n, n, dtype=torch.bool).tril()
    for layer in layers:
        for batch in layer.batches:
            scores = batch.q @ batch.k.transpose(-1, -2) / batch.q.shape[-1] ** 0.5
            reference = entmax_pkg.entmax15(scores.masked_fill(~below, float("-inf")), dim=-1)
            differ = batch.gold != ((reference > 0) & below)
            # the supports agree but for weights at the threshold (rounding), if any
            assert int(differ.sum()) <= differ.numel() // 10_000
            assert float(torch.cat([reference[differ], torch.zeros(1)]).max()) < 1e-6
    summary = gold_summary(layers, causal=True)
    assert summary["sparsity"] > 0.2  # exact zeros among the causal pairs
    torch.manual_seed(0)
    twin = lm.make_model(replace(config, prob_map="softmax")).eval()  # softmax: no zeros
    assert gold_summary(extract_decoder_graphs(twin, ids), causal=True)["sparsity"] == 0.0


def test_prob_map_keeps_the_identity_of_softmax_runs():
    """Runs from before the field keep their folder; an entmax run gets its own."""
    assert "prob_map" not in lm.LMConfig().identity()
    assert lm.LMConfig().run_name() == "n256-d64-L2-800steps-b310b9e8"  # results/lm
    assert lm.LMConfig(steps=4000).run_name() == "n256-d64-L2-4000steps-92ce7b83"
    entmax_run = lm.LMConfig(prob_map="entmax15")
    assert entmax_run.identity()["prob_map"] == "entmax15"
    assert "entmax15" in entmax_run.run_name()
    with pytest.raises(ValueError, match="prob_map"):
        lm.LMConfig(prob_map="entmax").validate()


def test_distance_and_kmeans_rows_ignore_later_tokens_quantization_does_not():
    """Row i of a prefix-stable predictor depends on positions ≤ i only (decodable token by
    token); quantization ranks the whole window (flagged † in the table)."""
    torch.manual_seed(3)
    n, t = 20, 9
    q, k = torch.randn(1, 2, n, 6), torch.randn(1, 2, n, 6)
    q2, k2 = q.clone(), k.clone()
    q2[..., t + 1 :, :] = torch.randn_like(q2[..., t + 1 :, :]) * 3
    k2[..., t + 1 :, :] = torch.randn_like(k2[..., t + 1 :, :]) * 3
    predictors = _predictors(q, k)
    for name in ("sf_distance", "sf_kmeans", "reformer", "window"):
        pattern = PredictedPattern(predictors[name], FixedParts(1)).causal()
        a, b = pattern.build(q, k).to_dense(), pattern.build(q2, k2).to_dense()
        assert torch.equal(a[..., : t + 1, :], b[..., : t + 1, :]), name
    pattern = PredictedPattern(predictors["sf_quantization"], None).causal()
    a, b = pattern.build(q, k).to_dense(), pattern.build(q2, k2).to_dense()
    assert not torch.equal(a[..., : t + 1, :], b[..., : t + 1, :])


def test_quick_pipeline_end_to_end_and_resume(tmp_path):
    """The quick config end to end: a 20-step entmax teacher, fits, the causal sweep of every
    method, downstream bits per byte. The window that holds every key (w = n − 1) has recall 1
    and gives the full teacher's bits per byte (Proposition 1); every graph used is causal with
    its diagonal. A second run recomputes nothing."""
    config = quick_config(out_dir=str(tmp_path), progress=False)
    n = config.teacher.n
    knobs = (("window", (3, n - 1)), ("sf_kmeans", (4,)), ("sf_distance", (2.0,)))
    config = replace(
        config,
        downstream_knobs=knobs,
        downstream_windows=(1, 3),
        window_grid=(0, 1, 3, 7, 15, n - 1),
    )
    summary = run(config)
    folder = Path(summary["folder"])
    for name in (
        "table.md",
        "summary.json",
        "sweep.json",
        "downstream.json",
        "fits.pt",
        "sparsity_recall.png",
        "sparsity_downstream.png",
        "teacher.json",
    ):
        assert (folder / name).exists(), name
    assert set(summary["methods"]) == set(DECODER_METHODS)
    teacher = summary["teacher"]
    assert teacher["prob_map"] == "entmax15" and teacher["steps"] == config.teacher.steps
    assert (tmp_path / "lm").exists()  # the teacher is a `sparseattn lm` cell, weights saved
    assert 0.0 < summary["gold_sparsity"] < 1.0
    ref = summary["downstream_reference"]["bits_per_byte"]
    for method, points in summary["downstream"].items():
        for p in points:
            assert p["future_edges"] == 0 and p["rows_without_diagonal"] == 0, method
            assert p["rows_checked"] > 0
    (complete,) = [p for p in summary["downstream"]["window"] if p["knob"] == n - 1]
    kmeans = summary["downstream"]["sf_kmeans"]
    assert sorted(p["window"] for p in kmeans) == sorted(config.downstream_windows)
    assert complete["recall"] == 1.0 and complete["exact"] == 1.0
    assert complete["sparsity"] == 0.0
    assert complete["bits_per_byte"] == pytest.approx(ref, abs=1e-5)
    assert complete["attention_mass_kept"] == pytest.approx(1.0, abs=1e-5)
    for p in summary["downstream"]["sf_kmeans"]:
        assert 0.0 < p["attention_mass_kept"] <= 1.0 + 1e-6
    for rows in json.loads((folder / "sweep.json").read_text()).values():
        for r in rows:
            assert 0.0 <= r["sparsity"] <= 1.0 and 0.0 <= r["recall"] <= 1.0
    fits_time = (folder / "fits.pt").stat().st_mtime_ns
    again = run(config)
    assert (folder / "fits.pt").stat().st_mtime_ns == fits_time
    assert again["methods"] == summary["methods"]
    assert again["downstream"] == summary["downstream"]
