"""Bytes per rank per layer of context parallelism: this plan against ring / all-gather and
Ulysses (issue 42 item 7), analytic — computed from the plans, no attention is run.

Per rank and layer, forward, received: keys and values of B = 1 sequence with ``--kv-heads``
key/value heads of head dim ``--d`` in ``--bytes``-byte values (bf16 by default), query heads
``--heads``.

- **this plan** (``sparseattn.parallel.plan``): the keys and values the rank's rows read on
  other ranks, plus the all-reduces that merge global rows (queries, row max, denominators,
  weighted values, in float64); the table shows the busiest rank and the mean over ranks;
- **ring / all-gather**: every rank ends up with every other rank's keys and values, (N − N/P)
  keys (PyTorch's ``context_parallel`` for SDPA and for flex_attention, ring-flash-attention);
- **Ulysses** (DeepSpeed): all-to-alls of q, k, v and the output, (P − 1)/P of the rank's
  shard of each; only defined for P <= kv heads.

    python scripts/parallel_bytes.py                 # the table of docs/parallel.md
    python scripts/parallel_bytes.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

import sparseattn as sa
from sparseattn.parallel import plan

PATTERNS = {
    "window(128)": lambda: sa.window(128),
    "window(4096)": lambda: sa.window(4096),
    "sliding_window(4096, 4)": lambda: sa.sliding_window(4096, 4),
    "longformer(512, 16)": lambda: sa.longformer(512, 16),
    "longformer(4096, 16)": lambda: sa.longformer(4096, 16),
    "bigbird(192, 128, 3, 64)": lambda: sa.bigbird(192, 128, 3, 64),
    "causal_strided(256)": lambda: sa.causal_strided(256),
    "dense().causal()": lambda: sa.dense().causal(),
}


def rows(ns, parts, heads, kv_heads, d, nbytes) -> list[dict]:
    dtype = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[nbytes]
    out = []
    per_key = kv_heads * 2 * d * nbytes  # one key and its value, B = 1
    for name, make in PATTERNS.items():
        for n in ns:
            for p in parts:
                start = time.perf_counter()
                plan_ = plan(make(), n, p)
                seconds = time.perf_counter() - start
                shape = {"batch": 1, "heads": heads, "kv_heads": kv_heads, "d": d, "dtype": dtype}
                table = plan_.table(**shape)
                moved = np.array([t["halo_recv"] + t["global_forward"] for t in table], float)
                ring = (n - n / p) * per_key
                ulysses = None
                if p <= kv_heads:
                    ulysses = (n / p) * (p - 1) / p * d * nbytes * (2 * heads + 2 * kv_heads)
                out.append(
                    {
                        "pattern": name,
                        "n": n,
                        "parts": p,
                        "plan_max_mb": moved.max() / 1e6,
                        "plan_mean_mb": moved.mean() / 1e6,
                        "ring_mb": ring / 1e6,
                        "ulysses_mb": None if ulysses is None else ulysses / 1e6,
                        "ring_over_plan": ring / max(moved.max(), 1.0),
                        "global_rows": int(len(plan_.global_rows)),
                        "plan_seconds": seconds,
                    }
                )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[32768, 131072, 1 << 20])
    parser.add_argument("--parts", type=int, nargs="+", default=[2, 8, 64])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--bytes", type=int, default=2, help="bytes per value (2: bf16)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    table = rows(args.n, args.parts, args.heads, args.kv_heads, args.d, args.bytes)
    print(
        "| pattern | N | P | this plan, busiest rank (MB) | mean (MB) | ring / all-gather "
        "(MB) | Ulysses (MB) | ring ÷ plan |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in table:
        uly = "n/a (P > kv heads)" if r["ulysses_mb"] is None else f"{r['ulysses_mb']:.1f}"
        print(
            f"| {r['pattern']} | {r['n']} | {r['parts']} | {r['plan_max_mb']:.2f} | "
            f"{r['plan_mean_mb']:.2f} | {r['ring_mb']:.1f} | {uly} | {r['ring_over_plan']:.0f}× |"
        )
    print(f"planning: at most {max(r['plan_seconds'] for r in table):.2f} s per plan")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
