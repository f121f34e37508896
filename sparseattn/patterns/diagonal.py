"""Attention without the diagonal (SparseBERT, Shi et al. 2021, §4 and appendix A).

SparseBERT finds the diagonal the least important part of the attention matrix, and proves
Transformers that never use it still universal approximators (appendix A, Lemma 4).
:func:`no_diagonal` removes it from any pattern: A_k \\ {k}.
"""

from __future__ import annotations

import dataclasses

from torch import Tensor

from ..graph import AttentionGraph
from .base import Pattern
from .fixed import Dense

__all__ = ["NoDiagonal", "no_diagonal", "dense_no_diagonal", "drop_diagonal"]


def drop_diagonal(graph: AttentionGraph, what: str = "graph") -> AttentionGraph:
    """The graph minus the edges (i, i), for any ``batch_shape``; n_q must equal n_k. A
    ValueError (naming ``what``) when a query row is left without any key."""
    if graph.n_q != graph.n_k:
        raise ValueError(
            f"no_diagonal needs self-attention (n_q == n_k), got {graph.n_q} and {graph.n_k}"
        )
    rows = graph.row_indices()
    keep = graph.col != rows % graph.n_q
    out = AttentionGraph.from_edges(
        rows[keep], graph.col[keep], graph.n_q, graph.n_k, graph.batch_shape, graph.causal
    )
    empty = ((out.degrees == 0) & (graph.degrees > 0)).nonzero()
    if empty.numel():
        raise ValueError(
            f"{what} without its diagonal leaves {empty.shape[0]} query row(s) with no key "
            f"(first: {tuple(empty[0].tolist())}, whose only key was itself); every query needs "
            "a key other than itself"
        )
    return out


@dataclasses.dataclass(frozen=True, repr=False)
class NoDiagonal(Pattern):
    """``base`` minus the main diagonal: A_k \\ {k} (SparseBERT's attention without diag).

    Any base, static, per-head, data-dependent or causal; a row left empty (causal query 0)
    raises a ValueError when the graph is built.
    """

    base: Pattern

    @property
    def name(self) -> str:
        return f"{self.base.name} without diagonal"

    @property
    def data_dependent(self) -> bool:  # type: ignore[override]
        return self.base.data_dependent

    @property
    def is_causal(self) -> bool:
        return self.base.is_causal

    def _graph(self, n: int) -> AttentionGraph:
        return drop_diagonal(self.base.graph(n), repr(self))

    def _allows(self, q_idx: Tensor, kv_idx: Tensor, n: int) -> Tensor:
        return self.base.allows(q_idx, kv_idx, n) & (q_idx != kv_idx)

    def _predicate(self, n_t, const, n):
        base = None if self.data_dependent else self.base._predicate(n_t, const, n)
        return None if base is None else lambda q, kv: base(q, kv) & (q != kv)

    def build(self, q: Tensor, k: Tensor) -> AttentionGraph:
        if not self.data_dependent:
            return self.graph(*self._lengths(q, k))
        return drop_diagonal(self.base.build(q, k), repr(self))

    def __repr__(self) -> str:
        return f"no_diagonal({self.base!r})"


def no_diagonal(pattern: Pattern) -> Pattern:
    """Any pattern without the main diagonal, A_k \\ {k} (SparseBERT §4); building its graph
    raises a ValueError if some query keeps no key."""
    if not isinstance(pattern, Pattern):
        raise TypeError(f"pattern must be a Pattern, got {type(pattern).__name__}")
    return NoDiagonal(pattern)


def dense_no_diagonal() -> Pattern:
    """Dense attention without the diagonal: A_k = [n] \\ {k} (SparseBERT's main finding;
    n ≥ 2)."""
    return NoDiagonal(Dense())
