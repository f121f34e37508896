"""The d_min study of Likhosherstov et al. (Fig. 3) on the paper's grid, several parameter sets.

Runs ``sparseattn.lab.experiments.dmin.run`` for each parameter set below on n = 512, 768, ..., 3072
(the paper's grid), d grid step 8 scanned coarse-to-fine (``coarse``: every 8th d first), Q = 1,
in rounds: round r adds matrix A number r for every n of every set, so a run stopped by
``--minutes`` still covers the whole n range with fewer matrices. Each set's metrics.json is
copied to ``--copy-to`` as ``<run>.json``; ``--plot`` redraws the figures from such copies.
``--part NAME`` runs other lengths of the same sets in folders of their own (``paper-<set>+NAME``);
``--plot`` merges a set's parts.

Parameter sets (eq. (6) <= 2n, where the theorem makes a claim, noted; causal A has k + 1
nonzeros per row with the diagonal, and eq. (22) is evaluated with k + 1):

* k = 1, gamma = 2, eps = (0.25, 2): the earlier default; eq. (6) <= 2n from n = 1536.
* k = 2, gamma = 2, eps = (0.25, 2): eq. (6) > 2n on the whole grid.
* k = 2, gamma = 2, eps = (0.9, 20): eq. (6) <= 2n from n = 1792.
* causal, k = 1 (+ diagonal), gamma = 2, eps = (0.9, 20): as the previous, for CSAM.

    python scripts/dmin_paper_grid.py --device cuda --minutes 8 --copy-to "$OUT"
    .venv/bin/python scripts/dmin_paper_grid.py --plot results/expressivity/dmin-paper
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from sparseattn.lab.experiments.dmin import PAPER_NS, DminConfig, plot
from sparseattn.lab.experiments.dmin_grid import SETS, printed, summaries


def configs(args: argparse.Namespace) -> dict[str, DminConfig]:
    ns = tuple(args.n) if args.n else PAPER_NS
    return {
        name: DminConfig(
            **params,
            ns=ns,
            draws=args.draws,
            d_step=8,
            coarse=args.coarse,
            device=args.device,
            run=f"paper-{name}" + (f"+{args.part}" if args.part else ""),
            out_dir=args.out_dir,
            threads=args.threads,
            progress=False,
        )
        for name, params in SETS.items()
        if not args.only or name in args.only
    }


def _copier(cfgs: dict[str, DminConfig], dest: Path, stop: threading.Event) -> None:
    """Copy each set's metrics.json (rewritten after every cell) to ``dest`` every 10 s, so
    that a run killed at its time limit still returns every finished cell."""

    def copy() -> None:
        for cfg in cfgs.values():
            src = Path(cfg.out_dir) / cfg.run / "metrics.json"
            if src.exists():
                shutil.copy(src, dest / f".{cfg.run}.tmp")
                (dest / f".{cfg.run}.tmp").replace(dest / f"{cfg.run}.json")

    while not stop.wait(10):
        copy()
    copy()


def run_rounds(args: argparse.Namespace) -> None:
    from sparseattn.lab.experiments.dmin import run

    deadline = time.perf_counter() + 60 * args.minutes
    cfgs = configs(args)
    stop = threading.Event()
    if args.copy_to:
        copier = threading.Thread(target=_copier, args=(cfgs, Path(args.copy_to), stop))
        copier.start()
    try:
        _rounds(args, cfgs, deadline, run)
    finally:
        stop.set()
        if args.copy_to:
            copier.join()


def _rounds(args: argparse.Namespace, cfgs: dict[str, DminConfig], deadline: float, run) -> None:
    for r in range(1, args.draws + 1):
        for name, cfg in cfgs.items():
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            start = time.perf_counter()
            result = run(replace(cfg, draws=r, time_limit_s=left))
            cells = result["cells"]
            print(
                f"round {r} {name}: {len(cells)} cells, "
                f"{time.perf_counter() - start:.0f} s this call; "
                + " ".join(f"{c['n']}:{c['d_min']}" for c in cells.values() if c["draw"] == r - 1),
                flush=True,
            )


def replot(folder: Path) -> None:
    """Write ``printed.md`` (see ``printed``), one figure per set and the combined figure."""
    sets = summaries(folder, verbose=True)
    if not sets:
        raise SystemExit(f"no paper-<set>.json files in {folder}")
    for name, (cfg, s) in sets.items():
        plot(cfg, {"1": s}, folder / f"paper-{name}.png")
    lines = printed(sets)
    (folder / "printed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    _combined_figure({name: s for name, (_, s) in sets.items()}, folder / "dmin_paper_grid.png")


def _combined_figure(summaries: dict[str, dict], path: Path) -> None:
    """One panel per set: d_min of every matrix, the ln n and sqrt n fits (no bound: eq. (6) and
    2n are 10-50x larger and would flatten the points; the tables give them)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(summaries), figsize=(4.2 * len(summaries), 3.6))
    for ax, (name, s) in zip(axes, summaries.items(), strict=True):
        xs = [r["n"] for r in s["table"] for _ in r["d_min"]]
        ys = [d for r in s["table"] for d in r["d_min"]]
        ax.scatter(xs, ys, s=16, facecolors="none", edgecolors="red", label="d_min (one A each)")
        lo, hi = min(xs), max(xs)
        grid = [lo * (hi / lo) ** (t / 60) for t in range(61)]
        f, q = s["fit"], s["fit_sqrt"]
        ax.plot(
            grid,
            [f["slope"] * math.log(g) + f["intercept"] for g in grid],
            "k:",
            label=f"{f['slope']:.1f} ln n {f['intercept']:+.0f} (R² {f['r2']:.3f})",
        )
        ax.plot(
            grid,
            [q["slope"] * math.sqrt(g) + q["intercept"] for g in grid],
            "g-.",
            label=f"{q['slope']:.2f} √n {q['intercept']:+.0f} (R² {q['r2']:.3f})",
        )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("n")
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("least d meeting (7), (8)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--minutes", type=float, default=8.0, help="stop starting cells after")
    parser.add_argument("--draws", type=int, default=5, help="matrices A per n (rounds)")
    parser.add_argument("--coarse", type=int, default=8)
    parser.add_argument("--n", type=int, action="append", help="lengths (default paper grid)")
    parser.add_argument("--only", action="append", help="parameter set names (repeat)")
    parser.add_argument("--part", default=None, help="run folder suffix, for other lengths")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out-dir", default="results/expressivity/dmin-paper")
    parser.add_argument("--copy-to", default=None, help="copy each set's metrics.json here")
    parser.add_argument("--plot", default=None, help="only redraw figures from this folder")
    args = parser.parse_args(argv)
    if args.plot:
        replot(Path(args.plot))
    else:
        run_rounds(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
