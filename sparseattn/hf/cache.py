"""The evicting KV cache of a sparsified model: :func:`window_cache` reads the layers' causal
patterns and builds :func:`sparseattn.hf.kvcache.window_cache` (which needs no sparsified model).
"""

from __future__ import annotations

from torch import Tensor, nn

from . import kvcache
from .registry import attention_modules, layer_specs

__all__ = ["window_cache"]


def window_cache(model: nn.Module, attention_mask: Tensor | None = None):
    """A KV cache for ``model.generate(cache=...)`` of a sparsified ``model`` that forgets keys
    for good (:func:`sparseattn.hf.kvcache.window_cache` on the layers' causal patterns): every
    layer must use a pattern whose rows lie in {first ``front`` keys} ∪ {the previous
    ``window`` tokens}, e.g. ``sliding_window(w, sinks)``; ``attention_mask`` (batch, n) gives
    the left padding to keep in front. Raises ValueError when the model is not sparsified, a
    layer's pattern does not allow eviction, or layers differ in (front, window)."""
    specs = layer_specs(model)
    patterns = [
        None if layer not in specs else specs[layer].causal_pattern
        for layer in range(len(attention_modules(model)))
    ]
    return kvcache.window_cache(patterns, attention_mask)
