"""Hugging Face integration: any sparseattn configuration inside a transformers model.

``sparsify(model, pattern, prob_map, engine)`` replaces the self-attention kernel of any
transformers model whose attention modules dispatch through ``transformers.AttentionInterface``
by Yun et al. eq. (3), out_i = Σ_{j ∈ A_i} ρ(scale · q_i·k_j)_j v_j, computed by
:func:`sparseattn.sparse_attention` or by any method with its signature. Tested (transformers
5.24) on BERT, RoBERTa, DistilBERT (MiniLM is a BERT), ModernBERT, and the decoders Llama,
Qwen2, Qwen3, Mistral, GPT-2 and GPT-NeoX, including ``model.generate()`` with its KV cache,
and the models that modify their scores: Gemma 2 (logit soft-capping) and T5 (relative position
bias), whose modifiers reach ``sparse_attention(score_mod=)`` (:mod:`sparseattn.score_mods`);
in encoder–decoders (T5, BART) the cross-attention stays exact and ``layer_names(model)`` says
which module each ``layers=`` index is.
It uses transformers' public extension points only:

* ``transformers.AttentionInterface.register("sparseattn", fn)`` and
  ``model.set_attn_implementation``; the layers are the modules whose ``forward`` looks its
  kernel up in that registry, in the order the model registers them (cross-attention modules
  keep exact attention);
* ``transformers.AttentionMaskInterface.register("sparseattn", sdpa_mask)`` — without a mask
  function the padding mask would arrive as ``None``; the sdpa mask is a boolean
  (batch, 1, n_q, n_k) tensor that we split into the key padding (batch, n_k), the
  causal structure and, where the model has more (ModernBERT's local layers), that structure,
  which is intersected with the pattern's graph.

Decoders (docs/causal.md, "Hugging Face decoders"): a causal layer applies the pattern causally —
a causal pattern (``sliding_window``, ``causal_strided``, …) as it is, any other pattern
intersected with the lower triangle (``pattern.causal()``; ``dense()`` becomes exact causal
attention). Queries at an offset (a KV cache: n_q < n_k) sit at positions n_k − n_q … n_k − 1.
Grouped-query attention (fewer key/value heads) goes to ``sparse_attention(..., enable_gqa=True)``,
which stacks the query heads sharing a key/value head along the query axis, so k and v are not
copied. With left padding
(generation's padding side) the pattern is laid over each item's real tokens, so sink tokens are
its first real tokens and a padded item computes what it computes alone. Refused with a
ValueError: static caches, and a model's own sliding window once its cache drops keys.
``window_cache(model)`` is a KV cache that drops, for good, the keys a sliding window with sink
tokens will never read again: generation then holds O(window + sinks) keys per layer.

Per-layer settings live on the model (an attribute on each attention module names its
layer), so a ``cycle(A1, A2)`` gives layer l the pattern A_{l mod 2} (Yun §5.1 SEQUENTIAL) and
``split_heads`` gives head groups different patterns (MULTIHEAD). In encoders, patterns are
laid over the padded length with right padding (the tokenizers' default); padding keys are
masked out.

Saving and loading (docs/persistence.md): ``sparsify`` writes its configuration into
``model.config`` (so ``save_pretrained`` keeps it, versioned) and :func:`from_pretrained`
loads a saved model with it; ``import sparseattn.hf`` registers the kernel with transformers.

The package, imports running one way (each module uses only those listed after it):
:mod:`~sparseattn.hf.graphs` (``extract_graphs``: Sparsefinder's gold graphs into the containers
of :mod:`sparseattn.methods.sparsefinder`; not re-exported here, so the paper method is not
imported) →
:mod:`~sparseattn.hf.capture` (``capture_attention``, ``attention_sparsity``),
:mod:`~sparseattn.hf.cache` (``window_cache``, over :mod:`~sparseattn.hf.kvcache`) and
:mod:`~sparseattn.hf.load` (``from_pretrained``) →
:mod:`~sparseattn.hf.registry` (``sparsify``, ``restore``, ``layer_specs``, registration) →
:mod:`~sparseattn.hf.longformer` (Longformer's self-attention, which does not dispatch through
``AttentionInterface``, on the engines: docs/checkpoints.md) and
:mod:`~sparseattn.hf.adapter` (the registered kernel, GQA, the layer's graph) →
:mod:`~sparseattn.hf.persist` (the saved configuration's form) →
:mod:`~sparseattn.hf.accounting` (the real-token counts) → :mod:`~sparseattn.hf.mask` (the
mask decomposition) and :mod:`~sparseattn.hf.state` (layer specs, records, the model's state).
MiniLM loading lives in :mod:`sparseattn.hf.minilm`; ``hf.load_minilm``, ``hf.encode`` and
``hf.mean_pool`` re-export it.
"""

from __future__ import annotations

from .._extras import check_installed
from .cache import window_cache
from .capture import attention_sparsity, capture_attention
from .kvcache import evictable_extent
from .lengthen import lengthen
from .load import from_pretrained
from .minilm import encode, load_minilm, mean_pool
from .persist import NotConfiguredError
from .registry import layer_names, layer_specs, register, restore, sparsify
from .state import ATTN_NAME, VALUE_PROJECTIONS, AttentionRecord, LayerContext, LayerSpec

# transformers is needed; its absence is an error now, naming the extra that installs it.
check_installed("transformers", "hf", "sparseattn.hf")
# The kernel is registered with transformers on import (importing transformers, ~1 s): a model
# saved with attn_implementation "sparseattn" loads, and one saved whole runs.
register()

__all__ = [
    "ATTN_NAME",
    "VALUE_PROJECTIONS",
    "AttentionRecord",
    "LayerContext",
    "LayerSpec",
    "NotConfiguredError",
    "attention_sparsity",
    "capture_attention",
    "encode",
    "evictable_extent",
    "from_pretrained",
    "layer_names",
    "layer_specs",
    "lengthen",
    "load_minilm",
    "mean_pool",
    "register",
    "restore",
    "sparsify",
    "window_cache",
]
