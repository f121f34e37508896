"""Which FlexAttention results on CPU depend on the vector width of the code Inductor emits.

Each width this CPU has (``ATEN_CPU_CAPABILITY=avx2``, and ``avx512`` where present) runs in a
process of its own, on a fresh Inductor cache, and reports the largest error against float64
of (a) torch's compiled ``flex_attention`` called by hand and (b) the flex engine, at lengths
whose last tile holds 8 keys (n = 8, 72, 136) or none (128), head dims 8, 16 and 32. The keys
past n are bait (a score of 1000·|q|² for the last query), so a read of them shows for sure.
Then, where the CPU has both widths, the cache: one process fills a cache directory with AVX2
code, a second runs AVX-512 on it, by hand and through the engine.

    python scripts/flex_vector_width.py --out docs/results/flex/vector-width.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CASES = [(8, 8), (72, 8), (136, 8), (8, 16), (72, 16), (136, 16), (128, 16), (72, 32)]

ONE_WIDTH = """
import json, math, sys, torch, sparseattn as sa
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from sparseattn.lab.results import machine_facts

def inputs(n, d):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, d, generator=g, dtype=torch.float64).float() for _ in "qkv")
    past = 1e3 * q[:, :, -1:].expand(-1, -1, 16, -1)
    return q, torch.cat([k, past], dim=2)[:, :, :n], v

rows = []
for n, d in json.loads(sys.argv[1]):
    q, k, v = inputs(n, d)
    ref = torch.softmax(q.double() @ k.double().mT / math.sqrt(d), -1) @ v.double()
    mask = create_block_mask(lambda b, h, i, j: j >= 0, None, None, n, n, device="cpu")
    with torch.no_grad():
        by_hand = torch.compile(flex_attention)(q, k, v, block_mask=mask)
        engine = sa.sparse_attention(q, k, v, sa.dense(), engine="flex")
    rows.append({"n": n, "d": d,
                 "by_hand": float((by_hand.double() - ref).abs().max()),
                 "engine": float((engine.double() - ref).abs().max())})
print(json.dumps({"machine": machine_facts(), "rows": rows}))
"""


def run(code: str, capability: str, cache: str, *args: str) -> dict:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "TORCHINDUCTOR_CACHE_DIR": cache}
    out = subprocess.run(
        [sys.executable, "-c", code, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/flex/vector-width.json")
    args = parser.parse_args()
    with open("/proc/cpuinfo") as f:
        has_512 = "avx512f" in f.read().split()
    widths = ["avx2", "avx512"] if has_512 else ["avx2"]
    result: dict = {"command": "python scripts/flex_vector_width.py", "widths": {}}
    for capability in widths:
        with tempfile.TemporaryDirectory() as cache:
            result["widths"][capability] = run(ONE_WIDTH, capability, cache, json.dumps(CASES))
        for row in result["widths"][capability]["rows"]:
            print(
                f"{capability:6} n={row['n']:4} d={row['d']:3}  by hand {row['by_hand']:.2e}"
                f"  engine {row['engine']:.2e}"
            )
    if has_512:  # the cache: AVX2 code first, then AVX-512 on the same directory
        case = json.dumps([(64, 16)])
        with tempfile.TemporaryDirectory() as cache:
            first = run(ONE_WIDTH, "avx2", cache, case)["rows"][0]
            second = run(ONE_WIDTH, "avx512", cache, case)["rows"][0]
        result["shared_cache"] = {"avx2_first": first, "avx512_second": second}
        print(
            f"shared cache, avx512 after avx2, n=64 d=16: by hand {second['by_hand']:.2e}"
            f"  engine {second['engine']:.2e}"
        )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
