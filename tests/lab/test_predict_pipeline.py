"""The Sparsefinder pipeline shared by the encoder and decoder experiments
(experiments/sparsefinder_pipeline.py).

On small synthetic gold graphs: every method of the encoder table (chunked rows and eq. 7 on all
edges included) is fitted and swept, and the window baseline's row is checked against a
brute-force count of the band ∪ first/last-token graph written out here.
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from sparseattn.lab.experiments.sparsefinder import SparsefinderConfig
from sparseattn.lab.experiments.sparsefinder_pipeline import (
    METHODS,
    FittedPredictors,
    fit_layers,
    sweep_method,
)
from sparseattn.methods.sparsefinder.extract import GraphBatch, LayerGraphs

LENGTHS = (12, 9)
N, H, D = 12, 2, 8


def _layers(seed: int) -> list[LayerGraphs]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for layer in range(2):
        q, k = (torch.randn(len(LENGTHS), H, N, D, generator=gen) for _ in range(2))
        valid = torch.arange(N) < torch.tensor(LENGTHS)[:, None]
        pairs = (valid[:, :, None] & valid[:, None, :])[:, None]
        gold = (torch.rand(len(LENGTHS), H, N, N, generator=gen) < 0.3) & pairs
        out.append(LayerGraphs(layer, [GraphBatch(q, k, gold, valid)]))
    return out


def _config() -> SparsefinderConfig:
    """One knob per method (two window sizes), tiny fits."""
    one = ("thresholds", "bins", "clusters", "bigbird_blocks", "longformer_tokens")
    one += ("lsh_buckets", "routing_clusters", "chunk_top")
    knobs = {name: (1.0,) if name == "thresholds" else (2,) for name in one}
    small = {"r": 2, "batch_pairs": 64, "max_pairs": 256, "windows": (1,), "chunk_block": 3}
    return SparsefinderConfig(**knobs, **small, window_grid=(0, 2), strides=(3,), chunk_clusters=2)


def test_every_encoder_method_fits_and_sweeps() -> None:
    config = _config()
    fits = fit_layers(_layers(0), config, tqdm(disable=True))
    assert len(fits["chunk_projection"]) == len(fits["projection_all_edges"]) == 2
    fitted = FittedPredictors(fits, config)
    test = _layers(1)
    for method in METHODS:
        rows = sweep_method(fitted, method, test)
        assert len(rows) == len(config.grid(method)), method  # one fixed window each
        for row in rows:
            assert 0.0 <= row["sparsity"] <= 1.0 and 0.0 <= row["recall"] <= 1.0, (method, row)


def test_window_row_against_a_brute_force_count() -> None:
    """The window baseline at knob w (first and last real token global, as §4.7 adds), counts
    pooled over the sequences per (layer, head): sparsity 1 − |Ĝ| / Σ L² and recall
    |Ĝ ∩ G| / |G|, each then averaged over layers and heads."""
    config = _config()
    fitted = FittedPredictors(fit_layers(_layers(0), config, tqdm(disable=True)), config)
    test = _layers(1)
    for row in sweep_method(fitted, "window", test):
        w, sparsities, recalls = row["knob"], [], []
        for layer in test:
            batch = layer.batches[0]
            for h in range(H):
                edges = hits = gold_edges = pairs = 0
                for b, length in enumerate(LENGTHS):
                    i = torch.arange(length)
                    band = (i[:, None] - i[None, :]).abs() <= w
                    ends = torch.zeros(length, dtype=torch.bool)
                    ends[[0, length - 1]] = True
                    graph = band | ends[:, None] | ends[None, :]
                    gold = batch.gold[b, h, :length, :length]
                    edges += int(graph.sum())
                    hits += int((gold & graph).sum())
                    gold_edges += int(gold.sum())
                    pairs += length * length
                sparsities.append(1 - edges / pairs)
                recalls.append(hits / gold_edges)
        assert abs(row["sparsity"] - sum(sparsities) / len(sparsities)) < 1e-9, row
        assert abs(row["recall"] - sum(recalls) / len(recalls)) < 1e-9, row
