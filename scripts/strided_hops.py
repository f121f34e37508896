"""STRIDED's hop count s (Yun et al. Assumption 1.3) over a grid of w and n, against a closed rule.

Runs the library's reachability recursion (:func:`sparseattn.methods.yun.hops`) for the SEQUENTIAL
cycle A¹ → A² (the paper's order, the default of ``sparseattn analyze strided``), the reversed
cycle A² → A¹, and the UNION, for every w in 1..W and n in 2..N, and compares each s with the
closed rule :func:`sparseattn.methods.yun.strided_hops`. Prints one row per w and a summary;
exits 1 on any mismatch.

    .venv/bin/python scripts/strided_hops.py --max-w 32 --max-n 256
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import sparseattn as sa
from sparseattn.methods.yun import hops, strided_hops


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-w", type=int, default=32)
    parser.add_argument("--max-n", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    mismatches, cells = [], 0
    print("| w | s, window first: n ranges | s, stride first: n ranges | union s = 3: n mod w |")
    print("|---|---|---|---|")
    for w in range(1, args.max_w + 1):
        a1, a2 = sa.strided(w, 1), sa.strided(w, 2)
        configs = {
            "window-first": sa.cycle(a1, a2),
            "stride-first": sa.cycle(a2, a1),
            "union": sa.strided(w),
        }
        seen: dict[str, dict[int, list[int]]] = {c: {} for c in configs}
        for n in range(2, args.max_n + 1):
            for name, pattern in configs.items():
                s = hops(pattern, n).hops
                cells += 1
                seen[name].setdefault(s, []).append(n)
                if s != strided_hops(w, n, name):
                    mismatches.append((w, n, name, s, strided_hops(w, n, name)))

        def ranges(values: dict[int, list[int]]) -> str:
            return ", ".join(f"s={s}: {min(v)}–{max(v)}" for s, v in sorted(values.items()))

        union3 = sorted({n % w for n in seen["union"].get(3, [])})
        print(
            f"| {w} | {ranges(seen['window-first'])} | {ranges(seen['stride-first'])} | "
            f"{union3 if union3 else '—'} |"
        )
    took = time.perf_counter() - start
    print(f"\n{cells} (w, n, config) cells, {len(mismatches)} differ from the rule, {took:.1f} s")
    for row in mismatches[:20]:
        w, n, name, s, expected = row
        print(f"mismatch w={w} n={n} {name}: hops {s}, rule {expected}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
