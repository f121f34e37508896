"""Composing patterns: Yun §5.1 head configurations UNION, SEQUENTIAL (cycle) and MULTIHEAD."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from ..graph import AttentionGraph
from .base import Pattern, Union, _check_patterns, check_positive, union

__all__ = ["Union", "PatternCycle", "HeadSplit", "union", "cycle", "split_heads", "as_cycle"]


@dataclasses.dataclass(frozen=True)
class PatternCycle:
    """SEQUENTIAL (Yun §3.1 cycling blocks): layer l uses pattern l mod p."""

    patterns: tuple[Pattern, ...]

    def __getitem__(self, layer: int) -> Pattern:
        return self.patterns[layer % len(self.patterns)]

    def __len__(self) -> int:
        return len(self.patterns)

    def __iter__(self):
        return iter(self.patterns)


def cycle(*patterns: Pattern) -> PatternCycle:
    """SEQUENTIAL configuration: ``cycle(A1, A2)[l]`` is the pattern of layer l."""
    _check_patterns(patterns)
    return PatternCycle(tuple(patterns))


def as_cycle(pattern: Pattern | PatternCycle | Sequence[Pattern]) -> PatternCycle:
    """A single pattern is a cycle of length 1; a sequence becomes a cycle."""
    if isinstance(pattern, PatternCycle):
        return pattern
    if isinstance(pattern, Pattern):
        return PatternCycle((pattern,))
    return cycle(*pattern)


@dataclasses.dataclass(frozen=True, repr=False)
class HeadSplit(Pattern):
    """MULTIHEAD (Yun §5.1): heads are split into consecutive groups, group g uses pattern g.

    ``sizes`` gives the number of heads per group; ``None`` splits the heads as evenly as
    possible (the first groups get the remainder). The graph has leading shape (num_heads,).
    """

    patterns: tuple[Pattern, ...]
    sizes: tuple[int, ...] | None = None

    @property
    def name(self) -> str:
        return "multihead"

    @property
    def data_dependent(self) -> bool:  # type: ignore[override]
        return any(p.data_dependent for p in self.patterns)

    def head_sizes(self, num_heads: int) -> tuple[int, ...]:
        check_positive("num_heads", num_heads)
        if self.sizes is not None:
            if sum(self.sizes) != num_heads:
                raise ValueError(f"head sizes {self.sizes} do not add up to num_heads={num_heads}")
            return self.sizes
        p = len(self.patterns)
        if num_heads < p:
            raise ValueError(f"cannot split {num_heads} heads over {p} patterns")
        return tuple(num_heads // p + (g < num_heads % p) for g in range(p))

    def head_graph(self, graphs: Sequence[AttentionGraph], num_heads: int) -> AttentionGraph:
        """Stack one unbatched graph per head group into a graph of leading shape (num_heads,)."""
        rows, cols = [], []
        head0 = 0
        for g, size in zip(graphs, self.head_sizes(num_heads), strict=True):
            g_rows = g.row_indices()
            for h in range(head0, head0 + size):
                rows.append(g_rows + h * g.n_q)
                cols.append(g.col)
            head0 += size
        first = graphs[0]
        causal = all(g.causal for g in graphs)
        return AttentionGraph.from_edges(
            torch.cat(rows), torch.cat(cols), first.n_q, first.n_k, (num_heads,), causal
        )

    def graph(  # type: ignore[override]
        self, n: int, num_heads: int | None = None, n_q: int | None = None
    ) -> AttentionGraph:
        """Graph of leading shape (num_heads,), cached per (n, num_heads, n_q); ``n_q < n``:
        the last n_q queries, as in :meth:`Pattern.graph` (all parts causal)."""
        if num_heads is None:
            raise ValueError("a head split needs num_heads: graph(n, num_heads=H)")
        check_positive("n", n)
        check_positive("num_heads", num_heads)
        if n_q is not None and n_q != n:
            self._check_offset(n, n_q)
        return self._cached((n, num_heads, n if n_q is None else n_q), self._head_split_graph)

    @property
    def is_causal(self) -> bool:
        return all(p.is_causal for p in self.patterns)

    def _head_split_graph(self, n: int, num_heads: int, n_q: int) -> AttentionGraph:
        return self.head_graph([p.graph(n, n_q) for p in self.patterns], num_heads)

    def _graph(self, n: int) -> AttentionGraph:  # graph() is overridden
        raise TypeError("use graph(n, num_heads)")

    def _allows(self, q_idx: Tensor, kv_idx: Tensor, n: int) -> Tensor:
        raise TypeError("a head split has one predicate per head: use allows_head")

    def allows_head(self, head: Tensor, q_idx: Tensor, kv_idx: Tensor, n: int, num_heads: int):
        """FlexAttention-shaped predicate (h, q_idx, kv_idx) for the given number of heads."""
        head = torch.as_tensor(head)
        sizes = self.head_sizes(num_heads)
        bounds = self._on(("bounds", num_heads), head.device, lambda: torch.tensor(sizes).cumsum(0))
        group = torch.bucketize(head, bounds, right=True)
        shapes = (group.shape, torch.as_tensor(q_idx).shape, torch.as_tensor(kv_idx).shape)
        out = torch.zeros(torch.broadcast_shapes(*shapes), dtype=torch.bool, device=head.device)
        for g, p in enumerate(self.patterns):
            out |= (group == g) & p.allows(q_idx, kv_idx, n)
        return out

    def build(self, q: Tensor, k: Tensor) -> AttentionGraph:
        if self.data_dependent:
            raise ValueError("split_heads with data-dependent parts is not supported")
        n_k, n_q = self._lengths(q, k)
        return self.graph(n_k, num_heads=q.shape[1], n_q=n_q)

    def causal(self) -> Pattern:
        return HeadSplit(tuple(p.causal() for p in self.patterns), self.sizes)


def split_heads(*patterns: Pattern, sizes: Sequence[int] | None = None) -> HeadSplit:
    """MULTIHEAD configuration: consecutive head groups use different patterns."""
    _check_patterns(patterns)
    if sizes is not None:
        if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
            raise TypeError(f"sizes must be a sequence of ints, got {type(sizes).__name__}")
        sizes = tuple(check_positive(f"sizes[{i}]", s) for i, s in enumerate(sizes))
        if len(sizes) != len(patterns):
            raise ValueError(
                f"sizes must give one head count per pattern ({len(patterns)}), got {len(sizes)}"
            )
    return HeadSplit(tuple(patterns), sizes)
