"""How often the first parallel element-wise op of a new process is inexact, with torch alone:
each of ``--processes`` fresh Pythons (two threads) takes the square root of 3200 entries of
0.5 (split over both threads) and counts the entries that differ from the first, once as the
process's first parallel op and once after a warm-up op on 2¹⁶ entries.

    python scripts/first_parallel_op.py --processes 100 \
        --out docs/results/compat/first-parallel-op.json

On the project's 2-core machines a few processes in a hundred got the second thread's half
wrong by 3e-4 relative (√0.5 = 0.70690918 instead of 0.70710677), the first op only: the
fresh-process round-trip tests (``tests/fresh.py``) warm the pool before their code.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from sparseattn.lab.results import timing_record, write_json

CHILD = """
import json, sys, torch
torch.set_num_threads(2)
if sys.argv[1] == "warm":
    torch.full((1 << 16,), 0.5).sqrt()
r = torch.full((3200,), 0.5).sqrt()
print(json.dumps([int((r != r[0]).sum()), r[-1].item()]))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=100)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    counts = {}
    for mode in ("cold", "warm"):
        wrong, values = 0, set()
        for _ in range(args.processes):
            run = subprocess.run(
                [sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True
            )
            bad, last = json.loads(run.stdout)
            wrong += bad > 0
            values.add(last)
        counts[mode] = {
            "processes with wrong entries": wrong,
            "last entry's values": sorted(values),
        }
        print(mode, counts[mode], flush=True)
    result = timing_record(
        "scripts/first_parallel_op.py", load_before, processes=args.processes, counts=counts
    )
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
