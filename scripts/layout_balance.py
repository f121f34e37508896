"""How evenly a pattern's block layout spreads the Triton entmax kernels' work over programs.

One program per (query block, head) walks its query block's key blocks (pairs) one after the
other, several times in the forward (pass 0, the threshold passes, the last pass) and once in
the backward's dq. A query block that visits far more key blocks than the others — the block
of a Longformer's or BigBird's global query tokens visits every key block — is one long serial
program. This prints, per pattern and length, the pairs per query block (mean and max) and the
longest program's pairs over one SM's share of the whole launch (total pairs · heads / SMs):
above 1, the launch cannot end before that one program, however the others are scheduled.
The last column is the longest program once the query blocks above ``--split`` times the
mean are cut into chunks (``triton_entmax.split_plan``, what ``TritonOptions.split_long`` does).

A second table models the launch order: programs of durations ∝ pairs, started in grid order
on ``--sms`` × ``--per-sm`` slots, each taking the next program when free (a list schedule),
ended at the makespan; over its lower bound max(total / slots, longest program), for the
query-block order head after head (grid (nbq, B·H)) and for every head's query blocks
longest first (``TritonOptions.longest_first``, grid (B·H, nbq)).
Device-independent (the layout only); the SM count is a parameter (132: the H100 SXM).

    python scripts/layout_balance.py > docs/results/engines/layout-balance/block64.txt
"""

from __future__ import annotations

import argparse
import heapq

import torch

import sparseattn as sa
from sparseattn.engines.triton_entmax import causal_layout, graph_layout, split_plan


def makespan(durations: list[float], slots: int) -> float:
    """When the last of ``durations`` ends, started in order on ``slots`` free slots."""
    free = [0.0] * slots
    heapq.heapify(free)
    for d in durations:
        heapq.heappush(free, heapq.heappop(free) + d)
    return max(free)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ns", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--sms", type=int, default=132)
    parser.add_argument("--split", type=float, default=4.0)
    parser.add_argument("--per-sm", type=int, default=2, help="programs an SM runs at once")
    args = parser.parse_args()
    patterns = {
        "longformer(512, 16)": sa.longformer(512, 16),
        "window(512)": sa.window(512),
        "bigbird(192, 16, 3, 64)": sa.bigbird(192, 16, 3, 64),
    }
    print(f"block {args.block}, {args.heads} heads, {args.sms} SMs")
    split = f"split x{args.split:g}: max / SM share"
    head = "| pattern | n | query blocks | pairs per query block: mean | max | max / SM share |"
    print(f"{head} {split} |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, pattern in patterns.items():
        for n in args.ns:
            layout = graph_layout(pattern.graph(n), args.block)
            per = (layout.row_ptr[1:] - layout.row_ptr[:-1]).double()
            share = per.sum().item() * args.heads / args.sms
            plan = split_plan(layout, args.split, torch.device("cpu"))
            longest = per.max().item()
            if plan is not None:
                kept = per.clone()
                kept[plan.long_rb.long()] = 0
                longest = max(kept.max().item(), (plan.ch_end - plan.ch_start).max().item())
            print(
                f"| {name} | {n} | {per.numel()} | {per.mean().item():.1f} | "
                f"{per.max().item():.0f} | {per.max().item() / share:.2f} | "
                f"{longest / share:.2f} |"
            )
    slots = args.sms * args.per_sm
    print(f"\nlist schedule on {slots} slots: makespan / max(total / slots, longest program)")
    print("| pattern | n | query-block order | longest first |")
    print("|---|---:|---:|---:|")
    layouts = {
        name: (lambda n, p=p: graph_layout(p.graph(n), args.block)) for name, p in patterns.items()
    }
    layouts["causal"] = lambda n: causal_layout(n, n, args.block)
    for name, make in layouts.items():
        for n in args.ns:
            row_ptr = make(n).row_ptr.double()
            per = (row_ptr[1:] - row_ptr[:-1]).tolist()
            bound = max(sum(per) * args.heads / slots, max(per))
            in_order = makespan(per * args.heads, slots)
            first = makespan(
                [p for p in sorted(per, reverse=True) for _ in range(args.heads)], slots
            )
            print(f"| {name} | {n} | {in_order / bound:.3f} | {first / bound:.3f} |")


if __name__ == "__main__":
    main()
