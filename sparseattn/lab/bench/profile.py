"""Where the block engine's time goes: ``torch.profiler`` over one forward (or forward+backward)
call of a suite pattern, and the flash kernel's share and rate.

``python -m sparseattn.lab.bench.profile [pattern] [n] [--backward] [--block B] [--threads T]``
(pattern: longformer, bigbird, strided or random as in ``sparseattn.lab.bench.kernels``; default
longformer 8192, B = 1, H = 8, d = 64, fp32, torch's default threads).
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from sparseattn.engines import block_attention
from sparseattn.engines.layout import block_plan, choose_block
from sparseattn.lab.bench.kernels import make_pattern
from sparseattn.maps import softmax

FLASH = "aten::_scaled_dot_product_flash_attention_for_cpu"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pattern", nargs="?", default="longformer")
    parser.add_argument("n", nargs="?", type=int, default=8192)
    parser.add_argument("--backward", action="store_true", help="profile forward+backward")
    parser.add_argument("--block", type=int, default=0, help="block size (0: choose_block)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    heads, d = 8, 64
    graph = make_pattern(args.pattern).graph(args.n)
    q, k, v = (torch.randn(1, heads, args.n, d, requires_grad=args.backward) for _ in range(3))
    b = args.block or choose_block(graph, train=args.backward)

    def call() -> None:
        with torch.set_grad_enabled(args.backward):
            out = block_attention(q, k, v, graph, softmax(), 1 / math.sqrt(d), block=b)
            if args.backward:
                out.sum().backward()

    call()  # builds and caches the plan
    start = time.perf_counter()
    call()
    wall = time.perf_counter() - start
    with torch.profiler.profile() as prof:
        call()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    print(events.table(sort_by="self_cpu_time_total", row_limit=12))
    flash = sum(e.self_cpu_time_total for e in events if e.key == FLASH)
    plan = block_plan(graph, b)
    scored = sum(
        c.rows.numel() * (c.full.shape[1] + (0 if c.extra is None else c.extra.shape[1]))
        for c in plan.chunks(heads, 1 << 18, True)
    )
    flops = 4 * scored * b * b * d * heads
    print(
        f"{args.pattern} n={args.n} b={b} threads={torch.get_num_threads()}: "
        f"{wall * 1e3:.1f} ms unprofiled; {total / 1e3:.1f} ms self CPU profiled; "
        f"flash forward kernel {flash / 1e3:.1f} ms "
        f"({flash / total:.0%}), {flops / max(flash, 1) / 1e3:.0f} GF/s on the "
        f"{scored * b * b * heads / 1e6:.1f} M entries it scores"
    )


if __name__ == "__main__":
    main()
