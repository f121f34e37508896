"""One BigBird-RoBERTa-base self-attention layer, transformers' own against the sparsified one.

A random-weight ``BigBirdModel`` of BigBird-RoBERTa-base's width (hidden 768, 12 heads, block
size 64, 3 random blocks, 4096 positions), its first ``BigBirdBlockSparseAttention`` called
directly on (1, n, 768) hidden states with transformers' block-sparse masks (no padding),
projections included, forward only, under ``torch.no_grad``, in eval mode (band and global
blocks, block 0 counted r + 1 times) and, with ``--modes eval train``, with the module in
training mode too (layer 0's random draw; no dropout in either): interleaved medians of
``--repeats`` warm calls, peak memory of one call in a process of its own (the first call: for
the sparsified layer it includes building the layout's graph, which is then kept; the peak
resident set, reset through ``/proc/self/clear_refs`` just before the call, over the resident
set then), and the largest difference of the two outputs.

    python scripts/bigbird_layer.py --ns 1024 4096 --modes eval train --threads 1 \
        --out docs/results/hf/bigbird-layer-1t.json
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
from bigbird_layer import build
torch.set_num_threads({threads})
attn, args = build({n}, {mode!r}, {sparse})
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


def build(n: int, mode: str, sparse: bool):
    """(the layer's block-sparse self-attention module, its positional arguments)."""
    import transformers

    from sparseattn.hf import bigbird

    config = transformers.BigBirdConfig(
        hidden_size=768, num_attention_heads=12, num_hidden_layers=1, intermediate_size=3072,
        block_size=64, num_random_blocks=3, max_position_embeddings=max(4096, n),
        attention_type="block_sparse",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BigBirdModel(config).train(mode == "train")
    if sparse:
        bigbird.sparsify(model)
    attn = model.encoder.layer[0].attention.self
    hidden = torch.randn(1, n, 768, generator=torch.Generator().manual_seed(1))
    masks = transformers.BigBirdModel.create_masks_for_block_sparse_attn(torch.ones(1, n), 64)
    blocked, band, from_mask, to_mask = masks
    return attn, (hidden, band, from_mask, to_mask, blocked, blocked)


def measure(n: int, mode: str, threads: int, repeats: int) -> dict:
    """One row: medians, peak memory and the largest difference at length n."""
    ref_attn, ref_args = build(n, mode, False)
    attn, sp_args = build(n, mode, True)
    with torch.no_grad():
        diff = float((attn(*sp_args)[0] - ref_attn(*ref_args)[0]).abs().max())
        calls = {"transformers": lambda: ref_attn(*ref_args), "sparseattn": lambda: attn(*sp_args)}
        med = interleaved_medians(calls, repeats)
    memory = {}
    root = os.path.dirname(os.path.abspath(__file__))
    for name, sparse in (("transformers", False), ("sparseattn", True)):
        code = ONE_CALL.format(root=root, threads=threads, n=n, mode=mode, sparse=sparse)
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
        memory[name] = float(out.stdout.split()[-1])
    return {
        "n": n,
        "mode": mode,
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
    parser.add_argument("--modes", nargs="+", choices=["eval", "train"], default=["eval"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="results/hf/bigbird-layer.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    facts = timing_facts(args.threads)
    rows = []
    for mode in args.modes:
        for n in args.ns:
            rows.append(measure(n, mode, args.threads, args.repeats))
            print(json.dumps(rows[-1]))
    facts["load after"] = os.getloadavg()[0]
    result = {"command": " ".join(sys.argv), "machine": machine_facts(), **facts, "rows": rows}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
