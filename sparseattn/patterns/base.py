"""Pattern: a rule {A_k} that yields an AttentionGraph for any length n (Yun et al. §3.1)."""

from __future__ import annotations

import abc
import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import ClassVar

import torch
from torch import Tensor

from ..graph import AttentionGraph
from ..validate import check_positive

__all__ = ["GRAPH_CACHE_SIZE", "Pattern", "Causal", "check_positive"]

#: Graphs a pattern object keeps, one per length n (and head count, for a head split); the
#: least recently used goes first. Each graph carries its engines' plans, so a stream of
#: varying lengths holds at most this many graphs and plans per pattern object.
GRAPH_CACHE_SIZE = 8


@dataclasses.dataclass(frozen=True)
class Pattern(abc.ABC):
    """A sparsity pattern: for each length n, the sets A_k ⊆ [n] of keys query k attends to.

    Static patterns implement :meth:`_graph` (O(n·K), no n² scan) and :meth:`_allows`
    (a vectorised predicate in the shape of FlexAttention's ``mask_mod``). A pattern object
    caches its graphs per n (the ``GRAPH_CACHE_SIZE`` most recently used lengths), and the
    engines cache their plans on the graph: holding the pattern (as ``SparseAttention`` does)
    makes every later call at a seen length skip building and planning. Data-dependent
    patterns (``data_dependent = True``) override :meth:`build` and build per call.
    Indices are 0-based here; the papers count from 1.
    """

    data_dependent: ClassVar[bool] = False

    @property
    def name(self) -> str:
        return type(self).__name__.lower()

    # -- to implement -------------------------------------------------------------------
    @abc.abstractmethod
    def _graph(self, n: int) -> AttentionGraph: ...

    @abc.abstractmethod
    def _allows(self, q_idx: Tensor, kv_idx: Tensor, n: int) -> Tensor: ...

    # -- public ---------------------------------------------------------------------------
    def graph(self, n: int) -> AttentionGraph:
        """The AttentionGraph of this pattern at length n (cached per n)."""
        check_positive("n", n)
        return self._cached(n, self._graph)

    def _cached(self, key: Hashable, make: Callable[..., AttentionGraph]) -> AttentionGraph:
        """``make(*key)`` (or ``make(key)``), kept in this object's bounded LRU graph cache."""
        cache = self.__dict__.setdefault("_cache", OrderedDict())
        if key in cache:
            cache.move_to_end(key)
            return cache[key]
        graph = make(*key) if isinstance(key, tuple) else make(key)
        cache[key] = graph
        while len(cache) > GRAPH_CACHE_SIZE:
            cache.popitem(last=False)
        return graph

    def allows(self, q_idx: Tensor, kv_idx: Tensor, n: int) -> Tensor:
        """Vectorised predicate: may query ``q_idx`` attend to key ``kv_idx`` at length n?

        ``q_idx`` and ``kv_idx`` are integer tensors broadcast against each other; returns a
        BoolTensor of their broadcast shape. This is FlexAttention's ``mask_mod`` with n bound.
        """
        check_positive("n", n)
        q_idx, kv_idx = torch.broadcast_tensors(torch.as_tensor(q_idx), torch.as_tensor(kv_idx))
        inside = (q_idx >= 0) & (q_idx < n) & (kv_idx >= 0) & (kv_idx < n)
        return inside & self._allows(q_idx.long(), kv_idx.long(), n)

    def build(self, q: Tensor, k: Tensor) -> AttentionGraph:
        """The graph for inputs q: (B, H, n_q, d), k: (B, H, n_k, d) — what engines call."""
        return self.graph(self._self_attention_length(q, k))

    def _self_attention_length(self, q: Tensor, k: Tensor) -> int:
        n_q, n_k = q.shape[-2], k.shape[-2]
        if n_q != n_k:
            raise ValueError(
                f"pattern {self!r} defines self-attention graphs (n_q == n_k); got n_q={n_q}, "
                f"n_k={n_k}. For cross-attention use dense(), topk(k) or an AttentionGraph."
            )
        return n_q

    def causal(self) -> Pattern:
        """Causal variant: the same pattern restricted to keys j <= query i."""
        return Causal(self)

    def to_block_mask(self, n: int, block: int = 128, **graph_kwargs):
        """This pattern at length n as a FlexAttention ``BlockMask`` (batch 1, heads 1 or the
        graph's heads), built from the graph's block layout in O(E); its ``mask_mod`` is
        exactly :meth:`allows`. ``graph_kwargs`` go to :meth:`graph` (e.g. ``num_heads``
        for a head split). Pass it to ``torch.nn.attention.flex_attention.flex_attention``.
        """
        from ..engines.flex import graph_block_mask

        check_positive("block", block)
        graph = self.graph(n, **graph_kwargs)
        heads = graph.batch_shape[-1] if graph.batch_shape else 1
        return graph_block_mask(graph, 1, heads, block)

    def __or__(self, other: Pattern) -> Pattern:
        from .compose import union

        return union(self, other)

    def params(self) -> dict:
        """The pattern's parameters, for listings and reports."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{self.name}({args})"


@dataclasses.dataclass(frozen=True, repr=False)
class Causal(Pattern):
    """``base`` restricted to j <= i (the lower triangle); its density uses n(n+1)/2."""

    base: Pattern

    @property
    def name(self) -> str:
        return f"causal {self.base.name}"

    def _graph(self, n: int) -> AttentionGraph:
        return self.base.graph(n).tril()

    def _allows(self, q_idx: Tensor, kv_idx: Tensor, n: int) -> Tensor:
        return self.base.allows(q_idx, kv_idx, n) & (kv_idx <= q_idx)

    def causal(self) -> Pattern:
        return self

    def __repr__(self) -> str:
        return f"{self.base!r}.causal()"
