"""Sparsity patterns {A_k^l} (Yun et al. §3.1) and their compositions (§5.1)."""

from .base import Causal, Pattern
from .bigbird_blocks import bigbird_blocks
from .causal import causal_bigbird, causal_fixed, causal_strided, sliding_window
from .compose import HeadSplit, PatternCycle, Union, as_cycle, cycle, split_heads, union
from .diagonal import NoDiagonal, dense_no_diagonal, no_diagonal
from .dynamic import TopK, topk
from .fixed import (
    bigbird,
    block_local,
    dense,
    fixed,
    global_tokens,
    longformer,
    random,
    random_blocks,
    star,
    strided,
    window,
)

#: The named patterns with an example of their parameters (``sparseattn patterns`` lists them).
NAMED = {
    "dense": (dense, {}),
    "dense_no_diagonal": (dense_no_diagonal, {}),
    "window": (window, {"w": 16}),
    "strided": (strided, {"w": 16}),
    "fixed": (fixed, {"w": 16}),
    "star": (star, {"w": 1}),
    "random": (random, {"density": 0.1, "seed": 0}),
    "longformer": (longformer, {"w": 16, "global_tokens": 2}),
    "bigbird": (bigbird, {"w": 16, "global_tokens": 2, "random_blocks": 2, "block": 16}),
    "block_local": (block_local, {"block": 16}),
    "global_tokens": (global_tokens, {"tokens": 2}),
    "random_blocks": (random_blocks, {"random_blocks": 2, "block": 16}),
    "topk": (topk, {"k": 32}),
    "causal_strided": (causal_strided, {"w": 16}),
    "causal_fixed": (causal_fixed, {"w": 16}),
    "sliding_window": (sliding_window, {"w": 16, "sinks": 2}),
    "causal_bigbird": (
        causal_bigbird,
        {"w": 16, "global_tokens": 2, "random_blocks": 2, "block": 16},
    ),
}

__all__ = [
    "NAMED",
    "Causal",
    "HeadSplit",
    "NoDiagonal",
    "Pattern",
    "PatternCycle",
    "TopK",
    "Union",
    "as_cycle",
    "bigbird",
    "bigbird_blocks",
    "block_local",
    "causal_bigbird",
    "causal_fixed",
    "causal_strided",
    "cycle",
    "dense",
    "dense_no_diagonal",
    "fixed",
    "global_tokens",
    "longformer",
    "no_diagonal",
    "random",
    "random_blocks",
    "sliding_window",
    "split_heads",
    "star",
    "strided",
    "topk",
    "union",
    "window",
]
