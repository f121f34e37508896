"""Draw one figure of time and peak memory against n from several kept ``sparseattn bench full``
runs (one ``--only PATTERN`` run per pattern), as the full suite draws its own ``bench.png``.

    python scripts/bench_plot.py \
        docs/results/bench/full-{longformer,bigbird,strided,random}-amd-20261127/results.json \
        --out docs/img/bench.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sparseattn.lab.bench.kernels import plot_runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="results.json of each run")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = parser.parse_args()
    plot_runs(args.results, args.out)


if __name__ == "__main__":
    main()
