"""``torch.compile`` of a small model built from ``SparseAttention`` over a stream of lengths.

Two blocks of LayerNorm → ``SparseAttention(64, 4, pattern=sa.longformer(32, 2))`` → residual
→ MLP (64 → 256 → 64) → residual, batch 8, fp32, one training step (forward + backward of
``y.square().mean()``) per call. ``torch.compile(model)`` (inductor) and the eager model take the
lengths one after another; per length: the first compiled call (compiling included), then
``--repeats`` eager and compiled steps interleaved (medians of wall and process CPU time), the
largest output difference, and dynamo's counters so far (graphs, graph breaks, recompile-limit
hits). docs/engines.md, "torch.compile".

    python scripts/compile_stream.py --threads 2 --repeats 7 --out results/compile_stream.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time

import torch
from torch import nn
from torch._dynamo.utils import counters

import sparseattn as sa
from sparseattn.lab.results import timing_facts

LENGTHS = [256, 300, 384, 512, 640, 700, 768, 800, 900, 1000]


class Block(nn.Module):
    def __init__(self, embed_dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(embed_dim)
        self.att = sa.SparseAttention(embed_dim, heads, pattern=sa.longformer(32, 2))
        self.mlp = nn.Sequential(
            nn.Linear(embed_dim, 4 * embed_dim), nn.GELU(), nn.Linear(4 * embed_dim, embed_dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.att(self.ln(x))
        return x + self.mlp(x)


class LimitHits(logging.Handler):
    """Counts dynamo's "hit config.recompile_limit" warnings."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += "recompile_limit" in record.getMessage()


def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.zero_grad()
    y = model(x)
    y.square().mean().backward()
    return y.detach()


def timed(model: nn.Module, x: torch.Tensor) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    step(model, x)
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=LENGTHS)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="JSON file for the rows and machine facts")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hits = LimitHits()
    logging.getLogger("torch._dynamo").addHandler(hits)
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    compiled = torch.compile(model)
    facts = timing_facts(args.threads)
    rows = []
    for n in args.lengths:
        x = torch.randn(8, n, 64)
        t0 = time.perf_counter()
        y_c = step(compiled, x)
        row: dict = {"n": n, "first compiled s": round(time.perf_counter() - t0, 2)}
        row["max |diff|"] = float((y_c - step(model, x)).abs().max())
        times: dict[str, list[tuple[float, float]]] = {"eager": [], "compiled": []}
        for _ in range(args.repeats):
            times["eager"].append(timed(model, x))
            times["compiled"].append(timed(compiled, x))
        for name, ts in times.items():
            row[f"{name} ms"] = round(1e3 * statistics.median(t[0] for t in ts), 1)
            row[f"{name} cpu ms"] = round(1e3 * statistics.median(t[1] for t in ts), 1)
        row["ratio"] = round(row["compiled ms"] / row["eager ms"], 3)
        row["cpu ratio"] = round(row["compiled cpu ms"] / row["eager cpu ms"], 3)
        row["graphs"] = counters["stats"]["unique_graphs"]
        row["graph breaks"] = sum(counters["graph_break"].values())
        row["recompile-limit hits"] = hits.count
        rows.append(row)
        print(json.dumps(row), flush=True)
    facts["load after"] = os.getloadavg()[0]
    facts["median ratio"] = statistics.median(r["ratio"] for r in rows)
    facts["median cpu ratio"] = statistics.median(r["cpu ratio"] for r in rows)
    print(json.dumps(facts))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"facts": facts, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
