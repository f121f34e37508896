"""Is 5× over transformers' Longformer layer within reach of torch's CPU kernels? One run, calls
interleaved, one thread: transformers' ``LongformerSelfAttention`` and ``hf.sparsify``'s, both
at Longformer-base's width (hidden 768, 12 heads, window 512: keys i − 256 … i + 256, 16 global
tokens; :func:`sparseattn.lab.models.checkpoints.build`), beside the parts that any exact
computation of the sparsified layer must run with these kernels, each alone:

* ``projections`` — the q, k and v projections of the n tokens (three n × 768 × 768 GEMMs);
* ``band kernel`` — the local rows' attention as the block engine hands it to torch's CPU flash
  kernel (``_scaled_dot_product_flash_attention_for_cpu``): row blocks of 32 queries against
  the 544 keys their windows cover (a strided view of k and v), the band's ragged edges masked
  by an additive bias; for the row blocks whose band lies inside the sequence, scaled to all n
  rows (``band kernel, all rows``);
* ``global rows`` — the 16 global rows folded into the hidden states (the two products of the
  12·16 = 192 rows against the n × 768 hidden states that replace ``key_global`` and
  ``value_global``; docs/checkpoints.md).

``floor`` is their sum: the sparsified layer's time if everything else (the global columns of
the local rows, merges, masks, copies) were free; ``transformers / floor`` bounds the speed-up
reachable with these kernels. Medians of ``--repeats`` interleaved calls after a warm-up each.

    python scripts/longformer_floor.py --out docs/results/hf/longformer-floor-1t.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from sparseattn.lab.models.checkpoints import build
from sparseattn.lab.results import machine_facts

HIDDEN, HEADS, HEAD_DIM, ONE_SIDED, BLOCK, GLOBALS = 768, 12, 64, 256, 32, 16
flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def band_kernel(n: int):
    """The band's one flash call, and the rows it covers."""
    w = ONE_SIDED // BLOCK
    keys, m = (2 * w + 1) * BLOCK, n // BLOCK - 2 * w
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, HIDDEN, generator=gen)  # q in a projection's (n, H·d) layout
    k, v = (torch.randn(HEADS, n, HEAD_DIM, generator=gen) for _ in range(2))
    q = x.as_strided((HEADS, m, BLOCK, HEAD_DIM), (HEAD_DIM, BLOCK * HIDDEN, HIDDEN, 1),
                     w * BLOCK * HIDDEN)  # fmt: skip
    band = (HEADS, m, keys, HEAD_DIM), (n * HEAD_DIM, BLOCK * HEAD_DIM, HEAD_DIM, 1)
    kb, vb = k.as_strided(*band), v.as_strided(*band)
    i = torch.arange(BLOCK)[:, None] + w * BLOCK
    j = torch.arange(keys)[None]
    bias = torch.where((j - i).abs() <= ONE_SIDED, 0.0, float("-inf"))
    bias = bias.expand(HEADS, m, BLOCK, keys)
    scale = HEAD_DIM**-0.5
    return lambda: flash(q, kb, vb, 0.0, False, attn_mask=bias, scale=scale), m * BLOCK


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    n = args.n
    original, original_args = build("longformer", n, sparse=False, globals_=GLOBALS)
    ours, ours_args = build("longformer", n, sparse=True, globals_=GLOBALS)
    hidden = original_args[0]
    gen = torch.Generator().manual_seed(2)
    weights = [torch.randn(HIDDEN, HIDDEN, generator=gen) * 0.02 for _ in range(3)]
    folded = torch.randn(1, HEADS * GLOBALS, HIDDEN, generator=gen)
    probs = torch.randn(1, HEADS * GLOBALS, n, generator=gen)
    band, band_rows = band_kernel(n)
    calls = {
        "transformers": lambda: original(*original_args),
        "sparseattn": lambda: ours(*ours_args),
        "projections": lambda: [F.linear(hidden, w) for w in weights],
        "band kernel": band,
        "global rows": lambda: (folded @ hidden.mT, probs @ hidden),
    }
    load = os.getloadavg()[0]
    times: dict[str, list[float]] = {name: [] for name in calls}
    with torch.no_grad():
        for call in calls.values():
            call()
        for _ in range(args.repeats):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                times[name].append((time.perf_counter() - start) * 1e3)
    ms = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    ms["band kernel, all rows"] = ms["band kernel"] * n / band_rows
    ms["floor"] = ms["projections"] + ms["band kernel, all rows"] + ms["global rows"]
    result = {
        "script": "scripts/longformer_floor.py",
        "command": " ".join(["python", *sys.argv]),
        "n": n,
        "time": f"median of {args.repeats} interleaved calls after a warm-up each, ms",
        "band rows": band_rows,
        **machine_facts(),
        "threads": 1,
        "load before": load,
        "ms": {name: round(t, 1) for name, t in ms.items()},
        "ms all": {name: [round(t, 1) for t in ts] for name, ts in times.items()},
        "transformers / sparseattn": round(ms["transformers"] / ms["sparseattn"], 2),
        "transformers / floor": round(ms["transformers"] / ms["floor"], 2),
        "sparseattn / floor": round(ms["sparseattn"] / ms["floor"], 2),
        "load after": os.getloadavg()[0],
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
