"""The adapter: the kernel registered with transformers (:func:`attention_forward`). It turns a
layer call's q, k, v and mask into a call of the layer's method — the (causal) pattern's graph
laid over the real tokens, grouped-query k and v handed over unrepeated where the method takes
``enable_gqa`` — and records the call's counts and, under capture, its attention.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..attention import resolve_graph, sparse_attention
from ..engines.common import grid_indices
from ..graph import AttentionGraph
from ..maps import softmax
from ..patterns import Causal, Pattern, dense
from ..patterns.fixed import Dense
from ..score_mods import bias, chain, softcap
from .accounting import account, nonzero_weights
from .mask import MaskView, mask_view
from .persist import CONFIG_KEY, NotConfiguredError
from .state import Capture, LayerContext, LayerSpec, declares

__all__ = ["attention_forward"]

_UNSET = object()  # a module sparsify never saw (vs None: one it left exact)
_EXACT = LayerSpec(dense(), softmax(), "dense", sparse_attention, takes_gqa=True)


def _expand_kv(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Grouped-query attention: k, v (batch, kv_heads, n_k, d) → (batch, heads, n_k, d), head
    h reading key/value head h // (heads / kv_heads), as transformers' ``repeat_kv``."""
    groups, rest = divmod(q.shape[1], k.shape[1])
    if rest or k.shape[1] != v.shape[1]:
        raise ValueError(
            f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]}, "
            f"{v.shape[1]})"
        )
    if groups == 1:
        return k, v
    return k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)


def _keeps_kv_heads(spec: LayerSpec, capturing: bool) -> bool:
    """Whether a grouped-query call may hand k and v over unrepeated (``enable_gqa=True``):
    the method takes ``enable_gqa``, the graph is built from shapes alone (a data-dependent
    pattern scores every query head against its keys) and no capture needs q·kᵀ per head."""
    data_dependent = getattr(spec.pattern, "data_dependent", False) or getattr(
        spec.causal_pattern, "data_dependent", False
    )
    return spec.takes_gqa and not data_dependent and not capturing


def _shifted_graph(pattern: Pattern, q: Tensor, k: Tensor, pads: Tensor) -> AttentionGraph:
    """A causal pattern laid over each batch item's real tokens (left padding skipped).

    Item b has ``pads[b]`` padding keys in front: its real queries get the pattern's rows for
    keys pads[b] … n_k − 1 (so sink tokens are the first *real* tokens, as for the item alone),
    its padding queries their own key only (a padding key: a zero row). q (batch, heads, n_q,
    d), k (batch, heads, n_k, d) → graph of batch shape (batch, 1) or (batch, heads)."""
    bsz, heads, n_q, _ = q.shape
    n_k = k.shape[-2]
    start = n_k - n_q
    items = []
    for b in range(bsz):
        pad = min(int(pads[b]), n_k)
        skip = min(max(0, pad - start), n_q)  # leading queries that are padding
        graph = None
        if skip < n_q:
            graph = resolve_graph(pattern, q[b : b + 1, :, skip:], k[b : b + 1, :, pad:])
        items.append((pad, skip, graph))
    per_head = any(g is not None and g.batch_shape[-1:] == (heads,) for _, _, g in items)
    g_h = heads if per_head and heads > 1 else 1
    # static patterns' graphs live on the host, data-dependent ones on q's device
    dev = next((g.device for _, _, g in items if g is not None), torch.device("cpu"))
    rows, cols = [], []
    for b, (pad, skip, graph) in enumerate(items):
        own = torch.arange(skip, device=dev)
        for h in range(g_h):
            rows.append((b * g_h + h) * n_q + own)
            cols.append(start + own)
        if graph is not None:
            graph = graph.expand((1, g_h))
            m = n_q - skip
            r = graph.row_indices()
            rows.append((b * g_h + r // m) * n_q + skip + r % m)
            cols.append(graph.col + pad)
    return AttentionGraph.from_edges(
        torch.cat(rows), torch.cat(cols), n_q, n_k, (bsz, g_h), causal=True
    )


def _layer_graph(spec: LayerSpec, q: Tensor, k: Tensor, view: MaskView) -> AttentionGraph:
    """The layer's graph for this call: the (causal) pattern, laid over real tokens when a
    decoder batch is left-padded (or given the key padding, for patterns that take it:
    predicted patterns rank real tokens only), ∩ the model's own structure."""
    pattern = spec.causal_pattern if view.causal else spec.pattern
    if view.pads is not None and isinstance(pattern, Pattern):
        graph = _shifted_graph(pattern, q, k, view.pads)
    elif getattr(pattern, "uses_key_padding", False) and view.key_valid is not None:
        graph = resolve_graph(pattern.build(q, k, key_padding_mask=~view.key_valid), q, k)
    else:
        graph = resolve_graph(pattern, q, k)
    if view.structure is not None:
        graph = graph & AttentionGraph.from_dense(view.structure.cpu())
    return graph


def _graph_free(spec: LayerSpec, view: MaskView) -> Pattern | None:
    """The layer's pattern when :func:`sparse_attention` runs it without building a graph:
    ``dense()`` or its causal form (SDPA for softmax, the rows engine for other maps, O(n)
    memory instead of an n² graph), with the library's own method and no model structure
    beyond causality and padding (left padding needs no shift: every real key before a query
    is allowed anyway). None otherwise."""
    if spec.method is not sparse_attention or view.structure is not None:
        return None
    pattern = spec.causal_pattern if view.causal else spec.pattern
    base = pattern.base if isinstance(pattern, Causal) else pattern
    return pattern if type(base) is Dense else None


def _record(
    capture: Capture,
    layer: int,
    graph: AttentionGraph,
    q: Tensor,
    k: Tensor,
    key_valid: Tensor | None,
    spec: LayerSpec,
    scale: float,
    score_mod: Callable | None = None,
) -> None:
    with torch.no_grad():
        scores = (q @ k.transpose(-1, -2)) * scale
        if score_mod is not None:
            rows = torch.arange(q.shape[-2], device=q.device)
            scores = score_mod(scores, *grid_indices(*q.shape[:2], rows, k.shape[-2], q.device))
    capture.add(layer, q, k, scores, graph.to_dense(), key_valid, spec.prob_map)


@functools.lru_cache(maxsize=64)
def _softcap(cap: float):
    """One modifier object per cap value: a compiled engine (flex) then compiles it once."""
    return softcap(cap)


def model_score_mod(kwargs: dict) -> Callable | None:
    """The score modifiers a model passes its attention kernel, as one ``score_mod``: Gemma 2's
    logit soft-capping (``softcap``), then T5's additive relative position bias
    (``position_bias``, (1 or batch, heads, n_q, n_k)), in the order of their eager code."""
    mods = []
    if kwargs.get("softcap") is not None:
        mods.append(_softcap(float(kwargs["softcap"])))
    if kwargs.get("position_bias") is not None:
        mods.append(bias(kwargs["position_bias"]))
    if len(mods) < 2:
        return mods[0] if mods else None
    return chain(*mods)


def _takes_score_mod(method: Callable) -> bool:
    return method is sparse_attention or declares(method, "score_mod")


def eager_attention(
    module: nn.Module,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None,
    dropout: float,
    score_mod: Callable,
    causal: bool,
) -> Tensor:
    """Exact attention with a score modifier, as the models' eager code computes it: scaled
    scores, modified, plus the model's mask (bool: True = attend; float: added; None and
    ``causal``: keys j ≤ n_k − n_q + i), softmax in float32. q (batch, heads, n_q, d), k and
    v (batch, kv_heads, n_k, d) → (batch, n_q, heads, d). For the layers ``sparsify`` leaves
    exact (and cross-attention)."""
    k, v = _expand_kv(q, k, v)
    scale = q.shape[-1] ** -0.5 if scaling is None else float(scaling)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    rows = torch.arange(q.shape[-2], device=q.device)
    s = score_mod(s, *grid_indices(q.shape[0], q.shape[1], rows, k.shape[-2], q.device))
    if attention_mask is None and causal:
        n_q, n_k = s.shape[-2:]
        attention_mask = torch.ones(n_q, n_k, dtype=torch.bool, device=s.device).tril(n_k - n_q)
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            s = s.masked_fill(~attention_mask, float("-inf"))
        else:
            s = s + attention_mask
    p = torch.softmax(s, -1, dtype=torch.float32).to(q.dtype)
    p = nn.functional.dropout(p, dropout, training=module.training)
    return torch.matmul(p, v).transpose(1, 2).contiguous()


def _exact_attention(module, q, k, v, mask, scaling, dropout, score_mod, kwargs):
    """A layer left exact: transformers' SDPA kernel, or the eager formula where the model
    modifies its scores (which SDPA cannot take). Returns (output, None) as a kernel does."""
    if score_mod is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, q, k, v, mask, dropout=dropout, scaling=scaling, **kwargs
        )
    causal = _is_causal(module, kwargs)
    return eager_attention(module, q, k, v, mask, scaling, dropout, score_mod, causal), None


def _is_causal(module: nn.Module, kwargs: dict) -> bool:
    """A call is causal when the model says so (``is_causal`` kwarg, else the module's flag)."""
    flag = kwargs.get("is_causal")
    return bool(getattr(module, "is_causal", False) if flag is None else flag)


def attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, None]:
    """The kernel registered as ``ATTN_NAME``: q (batch, heads, n_q, d), k and v (batch,
    kv_heads, n_k, d) → (batch, n_q, heads, d). Decoder calls (``module.is_causal``) apply the
    layer's pattern causally with queries at n_k − n_q … n_k − 1 (a KV cache).

    Non-configured layers run torch SDPA (exact; the eager formula where the model modifies
    its scores) unless attention is being captured."""
    if kwargs.get("s_aux") is not None:
        raise ValueError("sparseattn attention does not support attention sinks ('s_aux')")
    score_mod = model_score_mod(kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k not in ("softcap", "position_bias")}
    hook = getattr(module, "_sparseattn", _UNSET)
    exact = (module, query, key, value, attention_mask, scaling, dropout, score_mod, kwargs)
    if hook is _UNSET and hasattr(getattr(module, "config", None), CONFIG_KEY):
        raise NotConfiguredError(
            f"{type(module).__name__}: this model was saved sparsified and loaded without its "
            "sparse configuration; load it with sparseattn.hf.from_pretrained(path, "
            "model_class=...) (or sparsify it again)"
        )
    if hook is None or hook is _UNSET:  # a module sparsify left exact (cross-attention)
        return _exact_attention(*exact)
    state, layer, value_proj = hook
    hidden_states = getattr(module, "_sparseattn_input", None)
    module._sparseattn_input = None
    capture = state.capture
    capturing = capture is not None and capture.wants(layer)
    spec = state.specs.get(layer)
    view = mask_view(
        attention_mask, query, key, _is_causal(module, kwargs), kwargs.get("sliding_window")
    )
    if spec is None and not capturing:
        edges = account(state, layer, None, query, key, view, _EXACT)
        state.nonzero[layer] = state.nonzero.get(layer, 0.0) + edges
        return _exact_attention(*exact)
    spec = spec or _EXACT
    if score_mod is not None:
        if not _takes_score_mod(spec.method):
            raise ValueError(
                f"layer {layer}: this model modifies its attention scores ({score_mod!r}), "
                f"which method {spec.method!r} does not take (it has no score_mod argument)"
            )
        extra = {"score_mod": score_mod}
    else:
        extra = {}
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    if spec.wants_context:
        if key.shape[1] != query.shape[1]:
            raise ValueError(
                f"layer {layer}: method {spec.method!r} takes the value projection, which here "
                f"gives {key.shape[1]} key/value heads for {query.shape[1]} query heads"
            )
        extra["context"] = LayerContext(layer, module, hidden_states, value_proj)
    free = _graph_free(spec, view)
    if key.shape[1] != query.shape[1]:
        if _keeps_kv_heads(spec, capturing):
            extra["enable_gqa"] = True
        else:
            key, value = _expand_kv(query, key, value)
    graph = None if free is not None and not capturing else _layer_graph(spec, query, key, view)
    edges = account(state, layer, None if free is not None else graph, query, key, view, spec)
    out = spec.method(
        query,
        key,
        value,
        graph if free is None else free,
        prob_map=spec.prob_map,
        engine=spec.engine,
        scale=scale,
        key_padding_mask=None if view.key_valid is None else ~view.key_valid,
        dropout_p=dropout,
        **extra,
    )
    if not spec.zeroes_weights:
        state.nonzero[layer] = state.nonzero.get(layer, 0.0) + edges
    elif state.count_weights:  # exact zeros of the map, one more pass
        target = graph if free is None else free
        gqa = extra.get("enable_gqa", False)
        edges = nonzero_weights(
            spec, query, key, target, view, scale, query.shape[-2], gqa, score_mod
        )
        state.nonzero[layer] = state.nonzero.get(layer, 0.0) + edges
    if capturing:
        _record(capture, layer, graph, query, key, view.key_valid, spec, scale, score_mod)
    return out.transpose(1, 2).contiguous(), None
