"""Work counts of the Triton entmax kernel that do not depend on the device: how many threshold
passes each query block takes (each pass recomputes q·kᵀ over the block's key tiles; the
forward does 1 + passes + 1 of them) and what share of the (query block, key block) tiles hold
a non-zero weight (the others skip the value product, and the backward skips them entirely).

Runs under Triton's interpreter on CPU (slow: keep n ≤ 1024) or on a GPU. Inputs: Gaussian
q, k, v, scale c/sqrt(d) for the given temperatures c (c = 1: scores ~ N(0, 1)); with
``--local A`` q and k also carry A·sqrt(d)·e(i), e(i) sinusoids of d/2 frequencies from 1 to
1/n with e(i)·e(j) = mean_f cos(ω_f (i − j)), so that scores favour nearby keys (attention
with locality: most far tiles hold no weight).

    TRITON_INTERPRET=1 python scripts/triton_entmax_passes.py --n 512 --d 64

``--time`` (meant for a GPU) also times the kernel, forward and forward + backward, in
``--dtype`` against ``scaled_dot_product_attention`` (dense and ``is_causal``) on the same
inputs: medians of ``--repeats`` calls after a warm-up, CUDA events on a GPU.

    python scripts/triton_entmax_passes.py --n 8192 --heads 8 --time --dtype bfloat16
"""

import argparse
import os
import statistics
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from sparseattn.engines import triton_entmax as te  # noqa: E402
from sparseattn.lab.bench.gpu import with_locality  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--temperatures", default="1,4")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--local", type=float, default=0.0)
    parser.add_argument("--time", action="store_true")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--topk", type=int, default=te.DEFAULT_OPTIONS.topk, help="TritonOptions.topk"
    )
    args = parser.parse_args()
    with te.tuning(topk=args.topk):  # validates it, as for the bench's sweep
        run(args)


def run(args: argparse.Namespace) -> None:
    """Count the passes (and with ``--time`` time the kernel) for the parsed ``args``."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(args.seed)
    shape = (1, args.heads, args.n, args.d)
    q, k, v = (torch.randn(shape, generator=gen) for _ in range(3))
    if args.local:
        q, k = with_locality(q, k, args.local)
    q, k, v = (x.to(device) for x in (q, k, v))
    layouts = {
        "dense": te.dense_layout(args.n, args.n, args.block),
        "causal": te.causal_layout(args.n, args.n, args.block),
    }
    gidx = torch.zeros(args.heads, dtype=torch.int32, device=device)
    print(
        f"device {device}, n {args.n}, d {args.d}, heads {args.heads}, block {args.block}, "
        f"local {args.local}, topk {args.topk}"
    )
    print("layout  alpha  c  passes mean  max  tiles with weights")
    for c in (float(x) for x in args.temperatures.split(",")):
        scale = c / args.d**0.5
        for name, layout in layouts.items():
            layout = layout.to(q.device)
            for alpha in (1.5, 2.0, 1.25):
                start = time.perf_counter()
                _, _, _, nz, passes = te._launch_forward(
                    q, k, v, layout, gidx, None, alpha, scale, need_grad=True
                )
                nz = nz[:, : layout.pairs].float()
                print(
                    f"{name:7} {alpha:5} {c:2g} {passes.float().mean():11.2f} "
                    f"{int(passes.max()):4d}  {nz.mean():.3f}"
                    f"   ({time.perf_counter() - start:.1f} s)"
                )
    if args.time:
        timings(q, k, v, layouts, args)


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up (compiles)
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def timings(q, k, v, layouts, args) -> None:
    """1.5-entmax kernel against SDPA softmax on the same inputs, forward and forward+backward."""
    import torch.nn.functional as F

    dtype = getattr(torch, args.dtype)
    q, k, v = (x.to(dtype).requires_grad_() for x in (q, k, v))
    scale = 1 / args.d**0.5
    print(f"times (ms, medians of {args.repeats}), {args.dtype}; ratio to SDPA in brackets")
    for name, layout in layouts.items():
        layout = layout.to(q.device)
        causal = name == "causal"

        def ours(layout=layout):
            return te.entmax_attention(q, k, v, layout, 1.5, scale)

        def sdpa(causal=causal):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)

        row = []
        for fn in (ours, sdpa):
            with torch.no_grad():
                fwd = _median_ms(fn, args.repeats)
            both = _median_ms(lambda fn=fn: fn().sum().backward(), args.repeats)
            row.append((fwd, both))
        (f1, b1), (f2, b2) = row
        print(
            f"{name:7} entmax15 fwd {f1:.3f} [{f1 / f2:.2f}x]  fwd+bwd {b1:.3f} [{b1 / b2:.2f}x]"
            f"   SDPA fwd {f2:.3f}  fwd+bwd {b2:.3f}"
        )


if __name__ == "__main__":
    main()
