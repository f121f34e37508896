"""Longformer and LED (transformers' ``LongformerSelfAttention``, ``LEDEncoderSelfAttention``)
on sparseattn's engines.

Longformer's self-attention does not dispatch through ``transformers.AttentionInterface``: it
computes its banded scores itself (``_sliding_chunks_query_key_matmul``) and has a second set of
projections for its global tokens. LED (Longformer encoder–decoder) runs the same attention in
its encoder: ``LEDEncoderSelfAttention`` is a copy of ``LongformerSelfAttention`` (not a
subclass) with the same attributes (``query``, ``key``, ``value``, their ``*_global`` twins,
``num_heads``, ``head_dim``, ``dropout``, ``one_sided_attn_window_size``) and the same call
(``LEDEncoderAttention`` passes it the padded ``hidden_states``, the extended mask and the
derived masks as ``LongformerAttention`` does); LED's decoder attention is BART's and stays
transformers' own. :func:`sparsify` (``sparseattn.hf.sparsify`` sends any model holding either
module here) replaces, per instance, the ``forward`` of each chosen layer's module by
:func:`longformer_forward`, which computes what transformers' code computes (transformers 5.24):

* Local rows (real tokens without global attention), with the layer's ``query``, ``key`` and
  ``value``: query i attends to the keys of its window ∪ the item's global tokens, minus the
  padding keys, the global keys with their *regular* key and value vectors (as transformers
  does: the global projections serve only the global rows). The window is the layer's own,
  ``config.attention_window[layer]`` = 2·w₁ tokens, keys i − w₁ … i + w₁ with w₁ =
  ``attention_window // 2`` (transformers' ``one_sided_attn_window_size``), which is
  ``window(attention_window)``; a ``pattern=`` given to ``sparsify`` replaces it. One
  :func:`sparseattn.sparse_attention` call per layer (or the ``method`` hook) on an
  :class:`~sparseattn.graph.AttentionGraph` of batch shape (batch, 1) — (batch, heads) for a
  per-head pattern — built per call from the pattern's graph, the item's global columns and its
  padding: O(B·(E + n·g)) edges for E pattern edges and g global tokens, merged by binary
  search (:meth:`AttentionGraph.union`), no n × n mask. It is built anew each call (no cache
  yet: the engines' plans are made again too).
* Global rows (``global_attention_mask`` 1), with ``query_global``, ``key_global`` and
  ``value_global``: each attends to every real (non-padding) key; only the global rows' queries
  are projected. With g global tokens and plain ``nn.Linear`` projections, when
  g·(E − d) < E·d (g < 70 for Longformer-base) the two global projections are folded into the
  queries and the weights (``_folded_global_rows``: q·(W x + b) = (q W)·x + q·b, and
  Σ p (W x + b) = W (Σ p x) + b Σ p), so ``key_global`` and ``value_global`` never project
  the n tokens — two products of the H·g rows against the n hidden states instead of two
  n × E × E projections, equal to float rounding; otherwise (or for an adapter, a
  parametrization, a hooked layer) one dense :func:`~sparseattn.sparse_attention` call
  (engine ``auto``) with the key padding mask. The map ρ of the layer either way; the method
  hook does not apply there.
* Padding rows: output 0 (transformers zeroes their probabilities), no gradient.

Queries are divided by √d before the scores and ``scale=1`` is passed (transformers' order of
operations; for a plain ``nn.Linear`` ``query`` the division is applied to its weight and bias,
which is bitwise the same for d = 64). With ``prob_map="softmax"`` (the default) the result
equals transformers' to float rounding, outputs and gradients (in float64 to ~1e-7 only:
transformers computes its softmax in float32 whatever the model's dtype, sparseattn in the
model's); dropout (``attention_probs_dropout_prob`` in training) is applied to the weights of
both parts, with their own random draws.

Saving: :func:`sparsify` writes the layers' configuration onto ``model.config`` as for other
models (:mod:`sparseattn.hf.persist`), so ``save_pretrained`` keeps it and
:func:`~sparseattn.hf.from_pretrained` loads it; :func:`install_guards` (run by
``import sparseattn.hf``) makes a layer loaded without it raise instead of running
transformers' attention in its place.

``output_attentions=True``: the weights in transformers' layout, formed apart from the engine
(:mod:`sparseattn.hf.longformer_weights`), for a layer on its own window without dropout or a
method hook (else a ValueError says which). Each call adds its real-token counts to the
layer's (:func:`_count`, read by :func:`~sparseattn.hf.attention_sparsity`). Under
:func:`~sparseattn.hf.capture_attention` each call of a recorded layer also forms its n × n
scores and weights, every row as the layer computes it (:func:`_record`).
:func:`restore` puts the original ``forward`` back: the model is the original one exactly.

One piece: transformers' Longformer self-attention re-expressed on the engines — the
layer's graph, the local rows, the global rows (folded or not) and the output assembly share
the layer's tensors and its quirks, and are read in the order the layer runs.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor, nn

from ..attention import resolve_graph, sparse_attention
from ..graph import AttentionGraph, broadcast_or_none
from ..maps import ProbabilityMap, resolve_prob_map, support
from ..patterns import HeadSplit, Pattern, PatternCycle, dense, window
from ..validate import check_bool, check_model
from .longformer_weights import global_weights, local_weights
from .persist import forget_config, guard, record_config
from .state import (
    Capture,
    Counts,
    LayerContext,
    LayerSpec,
    Method,
    check_layers,
    declares,
    per_layer,
    resolve_method,
)

__all__ = [
    "attention_modules",
    "install_guards",
    "is_longformer",
    "layer_names",
    "layer_specs",
    "local_graph",
    "longformer_forward",
    "model_state",
    "restore",
    "sparsify",
]

#: The attribute (on the model and on each patched module) holding the configuration.
_KEY = "_sparseattn_longformer"


@dataclasses.dataclass
class LongformerState(Counts):
    """Held by a sparsified Longformer (``model._sparseattn_longformer``): each configured layer's
    spec, and each patched module's own ``forward`` attribute before the patch (None: it had
    none, the class's ``forward`` ran); its counts (:func:`_count`) and capture as
    :class:`~sparseattn.hf.state.Counts`."""

    specs: dict[int, LayerSpec]
    #: the model's attention implementation before :func:`sparsify` (what loading asks for)
    original: str = "eager"
    originals: dict[int, Callable | None] = dataclasses.field(default_factory=dict)
    #: the last :data:`GRAPHS` local graphs, keyed by layer, length, device and the call's
    #: global and padding masks: a model called again with the same masks (a batch shape, the
    #: question tokens of a task) reuses the graph and the engines' plans cached on it
    graphs: OrderedDict = dataclasses.field(default_factory=OrderedDict)

    def __getstate__(self) -> dict:
        """Pickles and copies hold the configuration, not the graphs (nor a capture)."""
        return {**super().__getstate__(), "graphs": OrderedDict()}


#: How many local graphs a sparsified Longformer keeps (all layers together).
GRAPHS = 16


def _cached_local_graph(
    state: LongformerState, layer: int, spec: LayerSpec, q, k, is_global, is_padding
):
    """:func:`local_graph`, memoised in ``state.graphs`` for static patterns (a data-dependent
    one is drawn from q and k each call)."""
    if getattr(spec.pattern, "data_dependent", False):
        return local_graph(spec.pattern, q, k, is_global, is_padding)
    masks = torch.stack([is_global, is_padding]).cpu().numpy().tobytes()
    key = (layer, tuple(is_global.shape), q.shape[1], q.device, masks)
    graph = state.graphs.get(key)
    if graph is None:
        graph = state.graphs[key] = local_graph(spec.pattern, q, k, is_global, is_padding)
        while len(state.graphs) > GRAPHS:
            state.graphs.popitem(last=False)
    else:
        state.graphs.move_to_end(key)
    return graph


#: transformers' Longformer-style self-attention classes: (module, class name). LED's is a copy
#: of Longformer's, attribute for attribute; :func:`longformer_forward` serves both.
_CLASSES = (
    ("transformers.models.longformer.modeling_longformer", "LongformerSelfAttention"),
    ("transformers.models.led.modeling_led", "LEDEncoderSelfAttention"),
)


@functools.cache
def _self_attention_classes() -> tuple[type, ...]:
    """The classes of :data:`_CLASSES` that this transformers has."""
    classes = []
    for module_name, class_name in _CLASSES:
        try:
            classes.append(getattr(importlib.import_module(module_name), class_name))
        except (ImportError, AttributeError):  # a transformers without that model
            continue
    return tuple(classes)


def _named_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    classes = _self_attention_classes()
    if not classes:
        return []
    return [(name, m) for name, m in model.named_modules() if isinstance(m, classes)]


def install_guards() -> None:
    """:func:`sparseattn.hf.persist.guard` on each Longformer-style class (layer: its
    ``layer_id``, the encoder layer's index, which is its index in :func:`attention_modules`)."""
    for cls in _self_attention_classes():
        guard(cls, lambda module: module.layer_id)


def is_longformer(model: nn.Module) -> bool:
    """Whether ``model`` holds Longformer-style self-attention modules (or is one):
    transformers' ``LongformerSelfAttention`` (Longformer) or ``LEDEncoderSelfAttention`` (the
    encoder of LED)."""
    return isinstance(model, nn.Module) and bool(_named_modules(model))


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The ``LongformerSelfAttention`` (or LED's ``LEDEncoderSelfAttention``) modules, in layer
    order (module l is layer l; in LED, encoder layer l)."""
    check_model(model)
    modules = [m for _, m in _named_modules(model)]
    if not modules:
        raise ValueError(
            f"{type(model).__name__} holds no LongformerSelfAttention or LEDEncoderSelfAttention "
            "module"
        )
    return modules


def layer_names(model: nn.Module) -> list[str]:
    """The qualified names of the Longformer-style self-attention modules (``layers=``
    indices): e.g. ``encoder.layer.0.attention.self`` (Longformer),
    ``led.encoder.layers.0.self_attn.longformer_self_attn`` (LEDForConditionalGeneration)."""
    attention_modules(model)
    return [name for name, _ in _named_modules(model)]


def model_state(model: nn.Module) -> LongformerState | None:
    """What :func:`sparsify` keeps on a Longformer or LED (None for an unmodified model)."""
    return getattr(model, _KEY, None)


_state = model_state


def sparsify(
    model: nn.Module,
    pattern: Pattern | PatternCycle | Sequence[Pattern] | AttentionGraph | None = None,
    prob_map: str | ProbabilityMap = "softmax",
    engine: str = "auto",
    method: Method | str | None = None,
    layers: Iterable[int] | None = None,
    count_weights: bool | None = None,
    **method_options,
) -> nn.Module:
    """:func:`sparseattn.hf.sparsify` for a model holding ``LongformerSelfAttention`` modules,
    or LED's ``LEDEncoderSelfAttention`` (its encoder layers; the decoder keeps transformers'
    attention) — the module docstring says what each layer then computes.

    ``pattern`` None: each layer its own window, ``window(config.attention_window[layer])``
    (transformers' keys i − w/2 … i + w/2), exactly transformers' attention for softmax. A
    Pattern, a cycle or sequence of patterns (layer l: pattern l mod p), ``split_heads`` or an
    AttentionGraph of the padded length (a multiple of ``max(attention_window)``) replaces the
    window; the global tokens of each call (``global_attention_mask``) are added to it, and the
    padding taken out, as for the window. ``prob_map``, ``engine``, ``method`` and ``layers``
    as there, and ``count_weights``; calling it again changes only ``layers``; layers never
    configured keep transformers' own code. Modifies ``model`` in place and returns it;
    :func:`restore` undoes it. The configuration is written to ``model.config``
    (``save_pretrained`` keeps it).
    """
    if count_weights is not None:
        check_bool("count_weights", count_weights)
    modules = attention_modules(model)
    num_layers = len(modules)
    pattern_of = per_layer(
        pattern, lambda layer: window(2 * modules[layer].one_sided_attn_window_size)
    )
    rho = resolve_prob_map(prob_map)
    method = resolve_method(method, method_options, engine)
    chosen = check_layers(layers, num_layers)
    chosen_layers = range(num_layers) if chosen is None else chosen
    wants_context = declares(method, "context")
    specs = {}
    for layer in chosen_layers:
        layer_pattern = pattern_of(layer)
        if isinstance(layer_pattern, HeadSplit):
            layer_pattern.head_sizes(modules[layer].num_heads)
        specs[layer] = LayerSpec(layer_pattern, rho, engine, method, wants_context)

    state = _state(model)
    if state is None:
        original = getattr(getattr(model, "config", None), "_attn_implementation", None)
        state = LongformerState({}, original or "eager")
        setattr(model, _KEY, state)
    for layer in specs:
        module = modules[layer]
        if layer not in state.originals:
            state.originals[layer] = vars(module).get("forward")  # an instance's own forward
            setattr(module, _KEY, (state, layer))
            # a partial of a module-level function: deepcopy and pickle keep it bound right
            module.forward = functools.partial(longformer_forward, module)
    state.specs.update(specs)
    state.set_count_weights(count_weights)
    if hasattr(model, "config"):
        record_config(model, state.specs, state.original, _named_modules(model))
    return model


def restore(model: nn.Module) -> nn.Module:
    """Undo :func:`sparsify`: each patched module gets its original ``forward`` back."""
    check_model(model)
    state = _state(model)
    if state is None:
        return model
    modules = attention_modules(model)
    for layer, original in state.originals.items():
        module = modules[layer]
        for name in ("forward", _KEY):
            if name in vars(module):
                delattr(module, name)
        if original is not None:
            module.forward = original
    delattr(model, _KEY)
    if hasattr(model, "config"):
        forget_config(model, _named_modules(model))
    return model


def layer_specs(model: nn.Module) -> dict[int, LayerSpec]:
    """The configured layers of a sparsified Longformer (empty for an unmodified one)."""
    check_model(model)
    state = _state(model)
    return {} if state is None else dict(state.specs)


# ---------------------------------------------------------------------------- the forward
def _global_positions(is_global: Tensor) -> tuple[Tensor, Tensor]:
    """(positions (B, g), counts (B,)): item b's global positions ascending in its first
    counts[b] slots, then its other positions ascending (so that the B·g positions are
    distinct within an item); g = the most global tokens of an item."""
    counts = is_global.sum(-1)
    g = int(counts.max()) if counts.numel() else 0
    order = torch.sort((~is_global).to(torch.uint8), dim=-1, stable=True).indices
    return order[:, :g], counts


def local_graph(
    pattern: Pattern | AttentionGraph,
    q: Tensor,
    k: Tensor,
    is_global: Tensor,
    is_padding: Tensor,
) -> AttentionGraph:
    """The local rows' graph of one call: the pattern's graph ∪ each item's global columns,
    without padding keys (padding rows keep theirs: their output is zeroed).

    q, k: (B, H, n, d); is_global, is_padding: (B, n) bool. Returns a graph of batch shape
    (B, 1), or (B, H) for a per-head pattern, of O(B·(E + n·g)) edges for a pattern graph of E
    edges and at most g global tokens per item (a merge by binary search, no n × n mask)."""
    base = resolve_graph(pattern, q, k)
    dev = base.device
    bsz, n = is_global.shape
    is_global, is_padding = is_global.to(dev), is_padding.to(dev)
    shape = broadcast_or_none(base.batch_shape, (bsz, 1))
    if shape is None or len(shape) != 2:
        raise ValueError(f"the pattern's graph of batch shape {base.batch_shape} is not per head")
    graph = base.expand(shape)
    if bool(is_global.any()):
        pos, counts = _global_positions(is_global)
        g = pos.shape[1]
        slots = torch.arange(g, device=dev)
        valid = slots < counts[:, None]
        # ascending rows: global positions, then n, n + 1, … in the empty slots
        index = torch.where(valid, pos, n + slots)[:, None, None, :].expand(bsz, 1, n, g)
        columns = AttentionGraph.from_neighbours(index, valid[:, None, None, :], n)
        graph = graph | columns
    if bool(is_padding.any()):
        rows = graph.row_indices()
        item = rows // (graph.num_rows // bsz)
        drop = is_padding[item, graph.col] & ~is_padding[item, rows % n]
        if bool(drop.any()):
            keep = ~drop
            degrees = torch.bincount(rows[keep], minlength=graph.num_rows)
            crow = torch.zeros(graph.num_rows + 1, dtype=torch.long, device=dev)
            torch.cumsum(degrees, 0, out=crow[1:])
            graph = AttentionGraph(crow, graph.col[keep], n, n, graph.batch_shape)
    return graph


def _split(x: Tensor, heads: int) -> Tensor:
    """(B, n, H·d) → (B, H, n, d)."""
    bsz, n, _ = x.shape
    return x.view(bsz, n, heads, -1).transpose(1, 2)


def _plain_linear(layer: nn.Module) -> bool:
    """Whether ``layer`` computes ``x Wᵀ + b`` and nothing else: an ``nn.Linear`` itself (not a
    subclass, a parametrization or an adapter) without hooks, whose weight may be read."""
    return type(layer) is nn.Linear and not (layer._forward_hooks or layer._forward_pre_hooks)


def _fold_globals(module: nn.Module, g: int) -> bool:
    """Whether the global rows go through :func:`_folded_global_rows`: its two products
    over the n tokens cost ``H·g·E`` each per token against ``E·H·d + H·g·d`` for
    ``key_global`` and ``value_global`` over every token plus the attention (g global tokens,
    E the hidden size), so folded iff ``g·E < E·d + g·d`` (g < 70 at Longformer-base's E = 768,
    d = 64); only for plain ``nn.Linear`` projections, whose weights stand for their call."""
    embed, d = module.key_global.in_features, module.head_dim
    return (
        _plain_linear(module.key_global)
        and _plain_linear(module.value_global)
        and g * embed < embed * d + g * d
    )


def _folded_global_rows(
    module: nn.Module,
    hidden_states: Tensor,
    q: Tensor,
    valid: Tensor | None,
    prob_map: ProbabilityMap,
    dropout: float,
) -> Tensor:
    """The global rows' attention (B, H, g, d) for their queries q (B, H, g, d), without
    projecting every token by ``key_global`` and ``value_global``: with head h's rows W_h,
    b_h of a projection, q·(W_h x_j + b_h) = (q W_h)·x_j + q·b_h and
    Σ_j p_j (W_h x_j + b_h) = W_h (Σ_j p_j x_j) + b_h Σ_j p_j — the same scores and output
    (to float rounding) from two products of the H·g rows against the n hidden states."""
    bsz, n, embed = hidden_states.shape
    heads, d, g = module.num_heads, module.head_dim, q.shape[2]
    key, value = module.key_global, module.value_global
    folded = torch.matmul(q, key.weight.view(heads, d, embed))  # (B, H, g, E)
    scores = torch.matmul(folded.view(bsz, heads * g, embed), hidden_states.transpose(1, 2))
    scores = scores.view(bsz, heads, g, n)
    if key.bias is not None:
        scores = scores + torch.matmul(q, key.bias.view(heads, d, 1))
    if prob_map.is_softmax:  # one fused pass; every row has a valid key (see _global_rows)
        p = torch.softmax(scores if valid is None else scores.masked_fill(~valid, -math.inf), -1)
    else:
        p = prob_map(scores, valid)
    if dropout:
        p = nn.functional.dropout(p, dropout)
    mixed = torch.matmul(p.view(bsz, heads * g, n), hidden_states)  # (B, H·g, E): Σ_j p_j x_j
    out = torch.matmul(mixed.view(bsz, heads, g, embed), value.weight.view(heads, d, embed).mT)
    if value.bias is not None:
        out = out + p.sum(-1, keepdim=True) * value.bias.view(heads, 1, d)
    return out


def _global_rows(
    module: nn.Module,
    hidden_states: Tensor,
    pos: Tensor,
    is_padding: Tensor,
    prob_map: ProbabilityMap,
    dropout: float,
) -> Tensor:
    """The global rows' output (B, H, g, d) at the positions ``pos`` (B, g) of
    :func:`_global_positions` (an item's empty slots hold other positions, whose rows are
    discarded): ``query_global`` of the global tokens against ``key_global``,
    ``value_global`` of every real key (transformers'
    ``_compute_global_attn_output_from_hidden``), folded into the projections'
    weights where that costs less (:func:`_fold_globals`), else one dense
    :func:`~sparseattn.sparse_attention` call."""
    q = _global_queries(module, hidden_states, pos)
    # an item of padding only has no global token: its (unused) rows may read every key
    ignore = is_padding & (~is_padding).any(-1, keepdim=True)
    ignore = ignore if bool(ignore.any()) else None
    if _fold_globals(module, pos.shape[1]):
        valid = None if ignore is None else ~ignore[:, None, None, :]
        return _folded_global_rows(module, hidden_states, q, valid, prob_map, dropout)
    k = _split(module.key_global(hidden_states), module.num_heads)
    v = _split(module.value_global(hidden_states), module.num_heads)
    return sparse_attention(
        q,
        k,
        v,
        dense(),
        prob_map=prob_map,
        scale=1.0,
        key_padding_mask=ignore,
        dropout_p=dropout,
    )


def _global_queries(module: nn.Module, hidden_states: Tensor, pos: Tensor) -> Tensor:
    """``query_global`` of the tokens at ``pos`` (B, g), divided by √d: (B, H, g, d)."""
    picked = hidden_states.gather(1, pos[..., None].expand(*pos.shape, hidden_states.shape[-1]))
    return _split(module.query_global(picked) / math.sqrt(module.head_dim), module.num_heads)


def _scaled_query(query: nn.Module, hidden_states: Tensor, root_d: float) -> Tensor:
    """``query(hidden_states) / √d`` (transformers' order), for a plain ``nn.Linear`` as one
    product with the weight and bias divided instead of a pass over the n × E queries: the
    same numbers, bitwise for a power-of-two √d (d = 64: division by 8 is exact)."""
    if not _plain_linear(query):
        return query(hidden_states) / root_d
    bias = None if query.bias is None else query.bias / root_d
    return nn.functional.linear(hidden_states, query.weight / root_d, bias)


def longformer_forward(
    module: nn.Module,
    hidden_states: Tensor,
    attention_mask: Tensor | None = None,
    is_index_masked: Tensor | None = None,
    is_index_global_attn: Tensor | None = None,
    is_global_attn: bool | None = None,
    output_attentions: bool = False,
) -> tuple[Tensor]:
    """``LongformerSelfAttention.forward`` (or ``LEDEncoderSelfAttention.forward``, the same
    computation) on sparseattn (bound to ``module`` by :func:`sparsify`): hidden_states
    (B, n, E) with n the padded length; ``attention_mask`` (B, n) < 0 for padding, > 0 for
    global tokens, 0 for local ones (transformers' extended mask), or the two masks it derives
    (``is_index_masked``, ``is_index_global_attn``).
    Returns ``(output (B, n, E),)``; with ``output_attentions`` also transformers'
    ``attn_probs`` and, where there are global tokens, ``global_attn_probs``
    (:mod:`.longformer_weights`)."""
    state, layer = getattr(module, _KEY)
    spec = state.specs[layer]
    dropout = module.dropout if module.training else 0.0
    if output_attentions:
        _check_weights_wanted(module, spec, dropout)
    bsz, n, embed = hidden_states.shape
    heads, head_dim = module.num_heads, module.head_dim
    if is_index_masked is None:
        is_index_masked = (
            attention_mask < 0
            if attention_mask is not None
            else torch.zeros(bsz, n, dtype=torch.bool, device=hidden_states.device)
        )
    if is_index_global_attn is None:
        is_index_global_attn = (
            attention_mask > 0 if attention_mask is not None else torch.zeros_like(is_index_masked)
        )
    if is_global_attn is None:
        is_global_attn = bool(is_index_global_attn.any())

    q = _split(_scaled_query(module.query, hidden_states, math.sqrt(head_dim)), heads)
    k = _split(module.key(hidden_states), heads)
    v = _split(module.value(hidden_states), heads)
    graph = _cached_local_graph(state, layer, spec, q, k, is_index_global_attn, is_index_masked)
    if state.capture is not None and state.capture.wants(layer):
        _record(
            state.capture,
            layer,
            module,
            hidden_states,
            q,
            k,
            graph,
            is_index_global_attn,
            is_index_masked,
            spec.prob_map,
        )
    extra = {}
    if spec.wants_context:
        extra["context"] = LayerContext(layer, module, hidden_states, module.value)
    out = spec.method(
        q,
        k,
        v,
        graph,
        prob_map=spec.prob_map,
        engine=spec.engine,
        scale=1.0,
        key_padding_mask=None,
        dropout_p=dropout,
        **extra,
    )  # (B, H, n, d)
    _count(state, layer, module, hidden_states, graph, q, k, is_index_global_attn, is_index_masked)
    flat = out.transpose(1, 2).reshape(bsz * n, embed)  # a copy (a view for H = 1)
    padded = bool(is_index_masked.any())
    if (is_global_attn or padded) and flat.data_ptr() == out.data_ptr():
        flat = flat.clone()  # a view of the engine's output: the writes below go to a copy
    if is_global_attn:
        pos, counts = _global_positions(is_index_global_attn)
        glob = _global_rows(
            module, hidden_states, pos, is_index_masked, spec.prob_map, dropout
        )  # (B, H, g, d)
        real = torch.arange(pos.shape[1], device=pos.device) < counts[:, None]  # (B, g)
        rows = (pos + n * torch.arange(bsz, device=pos.device)[:, None])[real]
        flat.index_copy_(0, rows, glob.transpose(1, 2).reshape(-1, embed)[real.view(-1)])
    if padded:
        flat.masked_fill_(is_index_masked.reshape(bsz * n, 1), 0.0)
    if not output_attentions:
        return (flat.view(bsz, n, embed),)
    pos, counts = _global_positions(is_index_global_attn)
    w, dtype = module.one_sided_attn_window_size, hidden_states.dtype
    weights = [
        local_weights(q, k, pos, counts, is_index_global_attn, is_index_masked, w, spec.prob_map)
    ]
    if is_global_attn:  # the global rows' own weights, as transformers returns them
        q_global = _global_queries(module, hidden_states, pos)
        k_global = _split(module.key_global(hidden_states), heads)
        weights.append(global_weights(q_global, k_global, counts, is_index_masked, spec.prob_map))
    return (flat.view(bsz, n, embed), *(t.to(dtype) for t in weights))


def _record(
    capture: Capture,
    layer: int,
    module: nn.Module,
    hidden_states: Tensor,
    q: Tensor,
    k: Tensor,
    graph: AttentionGraph,
    is_global: Tensor,
    is_padding: Tensor,
    prob_map: ProbabilityMap,
) -> None:
    """The call as an :class:`~sparseattn.hf.state.AttentionRecord` (n × n, for analysis at
    small n): q (the regular queries, unscaled) and k; the scores and allowed keys of each row
    as the layer computes it — a local row its regular projections on its graph, a global row
    its global projections (``query_global``, ``key_global``) on every real key — and ρ's
    weights there. q (B, H, n, d) is already divided by √d."""
    root_d = math.sqrt(module.head_dim)
    with torch.no_grad():
        scores = q @ k.mT
        allowed = graph.to_dense().to(q.device) | is_global[:, None, :, None]
        if bool(is_global.any()):
            heads = module.num_heads
            q_global = _split(module.query_global(hidden_states) / root_d, heads)
            k_global = _split(module.key_global(hidden_states), heads)
            scores = torch.where(is_global[:, None, :, None], q_global @ k_global.mT, scores)
    capture.add(layer, q * root_d, k, scores, allowed, ~is_padding, prob_map)


def _count(state, layer, module, hidden_states, graph, q, k, is_global, is_padding) -> None:
    """Add this call's real-token counts to the layer's (``attention_sparsity``): the pairs of
    real tokens; the edges among them (a local row: its graph's keys, which hold no padding;
    a global row: every real key); for a sparse ρ, when the model counts them
    (``count_weights``), its non-zero weights among them — one more pass of the engine with ρ's
    support and values of ones for the local rows, the global rows' weights formed
    (:func:`global_weights`) — else the edges (softmax zeroes none)."""
    spec, heads = state.specs[layer], q.shape[1]
    real = ~is_padding
    n_real = real.sum(-1).double()  # (B,)
    local = (real & ~is_global).double()[:, None]  # (B, 1, n): the local rows of real tokens
    g_b, g_h = graph.batch_shape
    degrees = graph.degrees.view(g_b, g_h, -1).double()  # where the graph lives (the host)
    global_edges = float((is_global.sum(-1) * n_real).sum()) * heads
    edges = float((degrees * local.to(degrees.device)).sum()) * heads / g_h + global_edges
    nonzero = edges
    if spec.zeroes_weights and state.count_weights:
        with torch.no_grad():
            q32, k32 = q.detach().float(), k.detach().float()
            ones = k32.new_ones(*k32.shape[:-1], 1)
            rho, engine = support(spec.prob_map), spec.engine
            kept = sparse_attention(q32, k32, ones, graph, prob_map=rho, engine=engine, scale=1.0)
            nonzero = float((kept[..., 0].double() * local).sum())
            if bool(is_global.any()):
                pos, counts = _global_positions(is_global)
                q_global = _global_queries(module, hidden_states, pos)
                k_global = _split(module.key_global(hidden_states), heads)
                probs = global_weights(q_global, k_global, counts, is_padding, spec.prob_map)
                slots = torch.arange(pos.shape[1], device=pos.device) < counts[:, None]
                kept = (probs > 0) & real[:, None, None, :] & slots[:, None, :, None]
                nonzero += float(kept.sum())
    for name, value in (("pairs", float((n_real**2).sum()) * heads), ("edges", edges)):
        getattr(state, name)[layer] = getattr(state, name).get(layer, 0.0) + value
    if state.count_weights or not spec.zeroes_weights:
        state.nonzero[layer] = state.nonzero.get(layer, 0.0) + nonzero


def _check_weights_wanted(module: nn.Module, spec: LayerSpec, dropout: float) -> None:
    """``output_attentions=True`` gives transformers' layout (:mod:`.longformer_weights`),
    which holds the layer's own window and ρ's exact weights: refuse another pattern, a
    method hook (it does not compute those weights) and dropout (transformers returns the
    weights after its random draw)."""
    own = window(2 * module.one_sided_attn_window_size)
    why = None
    if spec.pattern != own:
        why = (
            f"the layer's pattern is {spec.pattern!r}, not its own {own!r}, which the layout holds"
        )
    elif spec.method is not sparse_attention:
        why = "a method hook computes the layer, not the weights of its map"
    elif dropout:
        why = "attention dropout is on (transformers returns the weights after its draw)"
    if why is not None:
        raise ValueError(
            f"output_attentions needs transformers' banded layout, which does not fit here: "
            f"{why}; use sparseattn.hf.restore(model) or model.eval()"
        )
