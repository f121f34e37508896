"""Where one call's time goes on a CUDA GPU: device time, host time, host-device syncs, kernels.

For each case (bf16, q, k, v of shape (1, 8, n, 64), ``longformer(512, 16)``, as in
``sparseattn bench gpu``'s main section), forward (no grad) and forward + backward:

* device: CUDA events around 20 back-to-back calls, per call;
* host: the host's time to issue one call after a synchronize (no sync of its own inside:
  then host < device and the GPU never waits for the host);
* syncs: ``torch.cuda.set_sync_debug_mode("warn")`` over one call, with the innermost frames of
  each synchronising call;
* kernels: ``torch.profiler`` over 5 calls: kernels per call and the top rows by self CPU and
  by CUDA time (all tables in ``$OUT/profile.txt``).

Cases: compiled ``flex_attention`` with a hand-written mask_mod ("direct", the bench's
baseline), ``sparse_attention(..., engine="flex")``, ``engine="auto"``, 1.5-entmax (Triton
kernels), and one training step of ``SparseAttention(512, 8)`` and ``nn.MultiheadAttention``.

Usage (repository root, CUDA machine): ``python scripts/gpu_profile.py [--n 8192] [--out DIR]``
(about a minute, most of it compiling).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import traceback
import warnings
from pathlib import Path

import torch

import sparseattn as sa
from sparseattn.lab.bench.cuda_timing import sample as _sample
from sparseattn.lab.bench.gpu import GPU_SUITES, _flex_by_hand


def _cases(n: int) -> dict:
    suite = GPU_SUITES["gpu-quick"]
    gen = torch.Generator(device="cuda").manual_seed(n)
    shape = (1, suite.heads, n, suite.head_dim)
    q, k, v, g = (
        torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(4)
    )
    for t in (q, k, v):
        t.requires_grad_(True)
    pattern = sa.longformer(suite.window, suite.sinks)
    direct = _flex_by_hand(suite, q, k, v, suite.head_dim**-0.5)

    def ours(engine, rho="softmax"):
        return lambda: sa.sparse_attention(q, k, v, pattern, prob_map=rho, engine=engine)

    x = torch.randn(1, n, suite.embed_dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    x.requires_grad_(True)
    layer = sa.SparseAttention(suite.embed_dim, suite.heads, pattern=pattern)
    mha = torch.nn.MultiheadAttention(suite.embed_dim, suite.heads, batch_first=True)
    layer, mha = (m.to("cuda", torch.bfloat16) for m in (layer, mha))
    grad_x = torch.randn_like(x)

    def step(m):
        def call():
            m.zero_grad(set_to_none=True)
            out = m(x) if m is layer else m(x, x, x, need_weights=False)[0]
            out.backward(grad_x)

        return call

    attention = {
        "direct": direct,
        "flex": ours("flex"),
        "auto": ours("auto"),
        "entmax15": ours("auto", "entmax15"),
    }
    cases = {}
    for name, fn in attention.items():
        cases[f"{name} fwd"] = _no_grad(fn)
        cases[f"{name} fwd+bwd"] = lambda fn=fn: torch.autograd.grad(fn(), (q, k, v), g)
    cases["SparseAttention step"] = step(layer)
    cases["nn.MultiheadAttention step"] = step(mha)
    return cases


def _no_grad(fn):
    def call():
        with torch.no_grad():
            return fn()

    return call


def _device_ms(fn, calls: int = 20) -> float:
    torch.cuda.synchronize()
    return _sample(fn, calls) * 1e3


def _host_ms(fn, calls: int = 20) -> float:
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e3


def _syncs(fn) -> list[str]:
    found = []

    def show(message, category, filename, lineno, file=None, line=None):
        frames = [
            f"{Path(f.filename).name}:{f.lineno} {f.name}"
            for f in traceback.extract_stack()[:-1]
            if "warnings" not in f.filename and "gpu_profile" not in f.filename
        ]
        found.append(" <- ".join(reversed(frames[-4:])))

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        old = warnings.showwarning
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = old
    torch.cuda.synchronize()
    return found


def _profile(fn, calls: int = 5) -> tuple[int, str, str]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    averages = prof.key_averages()
    by_cpu = averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70)
    by_cuda = averages.table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=70)
    return kernels // calls, by_cpu, by_cuda


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report = args.out / f"profile-n{args.n}.txt"
    with torch._dynamo.config.patch(recompile_limit=64), report.open("w") as file:
        for name, fn in _cases(args.n).items():
            start = time.perf_counter()
            for _ in range(3):
                fn()
            warm = time.perf_counter() - start
            device, host = _device_ms(fn), _host_ms(fn)
            syncs = _syncs(fn)
            kernels, by_cpu, by_cuda = _profile(fn)
            line = (
                f"n={args.n} {name:28s} device {device:8.3f} ms  host {host:8.3f} ms  "
                f"kernels/call {kernels:4d}  syncs {len(syncs)}  (warm-up {warm:.1f} s)"
            )
            print(line, flush=True)
            for s in syncs[:3]:
                print(f"    sync: {s}", flush=True)
            file.write(f"{line}\n" + "".join(f"    sync: {s}\n" for s in syncs))
            file.write(f"{by_cpu}\n{by_cuda}\n\n")
            file.flush()


if __name__ == "__main__":
    main()
