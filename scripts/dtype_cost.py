"""What half-precision inputs cost on CPU: the block engine's forward + backward on
``longformer(128, 4)``, (1, 8, 2048, 64), for float32, bf16 and fp16 inputs, process CPU
time of one thread, median of ``--repeats`` (docs/engines.md, "Mixed precision").

    python scripts/dtype_cost.py --repeats 5 --processes 3 \
        --out docs/results/engines/dtype-cost/now.json

Each row runs in ``--processes`` fresh processes; a row whose call raises is recorded with the
error instead of a time (the engines before half inputs were widened to float32 crashed on the
split path). ``sparseattn`` is whichever is first on PYTHONPATH, so the same script times an
older commit's engines: ``git archive COMMIT sparseattn/ | tar -x -C OLD`` and
``PYTHONPATH=OLD python scripts/dtype_cost.py ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

import sparseattn as sa
from sparseattn.lab.results import machine_facts  # also in older commits' sparseattn

MAPS = ("softmax", "entmax15")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def time_row(rho: str, dtype: str, repeats: int) -> dict:
    """One (map, dtype) row in this process: median process CPU time of forward + backward."""
    torch.set_num_threads(1)
    pattern = sa.longformer(128, 4)
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(3, 1, 8, 2048, 64, generator=gen)
    q, k, v = (t.to(DTYPES[dtype]).requires_grad_() for t in base.unbind(0))
    times = []
    try:
        for _ in range(repeats + 1):
            start = time.process_time()
            out = sa.sparse_attention(q, k, v, pattern, prob_map=rho, engine="block")
            out.sum().backward()
            times.append(time.process_time() - start)
    except Exception as err:  # noqa: BLE001 - the error is the measurement
        return {"map": rho, "dtype": dtype, "error": f"{type(err).__name__}: {err}"[:200]}
    return {"map": rho, "dtype": dtype, "ms": 1e3 * statistics.median(times[1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--out", help="JSON file for the rows and the machine")
    parser.add_argument("--row", nargs=2, metavar=("MAP", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.row:
        print(json.dumps(time_row(*args.row, args.repeats)))
        return
    facts = machine_facts()
    report = {
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "sparseattn": os.path.dirname(sa.__file__),
        "cpu": facts["cpu"],
        "torch": facts["torch"],
        "load_before": facts["load_average"],
        "rows": [],
    }
    for rho in MAPS:
        for dtype in DTYPES:
            runs = []
            for _ in range(args.processes):
                cmd = [sys.executable, __file__, "--repeats", str(args.repeats)]
                cmd += ["--row", rho, dtype]
                done = subprocess.run(cmd, capture_output=True, text=True, check=True)
                runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
            row = {"map": rho, "dtype": dtype}
            if "error" in runs[0]:
                row["error"] = runs[0]["error"]
            else:
                row["ms_per_process"] = [round(r["ms"], 1) for r in runs]
            print(json.dumps(row), flush=True)
            report["rows"].append(row)
    report["load_after"] = os.getloadavg()
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
