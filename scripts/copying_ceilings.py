"""Connectivity ceilings of the copying tables at n = 256, w = 16 (docs/experiments.md, causal.md).

Computed from the graphs, no training (seconds on a CPU). For every column and depth 1–4: the
sparsity of the table header and the connectivity ceiling (the share of copied symbols whose
source reaches the predicting position through the layers' graphs and the skip connections),
for Table 1 and for Table 2 in both causal readings (Child et al.'s and eq. (4)/(5) ∩ j ≤ i);
for RANDOM, per seed, also the direct-hop ceiling: the share of sources that are a key of the
predicting position in at least one layer (any head) — what a model that learns only direct
hops could copy. A test accuracy above it (plus chance on the rest) needs two-hop routes.

    python scripts/copying_ceilings.py --out docs/results/copying/ceilings-n256.json
"""

from __future__ import annotations

import argparse

import torch

from sparseattn.lab.experiments.copying import (
    CopyConfig,
    column_pattern,
    reachable_fraction,
    task_tensors,
)
from sparseattn.lab.experiments.runner import COLUMNS, sparsity
from sparseattn.lab.results import machine_facts, write_json
from sparseattn.patterns import HeadSplit, as_cycle

DEPTHS = (1, 2, 3, 4)


def direct_hop_fraction(config: CopyConfig, column: str, depth: int) -> float:
    """Share of scored positions p whose source s is a key of p in some layer < depth
    (the union over heads of each layer's graph; a layer's (n, n) dense graph is read at
    (p, s))."""
    n, half = config.n, config.n // 2
    layers = as_cycle(column_pattern(column, config))
    _, positions, _ = task_tensors(torch.zeros(1, n, dtype=torch.long), config.vocab, config.causal)
    sources = positions + 1 - half if config.causal else positions - half
    hit = torch.zeros(positions.shape[0], dtype=torch.bool)
    for layer in range(depth):
        p = layers[layer]
        graph = p.graph(n, num_heads=config.heads) if isinstance(p, HeadSplit) else p.graph(n)
        dense = graph.to_dense()
        dense = dense.any(0) if dense.dim() == 3 else dense
        hit |= dense[positions, sources]
    return hit.double().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--seeds", default="0,1", help="RANDOM's seeds (its graphs depend on it)")
    args = parser.parse_args()
    rows = []
    readings = [(False, "child"), (True, "child"), (True, "tril")]  # (causal, causal_form)
    for causal, form in readings:
        for seed in (int(s) for s in args.seeds.split(",")):
            # the options of the n = 256 tables in docs/experiments.md
            config = CopyConfig(
                n=256,
                w=16,
                batch_size=32,
                stop_accuracy=0.998,
                seed=seed,
                causal=causal,
                causal_form=form,
            )
            columns = COLUMNS if seed == int(args.seeds.split(",")[0]) else ("random",)
            for column in columns:
                if column in ("random", "dense", "star") and form == "tril":
                    continue  # the same graphs in both causal readings
                row = {
                    "table": 2 if causal else 1,
                    "causal_form": form if causal else None,
                    "seed": seed,
                    "column": column,
                    "sparsity": sparsity(column_pattern(column, config), config.n, config.heads),
                    "ceiling": [reachable_fraction(column, d, config) for d in DEPTHS],
                }
                if column == "random":
                    row["direct_hop_ceiling"] = [
                        direct_hop_fraction(config, column, d) for d in DEPTHS
                    ]
                rows.append(row)
                print(row)
    write_json(args.out, {"depths": list(DEPTHS), "rows": rows, "machine": machine_facts()})


if __name__ == "__main__":
    main()
