"""What the flex engine costs over calling FlexAttention by hand, on CPU, forward.

The user path — ``sparse_attention(q, k, v, sa.longformer(512, 16), engine="flex")`` with a
pattern object held across calls — against compiled ``flex_attention`` called directly with a
hand-written ``mask_mod`` (``|i − j| ≤ 256 or i < 16 or j < 16``) and ``create_block_mask``:
fp32, B = 1, H = 8, d = 64, inference. Warm calls, interleaved, median of ``--repeats``; the
first (compiling) call of each is reported apart.

    python scripts/flex_overhead.py --ns 8192 32768 --out docs/results/flex_overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import sparseattn as sa
from sparseattn.lab.results import timing_facts


def measure(n: int, repeats: int) -> dict:
    w, g = 256, 16
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 1, 8, n, 64, generator=gen).unbind(0)

    def by_hand(b, h, i, j):
        return ((i - j).abs() <= w) | (i < g) | (j < g)

    compiled = torch.compile(flex_attention)
    block_mask = create_block_mask(by_hand, None, None, n, n, device="cpu")
    pattern = sa.longformer(2 * w, g)
    calls = {
        "flex direct": lambda: compiled(q, k, v, block_mask=block_mask),
        "sparseattn flex": lambda: sa.sparse_attention(q, k, v, pattern, engine="flex"),
    }
    row: dict = {"n": n}
    with torch.no_grad():
        outs = {}
        for name, call in calls.items():
            t0 = time.perf_counter()
            outs[name] = call()
            row[f"{name} first s"] = round(time.perf_counter() - t0, 2)
        row["max |diff|"] = float((outs["flex direct"] - outs["sparseattn flex"]).abs().max())
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(repeats):
            for name, call in calls.items():
                t0 = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - t0)
    for name, ts in times.items():
        row[f"{name} ms"] = round(1e3 * statistics.median(ts), 1)
    row["ratio"] = round(row["sparseattn flex ms"] / row["flex direct ms"], 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ns", type=int, nargs="+", default=[8192])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="JSON file for the rows and machine facts")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    facts = timing_facts(args.threads)
    rows = []
    for n in args.ns:
        rows.append(measure(n, args.repeats))
        print(json.dumps(rows[-1]), flush=True)
    facts["load after"] = os.getloadavg()[0]
    print(json.dumps(facts))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"facts": facts, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
