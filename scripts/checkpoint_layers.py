"""One checkpoint-size attention layer, transformers' own against ``hf.sparsify``'s, on CPU.

``--model longformer``: a random-weight ``LongformerModel`` of Longformer-base's width (hidden
768, 12 heads, attention window 512), its first ``LongformerSelfAttention`` called directly on
(1, n, 768) hidden states with ``--globals`` global tokens (the first ones); eval mode only
(training mode differs by attention dropout alone). ``--model bigbird``: a random-weight
``BigBirdModel`` of BigBird-RoBERTa-base's width (hidden 768, 12 heads, block 64, 3 random
blocks), its first ``BigBirdBlockSparseAttention`` called directly with transformers'
block-sparse masks (no padding), in eval mode (band and global blocks, block 0 counted r + 1
times) and, with ``--modes eval train``, in training mode (layer 0's random draw; no dropout in
either). One layer each (the layers of a checkpoint are alike), projections included, batch 1,
forward only under ``torch.no_grad``, ``--threads`` torch threads. The layers and their
inputs come from :func:`sparseattn.lab.models.checkpoints.build` (random weights from seed 0),
which the GPU bench's models section shares.

Time: interleaved medians of ``--repeats`` warm calls (after one warm-up call each), every call
kept; interleaved with them, one E × E projection of the n hidden states (``ms projection``,
``projection GFLOP/s``: the GEMM rate the layers' projections run at, for the floor).
Peak memory: one call in a fresh process per side (the first call: the sparsified layer
builds its graph there), the peak resident set — VmHWM, reset through ``/proc/self/clear_refs``
just before the call — minus the resident set then, so tensors allocated and freed inside the
call count, the model's weights and the inputs do not. Max abs diff: the two outputs.

A size whose original layer would not fit is skipped for it (the sparsified layer is still
measured), with the reason in the row: predicted peak above ``--memory-fraction`` of the
available memory (a power law through the two previous sizes' peaks, and for BigBird at least
the n × n float32 ``attention_probs`` per head that transformers fills whatever
``output_attentions`` says), or predicted time of its calls above ``--max-seconds``.

    python scripts/checkpoint_layers.py --model longformer --ns 1024 4096 16384 --threads 1 \
        --out docs/results/hf/longformer-layer-1t.json
    python scripts/checkpoint_layers.py --model bigbird --ns 1024 4096 16384 \
        --modes eval train --threads 1 --out docs/results/hf/bigbird-layer-1t.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

import torch

from sparseattn.lab.models.checkpoints import BASE, build
from sparseattn.lab.results import interleaved, machine_facts

HIDDEN, HEADS = BASE.hidden, BASE.heads

ONE_CALL = """
import torch
from sparseattn.lab.models.checkpoints import build
torch.set_num_threads({threads})
attn, args = build({model!r}, {n}, {sparse}, {mode!r}, {globals})
def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))  # kB
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak resident set (VmHWM) restarts from the resident set now
before = status("VmRSS:")
with torch.no_grad():
    attn(*args)
print((status("VmHWM:") - before) / 1024)
"""


def peak_mb(args, n: int, sparse: bool, mode: str) -> float:
    """The peak resident set of one call in a fresh process, MB (see the module docstring)."""
    code = ONE_CALL.format(
        threads=args.threads, model=args.model, n=n, sparse=sparse, mode=mode,
        globals=args.globals,
    )  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"the memory run failed ({out.returncode}):\n{out.stderr[-2000:]}")
    return float(out.stdout.split()[-1])


def dump(result: dict) -> str:
    """The result as JSON, one line per field and per row."""
    fields = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in result.items() if k != "rows"]
    rows = ",\n".join(f"  {json.dumps(row)}" for row in result["rows"])
    return "{\n" + ",\n".join([*fields, f' "rows": [\n{rows}\n ]']) + "\n}\n"


def available_mb() -> float:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) / 1024


def extrapolate(done: list[tuple[int, float]], n: int) -> float | None:
    """A power law through the last two (size, value) points at n (one point: linear)."""
    if not done:
        return None
    if len(done) == 1:
        (n0, y0) = done[0]
        return y0 * n / n0
    (n0, y0), (n1, y1) = done[-2:]
    power = math.log(y1 / y0) / math.log(n1 / n0)
    return y1 * (n / n1) ** power


def skip_reason(args, n: int, seen: dict) -> str | None:
    """Why the original layer is not run at n (None: it is), from the sizes measured before."""
    floor = 4 * HEADS * n * n / 2**20 if args.model == "bigbird" else 0.0  # attention_probs
    peak = max(extrapolate(seen["peak"], n) or 0.0, floor)
    limit = args.memory_fraction * available_mb()
    if peak > limit:
        return (
            f"predicted peak {peak:.0f} MB > {args.memory_fraction} x the {available_mb():.0f} MB "
            "available"
        )
    per_call = extrapolate(seen["seconds"], n)
    calls = args.repeats + 3  # warm-up, difference, memory
    if per_call is not None and per_call * calls > args.max_seconds:
        return f"predicted {per_call * calls:.0f} s for its {calls} calls > {args.max_seconds} s"
    return None


def measure(args, n: int, mode: str, seen: dict) -> dict:
    """One row at length n: times, peak memory and the largest difference."""
    row: dict = {"n": n}
    row.update({"globals": args.globals} if args.model == "longformer" else {"mode": mode})
    row["load"] = round(os.getloadavg()[0], 2)
    skipped = skip_reason(args, n, seen)
    attn, sp_args = build(args.model, n, True, mode, args.globals)
    weight = attn.query.weight
    calls = {
        "sparseattn": lambda: attn(*sp_args),
        "projection": lambda: torch.nn.functional.linear(sp_args[0], weight),
    }
    with torch.no_grad():
        if skipped is None:
            ref_attn, ref_args = build(args.model, n, False, mode, args.globals)
            diff = (attn(*sp_args)[0] - ref_attn(*ref_args)[0]).abs().max()
            row["max abs diff"] = float(diff)
            calls = {"transformers": lambda: ref_attn(*ref_args), **calls}
        times = interleaved(calls, args.repeats)
    for name, ts in times.items():
        row[f"ms {name}"] = round(1e3 * sorted(ts)[len(ts) // 2], 1)
        row[f"ms {name} all"] = [round(1e3 * t, 1) for t in ts]
    row["projection GFLOP/s"] = round(2 * n * HIDDEN**2 / row["ms projection"] / 1e6, 1)
    for name in ("transformers", "sparseattn")[1 if skipped else 0 :]:
        row[f"peak MB {name}"] = round(peak_mb(args, n, name == "sparseattn", mode), 1)
    if skipped is None:
        row["speedup"] = round(row["ms transformers"] / row["ms sparseattn"], 2)
        seen["peak"].append((n, row["peak MB transformers"]))
        seen["seconds"].append((n, row["ms transformers"] / 1e3))
    else:
        row["transformers skipped"] = skipped
    row["load after"] = round(os.getloadavg()[0], 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["longformer", "bigbird"], required=True)
    parser.add_argument("--ns", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--modes", nargs="+", choices=["eval", "train"], default=["eval"])
    parser.add_argument("--globals", type=int, default=16, help="Longformer's global tokens")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--memory-fraction", type=float, default=0.5)
    parser.add_argument("--max-seconds", type=float, default=300.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.model == "longformer" and args.modes != ["eval"]:
        parser.error("--modes is BigBird's: Longformer's layer computes the same in both modes")
    import transformers

    torch.set_num_threads(args.threads)
    facts = machine_facts()
    result = {
        "script": "scripts/checkpoint_layers.py",
        "command": "python " + " ".join(sys.argv),
        "model": args.model,
        "layer": {
            "longformer": "LongformerSelfAttention, hidden 768, 12 heads, window 512",
            "bigbird": "BigBirdBlockSparseAttention, hidden 768, 12 heads, block 64, 3 random",
        }[args.model],
        "batch": 1,
        "time": f"median of {args.repeats} interleaved warm calls under torch.no_grad, ms",
        "memory": "VmHWM - VmRSS of one call in a fresh process (clear_refs 5 before it), MB",
        "cpu": facts["cpu"],
        "cpu capability": facts["torch_cpu_capability"],
        "cores": facts["cores"],
        "threads": args.threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": facts["python"],
        "load before": [round(x, 2) for x in os.getloadavg()],  # 1, 5 and 15 minutes
        "rows": [],
    }
    for mode in args.modes:
        seen: dict = {"peak": [], "seconds": []}
        for n in sorted(args.ns):
            result["rows"].append(measure(args, n, mode, seen))
            print(json.dumps(result["rows"][-1]), flush=True)
    result["load after"] = [round(x, 2) for x in os.getloadavg()]
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        f.write(dump(result))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
