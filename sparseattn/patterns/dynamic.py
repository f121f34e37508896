"""Data-dependent patterns: the graph depends on q and k (top-k; Zhao et al., Yun app. B.1)."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from ..graph import AttentionGraph
from ..validate import check_bool
from .base import Pattern, check_positive

__all__ = ["TopK", "topk"]


@dataclasses.dataclass(frozen=True, repr=False)
class TopK(Pattern):
    """Each query keeps the keys of its ``k`` largest scores q_i·k_j (ties broken by torch.topk).

    With ``is_causal`` among keys j <= i (early queries keep min(k, i + 1) keys). O(n_q·n_k·d)
    to score, chunked over queries (memory O(chunk·n_k)).
    """

    k: int
    is_causal: bool = False
    chunk: int = 1024

    data_dependent = True

    def __post_init__(self) -> None:
        check_positive("k", self.k)
        check_positive("chunk", self.chunk)
        check_bool("is_causal", self.is_causal)

    @property
    def name(self) -> str:
        return "causal topk" if self.is_causal else "topk"

    def graph(self, n: int, q: Tensor | None = None, k: Tensor | None = None) -> AttentionGraph:  # type: ignore[override]
        """Graph of leading shape (B, H) for q: (B, H, n, d), k: (B, H, n, d)."""
        if q is None or k is None:
            raise TypeError("topk is data-dependent: call graph(n, q, k) with the queries and keys")
        if q.shape[-2] != n:
            raise ValueError(f"q has {q.shape[-2]} queries, expected n={n}")
        return self.build(q, k)

    def build(self, q: Tensor, k: Tensor) -> AttentionGraph:
        n_q, n_k = q.shape[-2], k.shape[-2]
        if self.is_causal and n_q > n_k:
            raise ValueError(
                f"causal topk needs n_q <= n_k (the last n_q positions), got {n_q} and {n_k}"
            )
        offset = n_k - n_q if self.is_causal else 0  # causal: query i sits at n_k - n_q + i
        keep = min(self.k, n_k)
        tables = []
        with torch.no_grad():
            for start in range(0, n_q, self.chunk):
                scores = q[..., start : start + self.chunk, :] @ k.transpose(-1, -2)
                if self.is_causal:
                    i = torch.arange(start, start + scores.shape[-2], device=q.device)
                    above = torch.arange(n_k, device=q.device) > i[:, None] + offset
                    scores = scores.masked_fill(above, float("-inf"))
                tables.append(scores.topk(keep, dim=-1).indices)
        index = torch.cat(tables, -2)
        valid = None
        if self.is_causal:  # positions p < keep - 1 have fewer than `keep` allowed keys
            valid = torch.arange(keep, device=q.device)
            valid = valid <= torch.arange(offset, n_k, device=q.device)[:, None]
        return AttentionGraph.from_neighbours(index, valid, n_k, causal=self.is_causal)

    def _graph(self, n: int) -> AttentionGraph:
        raise TypeError("topk is data-dependent: call graph(n, q, k)")

    def _allows(self, q_idx: Tensor, kv_idx: Tensor, n: int) -> Tensor:
        raise TypeError("topk is data-dependent: build its graph, then use graph.allows(q, kv)")

    def causal(self) -> Pattern:
        return TopK(self.k, True, self.chunk)


def topk(k: int) -> TopK:
    """Top-k pattern: each query attends to its k highest-scoring keys."""
    return TopK(k)
