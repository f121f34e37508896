"""Softmax with key padding on CPU: the dense engine (SDPA's fused kernel on the graph ∩ the
real keys) against the engine ``auto`` picked for these requests before it could (block or
gather), one thread, the engines taking turns. Cells: the requests of
``scripts/auto_decisions.py``'s grid whose decision changed (4 heads, a quarter of the keys
padding in every item), and a BERT-small-like call (12 heads, d = 32, window(64), n = 128,
half of 7 items padding).

    python scripts/padded_softmax_engines.py --out docs/results/auto/padded-softmax-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch

import sparseattn as sa
from sparseattn.attention import choose_engine, resolve_graph
from sparseattn.lab.results import interleaved_medians, timing_record, write_json
from sparseattn.maps import softmax

#: (name, pattern, batch, heads, n, d, backward, the engine auto picked before)
CELLS = [
    ("full", sa.window(1 << 20), 32, 4, 1024, 64, False, "block"),
    ("random", sa.random(k=16), 32, 4, 256, 64, False, "gather"),
    ("fixed", sa.fixed(32), 1, 4, 4096, 64, True, "gather"),
    ("longformer", sa.longformer(64, 4), 32, 4, 256, 64, True, "block"),
    ("bigbird", sa.bigbird(16, 2, 2), 32, 4, 256, 64, True, "block"),
    ("bert-small window(64)", sa.window(64), 8, 12, 128, 32, False, "block"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    rows = []
    for name, pattern, batch, heads, n, d, backward, before in CELLS:
        q, k, v = (torch.randn(batch, heads, n, d, requires_grad=backward) for _ in range(3))
        padding = torch.zeros(batch, n, dtype=torch.bool)
        if name.startswith("bert"):
            padding[1:, n // 2 :] = True
        else:
            padding[:, n - n // 4 :] = True

        def call(engine, q=q, k=k, v=v, pattern=pattern, padding=padding, backward=backward):
            def run():
                out = sa.sparse_attention(q, k, v, pattern, engine=engine, key_padding_mask=padding)
                if backward:
                    out.sum().backward()

            return run

        engines = {before: call(before), "dense": call("dense")}
        ms = {e: round(s * 1e3, 2) for e, s in interleaved_medians(engines, args.repeats).items()}
        auto = choose_engine(resolve_graph(pattern, q, k), q, k, softmax(), 0.0, False, True)
        rows.append(
            {
                "cell": name,
                "shape (B, H, n, d)": [batch, heads, n, d],
                "forward + backward": backward,
                "auto before": before,
                "auto now": auto,
                "ms, median": ms,
                "before / dense": round(ms[before] / ms["dense"], 2),
            }
        )
        print(json.dumps(rows[-1]))
    result = timing_record(
        "scripts/padded_softmax_engines.py", load_before, repeats=args.repeats, rows=rows
    )
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
