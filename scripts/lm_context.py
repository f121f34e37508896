"""The byte LM trained by one process and by two with its sequence sharded (issue 42 item 6).

Runs ``sparseattn lm`` on two columns (strided-union crosses the shard boundary from every row of
the second half; star's last position reads every key and is merged across ranks) for 100 steps,
in float32 and float64, once in one process and once under ``torchrun --nproc-per-node 2
--parallel context``, and writes both loss curves and their largest relative difference
(docs/parallel.md, "A real run"). About ten minutes on 2 cores.

    .venv/bin/python scripts/lm_context.py docs/results/parallel/lm-context.json
"""

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
WORK = Path(tempfile.mkdtemp(prefix="lm-context-"))
OUT = WORK / "runs"
shutil.rmtree(OUT, ignore_errors=True)
COLS, W, STEPS = ("strided-union", "star"), 16, 100
ARGS = [
    "lm",
    "--patterns",
    ",".join(COLS),
    "--widths",
    str(W),
    "--seeds",
    "0",
    "--steps",
    str(STEPS),
]
result = {
    "what": "sparseattn lm (byte LM, n = 256, d = 64, 2 layers x 4 heads, batch 4, lr 3e-3, "
    "warm-up 50, cosine) trained by one process and by torchrun --nproc-per-node 2 with "
    "--parallel context (each window's 256 positions sharded 128 + 128 over 2 gloo processes); "
    "per-step training losses and the validation loss compared",
    "columns": list(COLS),
    "w": W,
    "steps": STEPS,
    "runs": {},
}
for dtype in ("float32", "float64"):
    for mode in ("single", "context"):
        out = OUT / f"{mode}-{dtype}"
        args = [*ARGS, "--dtype", dtype, "--out-dir", str(out)]
        if mode == "single":
            cmd = [str(BIN / "sparseattn"), *args]
            shown = ["sparseattn", *args]
        else:
            args += ["--parallel", "context"]
            cmd = [
                str(BIN / "torchrun"),
                "--nproc-per-node",
                "2",
                "--standalone",
                "-m",
                "sparseattn.lab.cli",
                *args,
            ]
            shown = [
                "torchrun",
                "--nproc-per-node",
                "2",
                "--standalone",
                "-m",
                "sparseattn.lab.cli",
                *args,
            ]
        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        subprocess.run(
            cmd,
            cwd=WORK,
            check=True,
            timeout=600,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wall = time.perf_counter() - t0
        load1 = os.getloadavg()[0]
        cells = {}
        for c in COLS:
            (p,) = glob.glob(str(out / f"*/cells/{c}-w{W}-s0.json"))
            cells[c] = json.loads(Path(p).read_text())
        result["runs"][f"{mode} {dtype}"] = {
            "command": " ".join(a.replace(str(OUT), "OUT") for a in shown),
            "wall_seconds": round(wall, 1),
            "load_before": round(load0, 2),
            "load_after": round(load1, 2),
            "cells": {
                c: {
                    "workers": v["workers"],
                    "parallel": v["parallel"],
                    "train_seconds": round(v["train_seconds"], 2),
                    "validation_loss": v["loss"],
                    "train_losses": v["train_losses"],
                }
                for c, v in cells.items()
            },
        }
        result.setdefault("machine", cells[COLS[0]]["machine"])
summary = {}
for dtype in ("float32", "float64"):
    s, c = result["runs"][f"single {dtype}"]["cells"], result["runs"][f"context {dtype}"]["cells"]
    per = {}
    for col in COLS:
        a, b = c[col]["train_losses"], s[col]["train_losses"]
        per[col] = {
            "max_relative_train_loss_difference": max(
                abs(x - y) / abs(y) for x, y in zip(a, b, strict=True)
            ),
            "relative_validation_loss_difference": abs(
                c[col]["validation_loss"] - s[col]["validation_loss"]
            )
            / s[col]["validation_loss"],
        }
    summary[dtype] = {
        "max_relative_train_loss_difference": max(
            v["max_relative_train_loss_difference"] for v in per.values()
        ),
        "per_column": per,
        "tolerance": {"float32": 1e-4, "float64": 1e-9}[dtype],
    }
result["summary"] = summary
m = result["machine"]
result["machine"] = {k: m[k] for k in ("cpu", "cores", "torch", "python") if k in m}
text = json.dumps(result, indent=1)
Path(sys.argv[1]).write_text(text + "\n")
print(len(text), json.dumps(summary, indent=1))
for k, v in result["runs"].items():
    print(
        k,
        v["wall_seconds"],
        v["load_before"],
        v["load_after"],
        {c: x["train_seconds"] for c, x in v["cells"].items()},
    )
