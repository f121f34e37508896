"""Engines: how the work on a graph is done.

``dense`` is the reference, ``gather`` works on neighbour lists (any graph), ``block`` on the
block-sparse layout with batched matrix products, ``flex`` hands a BlockMask to torch's
FlexAttention (softmax only; on CPU forward only, compiled), ``rows`` takes full (or wide) rows
a chunk of queries at a time (sparse maps on the dense pattern).
"""

from .block import block_attention
from .dense import dense_attention
from .flex import flex_attention_engine
from .gather import gather_attention
from .rows import rows_attention

ENGINES = {
    "dense": dense_attention,
    "gather": gather_attention,
    "block": block_attention,
    "flex": flex_attention_engine,
    "rows": rows_attention,
}

__all__ = [
    "ENGINES",
    "block_attention",
    "dense_attention",
    "flex_attention_engine",
    "gather_attention",
    "rows_attention",
]
