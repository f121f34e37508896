"""Engines: how the work on a graph is done.

``dense`` is the reference, ``gather`` works on neighbour lists (any graph), ``block`` on the
block-sparse layout with batched matrix products, ``flex`` hands a BlockMask to torch's
FlexAttention (softmax only; on CPU forward only, compiled).
"""

from .block import block_attention
from .dense import dense_attention
from .flex import flex_attention_engine
from .gather import gather_attention

ENGINES = {
    "dense": dense_attention,
    "gather": gather_attention,
    "block": block_attention,
    "flex": flex_attention_engine,
}

__all__ = [
    "ENGINES",
    "block_attention",
    "dense_attention",
    "flex_attention_engine",
    "gather_attention",
]
