"""What half-precision inputs cost on CPU: the block engine's forward + backward on
``longformer(128, 4)``, (1, 8, 2048, 64), for float32, bf16 and fp16 inputs, process CPU
time of one thread, median of ``--repeats`` (docs/engines.md, "Mixed precision").

    python scripts/dtype_cost.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import sparseattn as sa


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pattern = sa.longformer(128, 4)
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(3, 1, 8, 2048, 64, generator=gen)
    for rho in ("softmax", "entmax15"):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            q, k, v = (t.to(dtype).requires_grad_() for t in base.unbind(0))
            times = []
            for _ in range(args.repeats + 1):
                start = time.process_time()
                out = sa.sparse_attention(q, k, v, pattern, prob_map=rho, engine="block")
                out.sum().backward()
                times.append(time.process_time() - start)
            row = {"map": rho, "dtype": str(dtype), "ms": 1e3 * statistics.median(times[1:])}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
