"""BigBird and BigBirdPegasus (transformers' block-sparse attention) on sparseattn's engines.

transformers' ``BigBirdBlockSparseAttention`` (``BigBirdModel``, ``BigBirdForMaskedLM``, …) and
its copy ``BigBirdPegasusBlockSparseAttention`` (the encoder of ``BigBirdPegasusModel`` and
``BigBirdPegasusForConditionalGeneration``; the decoder's attention is a plain one and stays
transformers' own) do not dispatch through ``transformers.AttentionInterface``: they gather key
blocks themselves. :func:`sparsify` replaces, per instance, the ``forward`` of each chosen
layer's block-sparse module by :func:`bigbird_forward`, which computes what transformers' code
computes (transformers 5.24):

* The layout: without a ``pattern``, a layer in training mode (the module's ``training`` flag
  at call time, as in transformers) uses ``bigbird_blocks(block_size, num_random_blocks,
  heads=num_attention_heads, seed=layer, max_seqlen=max_position_embeddings)`` — transformers
  reseeds numpy with the layer index on every training call, so its draw is that pattern's; in
  eval mode ``bigbird_blocks(block_size, num_random_blocks, training=False)`` (band and global
  blocks; transformers points every random block at block 0). One graph per layer and length
  (or one for all layers in eval mode), cached by the pattern; the engines' plans ride on it.
* Block multiplicities: transformers' softmax runs over a row of *listed* key blocks, so a
  block listed twice counts twice. In eval mode the r random slots all name block 0, whose
  keys therefore weigh r + 1 times in the rows of query blocks 1 … nb − 2; at the lengths of
  its older draw (1024, 3072, 4096 tokens) a training draw may name a band or global block
  again (layer 0 of BigBird-RoBERTa-base's configuration does at n = 1024). For softmax both
  are reproduced by a few extra query and key columns (:func:`repeat_columns`): appended to
  q/√d and k they add log(multiplicity) to exactly those scores (one column in eval mode, one
  per repeated key block of a head in training mode), so the engines keep their fused paths
  and a method hook sees plain q, k, v (q and k wider). Other maps see the layout as a set
  (the repeats are an artefact of transformers' softmax code).
* Padding (``attention_mask`` 0): padding keys are left out of every real row
  (``key_padding_mask``; transformers adds −10000 to their scores, whose exponential is 0 in
  float32); padding rows output 0 (transformers multiplies the output by ``from_mask``; so
  does this forward). Every real row keeps a real key (its own block is in its list), so no
  row is left empty. An item of padding only outputs 0 everywhere.
* Scores: queries times 1/√d, as transformers scales them. Dropout: none —
  transformers' block-sparse path applies no attention dropout, in training either.
* numpy: a training call of transformers' module seeds numpy's global generator with the layer
  index and draws from it; the sparsified module leaves that generator in the state
  transformers leaves it in (computed once per layer and length with a private generator).

Short inputs: ``BigBirdModel`` and ``BigBirdPegasusEncoder`` switch themselves to full
attention (``set_attention_type("original_full")``) for inputs of at most (5 + 2r)·b tokens,
which *replaces* each layer's block-sparse module by a new full-attention module (sharing the
projections) — for good: later calls stay on full attention, in transformers as here. A
sparsified model lets that happen: those calls run transformers' full attention, exactly the
original's. The dropped modules keep their patch until :func:`restore` (which reaches them
through the state, not the model); if a model is switched back to ``block_sparse``, its new
modules run transformers' code until :func:`sparsify` is called again.

Each call adds its real-token counts to the layer's (:func:`_count`, read by
:func:`~sparseattn.hf.attention_sparsity`). ``output_attentions=True``: transformers' n × n
matrix, formed apart from the engine (:func:`dense_weights`; a method hook refuses it).
Under :func:`~sparseattn.hf.capture_attention` each call of a recorded layer forms its n × n
scores and weights (:func:`_record`); calls on transformers' full attention (short inputs)
record nothing. :func:`restore` puts the original ``forward`` back: the model is the original
one exactly.

One piece: BigBird's own block layout and its quirks (eval's block 0, the repeated blocks,
the short-input switch) are one mapping from transformers' layer to the engines, read in the
order the layer runs.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from ..attention import resolve_graph, sparse_attention
from ..graph import AttentionGraph
from ..maps import ProbabilityMap, resolve_prob_map
from ..memo import Memo
from ..patterns import HeadSplit, Pattern, PatternCycle
from ..patterns.bigbird_blocks import (
    HF_LEGACY_LENGTHS,
    BigBirdBlocks,
    _legacy_rand_mask,
    _rand_attn_plan,
    _rand_mask_with_head,
    bigbird_blocks,
)
from ..validate import check_bool, check_model
from .accounting import account, nonzero_weights
from .mask import MaskView
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
    "bigbird_forward",
    "block_repeats",
    "dense_weights",
    "is_bigbird",
    "layer_names",
    "layer_specs",
    "model_state",
    "repeat_columns",
    "restore",
    "sparsify",
]

#: The attribute of a sparsified model holding its state, and the one of each patched module
#: holding (state, layer): two names, so that a bare module can be the model itself.
_KEY = "_sparseattn_bigbird"
_LAYER_KEY = "_sparseattn_bigbird_layer"

#: Derived values a sparsified model keeps (all layers together): per layer and length the
#: columns of its training draw's repeated blocks and numpy's state after the draw; per
#: length, device and dtype the eval columns.
CACHED = 64


@dataclasses.dataclass
class BigBirdState(Counts):
    """Held by a sparsified BigBird (``model._sparseattn_bigbird``).

    ``specs``: each configured layer's spec (``pattern``: the training layout of a layer on
    the model's own configuration, else the given pattern); ``own``: the layers on the model's
    own configuration; ``evals``: their eval layouts (one object per configuration, so that
    the layers share its graphs); ``modules``: the module patched per layer (it may have left
    the model since, replaced by transformers); ``originals``: each patched module's own
    ``forward`` attribute before the patch (None: it had none); its counts (:func:`_count`) and
    capture as :class:`~sparseattn.hf.state.Counts`."""

    specs: dict[int, LayerSpec]
    own: set[int] = dataclasses.field(default_factory=set)
    evals: dict[int, BigBirdBlocks] = dataclasses.field(default_factory=dict)
    modules: dict[int, nn.Module] = dataclasses.field(default_factory=dict)
    originals: dict[int, Callable | None] = dataclasses.field(default_factory=dict)
    #: the model's attention implementation before :func:`sparsify` (what loading asks for)
    original: str | None = None
    #: derived tensors (a memo: pickles and copies hold none)
    cache: Memo = dataclasses.field(default_factory=lambda: Memo(CACHED))


# ---------------------------------------------------------------------- the modules
def _block_sparse_classes() -> tuple[type, ...]:
    classes = []
    try:
        from transformers.models.big_bird.modeling_big_bird import BigBirdBlockSparseAttention

        classes.append(BigBirdBlockSparseAttention)
    except ImportError:  # a transformers without BigBird
        pass
    try:
        from transformers.models.bigbird_pegasus.modeling_bigbird_pegasus import (
            BigBirdPegasusBlockSparseAttention,
        )

        classes.append(BigBirdPegasusBlockSparseAttention)
    except ImportError:
        pass
    return tuple(classes)


def _named_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    classes = _block_sparse_classes()
    if not classes:
        return []
    return [(name, m) for name, m in model.named_modules() if isinstance(m, classes)]


def model_state(model: nn.Module) -> BigBirdState | None:
    """What :func:`sparsify` keeps on a BigBird (None for an unmodified model)."""
    return getattr(model, _KEY, None)


_state = model_state


def is_bigbird(model: nn.Module) -> bool:
    """Whether ``model`` holds transformers' ``BigBirdBlockSparseAttention`` or
    ``BigBirdPegasusBlockSparseAttention`` modules (or is one), or was sparsified here (its
    modules may have been replaced since by transformers' switch to full attention)."""
    return isinstance(model, nn.Module) and (
        _state(model) is not None or bool(_named_modules(model))
    )


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The block-sparse self-attention modules, in layer order (module l is layer l)."""
    check_model(model)
    modules = [m for _, m in _named_modules(model)]
    if not modules:
        hint = ""
        if _state(model) is not None:
            hint = (
                " (any more: transformers switched it to full attention, "
                "set_attention_type('original_full'), as it does for short inputs)"
            )
        raise ValueError(
            f"{type(model).__name__} holds no BigBirdBlockSparseAttention or "
            f"BigBirdPegasusBlockSparseAttention module{hint}"
        )
    return modules


def layer_names(model: nn.Module) -> list[str]:
    """The qualified names of the block-sparse modules (``layers=`` indices)."""
    attention_modules(model)
    return [name for name, _ in _named_modules(model)]


# ---------------------------------------------------------------------- sparsify, restore
def _own_layouts(module: nn.Module, layer: int) -> tuple[BigBirdBlocks, tuple]:
    """(the training layout of ``module``, the key of its eval layout)."""
    if module.seed is None:
        raise ValueError(
            f"layer {layer}: its block-sparse module has no seed (transformers then seeds its "
            "random draw from the operating system on each training call, which nothing can "
            "reproduce); pass pattern= (e.g. sa.bigbird_blocks(...)) instead"
        )
    b, r, heads = module.block_size, module.num_random_blocks, module.num_attention_heads
    train = bigbird_blocks(b, r, heads, module.seed, max_seqlen=module.max_seqlen)
    return train, (b, r, module.max_seqlen)


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
    """:func:`sparseattn.hf.sparsify` for a model holding BigBird's block-sparse modules (the
    module docstring says what each layer then computes).

    ``pattern`` None: each layer its model's own layout — in training mode HF's draw for that
    layer (``bigbird_blocks(block_size, num_random_blocks, heads, seed=layer)``), in eval mode
    band and global blocks with block 0 counted r + 1 times — exactly transformers' attention
    for softmax. A Pattern, a cycle or sequence of patterns (layer l: pattern l mod p),
    ``split_heads`` or an AttentionGraph of the padded length (a multiple of ``block_size``)
    replaces it in both modes (as a set: no block counted twice); padding keys are taken out,
    as for the layout. ``prob_map``, ``engine``, ``method`` and ``layers`` as for other
    models, and ``count_weights``; calling it again changes only ``layers``; layers never
    configured keep transformers' own code. Modifies ``model`` in place and returns it;
    :func:`restore` undoes it. The configuration is written to ``model.config``
    (``save_pretrained`` keeps it).
    """
    if count_weights is not None:
        check_bool("count_weights", count_weights)
    modules = attention_modules(model)
    num_layers = len(modules)
    pattern_of = per_layer(pattern, lambda _layer: None)  # None: the model's own layouts
    rho = resolve_prob_map(prob_map)
    method = resolve_method(method, method_options, engine)
    chosen = check_layers(layers, num_layers)
    chosen_layers = range(num_layers) if chosen is None else chosen
    wants_context = declares(method, "context")
    specs, evals = {}, {}
    for layer in chosen_layers:
        layer_pattern = pattern_of(layer)
        if layer_pattern is None:
            layer_pattern, evals[layer] = _own_layouts(modules[layer], layer)
        elif isinstance(layer_pattern, HeadSplit):
            layer_pattern.head_sizes(modules[layer].num_attention_heads)
        specs[layer] = LayerSpec(layer_pattern, rho, engine, method, wants_context)

    state = _state(model)
    if state is None:
        state = BigBirdState({})
        setattr(model, _KEY, state)
    shared = {key: layout for layout in state.evals.values() for key in [_eval_key(layout)]}
    for layer, key in evals.items():
        if key not in shared:
            b, r, max_seqlen = key
            shared[key] = bigbird_blocks(b, r, training=False, max_seqlen=max_seqlen)
        state.evals[layer] = shared[key]
        state.own.add(layer)
    for layer in specs:
        if layer not in evals:
            state.own.discard(layer)
            state.evals.pop(layer, None)
        module = modules[layer]
        old = state.modules.get(layer)
        if old is not module:
            if old is not None:  # replaced by transformers since: it leaves the state
                _unpatch(old, state.originals.pop(layer))
            state.originals[layer] = vars(module).get("forward")  # an instance's own forward
            state.modules[layer] = module
            setattr(module, _LAYER_KEY, (state, layer))
            # a partial of a module-level function: deepcopy and pickle keep it bound right
            module.forward = functools.partial(bigbird_forward, module)
    state.specs.update(specs)
    state.set_count_weights(count_weights)
    original = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if hasattr(model, "config"):
        if state.original is None:
            state.original = original or "eager"
        record_config(
            model, state.specs, state.original, _named_modules(model), frozenset(state.own)
        )
    return model


def install_guards() -> None:
    """:func:`sparseattn.hf.persist.guard` on the attention modules holding the block-sparse
    ones (``BigBirdAttention``, ``BigBirdPegasusEncoderAttention``: they keep the config and
    the layer index, ``seed``), served as :func:`_served` says."""
    for module_name, class_name in (
        ("transformers.models.big_bird.modeling_big_bird", "BigBirdAttention"),
        (
            "transformers.models.bigbird_pegasus.modeling_bigbird_pegasus",
            "BigBirdPegasusEncoderAttention",
        ),
    ):
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue
        guard(cls, lambda module: module.seed, _served)


def _served(module: nn.Module) -> bool:
    """Whether a BigBird attention module runs what its saved configuration says: its
    block-sparse module patched, or transformers' full attention, which short inputs switch
    to (the sparsified model does the same)."""
    return module.attention_type != "block_sparse" or hasattr(module.self, _LAYER_KEY)


def _eval_key(layout: BigBirdBlocks) -> tuple:
    return (layout.block, layout.random_blocks, layout.max_seqlen)


def _unpatch(module: nn.Module, original: Callable | None) -> None:
    for name in ("forward", _LAYER_KEY):
        if name in vars(module):
            delattr(module, name)
    if original is not None:
        module.forward = original


def restore(model: nn.Module) -> nn.Module:
    """Undo :func:`sparsify`: each patched module gets its original ``forward`` back, those
    transformers has replaced since included."""
    check_model(model)
    state = _state(model)
    if state is None:
        return model
    for layer, module in state.modules.items():
        _unpatch(module, state.originals[layer])
    delattr(model, _KEY)
    if hasattr(model, "config"):
        forget_config(model, _named_modules(model))
    return model


def layer_specs(model: nn.Module) -> dict[int, LayerSpec]:
    """The configured layers of a sparsified BigBird (empty for an unmodified one)."""
    check_model(model)
    state = _state(model)
    return {} if state is None else dict(state.specs)


# ---------------------------------------------------------------------- repeated blocks
def block_repeats(layout: BigBirdBlocks, n: int) -> Tensor:
    """How many times transformers lists each key block in each query block's row:
    IntTensor[G, nb, nb] (G = heads, or 1 for a shared draw), 0 where not listed.

    Row 0 and nb − 1 list every block once; row i of 1 … nb − 2 lists i − 1, i, i + 1, 0 and
    nb − 1 (as a set: rows 1 and nb − 2 name each of their four blocks once) and its r random
    blocks ``block_table(n)[:, i − 1]``, each slot counting."""
    table = layout.block_table(n)
    g, rows, _ = table.shape
    nb = rows + 2
    counts = torch.zeros(g, nb, nb, dtype=torch.int32)
    counts[:, 0] = counts[:, nb - 1] = 1
    mid = torch.arange(1, nb - 1)
    for fixed in (mid - 1, mid, mid + 1):
        counts[:, mid, fixed] = 1
    counts[:, mid, 0] = counts[:, mid, nb - 1] = 1
    ones = torch.ones(table.shape, dtype=torch.int32)
    counts[:, 1 : nb - 1].scatter_add_(-1, table.to(torch.long), ones)
    return counts


def repeat_columns(layout: BigBirdBlocks, n: int) -> tuple[Tensor, Tensor] | None:
    """Extra query and key columns (A, C), each FloatTensor[G, n, e], that weigh the repeated
    blocks of ``layout`` at length n: A_i·C_j = log(repeats) for query i and key j whenever
    j's block is listed more than once in i's row (0 otherwise), or None where no block
    repeats.

    One column per key block that repeats in some row of the head (e = the most such blocks
    of a head, the others' columns 0): C is 1 on that block's keys, A is the log of how often
    each query's row lists it (log 1 = 0 where it is listed once). Eval mode: e = 1, block 0,
    log(r + 1) in the rows of blocks 1 … nb − 2. Appended to q·scale and k (with ``scale=1``)
    they add exactly those logarithms to the scores (the other products are 0·x = 0)."""
    counts = block_repeats(layout, n)
    repeated = counts > 1
    if not bool(repeated.any()):
        return None
    g, nb, _ = counts.shape
    blocks = [repeated[h].any(0).nonzero().flatten().tolist() for h in range(g)]
    e = max(len(kbs) for kbs in blocks)
    a = torch.zeros(g, nb, e, dtype=torch.float64)
    c = torch.zeros(g, nb, e, dtype=torch.float64)
    for h, kbs in enumerate(blocks):
        for j, kb in enumerate(kbs):
            a[h, :, j] = counts[h, :, kb].clamp(min=1).double().log()
            c[h, kb, j] = 1.0
    b = layout.block
    return a.repeat_interleave(b, 1), c.repeat_interleave(b, 1)


def _columns(state: BigBirdState, layer: int, layout: BigBirdBlocks, n: int, like: Tensor):
    """:func:`repeat_columns` in ``like``'s dtype and device, cached (the eval layout is the
    same for every layer of a configuration: one entry)."""
    which = ("eval", *_eval_key(layout)) if not layout.training else ("layer", layer)
    key = ("columns", which, n, like.dtype, str(like.device))

    def make():
        columns = repeat_columns(layout, n)
        if columns is None:
            return None
        return tuple(t.to(like.device, like.dtype) for t in columns)

    return state.cache.get(key, make)


def _numpy_after_draw(state: BigBirdState, module: nn.Module, layer: int, n: int) -> tuple:
    """numpy's global state after transformers' training draw of ``module`` at length n:
    ``np.random.seed(seed)`` and the same draws, replayed on a private generator."""

    def make():
        b, r = module.block_size, module.num_random_blocks
        heads, seed = module.num_attention_heads, module.seed
        rng = np.random.RandomState(seed)
        if n in HF_LEGACY_LENGTHS:
            for _ in range(heads):
                _legacy_rand_mask(rng, module.max_seqlen, b, r, 1024)
        else:
            plan, plan_r = _rand_attn_plan(n, b, r)
            _rand_mask_with_head(rng, n, b, heads, plan, plan_r)
        return rng.get_state()

    return state.cache.get(("numpy", layer, n), make)


# ---------------------------------------------------------------------- the forward
def _attentions_wanted() -> bool:
    """Whether transformers records this call's attention weights (``output_attentions``: it
    collects the module's second output)."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # another transformers: it asks for none this way
        return False
    collected = _active_collector.get()
    return collected is not None and "attentions" in collected


def dense_weights(
    q: Tensor,
    k: Tensor,
    graph: AttentionGraph,
    repeats: Tensor | None,
    prob_map: ProbabilityMap,
    scale: float,
    ignore: Tensor | None,
) -> Tensor:
    """The layer's weights as transformers returns them for ``output_attentions``: an n × n
    matrix (B, H, n, n) per call, ρ on each row's listed keys (``graph``, without the
    ``ignore`` (B, n) padding keys), 0 elsewhere and in the rows of padding tokens (whose
    output is 0; transformers' hold weights on some of their keys there). ``repeats``
    (G, nb, nb) (:func:`block_repeats`) or None: with softmax a block listed r times weighs
    r times in its row's sum, and the matrix holds one copy's weight (transformers writes
    each copy to the same entries), so p / r of ρ(scores + log r). q, k (B, H, n, d)."""
    scores = (q.float() @ k.float().mT) * scale
    keys = graph.to_dense().bool().to(q.device)  # (n, n) or (H, n, n)
    if ignore is not None:
        keys = keys & ~ignore[:, None, None, :] & ~ignore[:, None, :, None]
    keys = keys.expand_as(scores)
    if repeats is None:
        return prob_map(scores, keys).to(q.dtype)
    r = _listed(repeats, scores)
    return (prob_map(scores + r.log(), keys) / r).to(q.dtype)


def _listed(repeats: Tensor, scores: Tensor) -> Tensor:
    """(G, n, n): how many times each key is listed in each query's row, at least 1 (from
    :func:`block_repeats`' (G, nb, nb)), in ``scores``' dtype and device."""
    b = scores.shape[-1] // repeats.shape[-1]
    r = repeats.clamp(min=1).to(scores.device, scores.dtype)
    return r.repeat_interleave(b, 1).repeat_interleave(b, 2)


def _record(
    capture: Capture,
    layer: int,
    q: Tensor,
    k: Tensor,
    graph: AttentionGraph,
    repeats: Tensor | None,
    prob_map: ProbabilityMap,
    scale: float,
    ignore: Tensor | None,
) -> None:
    """The call as an :class:`~sparseattn.hf.state.AttentionRecord` (n × n, for analysis at
    small n): scores scale·q kᵀ, the layout's keys as a set, and each key's total weight — a
    block listed r times (``repeats`` (G, nb, nb), :func:`block_repeats`) weighs r times, so
    ρ(scores + log r), what its values weigh in the output (``output_attentions`` holds one
    copy's, :func:`dense_weights`). q, k (B, H, n, d) unscaled; ``ignore`` (B, n) padding."""
    with torch.no_grad():
        scores = (q @ k.mT) * scale
    shift = None if repeats is None else _listed(repeats, scores).log()
    key_valid = None if ignore is None else ~ignore
    capture.add(layer, q, k, scores, graph.to_dense().bool(), key_valid, prob_map, shift)


def _split(x: Tensor, heads: int) -> Tensor:
    """(B, n, H·d) → (B, H, n, d)."""
    bsz, n, _ = x.shape
    return x.view(bsz, n, heads, -1).transpose(1, 2)


def _key_padding(to_mask: Tensor | None, bsz: int, n: int) -> Tensor | None:
    """(B, n) True for padding keys from transformers' ``to_mask`` (B, 1, 1, n), or None
    without padding; items of padding only get none (their rows output 0 anyway)."""
    if to_mask is None:
        return None
    padding = to_mask.reshape(bsz, n) == 0
    padding &= ~padding.all(-1, keepdim=True)
    return padding if bool(padding.any()) else None


def _count(state, layer, spec, pattern, q, k, ignore, scale) -> AttentionGraph:
    """Add this call's real-token counts to the layer's (``attention_sparsity``, as for other
    models: :func:`~sparseattn.hf.accounting.account`): the layout's keys as a set (a block
    listed twice is one block's keys), ρ's non-zero weights for a sparse map when the model
    counts them (``count_weights``). Returns the layout's graph."""
    graph = resolve_graph(pattern, q, k)
    view = MaskView(None if ignore is None else ~ignore, False, None, None)
    edges = account(state, layer, graph, q, k, view, spec)
    if spec.zeroes_weights:
        if not state.count_weights:
            return graph
        edges = nonzero_weights(spec, q, k, pattern, view, scale, q.shape[2])
    state.nonzero[layer] = state.nonzero.get(layer, 0.0) + edges
    return graph


def bigbird_forward(
    module: nn.Module,
    hidden_states: Tensor,
    band_mask: Tensor | None = None,
    from_mask: Tensor | None = None,
    to_mask: Tensor | None = None,
    from_blocked_mask: Tensor | None = None,
    to_blocked_mask: Tensor | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """``BigBirdBlockSparseAttention.forward`` on sparseattn (bound to ``module`` by
    :func:`sparsify`): hidden_states (B, n, E) with n a multiple of ``block_size`` (the model
    pads to one); transformers' masks — ``to_mask`` (B, 1, 1, n) and ``from_mask``
    (B, 1, n, 1), 1 for real tokens, 0 for padding (None: no padding; the band and blocked
    masks are products of the same mask and not read). Returns ``(output (B, n, E), None)``:
    no attention probabilities."""
    state, layer = getattr(module, _LAYER_KEY)
    spec = state.specs[layer]
    wanted = _attentions_wanted()
    if wanted and spec.method is not sparse_attention:
        raise ValueError(
            "output_attentions needs the weights of the layer's map, which a method hook "
            "does not compute; call sparseattn.hf.restore(model) for transformers' own"
        )
    bsz, n, _ = hidden_states.shape
    b, heads, d = module.block_size, module.num_attention_heads, module.attention_head_size
    if n % b:
        raise ValueError(f"the sequence length {n} must be a multiple of block_size={b}")
    training = module.training
    own = layer in state.own
    pattern = spec.pattern
    if own and not training:
        pattern = state.evals[layer]

    scale = 1.0 / math.sqrt(d)
    q = _split(module.query(hidden_states), heads)
    k = _split(module.key(hidden_states), heads)
    v = _split(module.value(hidden_states), heads)
    ignore = _key_padding(to_mask, bsz, n)
    graph = _count(state, layer, spec, pattern, q, k, ignore, scale)
    weights = repeats = None
    recording = state.capture is not None and state.capture.wants(layer)
    if (wanted or recording) and own and spec.prob_map.is_softmax:
        repeats = block_repeats(pattern, n)  # the repeated blocks as softmax weighs them
    if wanted:  # transformers' n × n matrix
        weights = dense_weights(q, k, graph, repeats, spec.prob_map, scale, ignore)
    if recording:
        _record(state.capture, layer, q, k, graph, repeats, spec.prob_map, scale, ignore)
    extra: dict = {}
    if spec.wants_context:
        extra["context"] = LayerContext(layer, module, hidden_states, module.value)
    width = None  # v's width when zero columns are appended to it
    columns = _columns(state, layer, pattern, n, q) if own and spec.prob_map.is_softmax else None
    if columns is not None:  # repeated blocks: extra query/key columns weigh them
        a, c = columns
        e = a.shape[-1]
        shape = (bsz, heads, n, e)
        q = torch.cat([q * scale, a.expand(shape)], -1)
        k = torch.cat([k, c.expand(shape)], -1)
        scale = 1.0
        if spec.method is sparse_attention:  # v as wide as q keeps the engines' fused paths
            width = v.shape[-1]
            v = torch.cat([v, v.new_zeros(shape)], -1)
    out = spec.method(
        q,
        k,
        v,
        pattern,
        prob_map=spec.prob_map,
        engine=spec.engine,
        scale=scale,
        key_padding_mask=ignore,
        dropout_p=0.0,  # transformers' block-sparse attention has no attention dropout
        **extra,
    )
    if width is not None:
        out = out[..., :width]
    if from_mask is not None:
        out = out * from_mask.to(out.dtype)
    if own and training and module.seed is not None:
        np.random.set_state(_numpy_after_draw(state, module, layer, n))
    return out.transpose(1, 2).reshape(bsz, n, heads * d), weights
