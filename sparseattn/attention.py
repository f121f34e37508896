"""The functional attention API: ``sparse_attention``, ``attention_weights``, the ``auto`` rule.

Data path (docs/architecture.md): pattern → AttentionGraph → engine scores on the graph → ρ →
weights·V. ``key_padding_mask`` is True for keys to *ignore* (``nn.MultiheadAttention``'s
meaning); the engines take its complement, formed once, here. The ``SparseAttention`` layer is
:mod:`sparseattn.module`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .engines import ENGINES, SPECS, capabilities, costs
from .engines.capabilities import Request
from .engines.common import grid_indices
from .graph import AttentionGraph, broadcast_or_none
from .maps import NonFiniteScoresError, ProbabilityMap, resolve_prob_map
from .memo import Memo
from .patterns import Causal, Pattern, PatternCycle
from .patterns.fixed import Dense
from .score_mods import check_score_mod, lifted_tensors
from .validate import all_finite, check_bool, check_choice, check_finite_float, check_probability

__all__ = ["sparse_attention", "attention_weights", "choose_engine", "resolve_graph"]


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
    """The ``auto`` rule (docs/engines.md, "The `auto` rule"): the engine table's choice
    (:func:`sparseattn.engines.capabilities.choose`) for this call on ``graph``: among the
    engines that can compute the request, the one of least cost (on a GPU the measured order
    first; constants: :mod:`sparseattn.engines.costs`). ``score_mod`` (the modifier, or whether
    the call has one) and ``key_padding`` (whether it has a key padding mask) change the
    decision, which is kept on the graph per request.
    """
    request = Request.of(q, k, k, prob_map, dropout_p, score_mod, key_padding)
    return capabilities.choose(request, graph, (q, k, k, prob_map, dropout_p, score_mod))


def _autocasting(t: Tensor) -> bool:
    """Whether ``torch.autocast`` is on for ``t``'s device type (False where it has none)."""
    device = t.device.type
    return torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)


def _autocast_like_sdpa(inputs: tuple[str, ...]) -> Callable[[Callable], Callable]:
    """Run the decorated function under ``torch.autocast`` as autocast runs SDPA: the tensor
    ``inputs`` (floating, not float64) cast to the autocast dtype, the body with autocast off
    (the engines pick their own compute dtype). Outside autocast: a plain call."""

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
            with kv_heads = heads unless ``enable_gqa``; n_k ≠ n_q where the pattern allows.
        pattern: a Pattern (static or data-dependent) or a ready AttentionGraph.
        prob_map: ρ — a ProbabilityMap or one of "softmax", "hardmax", "sparsemax", "entmax15".
        engine: "auto" (:func:`choose_engine`; the dense pattern runs on full rows without a
            graph), "dense", "rows", "block", "gather", "flex" or "triton" (docs/engines.md).
        scale: score scale, default 1/√d.
        key_padding_mask: optional BoolTensor (batch, n_k), True for keys to *ignore*, as
            ``nn.MultiheadAttention``'s (pass a tokenizer's ``attention_mask`` as ``~mask``).
        dropout_p: dropout on the attention weights (only when > 0).
        enable_gqa: grouped-query attention, as in SDPA: query head h reads key/value head
            h // (heads / kv_heads) (static patterns stack the query heads that share one,
            :func:`group_queries`; otherwise k and v are repeated per query head).
        score_mod: FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx)`` (h the query head),
            applied to the scaled scores before ρ (:mod:`sparseattn.score_mods`).
        group, boundaries: context parallelism (docs/parallel.md): a ``torch.distributed``
            process group over which the sequence is sharded at the P + 1 ``boundaries``
            (default: near-equal parts); q, k, v and ``key_padding_mask`` are this rank's part,
            the pattern the whole sequence's. No dropout or score_mod.
    Returns:
        (batch, heads, n_q, d_v).
    Raises:
        ValueError/TypeError for bad shapes, dtypes, devices, unknown engines, patterns that
        leave a query without any key, a key padding mask that ignores every key of an item,
        and (on CPU only) a result that is not finite, naming its cause (docs/engines.md,
        "Checks that read values").

    Dtypes: float64, float32, bfloat16, float16, the output in the inputs' dtype (under
    ``torch.autocast`` the autocast dtype, as for SDPA). ``torch.compile``: the call runs
    eagerly, one graph break per call (docs/engines.md).
    """
    if group is not None:
        return _sharded(
            q, k, v, pattern, prob_map, engine, scale, key_padding_mask, dropout_p, enable_gqa,
            score_mod, group, boundaries,
        )  # fmt: skip
    calls = key = None
    if KEEP_CALLS and key_padding_mask is None and score_mod is None:
        key = _signature(q, k, v, prob_map, engine, scale, dropout_p, enable_gqa)
        calls = None if key is None else _kept_calls(pattern)
        kept = None if calls is None else calls.peek(key)
        if kept is not None:  # checked and resolved by an earlier call with this signature
            _check_inputs_finite(**_read_whole(q, k, v, pattern))
            return kept[-1](q, k, v)
    _check_qkv(q, k, v, check_bool("enable_gqa", enable_gqa))
    _check_inputs_finite(**_read_whole(q, k, v, pattern))
    rho = resolve_prob_map(prob_map)
    check_probability("dropout_p", dropout_p, allow_one=False)
    check_choice("engine", engine, ["auto", *ENGINES])
    scale = _resolve_scale(scale, q)
    valid = None if key_padding_mask is None else _key_validity(key_padding_mask, q, k)
    if score_mod is not None:
        _check_score_mod(score_mod, q, k)
    run, cacheable = _resolve(q, k, v, pattern, rho, engine, scale, valid, dropout_p, score_mod)
    out = run(q, k, v)
    if calls is not None and cacheable:  # the map held: its id stays its own
        calls.get(key, lambda: (prob_map, run))
    return out


#: Whether :func:`sparse_attention` keeps what it resolved per call signature (:func:`_kept_calls`);
#: False: every call checks and resolves in full (to watch the decisions ``auto`` makes).
KEEP_CALLS = True


def _kept_calls(pattern: object) -> Memo | None:
    """Where what :func:`sparse_attention` resolved for a pattern (or a ready graph) is kept per
    call signature: the pattern's memo of calls (as many as the lengths of graphs it keeps),
    a graph's own memo; None for anything else (the full checks then refuse it)."""
    if isinstance(pattern, Pattern):
        return pattern.memo("calls")
    if isinstance(pattern, AttentionGraph):
        return pattern.memo
    return None


def _signature(q, k, v, prob_map, engine, scale, dropout_p, enable_gqa) -> tuple | None:
    """What every check and decision of :func:`sparse_attention` before the engine reads,
    besides the pattern (whose memo keeps the calls), for a call without key padding or
    score_mod (None where an argument is not of a plain kind, so that the full checks run):
    the inputs' shapes, dtypes, devices and whether the call is differentiated; the map (by
    identity: the kept entry holds it, so its id stays its own); the arguments; the ``auto``
    rule's memory limits (tests move them)."""
    if not (type(q) is Tensor and type(k) is Tensor and type(v) is Tensor):
        return None
    if type(prob_map) is not str and not isinstance(prob_map, ProbabilityMap):
        return None
    if type(engine) is not str or type(enable_gqa) is not bool:
        return None
    if not (scale is None or type(scale) in (int, float)) or type(dropout_p) not in (int, float):
        return None
    train = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    return (
        "call", prob_map if type(prob_map) is str else id(prob_map), engine, scale,
        dropout_p, enable_gqa, train, q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype,
        q.device, k.device, v.device, costs.DENSE_LIMIT, costs.GPU_DENSE_LIMIT,
    )  # fmt: skip


def _resolve(q, k, v, pattern, rho, engine, scale, valid, dropout_p, score_mod):
    """The call on checked inputs as ``(run, cacheable)``: ``run(q, k, v)`` computes it (the
    graph, the engine and the grouping of query heads decided here, from the inputs'
    metadata); ``cacheable``: whether a later call with the same signature may reuse ``run``
    — not for key padding, a score_mod, a data-dependent pattern (its graph reads q and k),
    learned or per-row α (decided every call), or k, v repeated per query head."""
    cacheable = valid is None and score_mod is None and rho.alpha is None
    cacheable = cacheable and not getattr(pattern, "data_dependent", False)
    if _empty_output(q, v, pattern):
        return _empty_result, cacheable
    groups = q.shape[1] // k.shape[1] if k.shape[1] else 1
    # with a score_mod, h must stay the query head: no stacking of query heads
    stack = groups > 1 and score_mod is None and _can_group(pattern, rho, engine, q, k)
    if stack:
        graph = resolve_graph(pattern, q, k)
        chosen = engine
        if engine == "auto":
            chosen = choose_engine(graph, q, k, rho, dropout_p, key_padding=valid is not None)
        if SPECS[chosen].gqa:  # the engine reads the shared key/value heads itself
            return _runner(q, k, v, graph, rho, chosen, scale, valid, dropout_p), cacheable
        kv_heads = k.shape[1]
        grouped_q, grouped = group_queries(q, graph, kv_heads)
        inner = _runner(grouped_q, k, v, grouped, rho, engine, scale, valid, dropout_p)

        def stacked(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            out = inner(q.reshape(q.shape[0], kv_heads, -1, q.shape[-1]), k, v)
            return out.reshape(q.shape[:3] + out.shape[-1:])

        return stacked, cacheable
    if groups > 1:  # k and v repeated per query head: resolved and run on this call's alone
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        run = _runner(q, k, v, pattern, rho, engine, scale, valid, dropout_p, score_mod)
        return (lambda q, _k, _v: run(q, k, v)), False
    return _runner(q, k, v, pattern, rho, engine, scale, valid, dropout_p, score_mod), cacheable


#: The context-parallel call, :func:`sparseattn.parallel.sparse_attention`, registered by
#: that package on import, so that this module, which it builds on, does not import it.
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


def _runner(
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
) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """:func:`sparse_attention` on validated inputs with as many key/value heads as query
    heads, decided here (the graph, the engine) and returned as ``run(q, k, v)`` for inputs
    of these shapes; ``valid`` (batch, n_k) is True for real keys (the engines' convention)."""
    full = _full_rows(pattern, q, k) if engine in ("auto", "rows") else None
    request = Request.of(q, k, v, rho, dropout_p, score_mod, valid is not None, full)
    call = (q, k, v, rho, dropout_p, score_mod)
    extra = {} if score_mod is None else {"score_mod": score_mod}
    if full is not None:  # the dense pattern: no n² graph (docs/engines.md, "full rows")
        if engine == "auto":
            engine = capabilities.choose(request, None, call)
        spec = SPECS[engine]

        def compute(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return spec.full_rows(q, k, v, rho, scale, valid, dropout_p, full, score_mod)

    else:
        graph = resolve_graph(pattern, q, k)
        if engine == "auto":
            engine = capabilities.choose(request, graph, call)
        else:
            reason = "; ".join(capabilities.request_reasons(engine, request, call))
            if reason:
                raise ValueError(f"engine={engine!r} cannot run this call: {reason}")

        bind = SPECS[engine].bind
        if bind is not None:  # the engine's own decisions made once, here
            compute = bind(q, k, v, graph, rho, scale, valid, dropout_p, **extra)
        else:

            def compute(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
                return ENGINES[engine](q, k, v, graph, rho, scale, valid, dropout_p, **extra)

    def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        try:
            out = compute(q, k, v)
        except NonFiniteScoresError:  # an input holds NaN or inf, or scale · q·k overflowed
            out = q.new_full((1,), math.nan)
        return _check_output(out, scale, k=k, v=v)

    return run


def _can_group(pattern: object, rho: ProbabilityMap, engine: str, q: Tensor, k: Tensor) -> bool:
    """Whether a grouped-query call may stack query heads (:func:`group_queries`): a static
    pattern or a ready graph, one α for all rows, and not the dense pattern's graph-free path."""
    if getattr(pattern, "data_dependent", False) or rho.alpha is not None:
        return False
    return not (engine in ("auto", "rows") and _full_rows(pattern, q, k) is not None)


def group_queries(q: Tensor, graph: AttentionGraph, kv_heads: int) -> tuple[Tensor, AttentionGraph]:
    """Grouped-query attention without copying keys: q (batch, heads, n_q, d) → (batch,
    kv_heads, g·n_q, d), the g = heads / kv_heads query heads that share a key/value head
    stacked along the query axis, and the graph's rows laid out the same way; the output
    (batch, kv_heads, g·n_q, d_v) reshapes to (batch, heads, n_q, d_v)."""
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

    q: (B, H, n_q, d), k: (B, H, n_k, d); ``key_padding_mask`` and ``score_mod`` as in
    :func:`sparse_attention`. Zeros off the graph and on padded keys. O(n_q · n_k) memory: for
    analysis and for methods that need A itself (MCA, Sparsefinder's gold graphs).
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
    input holding NaN or inf, or else scale · q·kᵀ overflowing the dtype. Only the result is
    read on success (docs/engines.md, "Checks that read values")."""
    if not _host_checks(out) or all_finite(out):
        return out
    _check_inputs_finite(**inputs)
    raise ValueError(
        f"scale · q·kᵀ overflows {out.dtype} (scale = {scale:g}): the scores are not "
        "finite; use a smaller scale, smaller inputs or a wider dtype"
    )


def _key_validity(key_padding_mask: Tensor, q: Tensor, k: Tensor) -> Tensor:
    """The public key padding mask (batch, n_k), True = ignore (``nn.MultiheadAttention``'s
    meaning), checked and turned into the engines' validity mask (True = real key). An item
    whose every key is ignored is refused: that is also what a True-for-real-tokens mask gives
    for every item without padding."""
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
