"""Theorem 0.2 made tangible: the exact d = 2 decider against Algorithm 1 and the d > 1 search.

1. **Exact counts over every S** (n = 3, 4, 5; S an n x n 0/1 matrix with a 1 in every row,
   (2^n - 1)^n of them): how many are (1, 2)-weakly SAM-approximable (Algorithm 1,
   ``weak_sam_approx_d1``) and how many (2, 4) (``weak_sam_approx_d2``, exact by order types).
   With d_hid >= 2d both answers depend only on the set of distinct row sets, so each distinct
   set is decided once and weighted by how many S have it.
2. **The gradient search checked against the decider** (n = 5, 6): random S, each decided
   exactly and given to ``try_weak_approx(S, d=2)`` (default budget: 4 restarts x 1500 Adam
   steps, d_hid = 4). Reports how often the search finds a witness when one exists, and that it
   never "finds" one when none exists (it runs on at most ``--max-no`` of those: each costs the
   whole budget). Three samplers: every entry 1 with probability 1/2 ("uniform"); n distinct
   proper row sets drawn uniformly ("distinct rows"); and n distinct row sets of 2 to n - 2 keys
   drawn from the separable sets of one random labelled order type ("one order type": always
   representable, but often by few key placements — the hard case for a search).

3. ``--retry RUN.json``: only rerun the search on the supports a run missed (its first 10 per
   cell, stored in the JSON), with another seed and a larger budget (``--restarts``, ``--steps``).

Writes JSON to ``--out`` and prints Markdown tables.

    .venv/bin/python scripts/weak_d2.py --samples 200
    .venv/bin/python scripts/weak_d2.py --retry results/expressivity/weak_d2/run.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from sparseattn.methods.likhosherstov.expressivity import try_weak_approx, weak_sam_approx_d1
from sparseattn.methods.likhosherstov.order_types import representable_families, weak_sam_approx_d2


def row_families(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Every S of size n as the bitset of its row sets other than V (bit T <=> some row is T):
    (distinct bitsets, how many S give each). Vectorised over all (2^n - 1)^n matrices."""
    every = (1 << n) - 1
    rows = np.stack(np.meshgrid(*[np.arange(1, every + 1)] * n, indexing="ij"), -1)
    rows = rows.reshape(-1, n)
    bits = np.where(rows != every, np.left_shift(np.int64(1), rows), 0)
    return np.unique(np.bitwise_or.reduce(bits, axis=1), return_counts=True)


def support(n: int, fam: int) -> torch.Tensor:
    """A representative S: one row per set in the bitset, then all-ones rows."""
    sets = [t for t in range(1 << n) if fam >> t & 1]
    rows = [[t >> j & 1 for j in range(n)] for t in sets]
    rows += [[1] * n] * (n - len(rows))
    return torch.tensor(rows, dtype=torch.bool)


def exact_counts(n: int) -> dict[str, int]:
    fams, counts = row_families(n)
    d2 = np.zeros(len(fams), dtype=bool)
    for family in representable_families(n):
        d2 |= (fams & ~np.int64(family)) == 0
    d1 = np.array([weak_sam_approx_d1(support(n, int(f)), 2) for f in fams])
    assert not (d1 & ~d2).any(), "d = 1 yes but d = 2 no: impossible"
    return {
        "n": n,
        "supports": int(counts.sum()),
        "distinct_row_set_families": len(fams),
        "d1_yes": int(counts[d1].sum()),
        "d2_yes": int(counts[d2].sum()),
        "d2_no": int(counts[~d2].sum()),
    }


def sample(n: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    if kind == "one order type":
        families = list(representable_families(n))
        family = families[int(torch.randint(len(families), (1,), generator=gen))]
        sets = [t for t in range(1 << n) if family >> t & 1 and 2 <= t.bit_count() <= n - 2]
        pick = torch.randperm(len(sets), generator=gen)[:n].tolist()
        rows = [[sets[p] >> j & 1 for j in range(n)] for p in pick]
        rows += [[1] * n] * (n - len(rows))
        return torch.tensor(rows, dtype=torch.bool)
    if kind == "uniform":
        s = torch.rand(n, n, generator=gen) < 0.5
        while not s.any(1).all():
            empty = ~s.any(1)
            s[empty] = torch.rand(int(empty.sum()), n, generator=gen) < 0.5
        return s
    proper = torch.randperm((1 << n) - 2, generator=gen)[:n] + 1  # n distinct sets, not ∅ or V
    return torch.tensor([[int(t) >> j & 1 for j in range(n)] for t in proper], dtype=torch.bool)


def search_vs_decider(n: int, kind: str, samples: int, max_no: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed * 1000 + n)
    yes = found_yes = no = tried_no = found_no = 0
    seconds_yes, seconds_no, misses = 0.0, 0.0, []
    for i in range(samples):
        s = sample(n, kind, gen)
        exact = weak_sam_approx_d2(s).found
        if not exact and tried_no >= max_no:
            no += 1
            continue
        start = time.perf_counter()
        res = try_weak_approx(s, 2, seed=i)
        took = time.perf_counter() - start
        if exact:
            yes, found_yes, seconds_yes = yes + 1, found_yes + res.found, seconds_yes + took
            if not res.found:
                misses.append(s.int().tolist())
        else:
            no, tried_no, found_no = no + 1, tried_no + 1, found_no + res.found
            seconds_no += took
    return {
        "n": n,
        "sampler": kind,
        "samples": samples,
        "exact_yes": yes,
        "search_found_of_yes": found_yes,
        "rate": found_yes / yes if yes else None,
        "exact_no": no,
        "search_run_on_no": tried_no,
        "search_found_of_no": found_no,
        "seconds_per_yes": seconds_yes / yes if yes else None,
        "seconds_per_no": seconds_no / tried_no if tried_no else None,
        "missed_supports": misses[:10],
    }


def retry(path: Path, restarts: int, steps: int, seed: int) -> None:
    """Rerun ``try_weak_approx`` on a run's missed supports with a larger budget."""
    run = json.loads(path.read_text())
    found = total = 0
    for cell in run["search"]:
        for rows in cell["missed_supports"]:
            s = torch.tensor(rows, dtype=torch.bool)
            if not weak_sam_approx_d2(s).found:
                raise RuntimeError("a stored miss is not representable: the run is inconsistent")
            start = time.perf_counter()
            res = try_weak_approx(s, 2, restarts=restarts, steps=steps, seed=seed)
            found, total = found + res.found, total + 1
            took = time.perf_counter() - start
            print(
                f"n = {cell['n']}, {cell['sampler']}: found {res.found} at restart "
                f"{res.tries} ({took:.0f} s)",
                flush=True,
            )
    print(f"found {found} of {total} missed supports with {restarts} x {steps} steps, seed {seed}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=200, help="random S per (n, sampler)")
    parser.add_argument("--max-no", type=int, default=10, help="searches on 'no' S per cell")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/expressivity/weak_d2/run.json")
    parser.add_argument("--retry", default=None, help="rerun a run's misses (its JSON path)")
    parser.add_argument("--restarts", type=int, default=16, help="restarts for --retry")
    parser.add_argument("--steps", type=int, default=3000, help="Adam steps for --retry")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.retry:
        retry(Path(args.retry), args.restarts, args.steps, args.seed + 1)
        return 0
    start = time.perf_counter()
    counts = [exact_counts(n) for n in (3, 4, 5)]
    print("| n | S | d = 1 yes (Alg. 1, d_hid = 2) | d = 2 yes (exact, d_hid = 4) | d = 2 no |")
    print("|---:|---:|---:|---:|---:|")
    for c in counts:
        print(
            f"| {c['n']} | {c['supports']:,} | {c['d1_yes']:,} | {c['d2_yes']:,} | {c['d2_no']:,} |"
        )
    search = []
    for n in (5, 6):
        for kind in ("uniform", "distinct rows", "one order type"):
            search.append(search_vs_decider(n, kind, args.samples, args.max_no, args.seed))
            r = search[-1]
            print(
                f"| {n} | {kind} | {r['exact_yes']}/{r['samples']} yes | found "
                f"{r['search_found_of_yes']}/{r['exact_yes']} | no: found "
                f"{r['search_found_of_no']}/{r['search_run_on_no']} | "
                f"{r['seconds_per_yes']:.2f} s/yes |",
                flush=True,
            )
    out = {
        "counts": counts,
        "search": search,
        "seconds": time.perf_counter() - start,
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "threads": 1,
        },
        "command": "scripts/weak_d2.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path} ({out['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
