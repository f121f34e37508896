"""Engines: how the work on a graph is done (``dense`` is the reference)."""

from .dense import dense_attention
from .gather import gather_attention

ENGINES = {"dense": dense_attention, "gather": gather_attention}

__all__ = ["ENGINES", "dense_attention", "gather_attention"]
