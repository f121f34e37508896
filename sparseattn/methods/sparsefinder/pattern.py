"""A data-dependent Pattern that predicts its graph with Sparsefinder, for use inside a model.

``hf.sparsify(model, [PredictedPattern(p_l, fixed) for p_l in per_layer], "entmax15")`` gives layer
l the graph Ĝ predicted from that layer's own q and k, and exact α-entmax on it: by Proposition 1
(sparse-consistency) each query whose gold support lies inside Ĝ gets exactly the full-entmax
weights.

Padding. A predicted graph depends on which tokens are real: quantization and Routing rank the
tokens of a sequence, k-means and LSH put padding into buckets, the last global token is the last
*real* one ([SEP]). :meth:`PredictedPattern.build` takes the key padding mask (B, n) and then
gives, on real tokens, exactly the graph of the unpadded sequence. Inside
:func:`sparseattn.hf.sparsify` the attention kernel passes the model's padding mask itself
(``uses_key_padding``); elsewhere, callers that cannot pass it wrap their calls in
:func:`key_padding`::

    with key_padding(batch["attention_mask"]):
        graph = pattern.build(q, k)
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import ClassVar

import torch
from torch import Tensor

from ...graph import AttentionGraph
from ...patterns import Pattern
from ...validate import check_positive, check_tensor
from .predictors import FixedParts, GraphPredictor, check_right_padding, merge_union, union_fixed

__all__ = ["PredictedPattern", "key_padding"]

_PADDING: contextvars.ContextVar[Tensor | None] = contextvars.ContextVar(
    "sparseattn_predicted_key_padding", default=None
)


def _as_valid(name: str, mask: Tensor) -> Tensor:
    """A (B, n) key padding mask — bool, or 0/1 integers as tokenizers give — as bool, checked
    for right padding."""
    check_tensor(name, mask, dim=2)
    if mask.is_floating_point() or mask.is_complex():
        raise TypeError(f"{name} must be a bool or 0/1 integer tensor, got {mask.dtype}")
    if mask.dtype != torch.bool:
        if mask.numel() and (int(mask.min()) < 0 or int(mask.max()) > 1):
            raise ValueError(
                f"{name} must hold 0/1 (1 for real tokens), got values in "
                f"[{int(mask.min())}, {int(mask.max())}]"
            )
        mask = mask.bool()
    return check_right_padding(name, mask.cpu())


@contextlib.contextmanager
def key_padding(mask: Tensor) -> Iterator[Tensor]:
    """Within the block, :meth:`PredictedPattern.build` calls that get no mask of their own use
    ``mask`` — (B, n) bool or 0/1, True for real tokens, right padding (a tokenizer's
    ``attention_mask``) — for inputs of batch B and length n; other shapes are an error.

    For models sparsified with :func:`sparseattn.hf.sparsify`, whose attention kernel builds the
    graph from q and k alone. Yields the mask as bool.
    """
    valid = _as_valid("mask", mask)
    token = _PADDING.set(valid)
    try:
        yield valid
    finally:
        _PADDING.reset(token)


@dataclasses.dataclass(frozen=True, repr=False)
class PredictedPattern(Pattern):
    """Ĝ = predictor(q, k) ∪ fixed parts, per (batch, head); graph ``batch_shape`` (B, H).

    A query row left empty (possible with a distance threshold and no fixed parts, and for every
    padding query) gets its own key, so every query attends to something (the engines reject
    empty rows).

    The causal variant (``pattern.causal()``, or ``is_causal=True``; decoder self-attention):
    Ĝ ∪ fixed parts ∪ the diagonal, restricted to keys j ≤ i — a causal graph in which every
    query keeps at least itself. The first token's fixed row then holds only itself; its column
    stays (an attention sink).
    """

    predictor: GraphPredictor
    fixed: FixedParts | None = FixedParts()
    is_causal: bool = False  # type: ignore[assignment]

    data_dependent = True
    #: ``build`` takes ``key_padding_mask``: a caller that knows the padding (an attention
    #: kernel) should pass it, as ``pattern.build(q, k, key_padding_mask=mask)``.
    uses_key_padding: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not isinstance(self.predictor, GraphPredictor):
            raise TypeError(
                f"predictor must be a GraphPredictor, got {type(self.predictor).__name__}"
            )
        if self.fixed is not None and not isinstance(self.fixed, FixedParts):
            raise TypeError(f"fixed must be a FixedParts or None, got {type(self.fixed).__name__}")
        if not isinstance(self.is_causal, bool):
            raise TypeError(f"is_causal must be a bool, got {type(self.is_causal).__name__}")

    def causal(self) -> PredictedPattern:
        """The same predictor and fixed parts, restricted to keys j ≤ i (with the diagonal)."""
        return dataclasses.replace(self, is_causal=True)

    @property
    def name(self) -> str:
        return f"{'causal ' if self.is_causal else ''}sparsefinder {self.predictor.name}"

    def graph(
        self,
        n: int,
        q: Tensor | None = None,
        k: Tensor | None = None,  # type: ignore[override]
        key_padding_mask: Tensor | None = None,
    ) -> AttentionGraph:
        """The predicted graph for q: (B, H, n, d), k: (B, H, n, d) (see :meth:`build`)."""
        if q is None or k is None:
            raise TypeError("a predicted pattern is data-dependent: call graph(n, q, k)")
        n = check_positive("n", n)
        check_tensor("q", q, dim=4)
        if q.shape[-2] != n:
            raise ValueError(f"q has {q.shape[-2]} queries, expected n={n}")
        return self.build(q, k, key_padding_mask)

    def build(
        self,
        q: Tensor,
        k: Tensor,  # type: ignore[override]
        key_padding_mask: Tensor | None = None,
    ) -> AttentionGraph:
        """Ĝ ∪ fixed parts for q, k (B, H, n, d), with every empty row given its own key.

        ``key_padding_mask`` (B, n) bool, True for padding tokens (right padding), as in
        ``nn.MultiheadAttention`` and :func:`sparseattn.sparse_attention`; when None, the
        mask of an enclosing :func:`key_padding` block (a tokenizer's ``attention_mask``), if
        any. With a mask, the
        predictor sees which tokens are real (padding joins no bucket and is ranked after every
        real token) and the last global token is each sequence's last real one, so the graph on
        real tokens equals that of the unpadded sequence.
        """
        check_tensor("q", q, dim=4)
        check_tensor("k", k, dim=4)
        n = self._self_attention_length(q, k)
        valid = self._valid(key_padding_mask, q.shape[0], n)
        with torch.no_grad():
            predicted = self.predictor.predict(q, k, None if valid is None else valid.to(q.device))
            lengths = None if valid is None else valid.sum(-1)
            graph = union_fixed(predicted, self.fixed, lengths)
        graph = graph.expand(tuple(q.shape[:2]))
        if self.is_causal:  # every row keeps itself, then nothing after it
            diagonal = torch.arange(n)
            return merge_union(graph, AttentionGraph.from_edges(diagonal, diagonal, n, n)).tril()
        empty = (graph.degrees == 0).reshape(-1).nonzero().squeeze(1)
        if empty.numel():
            graph = graph | AttentionGraph.from_edges(empty, empty % n, n, n, graph.batch_shape)
        return graph

    @staticmethod
    def _valid(key_padding_mask: Tensor | None, batch: int, n: int) -> Tensor | None:
        """The (B, n) bool mask to use, or None when every token is real."""
        if key_padding_mask is not None:
            check_tensor("key_padding_mask", key_padding_mask, dim=2)
            if key_padding_mask.dtype != torch.bool:
                raise TypeError(
                    "key_padding_mask must be a bool tensor, True for padding (as in "
                    f"nn.MultiheadAttention), got {key_padding_mask.dtype}; for a tokenizer's "
                    "0/1 attention_mask pass attention_mask == 0, or use key_padding(mask)"
                )
            valid = _as_valid("key_padding_mask", ~key_padding_mask)
            name = "key_padding_mask"
        else:
            valid, name = _PADDING.get(), "the key_padding(...) mask"
            if valid is None:
                return None
        if tuple(valid.shape) != (batch, n):
            raise ValueError(
                f"{name} has shape {tuple(valid.shape)} but q, k hold a batch of "
                f"{batch} sequences of length {n}"
            )
        return None if bool(valid.all()) else valid

    def _graph(self, n: int) -> AttentionGraph:
        raise TypeError("a predicted pattern is data-dependent: call graph(n, q, k)")

    def _allows(self, q_idx: Tensor, kv_idx: Tensor, n: int) -> Tensor:
        raise TypeError(
            "a predicted pattern is data-dependent: build its graph, then use graph.allows(q, kv)"
        )

    def params(self) -> dict:
        return {"predictor": self.predictor, "fixed": self.fixed, "is_causal": self.is_causal}
