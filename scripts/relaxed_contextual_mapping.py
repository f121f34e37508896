"""Yun et al. Theorem 1, step 3 (appendix F.2) executed: the contextual mapping of Lemma 7 with
σ_H replaced by softmax, sparsemax and 1.5-entmax at temperature t, through sparse_attention in
float64, against the exact hardmax ids. Prints one Markdown summary per configuration (max
error at t = 1, 2, 4, …, 256 and at the special t's); ``--full`` prints every row (t on a √2 grid,
the properties and Lemma 8's output error).

    .venv/bin/python scripts/relaxed_contextual_mapping.py [--full]
"""

from __future__ import annotations

import argparse
import platform
import time
from fractions import Fraction

import torch

import sparseattn as sa
from sparseattn.methods.yun.relaxed import (
    format_relaxed_summary,
    format_relaxed_table,
    relaxed_error_table,
)

CONFIGS = [
    (
        "STRIDED w=2 (sequential)",
        sa.cycle(sa.strided(2, 1), sa.strided(2, 2)),
        4,
        2,
        Fraction(1, 2),
    ),
    (
        "STRIDED w=2 (sequential)",
        sa.cycle(sa.strided(2, 1), sa.strided(2, 2)),
        4,
        1,
        Fraction(1, 4),
    ),
    ("STAR w=1", sa.star(1), 8, 1, Fraction(1, 2)),
]


def cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="every row, with Lemma 8's error")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {cpu()}, 1 thread\n")
    for name, patterns, n, d, delta in CONFIGS:
        start = time.perf_counter()
        table = relaxed_error_table(patterns, n, d, delta)
        print(f"### {name}\n")
        print(format_relaxed_table(table) if args.full else table.header() + "\n")
        if not args.full:
            print(format_relaxed_summary(table))
        print(f"({time.perf_counter() - start:.1f} s)\n")


if __name__ == "__main__":
    main()
