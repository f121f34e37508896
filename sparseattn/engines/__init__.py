"""Engines: how the work on a graph is done.

``dense`` is the reference, ``gather`` works on neighbour lists (any graph), ``block`` on the
block-sparse layout with batched matrix products, ``flex`` hands a BlockMask to torch's
FlexAttention (softmax only; on CPU forward only, compiled), ``rows`` takes full (or wide) rows
a chunk of queries at a time (sparse maps on the dense pattern), ``triton`` fused α-entmax /
sparsemax kernels on CUDA. What each supports is declared
in :mod:`.capabilities` (``SPECS``), the one table ``engine="auto"`` walks.
"""

from .block import block_attention
from .capabilities import (
    ENGINES,
    SPECS,
    EngineSpec,
    Request,
    flex_attention_engine,
    reasons,
    unsupported,
)
from .dense import dense_attention
from .gather import gather_attention
from .rows import rows_attention

__all__ = [
    "ENGINES",
    "SPECS",
    "EngineSpec",
    "Request",
    "block_attention",
    "dense_attention",
    "flex_attention_engine",
    "gather_attention",
    "reasons",
    "rows_attention",
    "unsupported",
]
