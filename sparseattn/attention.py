"""The public attention API: ``sparse_attention`` and the ``SparseAttention`` module.

Data path (docs/architecture.md, "Data path"): pattern → AttentionGraph → engine scores on the
graph → ρ → weights·V.

PyTorch's names keep PyTorch's meanings: ``key_padding_mask`` is True for keys to *ignore*
(as in ``nn.MultiheadAttention``), ``enable_gqa`` is SDPA's grouped-query flag. The engines
take the complement (True for real keys); it is formed once, here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from .engines import ENGINES, SPECS, capabilities
from .engines.capabilities import Request
from .engines.common import grid_indices
from .graph import AttentionGraph, broadcast_or_none
from .maps import NonFiniteScoresError, ProbabilityMap, entmax, resolve_prob_map
from .patterns import Causal, HeadSplit, Pattern, PatternCycle, as_cycle, dense
from .patterns.fixed import Dense
from .score_mods import check_score_mod, lifted_tensors
from .validate import (
    all_finite,
    check_bool,
    check_choice,
    check_finite_float,
    check_int,
    check_positive,
    check_probability,
)

__all__ = [
    "sparse_attention",
    "attention_weights",
    "SparseAttention",
    "choose_engine",
    "resolve_graph",
]


def _check_qkv(q: Tensor, k: Tensor, v: Tensor, enable_gqa: bool = False) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape (batch, heads, n, d), got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if t.device.type == "meta":
            raise ValueError(f"{name} is on the meta device; attention needs tensors with data")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v must share a device, got {q.device}, {k.device}, {v.device}")
    if enable_gqa:
        bad = q.shape[0] != k.shape[0] or k.shape[:2] != v.shape[:2]
        if bad or not k.shape[1] or q.shape[1] % k.shape[1]:
            raise ValueError(
                "with enable_gqa, k and v must share (batch, kv_heads) with kv_heads dividing "
                f"q's heads: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
            )
    elif q.shape[:2] != k.shape[:2] or k.shape[:2] != v.shape[:2]:
        hint = ""
        if q.shape[0] == k.shape[0] and k.shape[:2] == v.shape[:2] and k.shape[1]:
            hint = " (fewer key/value heads than query heads: pass enable_gqa=True)"
        raise ValueError(
            f"q, k, v must share (batch, heads): {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}{hint}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share the head dim d, got {q.shape[-1]} and {k.shape[-1]}")
    if q.shape[-1] == 0:
        raise ValueError("q and k must have a head dim d >= 1, got d = 0")
    if k.shape[-2] == 0 and q.shape[-2] > 0:
        raise ValueError("k must hold at least one key (n_k >= 1): every query needs a key")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must share their length, got {k.shape[-2]} and {v.shape[-2]}")


def _host_checks(t: Tensor) -> bool:
    """Whether value checks that read a result back to the host run for ``t``: on CPU yes; on
    a GPU no — each would stall the host until the device is done (as SDPA and FlexAttention
    do, NaN inputs and overflowing scores then give NaN outputs; docs/engines.md)."""
    return t.device.type == "cpu"


def resolve_graph(pattern: Pattern | AttentionGraph, q: Tensor, k: Tensor) -> AttentionGraph:
    """The AttentionGraph a pattern (or a ready graph) gives for these q, k; validated."""
    if isinstance(pattern, PatternCycle):
        raise TypeError(
            "a cycle of patterns is per layer: pass cycle[layer] (or use SparseAttention)"
        )
    if isinstance(pattern, Pattern):
        graph = pattern.build(q, k)
    elif isinstance(pattern, AttentionGraph):
        graph = pattern
    else:
        raise TypeError(
            f"pattern must be a Pattern or an AttentionGraph, got {type(pattern).__name__}"
        )
    bsz, heads, n_q, _ = q.shape
    n_k = k.shape[-2]
    if (graph.n_q, graph.n_k) != (n_q, n_k):
        raise ValueError(f"graph is {graph.n_q}×{graph.n_k} but q, k give {n_q}×{n_k}")
    if graph.batch_shape and broadcast_or_none(graph.batch_shape, (bsz, heads)) != (bsz, heads):
        raise ValueError(
            f"graph batch_shape {graph.batch_shape} does not broadcast to (batch, heads) "
            f"= {(bsz, heads)}"
        )
    # graphs are cached by their patterns: checked once
    empty = graph.cached(("empty_rows",), lambda: (graph.degrees == 0).nonzero())
    if empty.numel():
        raise ValueError(
            f"pattern {pattern!r} leaves {empty.shape[0]} query row(s) with no allowed key "
            f"(first: {tuple(empty[0].tolist())}); every query needs at least one key"
        )
    return graph


def choose_engine(
    graph: AttentionGraph,
    q: Tensor,
    k: Tensor,
    prob_map: ProbabilityMap | None = None,
    dropout_p: float = 0.0,
    score_mod: bool | Callable = False,
    key_padding: bool = False,
) -> str:
    """The ``auto`` rule (docs/engines.md): the engine table's choice
    (:func:`sparseattn.engines.capabilities.choose`) for this call on ``graph``.

    Only engines that can compute the request qualify (their declared capabilities; an
    unknown map, ``prob_map=None``, rules out the softmax-only ``flex``), and the cheapest of
    them by its row's cost (constants: :mod:`sparseattn.engines.costs`):

    * On CPU the least estimated cost per graph, in scored block entries: ``block``
      pairs·b²·ENTRY_COST[b] at the block size b the block engine will choose
      (``ENTRY_COST_TRAIN`` when a backward will follow), ``gather`` E / BLOCK_MIN_FILL (a
      gathered edge costs 12 block entries), ``dense`` n_q·n_k·DENSE_ENTRY_COST (0.7;
      ``DENSE_ENTRY_COST_TRAIN`` = 0.45 with a backward: SDPA's fused kernel scores an entry for
      less than a block entry) while B·H·n_q·n_k ≤ DENSE_LIMIT (2²⁷; DENSE_LIMIT // 32 where
      the dense engine materialises the scores), ``flex`` FLEX_ENTRY_COST × its work at block
      128: on the measured CPUs never the cheapest.
    * On a GPU first the measured order (``GPU_ORDER``): ``dense`` while B·H·n_q·n_k ≤
      GPU_DENSE_LIMIT, then ``flex`` wherever it qualifies (softmax: one fused kernel, forward
      and backward), then ``triton`` (α-entmax, sparsemax: fused kernels), then ``block`` or
      ``gather`` by the same costs.

    ``score_mod`` (the modifier, or whether the call has one) and ``key_padding`` (whether it
    has a key padding mask) change the decision: the dense engine then materialises the
    scores, and the Triton kernels take the library's modifiers only. The decision is kept on the
    graph per request.
    """
    request = Request.of(q, k, k, prob_map, dropout_p, score_mod, key_padding)
    return capabilities.choose(request, graph, (q, k, k, prob_map, dropout_p, score_mod))


def _autocasting(t: Tensor) -> bool:
    """Whether ``torch.autocast`` is on for ``t``'s device type (False where it has none)."""
    device = t.device.type
    return torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)


def _autocast_like_sdpa(inputs: tuple[str, ...]) -> Callable[[Callable], Callable]:
    """Run the decorated function under ``torch.autocast`` as autocast runs SDPA (a
    lower-precision op): the tensor ``inputs`` (floating, not float64) are cast to the autocast
    dtype, and the body runs with autocast off, so that the engines pick their own compute
    dtype (float32 inside for half inputs on CPU; docs/engines.md, "Mixed precision"). The
    output comes back in the autocast dtype. Outside autocast: a plain call."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args, **kwargs):
            first = args[0] if args else kwargs.get(inputs[0])
            if not isinstance(first, Tensor) or not _autocasting(first):
                return fn(*args, **kwargs)
            device = first.device.type
            dtype = torch.get_autocast_dtype(device)

            def cast(t: object) -> object:
                if isinstance(t, Tensor) and t.is_floating_point() and t.dtype != torch.float64:
                    return t.to(dtype)
                return t

            args = tuple(cast(a) if i < len(inputs) else a for i, a in enumerate(args))
            kwargs = {name: cast(a) if name in inputs else a for name, a in kwargs.items()}
            with torch.autocast(device, enabled=False):
                return fn(*args, **kwargs)

        return call

    return wrap


#: Why ``torch.compile`` does not trace into the attention call (docs/engines.md,
#: "torch.compile"); dynamo shows it with the graph break.
_OPAQUE = (
    "sparseattn runs the attention call eagerly: graph building, planning, host-side checks "
    "and the engines' chunk loops depend on values and lengths"
)


@torch.compiler.disable(reason=_OPAQUE)
@_autocast_like_sdpa(("q", "k", "v"))
def sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: Pattern | AttentionGraph,
    *,
    prob_map: str | ProbabilityMap = "softmax",
    engine: str = "auto",
    scale: float | None = None,
    key_padding_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
    score_mod: Callable | None = None,
    group: object = None,
    boundaries: Sequence[int] | None = None,
) -> Tensor:
    """Sparse attention, Yun et al. eq. (3): out_i = Σ_{j ∈ A_i} ρ(scale · q_i·k_j)_j · v_j.

    Args:
        q: (batch, heads, n_q, d); k: (batch, kv_heads, n_k, d); v: (batch, kv_heads, n_k, d_v)
            with kv_heads = heads unless ``enable_gqa``. n_k may differ from n_q
            (cross-attention) for patterns that allow it.
        pattern: a Pattern (static or data-dependent) or a ready AttentionGraph.
        prob_map: ρ — a ProbabilityMap or one of "softmax", "hardmax", "sparsemax", "entmax15".
        engine: "auto" (:func:`choose_engine`; the dense pattern goes to SDPA for softmax and
            to "rows" for other maps, without building its graph), "dense" (masked n×n
            reference), "rows" (full rows in chunks of queries), "block"
            (block-sparse matrix products), "gather" (neighbour lists) or "flex" (compiled
            FlexAttention; softmax, and on CPU inference only). docs/engines.md.
        scale: score scale, default 1/√d.
        key_padding_mask: optional BoolTensor (batch, n_k), True for keys to *ignore*
            (padding), as ``nn.MultiheadAttention``'s. A batch item whose every key is
            ignored is refused (that is what a True-for-real-tokens mask, such as a
            tokenizer's ``attention_mask``, means here for an unpadded item: pass its ``~``).
        dropout_p: dropout on the attention weights (only when > 0).
        enable_gqa: grouped-query attention, as in SDPA: kv_heads divides heads and query
            head h reads key/value head h // (heads / kv_heads). For static patterns and
            ready graphs the query heads sharing a key/value head are stacked along the query
            axis (k and v are not copied); otherwise k and v are repeated per query head.
        score_mod: FlexAttention's score modifier, ``score_mod(score, b, h, q_idx, kv_idx)``,
            applied to the scaled scores on the pattern's edges before ρ (every map and
            engine; ``triton`` takes the library's own only): an additive bias (T5), ALiBi,
            soft-capping (Gemma 2) — :mod:`sparseattn.score_mods`. h is the query head;
            q_idx, kv_idx index q and k.
        group: a ``torch.distributed`` process group over which the sequence is sharded
            (context parallelism, docs/parallel.md): q, k, v and ``key_padding_mask`` are this
            rank's contiguous part (positions ``boundaries[r] … boundaries[r + 1] − 1``), the
            pattern is the global sequence's, and the result is this rank's rows of the
            single-process result; each rank receives only the keys its queries read
            (:func:`sparseattn.parallel.sparse_attention`). No dropout or score modifier there.
        boundaries: the P + 1 shard boundaries with ``group`` (default: near-equal parts).
    Returns:
        (batch, heads, n_q, d_v).
    Raises:
        ValueError/TypeError for bad shapes, dtypes, devices, unknown engines, patterns that
        leave a query without any key, a key padding mask that ignores every key of an item,
        and (on CPU) a result that is not finite, naming the input holding NaN/inf or the
        overflowing scores (outside training the result is checked, not every input, so
        NaN/inf in keys the call never reads does not raise); on a GPU that check is skipped,
        since it would stall the host.

    Dtypes: float64, float32, bfloat16, float16 on every engine; the output has the inputs'
    dtype. Under ``torch.autocast`` q, k, v are cast to the autocast dtype first, as for
    SDPA. On CPU, half-precision inputs are computed in float32 inside the engines
    (docs/engines.md, "Mixed precision").

    ``torch.compile``: the call is opaque to dynamo (``torch.compiler.disable``) and runs
    eagerly, while the code around it compiles: one graph break per call, a bounded number of
    graphs over any stream of lengths, no ``fullgraph=True`` (docs/engines.md, "torch.compile").
    """
    if group is not None:
        return _sharded(
            q, k, v, pattern, prob_map, engine, scale, key_padding_mask, dropout_p, enable_gqa,
            score_mod, group, boundaries,
        )  # fmt: skip
    _check_qkv(q, k, v, check_bool("enable_gqa", enable_gqa))
    _check_inputs_finite(**_read_whole(q, k, v, pattern))
    rho = resolve_prob_map(prob_map)
    check_probability("dropout_p", dropout_p, allow_one=False)
    check_choice("engine", engine, ["auto", *ENGINES])
    scale = _resolve_scale(scale, q)
    valid = None if key_padding_mask is None else _key_validity(key_padding_mask, q, k)
    if score_mod is not None:
        _check_score_mod(score_mod, q, k)
    if _empty_output(q, v, pattern):
        return _empty_result(q, k, v)
    groups = q.shape[1] // k.shape[1] if k.shape[1] else 1
    # with a score_mod, h must stay the query head: no stacking of query heads
    stack = groups > 1 and score_mod is None and _can_group(pattern, rho, engine, q, k)
    if stack:
        graph = resolve_graph(pattern, q, k)
        chosen = engine
        if engine == "auto":
            chosen = choose_engine(graph, q, k, rho, dropout_p, key_padding=valid is not None)
        if SPECS[chosen].gqa:  # the engine reads the shared key/value heads itself
            return _attend(q, k, v, graph, rho, chosen, scale, valid, dropout_p)
        grouped_q, grouped = group_queries(q, graph, k.shape[1])
        out = _attend(grouped_q, k, v, grouped, rho, engine, scale, valid, dropout_p)
        return out.reshape(q.shape[:3] + out.shape[-1:])
    if groups > 1:
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    return _attend(q, k, v, pattern, rho, engine, scale, valid, dropout_p, score_mod)


#: The context-parallel call, :func:`sparseattn.parallel.sparse_attention`, registered by
#: that package on import (``import sparseattn`` imports it), so that this module, which it
#: builds on, does not import it back.
_SHARDED: Callable[..., Tensor] | None = None


def register_sharded(call: Callable[..., Tensor]) -> None:
    """Set the call :func:`sparse_attention` makes with ``group=``."""
    global _SHARDED
    _SHARDED = call


def _sharded(q, k, v, pattern, prob_map, engine, scale, key_padding_mask, dropout_p,
             enable_gqa, score_mod, group, boundaries):  # fmt: skip
    """:func:`sparse_attention` with ``group``: the context-parallel call."""
    if dropout_p:
        raise ValueError("dropout_p must be 0 with group= (not supported across ranks yet)")
    if score_mod is not None:
        raise ValueError("score_mod is not supported with group= (not across ranks yet)")
    if _SHARDED is None:
        raise RuntimeError("group= needs sparseattn.parallel (import sparseattn registers it)")
    return _SHARDED(
        q, k, v, pattern, group=group, prob_map=prob_map, engine=engine, scale=scale,
        key_padding_mask=key_padding_mask, enable_gqa=enable_gqa, boundaries=boundaries,
    )  # fmt: skip


def _check_score_mod(score_mod: Callable, q: Tensor, k: Tensor) -> None:
    """A callable; a bias must broadcast to the scores; tensors it reads on q's device."""
    check_score_mod(score_mod)
    check = getattr(score_mod, "check", None)
    if check is not None:
        check((q.shape[0], q.shape[1], q.shape[2], k.shape[2]))
    for t in lifted_tensors(score_mod, all_=True):
        if t.device != q.device:
            raise ValueError(
                f"score_mod {score_mod!r} reads a tensor on {t.device}, but q is on "
                f"{q.device}: move it to the inputs' device"
            )


def _attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: Pattern | AttentionGraph,
    rho: ProbabilityMap,
    engine: str,
    scale: float,
    valid: Tensor | None,
    dropout_p: float,
    score_mod: Callable | None = None,
) -> Tensor:
    """:func:`sparse_attention` on validated inputs with as many key/value heads as query
    heads; ``valid`` (batch, n_k) is True for real keys (the engines' convention)."""
    full = _full_rows(pattern, q, k) if engine in ("auto", "rows") else None
    request = Request.of(q, k, v, rho, dropout_p, score_mod, valid is not None, full)
    call = (q, k, v, rho, dropout_p, score_mod)
    extra = {} if score_mod is None else {"score_mod": score_mod}
    try:
        if full is not None:  # the dense pattern: no n² graph (docs/engines.md, "full rows")
            if engine == "auto":
                engine = capabilities.choose(request, None, call)
            spec = SPECS[engine]
            out = spec.full_rows(q, k, v, rho, scale, valid, dropout_p, full, score_mod)
        else:
            graph = resolve_graph(pattern, q, k)
            if engine == "auto":
                engine = capabilities.choose(request, graph, call)
            else:
                reason = "; ".join(capabilities.request_reasons(engine, request, call))
                if reason:
                    raise ValueError(f"engine={engine!r} cannot run this call: {reason}")
            out = ENGINES[engine](q, k, v, graph, rho, scale, valid, dropout_p, **extra)
    except NonFiniteScoresError:  # an input holds NaN or inf, or scale · q·k overflowed
        out = q.new_full((1,), math.nan)
    return _check_output(out, scale, k=k, v=v)


def _can_group(pattern: object, rho: ProbabilityMap, engine: str, q: Tensor, k: Tensor) -> bool:
    """Whether a grouped-query call may stack query heads instead of repeating k and v
    (:func:`group_queries`): a static pattern or a ready graph (a data-dependent pattern needs
    every query head's keys), one α for all rows, and not the dense pattern's graph-free path
    (which repeats k and v)."""
    if getattr(pattern, "data_dependent", False) or rho.alpha is not None:
        return False
    return not (engine in ("auto", "rows") and _full_rows(pattern, q, k) is not None)


def group_queries(q: Tensor, graph: AttentionGraph, kv_heads: int) -> tuple[Tensor, AttentionGraph]:
    """Grouped-query attention without copying keys: q (batch, heads, n_q, d) → (batch,
    kv_heads, g·n_q, d), the g = heads / kv_heads query heads that share a key/value head
    stacked along the query axis, and the graph's rows laid out the same way (a graph of batch
    shape (…, heads) keeps its edge arrays; one shared by the heads is repeated g times). The
    output (batch, kv_heads, g·n_q, d_v) reshapes to (batch, heads, n_q, d_v)."""
    bsz, heads, n_q, d = q.shape
    groups = heads // kv_heads

    # cached on the graph (itself cached by its pattern), so that the block plan built for
    # the grouped graph is reused by every later call of the same length
    def make() -> AttentionGraph:
        g_b, g_h = (1,) * (2 - len(graph.batch_shape)) + graph.batch_shape
        if g_h == 1:
            rows, shape = graph.expand((g_b, groups)), (g_b, 1)
        else:
            rows, shape = graph, (g_b, kv_heads)
        return AttentionGraph(rows.crow, rows.col, groups * n_q, rows.n_k, shape, causal=False)

    grouped = graph.cached(("grouped", groups, kv_heads), make)
    return q.reshape(bsz, kv_heads, groups * n_q, d), grouped


def _full_rows(pattern: object, q: Tensor, k: Tensor) -> bool | None:
    """For the dense pattern: whether it is causal (False: every key; True also for queries at
    an offset, n_q < n_k); else None."""
    if type(pattern) is Dense:
        return False
    if isinstance(pattern, Causal) and type(pattern.base) is Dense and q.shape[-2] <= k.shape[-2]:
        return True
    return None


@torch.compiler.disable(reason=_OPAQUE)
@_autocast_like_sdpa(("q", "k"))
def attention_weights(
    q: Tensor,
    k: Tensor,
    pattern: Pattern | AttentionGraph,
    *,
    prob_map: str | ProbabilityMap = "softmax",
    scale: float | None = None,
    key_padding_mask: Tensor | None = None,
    score_mod: Callable | None = None,
) -> Tensor:
    """The attention matrix A = ρ(scale · QKᵀ on the graph) as a dense (B, H, n_q, n_k) tensor.

    q: (B, H, n_q, d), k: (B, H, n_k, d); ``key_padding_mask`` (B, n_k) True for keys to ignore and
    ``score_mod`` a score modifier, as in :func:`sparse_attention`. Zeros off the graph and on
    padded keys. O(n_q · n_k) memory: meant for analysis and for methods that need A itself (MCA's
    sample sizes, Sparsefinder's gold graphs) at BERT lengths.
    """
    _check_qkv(q, k, k)
    _check_inputs_finite(q=q, k=k)  # every score is computed: read them whole
    rho = resolve_prob_map(prob_map)
    scale = _resolve_scale(scale, q)
    valid = None if key_padding_mask is None else _key_validity(key_padding_mask, q, k)
    if score_mod is not None:
        _check_score_mod(score_mod, q, k)
    if _empty_output(q, k, pattern):
        return _empty_result(q, k, k, k.shape[-2])
    graph = resolve_graph(pattern, q, k)
    mask = graph.to(q.device).to_dense()
    if valid is not None:
        mask = mask & valid[:, None, None, :]
    scores = (q @ k.transpose(-1, -2)) * scale
    if score_mod is not None:
        rows = torch.arange(q.shape[-2], device=q.device)
        scores = score_mod(scores, *grid_indices(*q.shape[:2], rows, k.shape[-2], q.device))
    scores = _check_output(scores, scale)
    return rho(scores, mask)


def _resolve_scale(scale: float | None, q: Tensor) -> float:
    """The score scale: 1/√d by default, else a finite real number."""
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else check_finite_float("scale", scale)


def _empty_output(q: Tensor, v: Tensor, pattern: object) -> bool:
    """Batch, heads, queries or value dim 0: the output is empty (defined, no graph built)."""
    if not isinstance(pattern, (Pattern, AttentionGraph)):
        resolve_graph(pattern, q, v)  # raises the TypeError
    return q.shape[0] * q.shape[1] * q.shape[2] * v.shape[-1] == 0


def _empty_result(q: Tensor, k: Tensor, v: Tensor, last: int | None = None) -> Tensor:
    shape = (*q.shape[:3], v.shape[-1] if last is None else last)
    # zero times every input keeps the (zero) gradient path to q, k and v
    return q.new_zeros(shape) + (q.sum() + k.sum() + v.sum()) * 0


def _read_whole(q: Tensor, k: Tensor, v: Tensor, pattern: object) -> dict[str, Tensor]:
    """The inputs checked whole before the call (docs/engines.md, "Checks that read values"):
    q (the output's size); k where the graph is drawn from q·kᵀ; k and v where the call will
    be differentiated (an inf key can leave the output finite and its gradient NaN)."""
    training = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if training:
        return {"q": q, "k": k, "v": v}
    return {"q": q, "k": k} if getattr(pattern, "data_dependent", False) else {"q": q}


def _check_inputs_finite(**inputs: Tensor) -> None:
    """Refuse NaN or inf in the named inputs (on CPU; see :func:`_host_checks`)."""
    for name, t in inputs.items():
        if _host_checks(t) and not all_finite(t):
            raise ValueError(f"{name} contains NaN or inf")


def _check_output(out: Tensor, scale: float, **inputs: Tensor) -> Tensor:
    """On CPU (:func:`_host_checks`), refuse a result that is not finite, naming its cause: an
    input holding NaN or inf, or else scale · q·kᵀ overflowing the dtype.

    Only the result is read on success, so the check costs what the call returns, not what it
    could read: decoding one token against a long cache with a window reads the window's keys,
    and so does the check (NaN or inf in keys the call never reads cannot change its result;
    docs/engines.md, "Checks that read values")."""
    if not _host_checks(out) or all_finite(out):
        return out
    _check_inputs_finite(**inputs)
    raise ValueError(
        f"scale · q·kᵀ overflows {out.dtype} (scale = {scale:g}): the scores are not "
        "finite; use a smaller scale, smaller inputs or a wider dtype"
    )


def _key_validity(key_padding_mask: Tensor, q: Tensor, k: Tensor) -> Tensor:
    """The public key padding mask (batch, n_k), True = ignore (``nn.MultiheadAttention``'s
    meaning), checked and turned into the engines' validity mask (True = real key).

    An item whose every key is ignored has nothing to attend to; it is refused, since it is
    also what a mask in the opposite convention (True for real tokens) gives for every item
    without padding — silence there would attend to the padding only."""
    expected = (q.shape[0], k.shape[-2])
    if not isinstance(key_padding_mask, Tensor):
        raise TypeError(
            f"key_padding_mask must be a bool tensor of shape {expected} (True = ignore that "
            f"key), got {type(key_padding_mask).__name__}"
        )
    if key_padding_mask.dtype != torch.bool or tuple(key_padding_mask.shape) != expected:
        raise ValueError(
            f"key_padding_mask must be a bool tensor of shape {expected} (True = ignore that "
            f"key), got {key_padding_mask.dtype} {tuple(key_padding_mask.shape)}"
        )
    if key_padding_mask.device.type == "meta":
        raise ValueError("key_padding_mask is on the meta device; attention needs its values")
    valid = ~key_padding_mask.to(q.device)
    if expected[1] and not bool(valid.any(-1).all()):
        items = (~valid.any(-1)).nonzero().flatten().tolist()
        raise ValueError(
            f"key_padding_mask ignores every key of batch item(s) {items[:8]}: True marks a "
            "key to ignore (padding), as in nn.MultiheadAttention. A mask that is True for "
            "real tokens (e.g. a tokenizer's attention_mask) must be inverted: pass "
            "key_padding_mask=~mask"
        )
    return valid


class SparseAttention(nn.Module):
    """Multi-head sparse self-attention (Yun eq. 3), a drop-in layer for (batch, n, embed_dim).

    Head configurations (Yun §5.1): a plain pattern or ``union(...)`` — every head the same
    pattern (UNION); ``split_heads(A1, A2)`` — head groups with different patterns (MULTIHEAD);
    ``cycle(A1, A2)`` — layer ``layer_index`` uses pattern ``layer_index mod p`` (SEQUENTIAL).

    Args:
        embed_dim: model width E (divisible by num_heads).
        num_heads: H.
        pattern: Pattern, HeadSplit, PatternCycle or AttentionGraph.
        prob_map: ρ (see ``sparse_attention``).
        engine: "auto", "dense", "block", "gather" or "flex" (see ``sparse_attention``).
        dropout: dropout on attention weights in training.
        bias: biases in the projections.
        layer_index: this layer's place in a stack (used by a cycle).
        learn_alpha: learn one α per head (the Adaptively Sparse Transformer, Correia et al.
            2019): ``prob_map`` must be α-entmax with α > 1 (e.g. ``"entmax15"``), its α the
            initial value; α_h = 1 + softplus(θ_h) > 1 with θ the parameter ``alpha_logit``
            (H,); :attr:`alpha` reads the current values.
        score_mod: a score modifier applied in every call (``sparse_attention``), e.g.
            ``sparseattn.score_mods.alibi(num_heads)``; a :class:`torch.nn.Module` score
            modifier becomes a submodule (its parameters train with the layer).
        group, boundaries: context parallelism (``sparse_attention(group=)``): x is this
            rank's contiguous part of the sequence, the pattern the whole sequence's; not
            with dropout, a score modifier or ``learn_alpha``.

    Dtypes: x must have the layer's dtype (``.bfloat16()``, ``.half()`` layers work), except
    under ``torch.autocast``, where x of any floating dtype is accepted and the projections
    and the attention run in the autocast dtype, as in ``nn.MultiheadAttention``
    (docs/engines.md, "Mixed precision").
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        pattern: Pattern | PatternCycle | AttentionGraph | None = None,
        prob_map: str | ProbabilityMap = "softmax",
        engine: str = "auto",
        dropout: float = 0.0,
        bias: bool = True,
        layer_index: int = 0,
        learn_alpha: bool = False,
        score_mod: Callable | None = None,
        group: object = None,
        boundaries: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        if group is not None and (dropout or score_mod is not None or learn_alpha):
            raise ValueError(
                "group= (context parallelism) does not take dropout, score_mod or learn_alpha"
            )
        check_positive("embed_dim", embed_dim)
        check_positive("num_heads", num_heads)
        check_choice("engine", engine, ["auto", *ENGINES])
        check_probability("dropout", dropout, allow_one=False)
        check_bool("bias", bias)
        check_int("layer_index", layer_index, 0)
        if score_mod is not None:
            check_score_mod(score_mod)
        if embed_dim % num_heads:
            raise ValueError(
                f"embed_dim ({embed_dim}) must be a positive multiple of num_heads ({num_heads})"
            )
        pattern = dense() if pattern is None else pattern
        if not isinstance(pattern, (Pattern, PatternCycle, AttentionGraph, list, tuple)):
            raise TypeError(
                "pattern must be a Pattern (e.g. sparseattn.window(16)), a cycle or sequence "
                f"of patterns, an AttentionGraph or None, got {type(pattern).__name__} "
                f"{pattern!r}"
            )
        if not isinstance(pattern, AttentionGraph):
            pattern = as_cycle(pattern)[layer_index]
        if isinstance(pattern, HeadSplit):
            pattern.head_sizes(num_heads)  # validate now, not at the first forward
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.pattern = pattern
        # a pattern learned from data (SparseBERT's mask logits, ...) is state: its tensors are
        # buffers, so the state dict carries them and loading one rebuilds the pattern
        self._pattern_tensors = _tensor_fields(pattern)
        for name in self._pattern_tensors:
            self.register_buffer(f"pattern_{name}", getattr(pattern, name))
        if self._pattern_tensors:
            self.register_load_state_dict_post_hook(_rebuild_pattern)
        self.prob_map = resolve_prob_map(prob_map)
        self.engine = engine
        self.dropout = dropout
        self.score_mod = score_mod
        self.group, self.boundaries = group, boundaries
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim, bias=bias)
        self.out = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.alpha_logit = None
        if check_bool("learn_alpha", learn_alpha):
            is_sparsemax = self.prob_map.name == "sparsemax"
            alpha = 2.0 if is_sparsemax else self.prob_map.params.get("alpha", 0.0)
            if not (is_sparsemax or self.prob_map.name == "entmax") or not alpha > 1.0:
                raise ValueError(
                    f"learn_alpha needs prob_map α-entmax with α > 1, got {self.prob_map!r}"
                )
            theta = math.log(math.expm1(alpha - 1.0))  # softplus⁻¹(α − 1)
            self.alpha_logit = nn.Parameter(torch.full((num_heads,), theta))

    @property
    def alpha(self) -> Tensor | None:
        """The heads' α (H,) = 1 + softplus(alpha_logit) with ``learn_alpha``, else None."""
        if self.alpha_logit is None:
            return None
        return 1.0 + nn.functional.softplus(self.alpha_logit)

    @torch.compiler.disable(reason=_OPAQUE)
    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        """x: (batch, n, embed_dim) → (batch, n, embed_dim).

        ``key_padding_mask``: optional bool (batch, n), True for tokens to ignore as keys
        (padding) — ``nn.MultiheadAttention``'s meaning, so the layer swaps in for it with the
        same mask. Padding queries still get an output (from the real keys), as there.

        Under ``torch.compile`` the whole layer, projections included, runs eagerly (one graph
        break) and the model around it compiles: compiling the projections too made a training
        step 1–15% slower than eager (docs/engines.md, "torch.compile").
        """
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.device.type == "meta":
            raise ValueError("x is on the meta device; attention needs tensors with data")
        if x.device != self.qkv.weight.device:
            raise ValueError(
                f"x is on {x.device} but the layer's parameters are on "
                f"{self.qkv.weight.device}; move one of them (layer.to(device) or x.to(...))"
            )
        if x.dtype != self.qkv.weight.dtype and not _autocasting(x):
            raise TypeError(f"x must have the layer's dtype {self.qkv.weight.dtype}, got {x.dtype}")
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(
                f"x must have shape (batch, n, {self.embed_dim}), got {tuple(x.shape)}"
            )
        bsz, n, _ = x.shape
        head_dim = self.embed_dim // self.num_heads
        q, k, v = self.qkv(x).view(bsz, n, 3, self.num_heads, head_dim).permute(2, 0, 3, 1, 4)
        out = sparse_attention(
            q,
            k,
            v,
            self.pattern,
            prob_map=self.prob_map
            if self.alpha_logit is None
            else entmax(self.alpha.view(-1, 1, 1)),
            engine=self.engine,
            key_padding_mask=key_padding_mask,
            dropout_p=self.dropout if self.training else 0.0,
            score_mod=self.score_mod,
            group=self.group,
            boundaries=self.boundaries,
        )
        return self.out(out.transpose(1, 2).reshape(bsz, n, self.embed_dim))

    def extra_repr(self) -> str:
        mod = "" if self.score_mod is None else f", score_mod={self.score_mod!r}"
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, pattern={self.pattern!r}, "
            f"prob_map={self.prob_map!r}, engine={self.engine!r}{mod}"
        )


def _tensor_fields(pattern: object) -> list[str]:
    """The fields of a dataclass pattern that hold tensors (a learned mask's logits)."""
    if not dataclasses.is_dataclass(pattern):
        return []
    return [
        f.name for f in dataclasses.fields(pattern) if isinstance(getattr(pattern, f.name), Tensor)
    ]


def _rebuild_pattern(module: SparseAttention, _incompatible) -> None:
    """After ``load_state_dict``: the pattern made again from the loaded buffers (on the host,
    where patterns build their graphs)."""
    tensors = {
        name: getattr(module, f"pattern_{name}").detach().cpu() for name in module._pattern_tensors
    }
    module.pattern = dataclasses.replace(module.pattern, **tensors)
