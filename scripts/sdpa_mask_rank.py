"""Why the dense engine hands SDPA a 4-D mask: torch's CPU kernel runs a per-head mask given as
(H, n, n) about 3x slower than the same mask as (1, H, n, n). Forward + backward at the copying
task's shape (B = 32, H = 4, n = 256, d = 16), 1 thread, mean of 5 after 2 warm-ups; then the
user path: ``sparse_attention`` with a MULTIHEAD pattern object on projection-layout q, k, v.

    python scripts/sdpa_mask_rank.py
"""

import platform
import time

import torch
import torch.nn.functional as F

import sparseattn as sa


def cpu_model() -> str:
    with open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def timed(fn, reps: int = 5) -> float:
    for _ in range(2):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    b, h, n, d = 32, 4, 256, 16
    pattern = sa.split_heads(sa.fixed(16, 1), sa.fixed(16, 2))
    mask = pattern.graph(n, num_heads=h).to_dense()  # (H, n, n)
    x = torch.randn(b, n, 3 * h * d)  # a fused projection's output
    q, k, v = (t.requires_grad_() for t in x.view(b, n, 3, h, d).permute(2, 0, 3, 1, 4).detach())

    def step(fn):
        return lambda: fn().sum().backward()

    three = timed(step(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)))
    four = timed(step(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None])))
    ours = timed(step(lambda: sa.sparse_attention(q, k, v, pattern, engine="dense")))
    print(f"{cpu_model()}, torch {torch.__version__}, 1 thread")
    print(f"SDPA, mask (H, n, n):    {three * 1e3:6.1f} ms")
    print(f"SDPA, mask (1, H, n, n): {four * 1e3:6.1f} ms  ({three / four:.1f}x faster)")
    print(f"sparse_attention(split_heads pattern, engine='dense'): {ours * 1e3:6.1f} ms")


if __name__ == "__main__":
    main()
