"""sparseattn: sparse attention for PyTorch — patterns, probability maps, engines, one data path."""

from . import _moved, attention, maps, parallel, patterns, score_mods
from .attention import attention_weights, sparse_attention
from .graph import AttentionGraph
from .maps import ProbabilityMap, entmax, hardmax, softmax, sparselin_gen, sparsemax
from .module import SparseAttention
from .patterns import (
    Pattern,
    bigbird,
    bigbird_blocks,
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

#: ``SparseAttention`` was defined in :mod:`sparseattn.attention` before :mod:`sparseattn.module`:
#: the old path still resolves it, so that models pickled before the move load.
attention.SparseAttention = SparseAttention

#: Old paths of moved modules (the paper methods, hf's minilm and kvcache) resolve, deprecated.
_moved.install()

__version__ = "0.1.0"

__all__ = [
    "AttentionGraph",
    "Pattern",
    "ProbabilityMap",
    "SparseAttention",
    "attention_weights",
    "bigbird",
    "bigbird_blocks",
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
    "parallel",
    "patterns",
    "random",
    "random_blocks",
    "score_mods",
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
