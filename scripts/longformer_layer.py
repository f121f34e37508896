"""One Longformer-base self-attention layer, transformers' own against ``hf.sparsify``'s, on CPU.

A random-weight ``LongformerModel`` of Longformer-base's width (hidden 768, 12 heads,
attention window 512), its first ``LongformerSelfAttention`` called directly on (1, n, 768)
hidden states with ``--globals`` global tokens (the first ones), projections included, forward
only, under ``torch.no_grad``: interleaved medians of ``--repeats`` warm calls, peak memory
of one call in a process of its own (the peak resident set, reset through
``/proc/self/clear_refs`` just before the call, over the resident set then), and the largest
difference of the two outputs.

    python scripts/longformer_layer.py --ns 1024 4096 --threads 1 \
        --out docs/results/hf/longformer-layer-1t.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

from sparseattn.lab.results import interleaved_medians, machine_facts, timing_facts

ONE_CALL = """
import sys, torch
sys.path.insert(0, {root!r})
from longformer_layer import build
torch.set_num_threads({threads})
attn, args = build({n}, {globals}, {sparse})
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


def build(n: int, globals_: int, sparse: bool):
    """(the layer's self-attention module, its positional arguments)."""
    import transformers

    from sparseattn import hf

    config = transformers.LongformerConfig(
        hidden_size=768, num_attention_heads=12, num_hidden_layers=1, intermediate_size=3072,
        attention_window=512, max_position_embeddings=n + 2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LongformerModel(config).eval()
    if sparse:
        hf.sparsify(model)
    attn = model.encoder.layer[0].attention.self
    hidden = torch.randn(1, n, 768, generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(1, n)
    mask[:, :globals_] = 1.0  # > 0: global (transformers' extended mask), 0: local
    return attn, (hidden, mask, mask < 0, mask > 0, globals_ > 0)


def measure(n: int, globals_: int, threads: int, repeats: int) -> dict:
    """One row: medians, peak memory and the largest difference at length n."""
    ref_attn, ref_args = build(n, globals_, False)
    attn, sp_args = build(n, globals_, True)
    with torch.no_grad():
        diff = float((attn(*sp_args)[0] - ref_attn(*ref_args)[0]).abs().max())
        calls = {"transformers": lambda: ref_attn(*ref_args), "sparseattn": lambda: attn(*sp_args)}
        med = interleaved_medians(calls, repeats)
    memory = {}
    root = os.path.dirname(os.path.abspath(__file__))
    for name, sparse in (("transformers", False), ("sparseattn", True)):
        code = ONE_CALL.format(root=root, threads=threads, n=n, globals=globals_, sparse=sparse)
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
        memory[name] = float(out.stdout.split()[-1])
    return {
        "n": n,
        "globals": globals_,
        "ms transformers": 1e3 * med["transformers"],
        "ms sparseattn": 1e3 * med["sparseattn"],
        "speedup": med["transformers"] / med["sparseattn"],
        "peak MB transformers": memory["transformers"],
        "peak MB sparseattn": memory["sparseattn"],
        "max abs diff": diff,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ns", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--globals", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="results/hf/longformer-layer.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    facts = timing_facts(args.threads)
    rows = []
    for n in args.ns:
        rows.append(measure(n, args.globals, args.threads, args.repeats))
        print(json.dumps(rows[-1]))
    facts["load after"] = os.getloadavg()[0]
    result = {"command": " ".join(sys.argv), "machine": machine_facts(), **facts, "rows": rows}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
