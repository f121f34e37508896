"""The tables of the d_min study on the paper's grid (Likhosherstov et al., Fig. 3), from kept
cells.

:data:`SETS` names the study's parameter sets; :func:`summaries` reads each set's copied
``paper-<set>.json`` files (a set's parts merged, a full ascending scan from
``coarse_check.json`` replacing the coarse-to-fine d_min where it differs), and
:func:`printed` gives the Markdown that docs/expressivity.md quotes (``printed.md``).
``scripts/dmin_paper_grid.py`` runs the study and writes the tables; tests recompute them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .dmin import DminConfig, summarise

#: The parameter sets (eq. (6) ≤ 2n, where the theorem makes a claim: see the script's docstring).
SETS = {
    "k1-e0.25-2": {"k": 1, "gamma": 2.0, "eps1": 0.25, "eps2": 2.0},
    "k2-e0.25-2": {"k": 2, "gamma": 2.0, "eps1": 0.25, "eps2": 2.0},
    "k2-e0.9-20": {"k": 2, "gamma": 2.0, "eps1": 0.9, "eps2": 20.0},
    "causal-k1-e0.9-20": {"k": 1, "gamma": 2.0, "eps1": 0.9, "eps2": 20.0, "causal": True},
}


def summaries(folder: Path, verbose: bool = False) -> dict[str, tuple[DminConfig, dict]]:
    """Each set's config and Q = 1 summary from the copied ``<run>.json`` files in ``folder``
    (their cells, a set's parts merged). Where ``coarse_check.json`` (from
    ``dmin_coarse_check.py``) holds a full ascending-scan d_min for a cell, that value (the
    paper's definition) replaces the coarse-to-fine one."""
    check = folder / "coarse_check.json"
    full = json.loads(check.read_text()) if check.exists() else []
    out = {}
    for name in SETS:
        parts = [p for p in folder.glob("paper-*.json") if p.stem.split("+")[0] == f"paper-{name}"]
        if not parts:
            continue
        cells = {}
        for part in sorted(parts):
            cells.update(json.loads(part.read_text())["cells"])
        for row in full:
            cell = cells.get(row["cell"])
            if row["set"] == name and cell and cell["d_min"] != row["full"]:
                if verbose:
                    print(f"{name} {row['cell']}: coarse {cell['d_min']} -> full {row['full']}")
                cell["d_min"] = row["full"]
        ns = tuple(sorted({c["n"] for c in cells.values()}))
        cfg = DminConfig(**SETS[name], ns=ns, d_step=8, coarse=8, run=f"paper-{name}")
        out[name] = (cfg, summarise(cfg, cells)["1"])
    return out


def printed(sets: dict[str, tuple[DminConfig, dict]]) -> list[str]:
    """The Markdown the docs quote: one row per set, then a per-n table per set."""
    lines = _summary_table({name: s for name, (_, s) in sets.items()})
    for name, (_, s) in sets.items():
        lines += ["", *_per_n_table(name, s)]
    return lines


def _growth(s: dict) -> tuple[list[tuple[int, float]], float]:
    """The mean d_min's increase per doubling of n (constant for a ln n law, growing by sqrt 2
    per doubling for a sqrt n law) and the exponent p of a least-squares fit d = a n^p."""
    means = {r["n"]: r["mean"] for r in s["table"]}
    steps = [(n, means[2 * n] - means[n]) for n in sorted(means) if 2 * n in means]
    xs = [math.log(n) for n in means]
    ys = [math.log(m) for m in means.values()]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    p = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    return steps, p / sum((x - mx) ** 2 for x in xs)


def _summary_table(summaries: dict[str, dict]) -> list[str]:
    lines = [
        "| set | eq. (6) ≤ 2n from | mean d_min, first → last n | d_min / min(eq. 6, 2n) "
        "| ln n fit (R²) | √n fit (R²) | eq. (6) slope / fitted slope "
        "| growth per doubling of n | power-law exponent |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summaries.items():
        first, last = s["table"][0], s["table"][-1]
        steps, p = _growth(s)
        f, q = s["fit"], s["fit_sqrt"]
        applies = s["theorem_applies_at"]
        lines.append(
            f"| {name} | {f'n = {applies[0]}' if applies else 'not on this grid'} "
            f"| {first['mean']:.1f} (n = {first['n']}) → {last['mean']:.1f} (n = {last['n']}) "
            f"| {first['mean_over_bound']:.3f} → {last['mean_over_bound']:.3f} "
            f"| {f['slope']:.1f} ln n {f['intercept']:+.1f} ({f['r2']:.3f}) "
            f"| {q['slope']:.2f} √n {q['intercept']:+.1f} ({q['r2']:.3f}) "
            f"| {s['theory_slope']:.1f} / {f['slope']:.1f} = {s['theory_slope'] / f['slope']:.1f} "
            f"| {', '.join(f'{n}→{2 * n}: {d:+.1f}' for n, d in steps)} | {p:.2f} |"
        )
    return lines


def _per_n_table(name: str, s: dict) -> list[str]:
    lines = [
        f"{name}: k in eq. (6) = {s['k_in_theory']}",
        "",
        "| n | d_min (one per matrix) | mean | eq. (6) | min(eq. 6, 2n) | mean / bound |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for r in s["table"]:
        lines.append(
            f"| {r['n']} | {' '.join(map(str, r['d_min']))} | {r['mean']:.1f} | "
            f"{r['theorem_d']} | {r['bound']} | {r['mean_over_bound']:.3f} |"
        )
    return lines
