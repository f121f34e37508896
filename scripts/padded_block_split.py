"""Softmax with key padding on the block engine, CPU: the split path (torch's flash kernel on
the full blocks, the padding one more mask on each part) against the general path (the masked
softmax over gathered blocks, which every padded call took before the split path took key
padding), with the dense engine and the same call without padding beside them; one thread,
the four taking turns. The padding: the last quarter of every item's keys (BERT-small: half
of 7 items of 8).

    python scripts/padded_block_split.py --out docs/results/auto/padded-block-split-cpu.json

and on the code before the split path took key padding (a worktree of it on PYTHONPATH;
there "split path" is the general path too, and "no padding" the old closed-form backward):

    PYTHONPATH=<worktree> python scripts/padded_block_split.py --note "code of <commit>" \
        --out docs/results/auto/padded-block-split-cpu-before.json

The general path is the engine's own (``_BlockAttention`` with its runner's ``split`` off),
unchanged by this change, so one process times both.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from unittest import mock

import torch

import sparseattn as sa
from sparseattn.engines import block
from sparseattn.lab.results import interleaved_medians, timing_record, write_json

#: (name, pattern, batch, heads, n, d, backward)
CELLS = [
    ("bert-small window(64)", sa.window(64), 8, 12, 128, 32, False),
    ("bert-small window(64)", sa.window(64), 8, 12, 128, 32, True),
    ("window(128)", sa.window(128), 4, 12, 1024, 64, False),
    ("window(128)", sa.window(128), 4, 12, 1024, 64, True),
    ("longformer(64, 4)", sa.longformer(64, 4), 32, 4, 256, 64, True),
    ("bigbird_blocks(64, 3)", sa.bigbird_blocks(64, 3, heads=12), 1, 12, 4096, 64, False),
    ("longformer-base layer", sa.longformer(512, 16), 1, 12, 4096, 64, False),
]


@contextlib.contextmanager
def general_path():
    """The block engine with its split path off, as it ran every padded call before."""
    init = block._Runner.__init__

    def without_split(self, plan, prob_map, scale, key_ok, dropout_p, budget, lead, *rest):
        fused = rest[0] and key_ok is None
        init(self, plan, prob_map, scale, key_ok, dropout_p, budget, lead, fused, *rest[1:])

    with mock.patch.object(block._Runner, "__init__", without_split):
        yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None)
    parser.add_argument("--note", default=None, help="stored with the results (e.g. the code run)")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    rows = []
    for name, pattern, batch, heads, n, d, backward in CELLS:
        q, k, v = (torch.randn(batch, heads, n, d, requires_grad=backward) for _ in range(3))
        padding = torch.zeros(batch, n, dtype=torch.bool)
        if name.startswith("bert"):
            padding[1:, n // 2 :] = True
        else:
            padding[:, n - n // 4 :] = True

        def call(engine, mask, general=False, q=q, k=k, v=v, pattern=pattern, bwd=backward):
            def run():
                with general_path() if general else contextlib.nullcontext():
                    out = sa.sparse_attention(
                        q, k, v, pattern, engine=engine, key_padding_mask=mask
                    )
                    if bwd:
                        out.sum().backward()

            return run

        calls = {
            "block, general path": call("block", padding, general=True),
            "block, split path": call("block", padding),
            "dense": call("dense", padding),
            "block, no padding": call("block", None),
        }
        ref = sa.sparse_attention(q, k, v, pattern, engine="dense", key_padding_mask=padding)
        out = sa.sparse_attention(q, k, v, pattern, engine="block", key_padding_mask=padding)
        diff = float((out - ref).detach().abs().max())
        ms = {e: round(s * 1e3, 2) for e, s in interleaved_medians(calls, args.repeats).items()}
        rows.append(
            {
                "cell": name,
                "shape (B, H, n, d)": [batch, heads, n, d],
                "forward + backward": backward,
                "ms, median": ms,
                "general / split": round(ms["block, general path"] / ms["block, split path"], 2),
                "split / dense": round(ms["block, split path"] / ms["dense"], 2),
                "largest difference from dense": diff,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    result = timing_record(
        "scripts/padded_block_split.py",
        load_before,
        note=args.note,
        repeats=args.repeats,
        rows=rows,
    )
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
