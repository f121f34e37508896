"""d_min(eps1, eps2) versus n: Likhosherstov et al. (AAAI 2023), Figures 3 and 4.

For each n on a grid and each of ``draws`` random k-nonzero-bounded, gamma-variation-bounded
right stochastic matrices A (union of k random permutation matrices, values 1 or gamma by a coin
flip), scan an ascending grid of even d and record the least d for which the Theorem 0.4
construction (redrawing the Stiefel matrix Y up to round(Q·n) times) meets eqs. (7) and (8).
Then fit d_min = a·ln n + b and d_min = a·sqrt(n) + b (R² of each), and compare d_min with the
bound the theorem actually gives, min(eq. (6)/(22), 2n): eq. (6) is a claim only where it is at
most 2n, and at d = 2n the construction is exact. A causal A keeps the diagonal, so it has up to
k + 1 nonzeros per row and column, and the theory columns use k + 1. Several Q give Figure 4.

Writes ``<out_dir>/<run>/config.json``, ``metrics.json`` (after every finished cell, atomically;
a re-run with the same config skips finished cells) and ``dmin.png``.
Run: ``sparseattn expressivity dmin`` (see ``--help``) or ``run(DminConfig())``.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...methods.likhosherstov.expressivity import (
    _device,
    least_construct_d,
    random_sparse_stochastic,
    theorem_d,
    theorem_slope,
)
from ...validate import check_finite_float, check_int, check_positive
from ..progress import tqdm
from ..results import machine_facts, run_folder, torch_threads, write_json
from .registry import Experiment, SummaryTable, figures_in
from .runner import run_name_digest

#: The paper's grid: n from 512 to 3072 in steps of 256, 5 matrices per n.
PAPER_NS = tuple(range(512, 3073, 256))


@dataclass(frozen=True)
class DminConfig:
    """One d_min study. Fields above ``run`` define the results; the rest only where and how."""

    k: int = 1  # A is the union of k random permutation matrices (k-nonzero-bounded)
    gamma: float = 2.0  # nonzeros are 1 or gamma by a coin flip (gamma-variation-bounded)
    eps1: float = 0.25  # eq. (7): zero entries of A -> ratio below eps1
    eps2: float = 2.0  # eq. (8): nonzero ratios within a factor exp(±eps2)
    ns: tuple[int, ...] = (16, 32, 64, 128, 256)  # sequence lengths (paper: PAPER_NS)
    draws: int = 5  # matrices A per n (paper: 5)
    d_step: int = 4  # d grid: d_step, 2·d_step, ... up to 2n (2n, where it is exact, comes last)
    qs: tuple[float, ...] = (1.0,)  # redraws of Y per d = round(Q·n) (paper: Q = 1; Fig. 4)
    causal: bool = False  # Corollary 0.7: lower-triangular A (diagonal kept), CSAM
    seed: int = 0
    coarse: int = 1  # 1: ascending d scan (paper); m > 1: every m-th d first, then fill in
    device: str = "cpu"  # where the Y draws run ("cuda": other random numbers than the CPU's)
    run: str | None = None  # run folder name; default derived from the fields above
    out_dir: str = "results/expressivity/dmin"
    threads: int = 1  # torch threads (the machine is shared)
    progress: bool = True
    time_limit_s: float | None = None  # stop starting new cells after this long (resumable)

    def identity(self) -> dict[str, Any]:
        """The fields that determine the results (a re-run with equal identity resumes; draws
        is left out, so a run with more draws extends one with fewer)."""
        d = asdict(self)
        for key in ("draws", "run", "out_dir", "threads", "progress", "time_limit_s"):
            d.pop(key)
        d["ns"], d["qs"] = list(self.ns), list(self.qs)
        return d

    def run_name(self) -> str:
        if self.run:
            return self.run
        kind = "causal-" if self.causal else ""
        digest = run_name_digest(self.identity())
        return f"{kind}k{self.k}-g{self.gamma:g}-e{self.eps1:g}-{self.eps2:g}-{digest}"

    def validate(self) -> DminConfig:
        check_positive("k", self.k)
        check_finite_float("gamma", self.gamma, 1.0)
        check_finite_float("eps1", self.eps1, 0.0, 1.0, low_open=True, high_open=True)
        check_finite_float("eps2", self.eps2, 0.0, low_open=True)
        if not self.ns:
            raise ValueError("ns must be a non-empty list of lengths >= 2")
        for n in self.ns:
            check_int("ns[i] (a length n)", n, 2)
        check_positive("draws", self.draws)
        if check_int("d_step", self.d_step, 2) % 2:
            raise ValueError(f"d_step must be an even number >= 2, got {self.d_step}")
        if not self.qs:
            raise ValueError("qs must be a non-empty list of positive factors")
        for q in self.qs:
            check_finite_float("qs[i] (a factor Q)", q, 0.0, low_open=True)
        check_positive("threads", self.threads)
        check_positive("coarse", self.coarse)
        _device(self.device)  # a name torch knows, and CUDA only where it is available
        if self.time_limit_s is not None:
            check_finite_float("time_limit_s", self.time_limit_s, 0.0, low_open=True)
        return self


@dataclass
class _Cell:
    q: float
    n: int
    draw: int
    key: str = field(init=False)

    def __post_init__(self) -> None:
        self.key = f"q={self.q:g}/n={self.n}/draw={self.draw}"


def _fit(points: list[tuple[int, int]], law: str = "log") -> dict[str, float] | None:
    """Least squares d = a·f(n) + b over (n, d) points, f = ln (``law="log"``) or sqrt
    (``law="sqrt"``); returns slope a, intercept b and R² (None with fewer than two n)."""
    if len({n for n, _ in points}) < 2:
        return None
    f = math.log if law == "log" else math.sqrt
    x = torch.tensor([f(n) for n, _ in points], dtype=torch.float64)
    y = torch.tensor([float(d) for _, d in points], dtype=torch.float64)
    design = torch.stack([x, torch.ones_like(x)], 1)
    sol = torch.linalg.lstsq(design, y[:, None]).solution.flatten()
    a, b = float(sol[0]), float(sol[1])
    resid = y - (a * x + b)
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((resid**2).sum()) / ss_tot if ss_tot > 0 else 1.0
    return {"slope": a, "intercept": b, "r2": r2}


def summarise(config: DminConfig, cells: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per-Q fits and per-n tables from the finished cells."""
    out: dict[str, Any] = {}
    # causal A keeps the diagonal as well: k + 1 nonzeros per row enter eq. (6)
    k = config.k + 1 if config.causal else config.k
    slope = theorem_slope(k, config.gamma, config.eps1, config.eps2)
    for q in config.qs:
        done = [c for c in cells.values() if c["q"] == q]
        table = []
        for n in config.ns:
            ds = sorted(c["d_min"] for c in done if c["n"] == n)
            if ds:
                eq6 = theorem_d(n, k, config.gamma, config.eps1, config.eps2)
                table.append(
                    {
                        "n": n,
                        "d_min": ds,
                        "mean": sum(ds) / len(ds),
                        "theorem_d": eq6,
                        "2n": 2 * n,
                        "bound": min(eq6, 2 * n),
                        "theorem_applies": eq6 <= 2 * n,
                        "mean_over_bound": sum(ds) / len(ds) / min(eq6, 2 * n),
                    }
                )
        points = [(c["n"], c["d_min"]) for c in done]
        fit = _fit(points)
        applies = [(c["n"], c["d_min"]) for c in done if _applies(config, k, c["n"])]
        out[f"{q:g}"] = {
            "table": table,
            "fit": fit,
            "fit_sqrt": _fit(points, "sqrt"),
            "k_in_theory": k,
            "theory_slope": slope,
            "theory_over_fit": slope / fit["slope"] if fit and fit["slope"] > 0 else None,
            "theorem_applies_at": [n for n in config.ns if _applies(config, k, n)],
            "fit_where_theorem_applies": _fit(applies),
        }
    return out


def _applies(config: DminConfig, k: int, n: int) -> bool:
    """Whether Theorem 0.4 makes a claim at n: eq. (6) with these constants is at most 2n."""
    return theorem_d(n, k, config.gamma, config.eps1, config.eps2) <= 2 * n


def plot(config: DminConfig, summary: dict[str, Any], path: Path) -> None:
    """Figure 3 (d_min vs n, log-x, fit and theoretical slope) and, with several Q, Figure 4."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 if len(config.qs) > 1 else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 3.8), squeeze=False)
    q0 = f"{1.0 if 1.0 in config.qs else config.qs[0]:g}"  # the paper's Q = 1 when run
    ax = axes[0][0]
    s = summary[q0]
    xs = [row["n"] for row in s["table"] for _ in row["d_min"]]
    ys = [d for row in s["table"] for d in row["d_min"]]
    ax.scatter(xs, ys, s=18, facecolors="none", edgecolors="red", label="d_min (one A each)")
    ns = [row["n"] for row in s["table"]]
    if s["fit"] and ns:
        a, b = s["fit"]["slope"], s["fit"]["intercept"]
        grid = [ns[0] * (ns[-1] / ns[0]) ** (t / 50) for t in range(51)]
        fit_label = f"fit {a:.1f}·ln n {b:+.1f}"
        ax.plot(grid, [a * math.log(g) + b for g in grid], "k:", label=fit_label)
        if s["fit_sqrt"]:
            a2, b2 = s["fit_sqrt"]["slope"], s["fit_sqrt"]["intercept"]
            sq_label = f"fit {a2:.2f}·√n {b2:+.1f}"
            ax.plot(grid, [a2 * math.sqrt(g) + b2 for g in grid], "g-.", lw=0.9, label=sq_label)
        bound = [row["bound"] for row in s["table"]]
        ax.plot(ns, bound, "b--", label="min(eq. 6, 2n)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("n")
    ax.set_ylabel("least d meeting (7), (8)")
    kind = "CSAM" if config.causal else "SAM"
    ax.set_title(
        f"{kind}: k={config.k}, γ={config.gamma:g}, ε1={config.eps1:g}, ε2={config.eps2:g}, Q={q0}",
        fontsize=9,
    )
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    if panels == 2:
        ax2 = axes[0][1]
        for q in config.qs:
            rows = summary[f"{q:g}"]["table"]
            ax2.plot(
                [r["n"] for r in rows], [r["mean"] for r in rows], "o-", ms=3, label=f"Q={q:g}"
            )
        ax2.set_xscale("log", base=2)
        ax2.set_xlabel("n")
        ax2.set_ylabel("mean d_min over draws")
        ax2.set_title("dependence on the redraw factor Q (Fig. 4)", fontsize=9)
        ax2.legend(fontsize=8)
    fig.tight_layout()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)


def _cell(config: DminConfig, cell: _Cell) -> dict[str, Any]:
    """d_min for one (Q, n, draw): the same A for every Q, Y seeds that depend on (n, draw, Q)."""
    a = random_sparse_stochastic(
        cell.n,
        config.k,
        config.gamma,
        seed=config.seed * 1_000_003 + cell.n * 1_009 + cell.draw,
        causal=config.causal,
    )
    start = time.perf_counter()
    d_values = range(config.d_step, 2 * cell.n + 1, config.d_step)  # 2n is tried last anyway
    y_seed = config.seed * 7_919 + cell.n * 31 + cell.draw * 3 + round(cell.q * 1000) * 100_019
    d_min, res = least_construct_d(
        a,
        config.eps1,
        config.eps2,
        d_values,
        q=cell.q,
        seed=y_seed,
        causal=config.causal,
        coarse=config.coarse,
        device=config.device,
    )
    return {
        "q": cell.q,
        "n": cell.n,
        "draw": cell.draw,
        "d_min": d_min,
        "y_draws_at_d_min": res.draws,
        "eps1_achieved": res.eps1,
        "eps2_achieved": res.eps2,
        "nonzeros_per_row_max": int((a > 0).sum(1).max()),
        "seconds": time.perf_counter() - start,
    }


def run(config: DminConfig) -> dict[str, Any]:
    """Run (or resume) the study; returns the metrics dict written to metrics.json."""
    config.validate()
    folder = run_folder(Path(config.out_dir) / config.run_name(), config.identity())
    metrics_path = folder / "metrics.json"
    cells: dict[str, dict[str, Any]] = {}
    if metrics_path.exists():
        cells = json.loads(metrics_path.read_text()).get("cells", {})
    todo = [
        _Cell(q, n, r) for q in config.qs for n in sorted(config.ns) for r in range(config.draws)
    ]
    pending = [c for c in todo if c.key not in cells]
    with torch_threads(config.threads):
        machine = machine_facts()

        def metrics(complete: bool) -> dict[str, Any]:
            return {
                "cells": cells,
                "summary": summarise(config, cells),
                "complete": complete,
                "machine": machine,
                "run": config.run_name(),
            }

        started = time.perf_counter()
        bar = tqdm(
            pending,
            total=len(todo),
            initial=len(todo) - len(pending),
            desc="d_min cells",
            disable=not config.progress,
        )
        for cell in bar:
            if config.time_limit_s and time.perf_counter() - started > config.time_limit_s:
                break
            bar.set_postfix_str(cell.key)
            cells[cell.key] = _cell(config, cell)
            write_json(metrics_path, metrics(False))
    result = metrics(all(c.key in cells for c in todo))
    result["total_seconds"] = sum(c["seconds"] for c in cells.values())
    write_json(metrics_path, result)
    plot(config, result["summary"], folder / "dmin.png")
    result["folder"] = str(folder)
    return result


# --------------------------------------------------------------------------- the registry's view
def summary_tables(config: DminConfig, result: dict[str, Any]) -> list[SummaryTable]:
    """One table per Q (what ``sparseattn expressivity dmin`` prints and the tour shows): d_min
    per draw and its mean against eq. (6) and 2n, then the fits against ln n and √n."""
    tables = []
    for qs, s in result["summary"].items():
        rows = [
            (
                str(row["n"]),
                " ".join(map(str, row["d_min"])),
                f"{row['mean']:.1f}",
                str(row["theorem_d"]),
                str(row["2n"]),
                str(row["bound"]),
            )
            for row in s["table"]
        ]
        notes = []
        if s["fit"]:
            fit, sq = s["fit"], s["fit_sqrt"]
            notes.append(
                f"fit d = {fit['slope']:.2f}·ln n {fit['intercept']:+.2f} (R² {fit['r2']:.3f}); "
                f"d = {sq['slope']:.3f}·√n {sq['intercept']:+.2f} (R² {sq['r2']:.3f}); "
                f"eq. (6) slope in ln n {s['theory_slope']:.1f} (k = {s['k_in_theory']}); "
                f"eq. (6) <= 2n at n = {s['theorem_applies_at'] or 'none of the grid'}"
            )
        header = ("n", "d_min per draw", "mean", "eq. (6)", "2n", "min(eq. 6, 2n)")
        tables.append(SummaryTable(f"d_min, Q = {qs} ({result['folder']})", header, rows, notes))
    return tables


EXPERIMENT = Experiment(
    name="dmin",
    config=DminConfig,
    run=run,
    summary=summary_tables,
    figures=lambda config, result: figures_in(result["folder"], "dmin.png"),
)
