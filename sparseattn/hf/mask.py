"""The mask decomposition: the 4-D mask transformers hands a layer, split into the key padding,
causality, the left padding of a decoder batch and any further structure of the model's own
(:class:`MaskView`). Imports nothing else of :mod:`sparseattn.hf`.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

__all__ = ["MaskView", "mask_view"]


@dataclasses.dataclass(frozen=True)
class MaskView:
    """What a layer call's HF mask says, split into the parts sparseattn applies.

    key_valid: (batch, n_k) bool, True for real keys, or None (no padding);
    causal: the layer is causal (queries at n_k − n_q … n_k − 1 see keys j ≤ their position);
    structure: (batch, 1, n_q, n_k) bool or None — the model's own mask beyond causality and
        padding (e.g. ModernBERT's local layers), padding keys re-allowed (key_valid masks them);
    pads: (batch,) long or None — left padding of a causal layer (patterns start after it).
    """

    key_valid: Tensor | None
    causal: bool
    structure: Tensor | None
    pads: Tensor | None


def _lower_right_tril(n_q: int, n_k: int, device: torch.device) -> Tensor:
    """(n_q, n_k) bool: query i (at position n_k − n_q + i) may see keys j ≤ its position."""
    rows = torch.arange(n_k - n_q, n_k, device=device)[:, None]
    return torch.arange(n_k, device=device)[None, :] <= rows


def _check_decoder_call(
    mask: Tensor | None, n_q: int, n_k: int, sliding_window: int | None
) -> None:
    """Refuse the cache layouts in which key index ≠ position (static, sliding-window caches)."""
    if n_q > n_k:
        raise ValueError(f"a decoder call needs n_q <= n_k, got n_q={n_q}, n_k={n_k}")
    if sliding_window is not None and n_q < n_k and n_k >= sliding_window:
        raise ValueError(
            f"this model has its own sliding window ({sliding_window} keys) and its cache drops "
            "older keys, so key positions are unknown to sparseattn; set "
            "model.config.sliding_window = None and pass the window as the pattern, e.g. "
            f"sliding_window({sliding_window})"
        )
    if mask is None and 1 < n_q < n_k:
        raise ValueError(
            f"{n_q} queries against {n_k} keys without a mask: a static cache, whose keys past "
            "the current position are unfilled; sparsify supports dynamic caches (the default "
            "of generate())"
        )


def mask_view(
    mask: Tensor | None, q: Tensor, k: Tensor, causal: bool, sliding_window: int | None = None
) -> MaskView:
    """Split HF's 4-D mask (bool, True = attend; or additive, 0 = attend; None = no masking
    beyond causality) into key padding, left padding and any further structure.

    Raises ValueError for masks of another shape and, for causal layers, for caches whose key
    indices are not positions (static caches, a model's own truncating sliding window)."""
    bsz, n_q, n_k = q.shape[0], q.shape[-2], k.shape[-2]
    if causal:
        _check_decoder_call(mask, n_q, n_k, sliding_window)
    if mask is None:
        return MaskView(None, causal, None, None)
    if mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2
    if mask.dim() != 4 or mask.shape[1] != 1:
        raise ValueError(f"expected a (batch, 1, n_q, n_k) attention mask, got {tuple(mask.shape)}")
    mask = mask.expand(bsz, 1, n_q, n_k)[:, 0]
    key_valid = mask.any(-2)  # a real key is seen by some query (its own, in a causal layer)
    expected = key_valid[:, None, :].expand_as(mask)
    if causal:
        expected = expected & _lower_right_tril(n_q, n_k, mask.device)
        if n_q < n_k and not bool(key_valid[:, -1].all()):
            raise ValueError(
                "the newest key is masked for a query at an offset: a static cache (keys past "
                "the current position unfilled); sparsify supports dynamic caches"
            )
    structure = None if torch.equal(mask, expected) else (mask | ~key_valid[:, None, :])[:, None]
    pads = None
    if causal:
        pads = (key_valid.cumsum(-1) == 0).sum(-1).cpu()
        pads = pads if bool(pads.any()) else None
    return MaskView(None if bool(key_valid.all()) else key_valid, causal, structure, pads)
