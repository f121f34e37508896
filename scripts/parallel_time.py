"""Forward + backward time of context parallelism on CPU with gloo (issue 42 item 7).

P processes × 1 thread running ``sparseattn.parallel.sparse_attention`` on their shards
against one process running ``sparseattn.sparse_attention`` on the whole sequence with 1
thread and with P threads, measured in the same run (medians of ``--repeats`` after one
warm-up call, which also builds the plan, the graphs and the engines' plans). The shards'
time is the slowest rank's, communication included. Prints one JSON line per measurement
and the ratios.

    python scripts/parallel_time.py                      # Longformer(512, 16), N = 16384
    python scripts/parallel_time.py --n 8192 --pattern window --w 256 --map entmax15
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import sparseattn as sa
from sparseattn import parallel as cp
from sparseattn.lab.results import timing_facts


def _pattern(args) -> sa.Pattern:
    if args.pattern == "longformer":
        return sa.longformer(args.w, args.globals)
    if args.pattern == "window":
        return sa.window(args.w)
    if args.pattern == "sliding_window":
        return sa.sliding_window(args.w, args.globals)
    raise SystemExit(f"unknown pattern {args.pattern}")


def _inputs(args, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, args.n, args.d)
    return [torch.randn(shape, generator=gen, dtype=dtype) for _ in range(3)]


def _step(fn, q, k, v) -> float:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    start = time.perf_counter()
    out = fn(q, k, v)
    out.backward(torch.ones_like(out))
    return time.perf_counter() - start


def _single(args, threads: int) -> float:
    torch.set_num_threads(threads)
    q, k, v = _inputs(args)
    pattern = _pattern(args)

    def fn(q, k, v):
        return sa.sparse_attention(q, k, v, pattern, prob_map=args.map)

    _step(fn, q, k, v)
    return statistics.median(_step(fn, q, k, v) for _ in range(args.repeats))


def _rank(rank: int, world: int, port: int, args, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    q, k, v = (cp.shard(t) for t in _inputs(args))
    pattern = _pattern(args)

    def fn(q, k, v):
        return cp.sparse_attention(q, k, v, pattern, prob_map=args.map)

    _step(fn, q, k, v)
    times = []
    for _ in range(args.repeats):
        dist.barrier()
        elapsed = torch.tensor([_step(fn, q, k, v)], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank
        times.append(float(elapsed))
    if rank == 0:
        queue.put(statistics.median(times))
    dist.destroy_process_group()


def _sharded(args) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(
        _rank, args=(args.parts, port, args, queue), nprocs=args.parts, start_method="spawn"
    )
    return queue.get()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pattern", default="longformer")
    parser.add_argument("--w", type=int, default=512)
    parser.add_argument("--globals", type=int, default=16)
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--parts", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--map", default="softmax")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="also write the rows and the machine's facts as JSON")
    args = parser.parse_args()
    facts = {
        **timing_facts(threads=1),
        "pattern": repr(_pattern(args)),
        **{k: getattr(args, k) for k in ("n", "parts", "batch", "heads", "d", "map")},
    }
    one = _single(args, 1)
    many = _single(args, args.parts)
    sharded = _sharded(args)
    rows = [
        {"run": "1 process, 1 thread", "seconds": one},
        {"run": f"1 process, {args.parts} threads", "seconds": many},
        {"run": f"{args.parts} processes x 1 thread (gloo)", "seconds": sharded},
    ]
    facts["load after"] = os.getloadavg()[0]
    for row in rows:
        print(json.dumps(facts | row))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**facts, "rows": rows, "sharded / 1 thread": sharded / one}, f, indent=1)
    print(
        f"sharded / 1 thread = {sharded / one:.2f}; sharded / {args.parts} threads = "
        f"{sharded / many:.2f}"
    )


if __name__ == "__main__":
    main()
