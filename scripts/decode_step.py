"""One decoding step's attention alone: one query token against a cache of n_k keys, on CPU.

`sparse_attention(q, k, v, pattern)` with q (1, 8, 1, 64) at the end of k, v (1, 8, n_k, 64)
for the causal dense pattern, a causal window and a sliding window with sinks, beside SDPA over
the whole cache (what dense attention costs per token). Medians of `--repeats` calls after a
warm-up, calls interleaved, µs.

    python scripts/decode_step.py --out docs/results/engines/decode/<name>.json

Run with `PYTHONPATH=<worktree>` to time another commit with the same script.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import sparseattn as sa
from sparseattn.lab.results import cpu_name  # also in older commits' sparseattn

PATTERNS = {
    "dense().causal()": lambda: sa.dense().causal(),
    "window(256).causal()": lambda: sa.window(256).causal(),
    "sliding_window(256, sinks=4)": lambda: sa.sliding_window(256, 4),
}


def commit() -> str:
    root = Path(sa.__file__).resolve().parents[1]
    run = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
        text=True,
        capture_output=True,
        check=False,
    )
    return run.stdout.strip() or "unknown"


def time_step(n_k: int, gen: torch.Generator, repeats: int) -> dict[str, float]:
    """Median µs per call of SDPA over the cache and of each pattern's step, interleaved (the
    loop of ``sparseattn.lab.results.interleaved_medians``, written out: older commits, which this
    script also times, lack that helper)."""
    q = torch.randn(1, 8, 1, 64, generator=gen)
    k, v = (torch.randn(1, 8, n_k, 64, generator=gen) for _ in range(2))
    calls = {"SDPA, whole cache": lambda: F.scaled_dot_product_attention(q, k, v)}
    for name, make in PATTERNS.items():
        calls[name] = functools.partial(sa.sparse_attention, q, k, v, make())
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        call()
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: sorted(ts)[len(ts) // 2] * 1e6 for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nk", type=int, nargs="+", default=[512, 4096, 32768])
    parser.add_argument("--repeats", type=int, default=51)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    rows = []
    with torch.no_grad():
        for n_k in args.nk:
            for name, us in time_step(n_k, gen, args.repeats).items():
                rows.append({"n_k": n_k, "call": name, "us": round(us, 1)})
                print(f"n_k = {n_k:6d}  {name:30s} {us:9.1f} µs", flush=True)
    record = {
        "command": "python scripts/decode_step.py "
        + " ".join(
            f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in (("nk", args.nk), ("repeats", args.repeats), ("threads", args.threads))
        ),
        "commit": commit(),
        "machine": f"{cpu_name()}, torch {torch.__version__}, {args.threads} thread(s)",
        "load_average": os.getloadavg(),
        "rows": rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
