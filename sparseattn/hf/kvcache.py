"""An evicting KV cache: a decoder whose pattern lets keys be forgotten for good keeps
O(window + sinks) keys per layer (issue 15 item 4; docs/causal.md "Memory-bounded generation").

:func:`evictable_extent` says which causal patterns allow it, :func:`window_cache` builds the
transformers ``DynamicCache`` (``hf.window_cache(model)`` calls it; imported on first use).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor

from .._extras import require
from ..graph import AttentionGraph
from ..patterns import HeadSplit, Pattern, Union
from ..patterns.causal import CausalGlobal, CausalWindow
from ..validate import check_tensor

__all__ = ["evictable_extent", "window_cache"]


def evictable_extent(pattern: Pattern | AttentionGraph) -> tuple[int, int] | None:
    """``(front, window)`` when every row i of the causal pattern lies in {j < front} ∪ the
    previous ``window`` tokens {i − window + 1, …, i}, so a decoder may forget every other key
    for good; None otherwise. ``sliding_window(w, sinks)``: (sinks or last sink + 1, w);
    a head split: the widest of its parts."""
    if isinstance(pattern, CausalWindow):
        return 0, pattern.w
    if isinstance(pattern, CausalGlobal):
        return None  # a sink query sees everything before it; no window part to bound the rest
    parts = getattr(pattern, "parts", None) if isinstance(pattern, Union) else None
    if isinstance(pattern, HeadSplit):
        parts = pattern.patterns
    if not parts:
        return None
    front, window = 0, 0
    for part in parts:
        if isinstance(part, CausalGlobal):
            last = part.tokens if isinstance(part.tokens, int) else max(part.tokens) + 1
            front = max(front, last)
            continue
        extent = evictable_extent(part)
        if extent is None:
            return None
        front, window = max(front, extent[0]), max(window, extent[1])
    return (front, window) if window else None


@functools.cache
def _window_layer_class() -> type:
    """transformers' DynamicLayer that keeps the first ``front`` keys and the last
    ``window − 1`` (made on first use: importing sparseattn does not import transformers)."""
    DynamicLayer = require("transformers.cache_utils", "hf", "the evicting KV cache").DynamicLayer

    class WindowLayer(DynamicLayer):
        """One layer of :func:`window_cache`: keys (batch, kv_heads, n, d) beyond the first
        ``front`` and the last ``window − 1`` are dropped after each update (which returns the
        kept and the new ones); ``get_seq_length`` counts every token seen."""

        is_croppable = False

        def __init__(self, front: int, window: int) -> None:
            super().__init__()
            self.front, self.window = front, window
            self.cumulative_length = 0

        def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            self.cumulative_length += key_states.shape[-2]
            keys = torch.cat([self.keys, key_states], dim=-2)
            values = torch.cat([self.values, value_states], dim=-2)
            self.keys, self.values = self._evict(keys), self._evict(values)
            return keys, values

        def _evict(self, states: Tensor) -> Tensor:
            n, recent = states.shape[-2], self.window - 1
            if n <= self.front + recent:
                return states
            tail = states[..., n - recent :, :] if recent else states[..., n:, :]
            return torch.cat([states[..., : self.front, :], tail], dim=-2)

        def get_seq_length(self) -> int:
            return self.cumulative_length

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            stored = self.keys.shape[-2] if self.is_initialized else 0
            return stored + query_length, 0

        def reset(self) -> None:
            super().reset()
            self.cumulative_length = 0

        def crop(self, tokens_to_remove: int) -> None:
            raise ValueError("a window_cache has dropped keys for good and cannot be cropped")

    return WindowLayer


def _left_padding(attention_mask: Tensor | None) -> int:
    """The largest number of leading padding tokens in a (batch, n) 0/1 or bool mask."""
    if attention_mask is None:
        return 0
    check_tensor("attention_mask", attention_mask, dim=2)
    return int((attention_mask.long().cumsum(-1) == 0).sum(-1).max())


def window_cache(
    patterns: Sequence[Pattern | AttentionGraph | None], attention_mask: Tensor | None = None
):
    """A KV cache for ``model.generate(cache=...)`` that forgets keys for good.

    ``patterns``: each layer's causal pattern, whose rows lie in {first ``front`` keys} ∪ {the
    previous ``window`` tokens} (:func:`evictable_extent`). Each layer keeps the first front
    keys (plus the left padding of ``attention_mask`` (batch, n)) and the last window − 1: the
    same tokens as the full cache (docs/causal.md). A ValueError for a layer whose pattern
    does not allow eviction (None: exact attention), or layers that differ in (front, window).
    """
    DynamicCache = require("transformers.cache_utils", "hf", "window_cache").DynamicCache

    extents = set()
    for layer, pattern in enumerate(patterns):
        extent = None if pattern is None else evictable_extent(pattern)
        if extent is None:
            pattern = "exact attention" if pattern is None else repr(pattern)
            raise ValueError(
                f"window_cache: layer {layer} uses {pattern}, which may attend to any earlier "
                "key; sparsify every layer with a sliding window, e.g. sliding_window(w, sinks)"
            )
        extents.add(extent)
    if len(extents) > 1:
        raise ValueError(f"window_cache needs one (front, window) for all layers, got {extents}")
    ((front, window),) = extents
    front += _left_padding(attention_mask)
    window_layer = _window_layer_class()
    cache = DynamicCache()
    cache.layers = [window_layer(front, window) for _ in patterns]
    return cache
