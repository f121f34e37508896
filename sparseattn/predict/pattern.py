"""A data-dependent Pattern that predicts its graph with Sparsefinder, for use inside a model.

``hf.sparsify(model, [PredictedPattern(p_l, fixed) for p_l in per_layer], "entmax15")`` gives layer
l the graph Ĝ predicted from that layer's own q and k, and exact α-entmax on it: by Proposition 1
(sparse-consistency) each query whose gold support lies inside Ĝ gets exactly the full-entmax
weights.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from ..graph import AttentionGraph
from ..patterns import Pattern
from ..validate import check_positive, check_tensor
from .predictors import FixedParts, GraphPredictor, union_fixed

__all__ = ["PredictedPattern"]


@dataclasses.dataclass(frozen=True, repr=False)
class PredictedPattern(Pattern):
    """Ĝ = predictor(q, k) ∪ fixed parts, per (batch, head); graph ``batch_shape`` (B, H).

    A query row left empty (possible with a distance threshold and no fixed parts) gets its own
    key, so every query attends to something (the engines reject empty rows).
    """

    predictor: GraphPredictor
    fixed: FixedParts | None = FixedParts()

    data_dependent = True

    def __post_init__(self) -> None:
        if not isinstance(self.predictor, GraphPredictor):
            raise TypeError(f"predictor must be a GraphPredictor, got "
                            f"{type(self.predictor).__name__}")
        if self.fixed is not None and not isinstance(self.fixed, FixedParts):
            raise TypeError(f"fixed must be a FixedParts or None, got {type(self.fixed).__name__}")

    @property
    def name(self) -> str:
        return f"sparsefinder {self.predictor.name}"

    def graph(self, n: int, q: Tensor | None = None, k: Tensor | None = None) -> AttentionGraph:  # type: ignore[override]
        """The predicted graph for q: (B, H, n, d), k: (B, H, n, d)."""
        if q is None or k is None:
            raise TypeError("a predicted pattern is data-dependent: call graph(n, q, k)")
        n = check_positive("n", n)
        check_tensor("q", q, dim=4)
        if q.shape[-2] != n:
            raise ValueError(f"q has {q.shape[-2]} queries, expected n={n}")
        return self.build(q, k)

    def build(self, q: Tensor, k: Tensor) -> AttentionGraph:
        """Ĝ ∪ fixed parts for q, k (B, H, n, d), with every empty row given its own key."""
        check_tensor("q", q, dim=4)
        check_tensor("k", k, dim=4)
        n = self._self_attention_length(q, k)
        with torch.no_grad():
            graph = union_fixed(self.predictor.predict(q, k), self.fixed)
        graph = graph.expand(tuple(q.shape[:2]))
        empty = (graph.degrees == 0).reshape(-1).nonzero().squeeze(1)
        if empty.numel():
            graph = graph | AttentionGraph.from_edges(empty, empty % n, n, n, graph.batch_shape)
        return graph

    def _graph(self, n: int) -> AttentionGraph:
        raise TypeError("a predicted pattern is data-dependent: call graph(n, q, k)")

    def _allows(self, q_idx: Tensor, kv_idx: Tensor, n: int) -> Tensor:
        raise TypeError("a predicted pattern is data-dependent: build its graph, then use "
                        "graph.allows(q, kv)")

    def params(self) -> dict:
        return {"predictor": self.predictor, "fixed": self.fixed}
