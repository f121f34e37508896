"""Evidence for ``engine="auto"``: which engine is fastest as the graph's block fill varies.

Runs each engine forward (softmax, fp32, B = 1, H = 8, d = 64) on graphs from dense-in-blocks
to scattered, in *one thread* and timed by process CPU time, so that the ratios hold on a
loaded, shared machine, and prints a markdown table: the block fill (edges / scored entries at
the block size the engine picks), per-entry and per-edge costs, the fastest engine, and what
``choose_engine`` picks. ``python -m sparseattn.lab.bench.calibrate [n ...]``.

``python -m sparseattn.lab.bench.calibrate --blocks [n ...]`` instead times the block engine at
every block size, forward and forward+backward, in ns per scored entry: the evidence for
``ENTRY_COST`` and ``ENTRY_COST_TRAIN`` (relative to b = 64).
"""

from __future__ import annotations

import math
import sys
import time

import torch

import sparseattn as sa
from sparseattn.attention import choose_engine
from sparseattn.engines import ENGINES, block_attention
from sparseattn.engines.layout import choose_block, count_pairs
from sparseattn.maps import softmax


def cpu_time(fn, repeats: int = 3) -> float:
    """Least process CPU time of ``repeats`` calls after a warm-up call."""
    fn()
    best = math.inf
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def _call(engine, q, k, v, graph, rho):
    def run():
        with torch.no_grad():
            return engine(q, k, v, graph, rho, 1 / math.sqrt(q.shape[-1]))

    return run


PATTERNS = {
    "window(64)": sa.window(64),
    "longformer(512, 16)": sa.longformer(512, 16),
    "bigbird(448, 16, 1, 64)": sa.bigbird(448, 16, 1, 64),
    "strided(256)": sa.strided(256),
    "random(k=512)": sa.random(k=512),
    "random(k=64)": sa.random(k=64),
    "random(k=16)": sa.random(k=16),
}


def main(ns: list[int]) -> None:
    torch.set_num_threads(1)
    patterns = PATTERNS
    print(
        "| n | pattern | K | block b | fill | block ms | gather ms | dense ms | block ns/entry "
        "| gather ns/edge | fastest | auto |"
    )
    print("|" + "---|" * 12)
    rho, heads, d = softmax(), 8, 64
    for n in ns:
        q, k, v = (torch.randn(1, heads, n, d) for _ in range(3))
        for name, pattern in patterns.items():
            graph = pattern.graph(n)
            edges = graph.col.numel()
            b = choose_block(graph)
            work = count_pairs(graph, b) * b * b
            times = {}
            for engine in ("block", "gather", "dense"):
                if engine != "dense" or heads * n * n <= 1 << 27:
                    times[engine] = cpu_time(_call(ENGINES[engine], q, k, v, graph, rho))
            auto = choose_engine(graph, q, k, rho)
            fastest = min(times, key=times.get)
            dense_ms = f"{times['dense'] * 1e3:.0f}" if "dense" in times else "—"
            print(
                f"| {n} | {name} | {edges / n:.0f} | {b} | {edges / work:.3f} "
                f"| {times['block'] * 1e3:.0f} | {times['gather'] * 1e3:.0f} | {dense_ms} "
                f"| {times['block'] / (work * heads) * 1e9:.1f} "
                f"| {times['gather'] / (edges * heads) * 1e9:.0f} | {fastest} | {auto} |",
                flush=True,
            )


def blocks(ns: list[int]) -> None:
    """ns per scored entry of the block engine at each block size, fwd and fwd+bwd."""
    torch.set_num_threads(1)
    rho, heads, d = softmax(), 8, 64
    sizes = (16, 32, 64, 128)
    print(
        "| n | pattern | "
        + " | ".join(f"fwd b={b}" for b in sizes)
        + " | "
        + " | ".join(f"fwd+bwd b={b}" for b in sizes)
        + " |"
    )
    print("|" + "---|" * (2 + 2 * len(sizes)))
    for n in ns:
        q, k, v = (torch.randn(1, heads, n, d, requires_grad=True) for _ in range(3))
        for name, pattern in PATTERNS.items():
            if name.startswith("random(k=") and name != "random(k=512)":
                continue
            graph = pattern.graph(n)
            cells = {}
            for b in sizes:
                work = count_pairs(graph, b) * b * b * heads

                args = (q, k, v, graph, rho, 1 / math.sqrt(d))

                def fwd(args=args, b=b):
                    with torch.no_grad():
                        block_attention(*args, block=b)

                def fwd_bwd(args=args, b=b):
                    block_attention(*args, block=b).sum().backward()

                cells[("f", b)] = cpu_time(fwd, 2) / work * 1e9
                cells[("fb", b)] = cpu_time(fwd_bwd, 2) / work * 1e9
            print(
                f"| {n} | {name} | "
                + " | ".join(f"{cells[('f', b)]:.2f}" for b in sizes)
                + " | "
                + " | ".join(f"{cells[('fb', b)]:.1f}" for b in sizes)
                + " |",
                flush=True,
            )


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--blocks"]:
        blocks([int(x) for x in args[1:]] or [4096])
    else:
        main([int(x) for x in args] or [1024, 4096])
