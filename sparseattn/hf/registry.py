"""Registration with transformers and the layers' configuration: which modules of a model are
its attention layers, :func:`sparsify` (the kernel and its mask function registered as
``ATTN_NAME``, a :class:`~sparseattn.hf.state.LayerSpec` per layer), :func:`restore` and
:func:`layer_specs`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable, Sequence

from torch import nn

from ..attention import sparse_attention
from ..graph import AttentionGraph
from ..maps import ProbabilityMap, resolve_prob_map
from ..patterns import HeadSplit, Pattern, PatternCycle, dense
from ..validate import check_bool, check_model
from . import bigbird, longformer
from .adapter import attention_forward
from .persist import forget_config, record_config
from .state import (
    ATTN_NAME,
    VALUE_PROJECTIONS,
    LayerSpec,
    Method,
    State,
    check_layers,
    declares,
    model_state,
    per_layer,
    resolve_method,
)

__all__ = ["attention_modules", "layer_names", "layer_specs", "register", "restore", "sparsify"]


@functools.cache
def _dispatches(cls: type) -> bool:
    """Whether ``cls.forward`` looks its kernel up in transformers' ``ALL_ATTENTION_FUNCTIONS``
    (the registry behind ``AttentionInterface``): the names its code object refers to."""
    forward = getattr(cls, "forward", None)
    code = getattr(inspect.unwrap(forward), "__code__", None) if forward is not None else None
    return code is not None and "ALL_ATTENTION_FUNCTIONS" in code.co_names


#: Attribute names under which encoder–decoder models keep their cross-attention modules
#: (T5 ``EncDecAttention``, BART/Whisper/Marian ``encoder_attn``, BERT decoders
#: ``crossattention``), lower-cased: the same class serves self- and cross-attention there.
_CROSS_NAMES = ("encdecattention", "encoder_attn", "crossattention", "cross_attn")


def _is_cross_attention(name: str, module: nn.Module) -> bool:
    return (
        bool(getattr(module, "is_cross_attention", False))
        or "CrossAttention" in type(module).__name__
        or name.rsplit(".", 1)[-1].lower() in _CROSS_NAMES
    )


def _named_attention(model: nn.Module, cross: bool = False) -> list[tuple[str, nn.Module]]:
    """The modules that look their kernel up in transformers' registry: self-attention ones,
    or with ``cross`` the cross-attention ones."""
    if not hasattr(model, "set_attn_implementation"):
        return []
    return [
        (name, m)
        for name, m in model.named_modules()
        if _dispatches(type(m)) and _is_cross_attention(name, m) == cross
    ]


def layer_names(model: nn.Module) -> list[str]:
    """The qualified names of the self-attention modules, position l holding layer l of
    ``sparsify(..., layers=)``: e.g. a T5 lists the encoder's ``SelfAttention`` modules, then
    the decoder's (a Longformer: its ``LongformerSelfAttention`` modules; an LED: its encoder's
    ``LEDEncoderSelfAttention`` modules only). ValueError as
    :func:`attention_modules`."""
    if longformer.is_longformer(model):
        return longformer.layer_names(model)
    if bigbird.is_bigbird(model):
        return bigbird.layer_names(model)
    attention_modules(model)  # raises for a model without any
    return [name for name, _ in _named_attention(model)]


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules that dispatch through ``AttentionInterface``, in the order
    the model registers them (layer order; :func:`layer_names` names them); cross-attention
    modules are left out (they keep exact attention). ValueError if there are none."""
    check_model(model)
    modules = [m for _, m in _named_attention(model)]
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
    module._sparseattn_input = args[0] if args else kwargs.get("hidden_states")


def register() -> None:
    """Register the kernel and its mask function with transformers as ``ATTN_NAME``
    (``import sparseattn.hf`` does): then a model whose config names ``"sparseattn"`` loads,
    and a sparsified model saved whole with ``torch.save`` runs in a new process."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(ATTN_NAME, attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    longformer.install_guards()
    bigbird.install_guards()


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
    """Give ``layers`` (default all) of a Hugging Face model the attention (pattern, ρ, engine).

    Yun et al. eq. (3) per layer; layer l is the l-th self-attention module,
    ``layer_names(model)[l]`` (encoder–decoders: the encoder's, then the decoder's;
    cross-attention keeps exact attention). ``pattern``: a Pattern (every layer), a
    ``cycle(...)`` or a sequence of patterns (layer l uses pattern l mod p, Yun §5.1
    SEQUENTIAL), ``split_heads`` (MULTIHEAD), or an AttentionGraph of the padded length.
    ``method`` replaces :func:`sparse_attention` (same signature; it receives the layer's
    AttentionGraph as ``pattern``). Calling ``sparsify`` again on a sparsified model changes
    only ``layers``; layers never configured keep exact attention (torch SDPA). Modifies
    ``model`` in place and returns it; :func:`restore` undoes it. A method may also be named:
    ``method="mca"`` with ``method_options`` for :class:`sparseattn.methods.mca.MCAMethod`
    (e.g. ``alpha=0.2``). ``count_weights=True``: each call of a layer whose map zeroes weights
    (α-entmax, sparsemax, …) also counts its non-zero weights for :func:`attention_sparsity`,
    one more pass of the attention per call (False, the default for a new model: only the
    graph is counted; None keeps the model's setting; a change starts the counts again).

    In a decoder (a causal attention module) the pattern is applied causally: a non-causal
    pattern is intersected with the lower triangle (``pattern.causal()``; note that Yun's
    ``window(w)`` then keeps ⌈w/2⌉ previous tokens — ``sliding_window(w, sinks)`` is the causal
    window), and ``generate()`` runs with its KV cache (queries at an offset).

    Raises:
        ValueError for a model without an AttentionInterface attention module, a bad layer
        index, an unknown engine, a head split that does not fit the model's heads, or a
        context method on a model whose q, k, v come from one fused projection;
        TypeError for a pattern or method of the wrong type.

    A model holding transformers' ``LongformerSelfAttention`` modules (Longformer) or
    ``LEDEncoderSelfAttention`` modules (LED's encoder), which do not dispatch through
    ``AttentionInterface``, goes to :func:`sparseattn.hf.longformer.sparsify`: window (the
    layer's own without ``pattern``) ∪ the call's global tokens, its global projections for the
    global rows.
    """
    if count_weights is not None:
        check_bool("count_weights", count_weights)
    if longformer.is_longformer(model):
        return longformer.sparsify(
            model, pattern, prob_map, engine, method, layers, count_weights, **method_options
        )
    if bigbird.is_bigbird(model):
        return bigbird.sparsify(
            model, pattern, prob_map, engine, method, layers, count_weights, **method_options
        )
    modules = attention_modules(model)
    num_layers = len(modules)
    pattern_of = per_layer(pattern, lambda _layer: dense())
    rho = resolve_prob_map(prob_map)
    method = resolve_method(method, method_options, engine)
    chosen = check_layers(layers, num_layers)
    chosen_layers = range(num_layers) if chosen is None else chosen
    heads = model.config.get_text_config().num_attention_heads
    wants_context = declares(method, "context")
    takes_gqa = method is sparse_attention or declares(method, "enable_gqa")
    specs = {}
    for layer in chosen_layers:
        layer_pattern = pattern_of(layer)
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

    state = model_state(model)
    if state is None:
        register()
        state = State(model.config._attn_implementation, num_layers, {})
        model.set_attn_implementation(ATTN_NAME)
        if model.config._attn_implementation != ATTN_NAME:
            raise ValueError(f"{type(model).__name__} refused set_attn_implementation")
        model._sparseattn = state
        for index, module in enumerate(modules):
            module._sparseattn = (state, index, _value_projection(module))
            state.hooks.append(module.register_forward_pre_hook(_stash_input, with_kwargs=True))
        for _, module in _named_attention(model, cross=True):
            module._sparseattn = None  # exact attention, by design
    state.specs.update(specs)
    state.set_count_weights(count_weights)
    record_config(model, state.specs, state.original, _named_attention(model))
    return model


def restore(model: nn.Module) -> nn.Module:
    """Undo :func:`sparsify`: the original attention implementation, exactly (no-op if none)."""
    check_model(model)
    if longformer.is_longformer(model):
        return longformer.restore(model)
    if bigbird.is_bigbird(model):
        return bigbird.restore(model)
    state = model_state(model)
    if state is None:
        return model
    model.set_attn_implementation(state.original)
    for handle in state.hooks:
        handle.remove()
    for _, module in _named_attention(model) + _named_attention(model, cross=True):
        for name in ("_sparseattn", "_sparseattn_input"):
            if hasattr(module, name):
                delattr(module, name)
    del model._sparseattn
    forget_config(model, _named_attention(model))
    return model


def layer_specs(model: nn.Module) -> dict[int, LayerSpec]:
    """The configured layers of a sparsified model (empty for an unmodified one)."""
    check_model(model)
    if longformer.is_longformer(model):
        return longformer.layer_specs(model)
    if bigbird.is_bigbird(model):
        return bigbird.layer_specs(model)
    state = model_state(model)
    return {} if state is None else dict(state.specs)
