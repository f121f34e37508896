"""Engines: how the work on a graph is done.

``dense`` (the reference), ``gather`` (neighbour lists), ``block`` (block-sparse matrix
products), ``flex`` (torch's FlexAttention), ``rows`` (full rows) and ``triton`` (fused α-entmax
kernels); what each supports is declared in :mod:`.capabilities` (``SPECS``), the table
``engine="auto"`` walks (docs/engines.md).
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
