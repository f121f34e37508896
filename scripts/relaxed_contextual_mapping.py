"""Yun et al. Theorem 1, step 3 (appendix F.2) executed: the contextual mapping of Lemma 7 with
σ_H replaced by softmax, sparsemax and 1.5-entmax at temperature t, through sparse_attention in
float64, against the exact hardmax ids. Prints one Markdown table per configuration.

    .venv/bin/python scripts/relaxed_contextual_mapping.py
"""

from __future__ import annotations

import platform
import time
from fractions import Fraction

import torch

import sparseattn as sa
from sparseattn.analysis.relaxed import format_relaxed_table, relaxed_error_table

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


def main() -> None:
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, 1 thread\n")
    for name, patterns, n, d, delta in CONFIGS:
        start = time.perf_counter()
        table = relaxed_error_table(patterns, n, d, delta)
        print(f"### {name}\n")
        print(format_relaxed_table(table))
        print(f"({time.perf_counter() - start:.1f} s)\n")


if __name__ == "__main__":
    main()
