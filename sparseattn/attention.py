"""The public attention API: ``sparse_attention`` and the ``SparseAttention`` module.

Data path (DESIGN §2): pattern → AttentionGraph → engine scores on the graph → ρ → weights·V.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .engines import ENGINES
from .engines.rows import full_rows_attention
from .graph import AttentionGraph, broadcast_or_none
from .maps import NonFiniteScoresError, ProbabilityMap, entmax, resolve_prob_map
from .patterns import Causal, HeadSplit, Pattern, PatternCycle, as_cycle, dense
from .patterns.fixed import Dense
from .validate import (
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

#: Largest score matrix (B·H·n_q·n_k entries) for which ``auto`` uses the dense engine.
DENSE_LIMIT = 1 << 22
#: The same on a GPU (provisional, not yet measured there: docs/benchmarks.md, "GPU").
GPU_DENSE_LIMIT = 1 << 24


def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
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
    if q.shape[:2] != k.shape[:2] or k.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"q, k, v must share (batch, heads): {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share the head dim d, got {q.shape[-1]} and {k.shape[-1]}")
    if q.shape[-1] == 0:
        raise ValueError("q and k must have a head dim d >= 1, got d = 0")
    if k.shape[-2] == 0 and q.shape[-2] > 0:
        raise ValueError("k must hold at least one key (n_k >= 1): every query needs a key")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must share their length, got {k.shape[-2]} and {v.shape[-2]}")
    if not _host_checks(q):
        return
    for name, t in (("q", q), ("k", k), ("v", v)):
        # a finite sum proves every entry finite (NaN and ±inf propagate); one pass, no mask
        if not torch.isfinite(t.detach().sum()) and not torch.isfinite(t).all():
            raise ValueError(f"{name} contains NaN or inf")


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
    if broadcast_or_none(graph.batch_shape, (bsz, heads)) != (bsz, heads):
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
) -> str:
    """The ``auto`` rule (docs/engines.md; constants measured in docs/benchmarks.md).

    1. ``dense`` while the full score matrix is small (B·H·n_q·n_k ≤ DENSE_LIMIT entries).
    2. Otherwise the block layout at the block size the block engine would choose scores
       ``work`` = pairs·b² entries per graph, of which ``fill`` = E / work are edges. A scored
       block entry costs ~4–8 ns, a gathered edge ~60–110 ns (fp32, d = 64), so ``block`` wins
       unless ``fill`` < BLOCK_MIN_FILL = 1/15 (scattered graphs): then ``gather``.
    3. ``flex`` only where it can compute the request (softmax map given, no dropout, no
       input requiring grad on CPU, a dtype and a compiler it supports) *and* its estimated
       cost, FLEX_ENTRY_COST × its work at block 128, is below the block engine's. On the
       measured CPU it never is; an unknown map (``prob_map=None``) never picks flex.
    """
    from .engines.block import BLOCK_MIN_FILL, ENTRY_COST, choose_block, count_pairs
    from .engines.flex import FLEX_BLOCK, FLEX_ENTRY_COST, flex_unsupported

    bsz, heads, n_q, _ = q.shape
    n_k = k.shape[-2]
    if q.device.type != "cpu":
        return _choose_on_gpu(graph, q, k, prob_map, dropout_p)
    if bsz * heads * n_q * n_k <= DENSE_LIMIT:
        return "dense"
    cache = graph.cached(("auto",), dict)
    if "block_work" not in cache:
        b = choose_block(graph)
        cache["block_work"] = count_pairs(graph, b) * b * b * ENTRY_COST[b]
        cache["fill"] = graph.col.numel() / (count_pairs(graph, b) * b * b)
    if cache["fill"] < BLOCK_MIN_FILL:
        return "gather"
    if prob_map is not None and flex_unsupported(q, k, k, prob_map, dropout_p) is None:
        if "flex_work" not in cache:
            cache["flex_work"] = count_pairs(graph, FLEX_BLOCK) * FLEX_BLOCK**2 * FLEX_ENTRY_COST
        if cache["flex_work"] < cache["block_work"]:
            return "flex"
    return "block"


def _choose_on_gpu(
    graph: AttentionGraph, q: Tensor, k: Tensor, prob_map: ProbabilityMap | None, dropout_p: float
) -> str:
    """The ``auto`` rule on a GPU: softmax goes to ``flex`` wherever FlexAttention can compute
    it (forward and backward there: one fused kernel), other maps (and dropout) to ``block``,
    scattered graphs (fill < BLOCK_MIN_FILL) to ``gather``, and small score matrices
    (≤ GPU_DENSE_LIMIT entries) to ``dense``. Provisional: not yet measured on a GPU; the
    calibration section of ``sparseattn bench gpu`` is the measurement that is to set it
    (docs/benchmarks.md, "GPU")."""
    from .engines.block import BLOCK_MIN_FILL, choose_block, count_pairs
    from .engines.flex import flex_unsupported

    bsz, heads, n_q, _ = q.shape
    if bsz * heads * n_q * k.shape[-2] <= GPU_DENSE_LIMIT:
        return "dense"
    if prob_map is not None and flex_unsupported(q, k, k, prob_map, dropout_p) is None:
        return "flex"
    cache = graph.cached(("auto",), dict)
    if "fill" not in cache:
        b = choose_block(graph)
        cache["fill"] = graph.col.numel() / (count_pairs(graph, b) * b * b)
    return "gather" if cache["fill"] < BLOCK_MIN_FILL else "block"


def sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: Pattern | AttentionGraph,
    prob_map: str | ProbabilityMap = "softmax",
    engine: str = "auto",
    scale: float | None = None,
    key_padding_mask: Tensor | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """Sparse attention, Yun et al. eq. (3): out_i = Σ_{j ∈ A_i} ρ(scale · q_i·k_j)_j · v_j.

    Args:
        q: (batch, heads, n_q, d); k: (batch, heads, n_k, d); v: (batch, heads, n_k, d_v).
            n_k may differ from n_q (cross-attention) for patterns that allow it.
        pattern: a Pattern (static or data-dependent) or a ready AttentionGraph.
        prob_map: ρ — a ProbabilityMap or one of "softmax", "hardmax", "sparsemax", "entmax15".
        engine: "auto" (:func:`choose_engine`; the dense pattern goes to SDPA for softmax and
            to "rows" for other maps, without building its graph), "dense" (masked n×n
            reference), "rows" (full rows in chunks of queries), "block"
            (block-sparse matrix products), "gather" (neighbour lists) or "flex" (compiled
            FlexAttention; softmax, and on CPU inference only). docs/engines.md.
        scale: score scale, default 1/√d.
        key_padding_mask: optional BoolTensor (batch, n_k), True for real keys.
        dropout_p: dropout on the attention weights (only when > 0).
    Returns:
        (batch, heads, n_q, d_v).
    Raises:
        ValueError/TypeError for bad shapes, dtypes, devices, unknown engines, patterns that
        leave a query without any key, and (on CPU) NaN/inf inputs and overflowing scores; on
        a GPU those two checks are skipped, since each would stall the host on the device.
    """
    _check_qkv(q, k, v)
    rho = resolve_prob_map(prob_map)
    check_probability("dropout_p", dropout_p, allow_one=False)
    check_choice("engine", engine, ["auto", *ENGINES])
    scale = _resolve_scale(scale, q)
    if key_padding_mask is not None:
        _check_key_padding(key_padding_mask, q, k)
    if _empty_output(q, v, pattern):
        return _empty_result(q, k, v)
    causal = _full_rows(pattern, q, k) if engine in ("auto", "rows") else None
    if causal is not None:  # the dense pattern: no n² graph (docs/engines.md, "full rows")
        out = full_rows_attention(q, k, v, rho, scale, key_padding_mask, dropout_p, causal)
        return _check_overflow(out, scale)
    graph = resolve_graph(pattern, q, k)
    if engine == "auto":  # the map matters only to the GPU rule (flex); docs/engines.md
        engine = choose_engine(graph, q, k, rho if q.device.type != "cpu" else None, dropout_p)
        if rho.alpha is not None and engine == "gather":  # per-row α: dense, block, rows
            engine = "block"
    if rho.alpha is not None and engine not in ("dense", "block", "rows"):
        raise ValueError(f"engine {engine!r} does not take a tensor alpha; use block or rows")
    try:
        out = ENGINES[engine](q, k, v, graph, rho, scale, key_padding_mask, dropout_p)
    except NonFiniteScoresError:  # inputs were checked finite: scale · q·k overflowed
        out = q.new_full((1,), math.nan)
    return _check_overflow(out, scale)


def _full_rows(pattern: object, q: Tensor, k: Tensor) -> bool | None:
    """For the dense pattern: whether it is causal (False: every key; True also for queries at
    an offset, n_q < n_k); else None."""
    if type(pattern) is Dense:
        return False
    if isinstance(pattern, Causal) and type(pattern.base) is Dense and q.shape[-2] <= k.shape[-2]:
        return True
    return None


def attention_weights(
    q: Tensor,
    k: Tensor,
    pattern: Pattern | AttentionGraph,
    prob_map: str | ProbabilityMap = "softmax",
    scale: float | None = None,
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """The attention matrix A = ρ(scale · QKᵀ on the graph) as a dense (B, H, n_q, n_k) tensor.

    Zeros off the graph and on padded keys. O(n_q · n_k) memory: meant for analysis and for
    methods that need A itself (MCA's sample sizes, Sparsefinder's gold graphs) at BERT lengths.
    """
    _check_qkv(q, k, k)
    rho = resolve_prob_map(prob_map)
    scale = _resolve_scale(scale, q)
    if key_padding_mask is not None:
        _check_key_padding(key_padding_mask, q, k)
    if _empty_output(q, k, pattern):
        return _empty_result(q, k, k, k.shape[-2])
    graph = resolve_graph(pattern, q, k)
    mask = graph.to(q.device).to_dense()
    if key_padding_mask is not None:
        mask = mask & key_padding_mask[:, None, None, :]
    scores = _check_overflow((q @ k.transpose(-1, -2)) * scale, scale)
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


def _check_overflow(out: Tensor, scale: float) -> Tensor:
    """Finite inputs give a finite output unless scale · q·k overflows the dtype: refuse that
    (on CPU; see :func:`_host_checks`)."""
    if not _host_checks(out):
        return out
    if not torch.isfinite(out.detach().sum()) and not bool(torch.isfinite(out).all()):
        raise ValueError(
            f"scale · q·kᵀ overflows {out.dtype} (scale = {scale:g}): the scores are not "
            "finite; use a smaller scale, smaller inputs or a wider dtype"
        )
    return out


def _check_key_padding(key_padding_mask: Tensor, q: Tensor, k: Tensor) -> None:
    expected = (q.shape[0], k.shape[-2])
    if not isinstance(key_padding_mask, Tensor):
        raise TypeError(
            f"key_padding_mask must be a bool tensor of shape {expected}, "
            f"got {type(key_padding_mask).__name__}"
        )
    if key_padding_mask.dtype != torch.bool or tuple(key_padding_mask.shape) != expected:
        raise ValueError(
            f"key_padding_mask must be a bool tensor of shape {expected}, "
            f"got {key_padding_mask.dtype} {tuple(key_padding_mask.shape)}"
        )


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
    ) -> None:
        super().__init__()
        check_positive("embed_dim", embed_dim)
        check_positive("num_heads", num_heads)
        check_choice("engine", engine, ["auto", *ENGINES])
        check_probability("dropout", dropout, allow_one=False)
        check_bool("bias", bias)
        check_int("layer_index", layer_index, 0)
        if embed_dim % num_heads:
            raise ValueError(
                f"embed_dim ({embed_dim}) must be a positive multiple of num_heads ({num_heads})"
            )
        pattern = dense() if pattern is None else pattern
        if not isinstance(pattern, AttentionGraph):
            pattern = as_cycle(pattern)[layer_index]
        if isinstance(pattern, HeadSplit):
            pattern.head_sizes(num_heads)  # validate now, not at the first forward
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.pattern = pattern
        self.prob_map = resolve_prob_map(prob_map)
        self.engine = engine
        self.dropout = dropout
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

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        """x: (batch, n, embed_dim) → (batch, n, embed_dim); key_padding_mask: (batch, n)."""
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype != self.qkv.weight.dtype:
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
            self.prob_map if self.alpha_logit is None else entmax(self.alpha.view(-1, 1, 1)),
            self.engine,
            key_padding_mask=key_padding_mask,
            dropout_p=self.dropout if self.training else 0.0,
        )
        return self.out(out.transpose(1, 2).reshape(bsz, n, self.embed_dim))

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, pattern={self.pattern!r}, "
            f"prob_map={self.prob_map!r}, engine={self.engine!r}"
        )
