"""The host time the user path adds to a compiled FlexAttention call, per call.

At a small size the kernel is cheap, so per-call time shows what each layer costs the host:
compiled ``flex_attention`` called by hand (a ``create_block_mask`` BlockMask of the same
Longformer predicate); the engine's own compiled function called by hand with its cached
BlockMask (the compiled call alone, as the engine makes it), and the same after a sum over k
(beside the sum alone: what a small step between two compiled calls costs); ``flex_engine``
called directly;
``sparse_attention(q, k, v, pattern, engine="flex")`` and ``engine="auto"``; and those two
with the compiled call replaced by a stub that returns q: what is left is sparseattn's own
Python (on CPU also without the finiteness checks, as on a GPU). On a GPU the calls are
asynchronous: per-call time is the host's as long as the kernel is shorter. Each row: the
least, over ``--repeats`` rounds, of the mean over ``--calls`` back-to-back calls (noise only
adds); the rows take turns within a round, so that the machine's drift reaches them alike. On
CPU the user path also checks the output finite and the engine k (GPU: skipped); ``auto``
picks the block engine on CPU at this size.

    python scripts/host_overhead.py --out docs/results/flex/host-overhead-cpu.json
    python scripts/host_overhead.py --stubbed-only   # the stubbed rows alone, in seconds
    python3 scripts/host_overhead.py --device cuda --out "$OUT/host-overhead-cuda.json"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import sparseattn as sa
import sparseattn.attention as attention
import sparseattn.engines.flex as flex_engine
from sparseattn.lab.bench import cuda_timing
from sparseattn.lab.results import timing_facts


def per_call_us(calls: dict, device: str, n_calls: int, repeats: int) -> dict[str, float]:
    """µs per call of each of ``calls``: the least, over ``repeats`` rounds, of the mean over
    ``n_calls`` back-to-back calls; the rows take turns within each round, so that a drift of
    the machine's speed reaches every row alike."""
    for call in calls.values():
        for _ in range(5):
            call()
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(repeats):
        for name, call in calls.items():
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n_calls):
                call()
            if device == "cuda":
                torch.cuda.synchronize()
            best[name] = min(best[name], (time.perf_counter() - t0) / n_calls)
    return {name: round(t * 1e6, 1) for name, t in best.items()}


def user_calls(q, k, v, pattern) -> dict:
    """The user path's two rows: ``sparse_attention`` with ``engine="flex"`` and ``"auto"``."""
    return {
        "sparseattn flex": lambda: sa.sparse_attention(q, k, v, pattern, engine="flex"),
        "sparseattn auto": lambda: sa.sparse_attention(q, k, v, pattern),
    }


def measure(args: argparse.Namespace) -> dict:
    n, w, g = args.n, args.n // 8, 2
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    q, k, v = (t.to(args.device, dtype) for t in torch.randn(3, 1, 1, n, 16, generator=gen))

    def by_hand(b, h, i, j):
        return ((i - j).abs() <= w) | (i < g) | (j < g)

    compiled = cuda_timing.user_compiled_flex(flex_attention)  # torch.compile, once a run
    block_mask = create_block_mask(by_hand, None, None, n, n, device=args.device)
    pattern = sa.longformer(2 * w, g)
    graph = attention.resolve_graph(pattern, q, k)  # the graph the user path uses
    scale = q.shape[-1] ** -0.5
    ours, generic = flex_engine._cached_block_mask(graph, flex_engine.FLEX_BLOCK, q.device)
    engine_call = flex_engine._compiled(flex_engine._dynamic(q, k, v, generic))
    softmax = sa.softmax()
    calls = {
        "flex direct": lambda: compiled(q, k, v, block_mask=block_mask),
        "engine's compiled call": lambda: engine_call(q, k, v, None, ours, scale, False),
        "the same after a sum of k": lambda: (
            k.sum(),
            engine_call(q, k, v, None, ours, scale, False),
        ),
        "sum of k": lambda: k.sum(),
        "flex engine": lambda: flex_engine.flex_engine(q, k, v, graph, softmax, scale),
        **user_calls(q, k, v, pattern),
    }
    row: dict = {"n": n, "shape": [1, 1, n, 16], "dtype": str(dtype).removeprefix("torch.")}
    with torch.no_grad():
        if not args.stubbed_only:
            for name, us in per_call_us(calls, args.device, args.calls, args.repeats).items():
                row[f"{name} us"] = us
        compiled_call = flex_engine._compiled
        flex_engine._compiled = lambda dynamic: lambda q, k, v, *rest: q
        host_checks = attention._host_checks
        try:
            # a pattern of its own: the calls kept per signature hold the stub
            stubbed = user_calls(q, k, v, sa.longformer(2 * w, g))
            for name, us in per_call_us(stubbed, args.device, args.calls, args.repeats).items():
                row[f"{name}, call stubbed us"] = us
            if args.device == "cpu":  # as on a GPU: no finiteness checks
                attention._host_checks = lambda t: False
                flex = {"flex": stubbed["sparseattn flex"]}
                us = per_call_us(flex, "cpu", args.calls, args.repeats)["flex"]
                row["sparseattn flex, call stubbed, no host checks us"] = us
        finally:
            flex_engine._compiled = compiled_call
            attention._host_checks = host_checks
    if args.stubbed_only:
        return row
    row["flex over direct us"] = round(row["sparseattn flex us"] - row["flex direct us"], 1)
    its_call = row["engine's compiled call us"]
    row["engine over its call us"] = round(row["flex engine us"] - its_call, 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--n", type=int, default=128)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--stubbed-only",
        action="store_true",
        help="only the rows with the compiled call stubbed (seconds: to compare commits)",
    )
    parser.add_argument("--out", default=None, help="JSON file for the row and machine facts")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    facts = timing_facts(args.threads)
    facts["commit"] = subprocess.run(
        ["git", "describe", "--always", "--dirty"], capture_output=True, text=True, check=False
    ).stdout.strip()
    facts["torch.compile takes recompile_limit"] = flex_engine._COMPILE_HAS_LIMIT
    if args.device == "cuda":
        facts["gpu"] = torch.cuda.get_device_name(0)
    row = measure(args)
    facts["load after"] = os.getloadavg()[0]
    print(json.dumps(row), flush=True)
    print(json.dumps(facts))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"facts": facts, "row": row}, f, indent=1)


if __name__ == "__main__":
    main()
