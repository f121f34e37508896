"""Gold attention graphs of a Hugging Face model, for Sparsefinder (Treviso et al. 2022, §4.1).

:func:`extract_graphs` runs a model and keeps, per layer and head h, the queries and keys the
attention saw and G_h = {(i, j) : p_ij > 0} over the real tokens, observed through
:func:`~sparseattn.hf.capture.capture_attention` (hooks only; nothing in the model's source is
edited). It fills the containers of the method's package, :mod:`sparseattn.methods.sparsefinder`
(``GraphBatch``, ``LayerGraphs``; the token batches it runs are ``predict.token_batches``), on
which the projections and predictors are fitted and measured. Not re-exported by
:mod:`sparseattn.hf`, so importing ``sparseattn.hf`` does not import the paper method.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

from ..methods.sparsefinder.extract import GraphBatch, LayerGraphs, TokenBatch
from .capture import capture_attention
from .state import AttentionRecord

__all__ = ["extract_graphs"]


@torch.no_grad()
def extract_graphs(
    model: nn.Module,
    batches: Iterable[TokenBatch | dict[str, Tensor]],
    layers: Iterable[int] | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[LayerGraphs]:
    """Run ``model`` on ``batches`` and keep, per layer, q, k and the gold graph of each head.

    Args:
        model: a Hugging Face encoder supported by :mod:`sparseattn.hf`; sparsify it with α-entmax
            first (``hf.sparsify(model, dense(), "entmax15")``) to get sparse gold graphs.
        batches: TokenBatch or tokenizer outputs (``input_ids``, ``attention_mask``, ...).
        layers: the layers to keep (default all).
        progress: called with 1 after each batch.
    Returns:
        One :class:`LayerGraphs` per kept layer, in layer order. Gold: p_ij > 0 with i and j real
        tokens (Sparsefinder §4.1); q, k are the head's projected queries and keys, unscaled.
    """
    kept: dict[int, list[GraphBatch]] = {}

    def keep(record: AttentionRecord) -> None:
        valid = ~record.key_padding_mask.cpu()  # True for real tokens
        real = (valid[:, :, None] & valid[:, None, :])[:, None]
        gold = (record.probs.cpu() > 0) & real
        kept.setdefault(record.layer, []).append(
            GraphBatch(record.q.cpu().contiguous(), record.k.cpu().contiguous(), gold, valid)
        )

    with capture_attention(model, layers=layers, callback=keep):
        for batch in batches:
            inputs = batch.inputs() if isinstance(batch, TokenBatch) else batch
            model(**inputs)
            if progress is not None:
                progress(1)
    return [LayerGraphs(layer, kept[layer]) for layer in sorted(kept)]
