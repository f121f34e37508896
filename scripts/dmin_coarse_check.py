"""Does the coarse-to-fine d scan give the paper's ascending-scan d_min? Rerun cells with coarse=1.

For each parameter set of ``dmin_paper_grid.py`` and each n given, runs the same cells (same A,
same Y seeds per d) with the full ascending scan and prints both answers. The coarse answers are
read from ``--coarse-dir`` (the ``paper-<set>/metrics.json`` folders of a coarse run).

    python scripts/dmin_coarse_check.py --device cuda --n 512 --n 1024 --n 2048 --n 3072
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from sparseattn.lab.experiments.dmin import DminConfig, run
from sparseattn.lab.experiments.dmin_grid import SETS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--n", type=int, action="append", required=True)
    parser.add_argument("--draws", type=int, default=1)
    parser.add_argument("--coarse-dir", default="results/expressivity/dmin-paper")
    parser.add_argument("--out-dir", default="results/expressivity/dmin-full-scan")
    parser.add_argument("--out", default=None, help="write the comparison JSON here")
    args = parser.parse_args(argv)
    rows = []
    for name, params in SETS.items():
        base = DminConfig(**params, d_step=8, device=args.device, progress=False)
        cfg = replace(base, ns=tuple(args.n), draws=args.draws, coarse=1, run=f"full-{name}")
        full = run(replace(cfg, out_dir=args.out_dir))["cells"]
        path = Path(args.coarse_dir) / f"paper-{name}" / "metrics.json"
        coarse = json.loads(path.read_text())["cells"] if path.exists() else {}
        for key, cell in full.items():
            other = coarse.get(key, {}).get("d_min")
            rows.append({"set": name, "cell": key, "full": cell["d_min"], "coarse": other})
            print(f"{name} {key}: full scan {cell['d_min']}, coarse-to-fine {other}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
