"""The Assumption 2 and contextual-mapping tables of docs/analysis.md, recomputed.

Three tables, no training, deterministic (seeded test columns, exact rational arithmetic):

* Assumption 2 at ζ = 0.1, η = 0.01: ``assumption2(rho, zeta=0.1, eta=0.01, n=n)`` for each map
  and n ∈ {16, 1024}, and again at ``t=r.t / 2`` (plus softmax on the top-8 inputs, n = 1024);
* ``verify_contextual_mapping(cm).to_dict()`` for Yun's Lemma 7 (STRIDED, STAR, FIXED) and
  SparseBERT's Lemma 4 constructions;
* the same on three broken STRIDED w = 2 constructions (a γ that is not a chain, the last
  all-max-shift dropped, the first selective shift dropped).

Writes ``assumption2.json``, ``contextual-mapping.json`` (the reports, with the machine) and
``tables.md`` (the three printed tables, as docs/analysis.md quotes them) under ``--out``.
About 20 s at one thread; only the contextual-mapping table's time column depends on the machine.

    python scripts/analysis_tables.py --out docs/results/analysis/tables
"""

from __future__ import annotations

import argparse
import dataclasses
from fractions import Fraction
from pathlib import Path

import torch

import sparseattn as sa
from sparseattn.lab.results import machine_facts, write_json, write_text
from sparseattn.maps import entmax, hardmax, softmax, sparselin_gen, sparsemax
from sparseattn.methods.yun import (
    assumption2,
    sparsebert_contextual_mapping,
    verify_contextual_mapping,
    yun_contextual_mapping,
)

ZETA, ETA = 0.1, 0.01


def assumption2_rows() -> list[dict]:
    """One report per (map, n), with the verdict at half the scale (``half_t_holds``)."""
    maps = [softmax(), sparsemax(), sparselin_gen(0.5), entmax(1.5), entmax(1.3), hardmax()]
    rows = []
    for rho in maps:
        for n in (16, 1024):
            r = assumption2(rho, zeta=ZETA, eta=ETA, n=n)
            half = assumption2(rho, ZETA, ETA, n, t=r.t / 2)
            rows.append({"label": repr(rho), **r.to_dict(), "half_t_holds": half.holds})
    r = assumption2(softmax(), zeta=ZETA, eta=ETA, n=1024, top_k=8)
    rows.append({"label": "softmax, top-8 inputs", **r.to_dict(), "half_t_holds": None})
    return rows


def assumption2_table(rows: list[dict]) -> list[str]:
    lines = [
        "| map | n | t (method) | least t on adversarial inputs | min ρ_j* | holds | t/2 holds |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        method = r["method"].split(":")[0]
        half = "-" if r["half_t_holds"] is None else str(r["half_t_holds"])
        lines.append(
            f"| {r['label']} | {r['n']} | {r['t']:.4g} ({method}) | {r['t_least']:.4g} "
            f"| {r['worst_max_weight']:.6f} | {r['holds']} | {half} |"
        )
    return lines


def constructions() -> list[tuple[str, object]]:
    """(pattern label, construction) of the contextual-mapping table."""
    half, fifth = Fraction(1, 2), Fraction(1, 5)
    strided = sa.cycle(sa.strided(2, 1), sa.strided(2, 2))
    fixed = sa.cycle(sa.fixed(2, 1), sa.fixed(2, 2))
    bert = "dense without diagonal"
    return [
        ("STRIDED w=2 (sequential)", yun_contextual_mapping(strided, n=4, d=2, delta=half)),
        ("STAR w=1", yun_contextual_mapping(sa.star(1), n=5, d=1, delta=Fraction(1, 3))),
        ("STAR w=1", yun_contextual_mapping(sa.star(1), n=5, d=2, delta=half)),
        ("FIXED w=2 (sequential)", yun_contextual_mapping(fixed, n=4, d=2, delta=half)),
        (f"{bert} (SparseBERT)", sparsebert_contextual_mapping(3, 2, half)),
        (f"{bert} (SparseBERT)", sparsebert_contextual_mapping(4, 1, fifth)),
        (f"{bert}, 1 global shift", sparsebert_contextual_mapping(4, 1, fifth, global_shifts=1)),
    ]


def broken_constructions() -> list[tuple[str, object]]:
    """(what is broken, construction) on STRIDED w = 2, n = 4, d = 2, δ = 1/2."""
    strided = sa.cycle(sa.strided(2, 1), sa.strided(2, 2))
    good = yun_contextual_mapping(strided, 4, d=2)
    wrong_gamma = yun_contextual_mapping(strided, 4, d=2, gamma=(0, 3, 1, 2), strict=False)
    return [
        ("γ = (0, 3, 1, 2), not a chain", wrong_gamma),
        ("last all-max-shift dropped", dataclasses.replace(good, layers=good.layers[:-1])),
        ("first selective shift dropped", dataclasses.replace(good, layers=good.layers[1:])),
    ]


def mapping_table(rows: list[dict]) -> list[str]:
    lines = [
        "| construction | pattern | n | d | δ | inputs | layers (paper) | 7.1 | 7.2 | id bits "
        "| time |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['construction']} | {r['label']} | {r['n']} | {r['d']} | {r['delta']} "
            f"| {r['inputs']} {r['inputs_checked']}/{r['input_space_size']} "
            f"| {r['attention_layers']} ({r['paper_layers']}) | {r['property_7_1']} "
            f"| {r['property_7_2']} | {r['max_id_bits']} | {r['seconds']:.1f} s |"
        )
    return lines


def broken_table(rows: list[dict]) -> list[str]:
    lines = [
        "| broken STRIDED construction | 7.1 | 7.2 | first counterexample |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['property_7_1']} | {r['property_7_2']} | {r['counterexample']} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the JSON files and tables.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_facts()

    a2 = assumption2_rows()
    write_json(out / "assumption2.json", {"zeta": ZETA, "eta": ETA, "rows": a2, "machine": machine})
    cms = [
        {"label": label, **verify_contextual_mapping(cm).to_dict()} for label, cm in constructions()
    ]
    broken = [
        {"label": label, **verify_contextual_mapping(cm).to_dict()}
        for label, cm in broken_constructions()
    ]
    write_json(
        out / "contextual-mapping.json",
        {"constructions": cms, "broken": broken, "machine": machine},
    )
    text = [
        f"{machine['cpu']}, torch {machine['torch']}, {machine['torch_threads']} thread(s)",
        "",
        f"### Assumption 2, ζ = {ZETA}, η = {ETA}",
        "",
        *assumption2_table(a2),
        "",
        "### Contextual mappings (exact arithmetic)",
        "",
        *mapping_table(cms),
        "",
        "### Broken constructions",
        "",
        *broken_table(broken),
        "",
    ]
    write_text(out / "tables.md", "\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main()
