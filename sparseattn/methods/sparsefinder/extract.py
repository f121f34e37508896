"""Gold attention graphs (Sparsefinder §4.1) and the queries and keys that produced them.

For each layer and head h of a model, G_h = {(i, j) : p_ij > 0} over the real tokens, with p the
attention weights of that head. This module holds the containers the projections and predictors
read (:class:`GraphBatch`, :class:`LayerGraphs`) and the token batches a model is run on
(:class:`TokenBatch`, :func:`token_batches`); it imports only the core. Filling them from a
Hugging Face model is :func:`sparseattn.hf.graphs.extract_graphs` (hooks only): a model
sparsified with α-entmax gives sparse graphs; an unmodified (softmax) model gives complete ones.

Batches are made by :func:`token_batches`: passages sorted by token length, grouped, and each group
cut to its shortest member, so no batch holds padding — the predictors then see exactly the tokens
of each sequence, as at inference time. Batches *with* padding are supported too (``valid``
marks the real tokens, right padding).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from ...validate import check_positive

__all__ = ["GraphBatch", "LayerGraphs", "TokenBatch", "token_batches"]


@dataclasses.dataclass(frozen=True)
class TokenBatch:
    """Token ids of some passages: ``index`` (b,) their positions in the input list,
    ``input_ids`` and ``attention_mask`` (b, n)."""

    index: Tensor
    input_ids: Tensor
    attention_mask: Tensor

    def inputs(self) -> dict[str, Tensor]:
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask}


def token_batches(
    tokenizer, texts: Sequence[str], batch_size: int = 8, max_length: int = 128
) -> list[TokenBatch]:
    """Tokenise ``texts`` (truncated at ``max_length``), sort by length, group ``batch_size``
    consecutive ones and cut each group to its shortest member (keeping its final [SEP]).

    Neighbours in length order differ by about one token, so little text is lost; in return no
    batch holds padding. Every text appears in exactly one batch (``TokenBatch.index``).
    """
    batch_size = check_positive("batch_size", batch_size)
    max_length = check_positive("max_length", max_length)
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise TypeError("texts must be a sequence of str")
    ids = [tokenizer(t, truncation=True, max_length=max_length)["input_ids"] for t in texts]
    order = sorted(range(len(ids)), key=lambda i: (len(ids[i]), i))
    out = []
    for start in range(0, len(order), batch_size):
        group = order[start : start + batch_size]
        n = min(len(ids[i]) for i in group)
        rows = [ids[i][: n - 1] + ids[i][-1:] for i in group]  # keep the last token ([SEP])
        input_ids = torch.tensor(rows, dtype=torch.long)
        out.append(TokenBatch(torch.tensor(group), input_ids, torch.ones_like(input_ids)))
    return out


@dataclasses.dataclass(frozen=True)
class GraphBatch:
    """One batch of one layer: q, k (b, H, n, d) as the attention saw them (before scaling),
    ``gold`` (b, H, n, n) bool — the attention graph G_h among real tokens — and ``valid`` (b, n)
    bool, True for real tokens."""

    q: Tensor
    k: Tensor
    gold: Tensor
    valid: Tensor

    @property
    def n(self) -> int:
        return self.q.shape[-2]

    @property
    def lengths(self) -> Tensor:
        return self.valid.sum(-1)

    def pair_mask(self) -> Tensor:
        """(b, 1, n, n) bool: pairs of real tokens (the pairs eq. 4–5 count)."""
        return (self.valid[:, :, None] & self.valid[:, None, :])[:, None]


@dataclasses.dataclass
class LayerGraphs:
    """All extracted batches of one layer."""

    layer: int
    batches: list[GraphBatch]

    @property
    def heads(self) -> int:
        return self.batches[0].q.shape[1]

    def gold_sparsity(self) -> Tensor:
        """(H,) 1 − |G_h| / real pairs, pooled over all batches (Sparsefinder eq. 5)."""
        edges = sum(b.gold.sum((0, 2, 3)).double() for b in self.batches)
        pairs = sum(float(b.pair_mask().sum()) for b in self.batches)
        return 1 - edges / pairs

    def tokens(self) -> tuple[Tensor, Tensor]:
        """Real-token queries and keys of every batch: (H, N, d) each."""
        qs = [b.q.transpose(0, 1)[:, b.valid] for b in self.batches]
        ks = [b.k.transpose(0, 1)[:, b.valid] for b in self.batches]
        return torch.cat(qs, 1), torch.cat(ks, 1)
