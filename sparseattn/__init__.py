"""sparseattn: sparse attention for PyTorch — patterns, probability maps, engines, one data path."""

from . import maps, patterns
from .attention import SparseAttention, attention_weights, sparse_attention
from .graph import AttentionGraph
from .maps import ProbabilityMap, entmax, hardmax, softmax, sparselin_gen, sparsemax
from .patterns import (
    Pattern,
    bigbird,
    block_local,
    causal_bigbird,
    causal_fixed,
    causal_strided,
    cycle,
    dense,
    dense_no_diagonal,
    fixed,
    global_tokens,
    longformer,
    no_diagonal,
    random,
    random_blocks,
    sliding_window,
    split_heads,
    star,
    strided,
    topk,
    union,
    window,
)

__version__ = "0.1.0"

__all__ = [
    "AttentionGraph",
    "Pattern",
    "ProbabilityMap",
    "SparseAttention",
    "attention_weights",
    "bigbird",
    "block_local",
    "causal_bigbird",
    "causal_fixed",
    "causal_strided",
    "cycle",
    "dense",
    "dense_no_diagonal",
    "entmax",
    "fixed",
    "global_tokens",
    "hardmax",
    "longformer",
    "no_diagonal",
    "maps",
    "patterns",
    "random",
    "random_blocks",
    "sliding_window",
    "softmax",
    "sparse_attention",
    "sparselin_gen",
    "sparsemax",
    "split_heads",
    "star",
    "strided",
    "topk",
    "union",
    "window",
]
