"""What ``hf.sparsify(..., count_weights=True)`` costs a forward: a random BERT-base-width model
(4 layers, 768 hidden, 12 heads) with 1.5-entmax on ``window(128)``, batch 2 × n tokens, timed
with the count of non-zero weights on and off, the two settings taking turns within each round
(the machine's drift reaches both alike). Writes the machine and the times as JSON.

    python scripts/count_weights_cost.py --out docs/results/hf/count-weights-cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import transformers

import sparseattn as sa
from sparseattn import hf
from sparseattn.lab.results import machine_facts, write_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--calls", type=int, default=3, help="timed calls per setting and round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    config = transformers.BertConfig(num_hidden_layers=4, max_position_embeddings=args.n)
    model = transformers.BertModel(config).eval()
    hf.sparsify(model, sa.window(128), "entmax15")
    ids = torch.randint(5, config.vocab_size, (2, args.n))
    times: dict[str, list[float]] = {"count_weights=True": [], "count_weights=False": []}
    load_before = os.getloadavg()[0]
    with torch.no_grad():
        for _ in range(args.rounds):
            for flag in (True, False):
                hf.sparsify(model, layers=[], count_weights=flag)
                model(ids)  # warm-up
                for _ in range(args.calls):
                    start = time.perf_counter()
                    model(ids)
                    times[f"count_weights={flag}"].append((time.perf_counter() - start) * 1e3)
    medians = {key: sorted(ts)[len(ts) // 2] for key, ts in times.items()}
    result = {
        "script": "scripts/count_weights_cost.py",
        "model": "BertModel, 4 layers, hidden 768, 12 heads, random weights",
        "sparsify": 'hf.sparsify(model, sa.window(128), "entmax15")',
        "input": f"batch 2 x {args.n} tokens, no padding, torch.no_grad()",
        **machine_facts(),
        "threads": args.threads,
        "load before": load_before,
        "load after": os.getloadavg()[0],
        "forward ms, median": {key: round(value, 1) for key, value in medians.items()},
        "ratio": round(medians["count_weights=True"] / medians["count_weights=False"], 2),
        "forward ms, all": {key: [round(t, 1) for t in ts] for key, ts in times.items()},
    }
    print(json.dumps(result["forward ms, median"]), "ratio", result["ratio"])
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
