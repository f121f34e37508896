"""What a sparsified model holds: each layer's :class:`LayerSpec`, the capture in progress
and the real-token counts behind :func:`~sparseattn.hf.attention_sparsity` (a :class:`State` on
``model._sparseattn``), with the checks on a model and its layer indices that every entry
point shares. Imports nothing else of :mod:`sparseattn.hf`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

from ..attention import sparse_attention
from ..engines import ENGINES
from ..graph import AttentionGraph
from ..maps import ProbabilityMap
from ..patterns import Pattern, PatternCycle, as_cycle
from ..validate import check_choice, check_int

__all__ = [
    "ATTN_NAME",
    "VALUE_PROJECTIONS",
    "AttentionRecord",
    "Capture",
    "Counts",
    "LayerContext",
    "LayerSpec",
    "Method",
    "State",
    "check_layers",
    "declares",
    "model_state",
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

    @property
    def zeroes_weights(self) -> bool:
        """Whether the layer's map zeroes weights its graph allows (α-entmax, sparsemax, … run
        by :func:`~sparseattn.sparse_attention`; a method hook's layer reports its graph):
        counting its non-zeros takes one more pass of the attention."""
        return self.prob_map.sparse and self.method is sparse_attention


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
class Capture:
    """A :func:`~sparseattn.hf.capture_attention` block in progress: the layers it records
    (None: all), and where each record goes (``callback``, else ``records``)."""

    layers: frozenset[int] | None
    callback: Callable[[AttentionRecord], None] | None
    records: list[AttentionRecord]

    def wants(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    def add(
        self,
        layer: int,
        q: Tensor,
        k: Tensor,
        scores: Tensor,
        allowed: Tensor,
        key_valid: Tensor | None,
        prob_map: ProbabilityMap,
        shift: Tensor | None = None,
    ) -> None:
        """Record one call of ``layer``: q, k (B, H, n, d) before scaling, ``scores``
        (B, H, n, n_k) as :class:`AttentionRecord` defines them, ``allowed`` the layer's graph
        as a bool mask broadcastable to them, ``key_valid`` (B, n_k) True for real keys (None:
        all). The weights are ρ(scores + shift) on ``allowed`` ∩ the real keys (``shift``
        broadcastable to ``scores``, e.g. log r for a block listed r times; None: 0)."""
        allowed = allowed.reshape(*((1,) * (4 - allowed.dim())), *allowed.shape)
        if key_valid is None:
            key_valid = torch.ones(q.shape[0], scores.shape[-1], dtype=torch.bool, device=q.device)
        allowed = allowed.to(q.device) & key_valid[:, None, None, :]
        with torch.no_grad():
            probs = prob_map(scores if shift is None else scores + shift, allowed)
        record = AttentionRecord(layer, q.detach(), k.detach(), scores, probs, allowed, ~key_valid)
        if self.callback is None:
            self.records.append(record)
        else:
            self.callback(record)


@dataclasses.dataclass(kw_only=True)
class Counts:
    """What every sparsified model's state holds beside its layers (a :class:`State`, and
    Longformer's and BigBird's own): per layer, the real-token counts since ``sparsify`` behind
    :func:`~sparseattn.hf.attention_sparsity`; whether the layers whose map zeroes weights count
    them (``sparsify(count_weights=)``); the :func:`~sparseattn.hf.capture_attention` block in
    progress, which pickles and copies do not hold."""

    edges: dict[int, float] = dataclasses.field(default_factory=dict)
    pairs: dict[int, float] = dataclasses.field(default_factory=dict)
    nonzero: dict[int, float] = dataclasses.field(default_factory=dict)
    count_weights: bool = False
    capture: Capture | None = None

    def set_count_weights(self, count_weights: bool | None) -> None:
        """``sparsify``'s ``count_weights``: None keeps the setting; a change starts the counts
        again, so that the ratios of :func:`~sparseattn.hf.attention_sparsity` cover the same
        calls."""
        if count_weights is not None and count_weights != self.count_weights:
            self.count_weights = count_weights
            for counts in (self.edges, self.pairs, self.nonzero):
                counts.clear()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "capture": None}


@dataclasses.dataclass
class State(Counts):
    """Held by a sparsified model (``model._sparseattn``), referenced by its attention modules."""

    original: str
    num_layers: int
    specs: dict[int, LayerSpec]
    hooks: list = dataclasses.field(default_factory=list)


def declares(method: Method, parameter: str) -> bool:
    """Whether a method hook's signature names ``parameter`` (``context``, ``enable_gqa``,
    ``score_mod``): what it asks for beyond :func:`sparseattn.sparse_attention`'s arguments."""
    try:
        return parameter in inspect.signature(method).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return False


def check_layers(layers: object, num_layers: int | None = None) -> list[int] | None:
    """None or an iterable of layer indices in [0, num_layers)."""
    if layers is None:
        return None
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
        raise TypeError(f"layers must be an iterable of ints or None, got {type(layers).__name__}")
    out = [check_int("layers[i]", layer, 0) for layer in layers]
    if num_layers is not None and any(layer >= num_layers for layer in out):
        raise ValueError(f"layers must hold ints in [0, {num_layers}), got {out}")
    return out


def model_state(model: nn.Module) -> State | None:
    return getattr(model, "_sparseattn", None)


def per_layer(
    pattern: object, default: Callable[[int], Pattern | AttentionGraph | None]
) -> Callable[[int], Pattern | AttentionGraph | None]:
    """layer → its pattern, as ``sparsify`` takes ``pattern``: None — ``default(layer)`` (the
    model's own); an AttentionGraph — every layer; a Pattern, a cycle or a sequence of
    patterns — layer l's is pattern l mod p (Yun §5.1 SEQUENTIAL)."""
    if pattern is None:
        return default
    if isinstance(pattern, AttentionGraph):
        return lambda _layer: pattern
    if isinstance(pattern, (Pattern, PatternCycle, list, tuple)):
        return as_cycle(pattern).__getitem__
    raise TypeError(
        "pattern must be a Pattern, a cycle/sequence of patterns, an AttentionGraph or None, "
        f"got {type(pattern).__name__}"
    )


def resolve_method(method: Method | str | None, options: dict, engine: str) -> Method:
    """``method`` as ``sparsify`` takes it: None (sparse_attention), a callable with its
    signature, or a name with options (``"mca"``); ``engine`` checked on the way."""
    check_choice("engine", engine, ["auto", *ENGINES])
    if isinstance(method, str):
        from ..methods.mca import MCAMethod

        named = {"mca": MCAMethod}
        if method not in named:
            raise ValueError(f"method must be one of {sorted(named)} or a callable, got {method!r}")
        return named[method](**options)
    if options:
        raise TypeError(f"options {sorted(options)} need a named method, e.g. method='mca'")
    if method is None:
        return sparse_attention
    if not callable(method):
        raise TypeError(
            f"method must be callable like sparse_attention, got {type(method).__name__}"
        )
    return method
