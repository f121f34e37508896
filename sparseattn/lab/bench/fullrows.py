"""Dense-pattern sparse maps: ``sparse_attention(q, k, v, dense(), map)`` against SDPA and the
``entmax`` package on the full score matrix, in one process.

    python -m sparseattn.lab.bench.fullrows [--n 4096] [--heads 8] [--threads 2] [--repeats 3]

SDPA and the dense-pattern calls are timed interleaved (round robin, ``repeats`` rounds after
a warm-up call that also records the peak C-heap increase), so that a change of machine load
hits every contender alike. The ``entmax`` package is timed on the ready score matrix (its map
alone, without the two matrix products) with ``sparseattn.lab.measure.measure`` (median of
``repeats`` after a warm-up). Prints one JSON object: machine facts, times (s), peaks (MiB),
ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

import sparseattn as sa
from sparseattn.lab.measure import measure, peak_memory


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def run(n: int, heads: int, repeats: int, maps: list[str], package_too: bool = True) -> dict:
    """Times and peaks for SDPA, the dense-pattern path and the entmax package at length n."""
    import entmax

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, n, 64, generator=gen) for _ in range(3))
    scale = 64**-0.5
    package = {"entmax15": entmax.entmax15, "sparsemax": entmax.sparsemax}
    out: dict = {
        "n": n,
        "heads": heads,
        "threads": torch.get_num_threads(),
        "cpu": _cpu(),
        "torch": torch.__version__,
        "load": os.getloadavg(),
        "results": {},
    }
    res = out["results"]
    calls = {"sdpa softmax": lambda: F.scaled_dot_product_attention(q, k, v)}
    for name in maps:
        calls[f"sparseattn {name}"] = lambda name=name: sa.sparse_attention(
            q, k, v, sa.dense(), prob_map=name
        )
    with torch.no_grad():
        for label, fn in calls.items():  # warm-up and peak memory, one call each
            with peak_memory() as mem:
                fn()
            res[label] = {"peak_mb": mem["mb"], "times_s": []}
        for _ in range(repeats):  # interleaved: a load change hits every contender alike
            for label, fn in calls.items():
                start = time.perf_counter()
                fn()
                res[label]["times_s"].append(time.perf_counter() - start)
        for label in calls:
            res[label]["time_s"] = statistics.median(res[label]["times_s"])
        for name in maps:
            if package_too and name in package:
                scores = (q @ k.transpose(-1, -2)) * scale
                res[f"entmax package {name} (map only)"] = measure(
                    lambda name=name, s=scores: package[name](s, dim=-1), repeats, 1e9
                )
                del scores
    out["load after"] = os.getloadavg()
    sdpa = res["sdpa softmax"]["time_s"]
    for name in maps:
        ours = res[f"sparseattn {name}"]["time_s"]
        out[f"{name}: ours / sdpa"] = ours / sdpa
        if f"entmax package {name} (map only)" in res:
            out[f"{name}: package map / ours"] = (
                res[f"entmax package {name} (map only)"]["time_s"] / ours
            )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--maps", default="entmax15", help="comma-separated map names")
    parser.add_argument("--no-package", action="store_true", help="skip the entmax package")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(
        json.dumps(
            run(args.n, args.heads, args.repeats, args.maps.split(","), not args.no_package),
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
