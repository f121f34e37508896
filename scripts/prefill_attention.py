"""One decoder layer's attention at prefill, alone: causal SDPA against the sliding window with
sinks that `sparseattn bench prefill` uses, on the Llama shape (8 query heads, 2 key/value heads,
d = 64), plain (k, v expanded) and grouped (``enable_gqa=True``, as hf.sparsify runs it).
Best of 3 after a warm-up.

    python scripts/prefill_attention.py --n 16384
"""

import argparse
import time

import torch
import torch.nn.functional as F

import sparseattn as sa


def best(fn, repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=16384)
    n = parser.parse_args().n
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, n, 64, generator=gen)
    k, v = (torch.randn(1, 2, n, 64, generator=gen) for _ in range(2))
    ke, ve = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
    pattern = sa.sliding_window(512, 16)
    with torch.no_grad():
        dense = best(lambda: F.scaled_dot_product_attention(q, ke, ve, is_causal=True))
        plain = best(lambda: sa.sparse_attention(q, ke, ve, pattern))
        group = best(lambda: sa.sparse_attention(q, k, v, pattern, enable_gqa=True))
    print(
        f"n = {n}, {torch.get_num_threads()} threads: causal SDPA {dense * 1e3:.0f} ms, "
        f"sliding_window(512, 16) {plain * 1e3:.0f} ms, grouped {group * 1e3:.0f} ms "
        f"({dense / group:.1f}x)"
    )


if __name__ == "__main__":
    main()
