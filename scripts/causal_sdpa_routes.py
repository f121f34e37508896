"""Causal softmax rows that SDPA's ``is_causal`` cannot express, by their two routes, on CPU.

Queries at an offset (n_q < n_k: decoding, prefill in pieces) and causal rows with key
padding: the rows engine (``rows_attention``, their route until commit f80168c) against
SDPA with a boolean mask per chunk of queries (``full_rows_attention``, the route since), in
one process, calls interleaved, median of ``--repeats``; (B, 8, n, 64) fp32, forward (no grad).

    python scripts/causal_sdpa_routes.py --out docs/results/engines/decode/causal-sdpa-routes.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from pathlib import Path

import torch

import sparseattn as sa
from sparseattn.engines.rows import full_rows_attention, rows_attention
from sparseattn.lab.results import interleaved_medians, timing_facts

#: (batch, n_q, n_k, left padding of the last item as a share of n_k)
CASES = [(1, 1, 4096, 0.0), (1, 16, 4096, 0.0), (1, 512, 4096, 0.0), (1, 1, 32768, 0.0),
         (2, 1024, 1024, 0.25), (2, 4096, 4096, 0.25)]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    facts = timing_facts(args.threads)
    gen = torch.Generator().manual_seed(0)
    rho, rows = sa.softmax(), []
    for bsz, n_q, n_k, pad in CASES:
        q = torch.randn(bsz, 8, n_q, 64, generator=gen)
        k, v = (torch.randn(bsz, 8, n_k, 64, generator=gen) for _ in range(2))
        valid = None
        if pad:
            valid = torch.ones(bsz, n_k, dtype=torch.bool)
            valid[-1, : int(pad * n_k)] = False
        calls = {
            "rows engine": functools.partial(
                rows_attention, q, k, v, None, rho, 0.125, valid, 0.0, True
            ),
            "SDPA, masked chunks": functools.partial(
                full_rows_attention, q, k, v, rho, 0.125, valid, 0.0, True
            ),
        }
        with torch.no_grad():
            torch.testing.assert_close(*(call() for call in calls.values()))
            ms = {name: t * 1e3 for name, t in interleaved_medians(calls, args.repeats).items()}
        row = {"batch": bsz, "n_q": n_q, "n_k": n_k, "padded": pad, **{
            f"{name} ms": round(t, 3) for name, t in ms.items()}}  # fmt: skip
        row["speed-up"] = round(ms["rows engine"] / ms["SDPA, masked chunks"], 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    facts["load after"] = os.getloadavg()[0]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"facts": facts, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
