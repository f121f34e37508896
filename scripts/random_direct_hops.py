"""RANDOM's direct-hop ceiling in the copying tables at n = 256, w = 16 (docs/experiments.md).

For each seed, table and depth: the share of copied symbols whose source is a key of the
predicting position in at least one layer (any head) — what a model that learns only direct
hops could copy — beside the full connectivity ceiling (any route through the layers and the
skip connections). A test accuracy above the direct-hop ceiling (plus chance on the rest) needs
routes of two or more hops. Seconds on a CPU.

    python scripts/random_direct_hops.py --out docs/results/copying/random-direct-hops.json
"""

from __future__ import annotations

import argparse

import torch

from sparseattn.experiments.copying import (
    CopyConfig,
    column_pattern,
    reachable_fraction,
    task_tensors,
)
from sparseattn.patterns import HeadSplit, as_cycle
from sparseattn.results import machine_facts, write_json


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
    parser.add_argument("--seeds", default="0,1")
    args = parser.parse_args()
    rows = []
    for causal in (False, True):
        for seed in (int(s) for s in args.seeds.split(",")):
            # the options of the n = 256 tables (docs/experiments.md); RANDOM's graphs depend
            # only on n, w, heads, causality, depths and the seed
            config = CopyConfig(
                n=256, w=16, batch_size=32, stop_accuracy=0.998, seed=seed, causal=causal
            )
            for depth in (1, 2, 3, 4):
                rows.append(
                    {
                        "table": 2 if causal else 1,
                        "seed": seed,
                        "column": "random",
                        "depth": depth,
                        "direct_hop_ceiling": direct_hop_fraction(config, "random", depth),
                        "ceiling": reachable_fraction("random", depth, config),
                    }
                )
                print(rows[-1])
    write_json(args.out, {"rows": rows, "machine": machine_facts()})


if __name__ == "__main__":
    main()
