"""The engine table: what each engine can compute and what it costs, declared in one place.

Each engine states what it supports and its cost for a request as an :class:`EngineSpec`, whose
:meth:`~EngineSpec.not_supported_reasons` say why it cannot run a :class:`Request`.
``sparse_attention(engine=...)`` refuses an engine with reasons; ``engine="auto"`` is
:func:`choose`, the cheapest engine without reasons (docs/engines.md, "The `auto` rule"; the
numbers: :mod:`sparseattn.engines.costs`). The dense pattern is a request without a graph
(``Request.full_rows``): only the engines that serve it graph-free have a cost for it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..graph import AttentionGraph
from ..maps import ProbabilityMap
from ..memo import Memo
from ..score_mods import steps
from . import costs
from ._entmax_args import triton_map_reason, triton_mod_reason
from .block import block_attention
from .dense import dense_attention, fused_with_padding
from .flex import FLEX_BLOCK, bind_flex, flex_available, flex_engine, flex_refuses
from .gather import gather_attention
from .layout import choose_block, count_pairs
from .rows import full_rows_attention, rows_attention
from .triton_entmax import full_rows_entmax, triton_entmax_attention, triton_entmax_unsupported

__all__ = [
    "ENGINES",
    "EngineSpec",
    "Request",
    "SPECS",
    "choose",
    "flex_attention_engine",
    "reasons",
    "request_reasons",
    "unsupported",
]

#: A cost: (tier, estimate), compared as tuples — the tier is the measured order of the fused
#: GPU kernels (0 elsewhere), the estimate the work in scored block entries at b = 64.
Cost = tuple[int, float]

_FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_HALF_AND_FLOAT = frozenset({torch.float16, torch.bfloat16, torch.float32})
_ANY = frozenset({"cpu", "cuda"})


def _softmax_only(prob_map: ProbabilityMap | None) -> str | None:
    if prob_map is not None and prob_map.is_softmax:
        return None
    what = "an unknown map" if prob_map is None else repr(prob_map)
    return f"it computes softmax only, not {what}"


def _triton_available() -> str | None:
    return None if importlib.util.find_spec("triton") else "triton is not installed"


@dataclasses.dataclass(frozen=True)
class Request:
    """What one call asks of an engine.

    Attributes:
        device, dtype: the inputs' device type ("cpu", "cuda", ...) and dtype.
        prob_map: ρ, or None when not known (then only engines that take any map qualify).
        train: autograd will ask for a backward (grad enabled and an input requires grad).
        dropout, row_alpha: dropout on the weights (p > 0); ρ is α-entmax with a tensor α.
        gqa, score_mod: k and v have fewer heads than q; a score modifier applies.
        mod_kinds: the kinds of the library's elementary modifiers it is made of, in order
            (``score_mods.steps``), or None for any other callable (or when not known).
        key_padding: a key padding mask applies.
        shape: (batch, heads, n_q, n_k) of the scores.
        full_rows: for the dense pattern, whether it is causal (then no graph is built);
            None for any other pattern.
    """

    device: str
    dtype: torch.dtype
    prob_map: ProbabilityMap | None
    train: bool = False
    dropout: bool = False
    row_alpha: bool = False
    gqa: bool = False
    score_mod: bool = False
    mod_kinds: tuple[str, ...] | None = None
    key_padding: bool = False
    shape: tuple[int, int, int, int] = (1, 1, 1, 1)
    full_rows: bool | None = None

    @property
    def entries(self) -> int:
        """B·H·n_q·n_k: the size of the score matrix."""
        return math.prod(self.shape)

    @classmethod
    def of(
        cls,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        prob_map: ProbabilityMap | None,
        dropout_p: float = 0.0,
        score_mod: bool | Callable | None = False,
        key_padding: bool = False,
        full_rows: bool | None = None,
    ) -> Request:
        """The request of a call with q (B, H, n_q, d), k (B, H_kv, n_k, d), v like k: made
        once per call, and what every decision about it reads. ``score_mod``: the modifier
        itself (its kinds are read) or whether there is one (kinds unknown)."""
        kinds = None
        if callable(score_mod):
            found = steps(score_mod)
            kinds = None if found is None else tuple(mod.kind for mod in found)
        return cls(
            device=q.device.type,
            dtype=q.dtype,
            prob_map=prob_map,
            train=torch.is_grad_enabled()
            and (q.requires_grad or k.requires_grad or v.requires_grad),
            dropout=dropout_p > 0,
            row_alpha=prob_map is not None and prob_map.alpha is not None,
            gqa=k.shape[1] != q.shape[1],
            score_mod=bool(score_mod),
            mod_kinds=kinds,
            key_padding=key_padding,
            shape=(q.shape[0], q.shape[1], q.shape[2], k.shape[2]),
            full_rows=full_rows,
        )


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """One engine and what it supports (the model: xformers' fmha operators).

    Attributes:
        name, why: the ``engine=`` name; one sentence on what the engine is for.
        run: the engine, ``run(q, k, v, graph, prob_map, scale, key_valid, dropout_p)``.
        devices, dtypes: device types it runs on and input dtypes it takes.
        maps: why it cannot compute a map (None when it can; the map may be None: unknown).
        backward_devices: device types on which it has a backward.
        dropout, row_alpha: it applies dropout; it takes α-entmax with a tensor α.
        gqa: it takes k, v with fewer heads than q itself (else they are repeated first).
        score_mod: it applies a score modifier (keyword ``score_mod`` of ``run``).
        mod_kinds: for an engine that takes only some modifiers: why it cannot apply one of
            these kinds (``Request.mod_kinds``), or None when it can. None here: any.
        available: None when what it needs is here (a compiler, a package), else why not.
        refuses: a finer check on the tensors, ``refuses(q, k, v, prob_map, dropout_p,
            score_mod=None)``, once the declared capabilities allow the call: None, or why not.
        cost: ``cost(request, graph, memo)`` (:data:`Cost`), or None where ``auto`` should not
            pick it (``graph`` None for the dense pattern, ``memo`` a dict kept on the graph).
        full_rows: ``full_rows(q, k, v, prob_map, scale, key_valid, dropout_p, causal,
            score_mod)`` serving the dense pattern without a graph, or None.
        bind: ``run``'s arguments → a call ``(q, k, v) → out`` for inputs of these shapes,
            dtypes and device with what ``run`` decides from them decided once (what
            ``sparse_attention`` keeps per call signature), or None: ``run`` each call.
    """

    name: str
    run: Callable[..., Tensor]
    why: str
    devices: frozenset[str] = _ANY
    dtypes: frozenset[torch.dtype] = _FLOATS
    maps: Callable[[ProbabilityMap | None], str | None] = lambda _: None
    backward_devices: frozenset[str] = _ANY
    dropout: bool = True
    row_alpha: bool = False
    gqa: bool = False
    score_mod: bool = True
    mod_kinds: Callable[[tuple[str, ...] | None], str | None] | None = None
    available: Callable[[], str | None] = lambda: None
    refuses: Callable[..., str | None] | None = None
    cost: Callable[[Request, AttentionGraph | None, dict], Cost | None] = lambda *_: None
    full_rows: Callable[..., Tensor] | None = None
    bind: Callable[..., Callable[[Tensor, Tensor, Tensor], Tensor]] | None = None

    def not_supported_reasons(self, req: Request) -> list[str]:
        """Why this engine cannot compute ``req``, one sentence each; empty if it can."""
        reasons = []
        if req.device not in self.devices:
            reasons.append(f"it runs on {sorted(self.devices)}, not on {req.device}")
        if req.dtype not in self.dtypes:
            reasons.append(f"it takes {sorted(str(d) for d in self.dtypes)}, not {req.dtype}")
        wrong_map = self.maps(req.prob_map)
        if wrong_map is not None:
            reasons.append(wrong_map)
        if req.train and req.device not in self.backward_devices:
            reasons.append(f"it has no backward on {req.device} (inputs require grad)")
        if req.dropout and not self.dropout:
            reasons.append("it has no attention dropout")
        if req.row_alpha and not self.row_alpha:
            reasons.append("it does not take a tensor α (alpha: one per head or row)")
        if req.score_mod and not self.score_mod:
            reasons.append("it does not apply score modifiers (score_mod)")
        elif req.score_mod and self.mod_kinds is not None:
            wrong_mod = self.mod_kinds(req.mod_kinds)
            if wrong_mod is not None:
                reasons.append(wrong_mod)
        missing = self.available()
        if missing is not None:
            reasons.append(missing)
        return reasons


# ---------------------------------------------------------------------------- the costs
def _graphs(graph: AttentionGraph) -> int:
    """Graphs a graph holds (a per-head graph holds H): every engine's cost grows as B·H, so
    costs are compared per graph."""
    return max(1, math.prod(graph.batch_shape))


def _block_work(req: Request, graph: AttentionGraph, memo: dict) -> float:
    """pairs·b²·ENTRY_COST[b] at the block size b the block engine will choose (its training
    table when a backward follows); per graph, kept on the graph."""
    if ("work", req.train) not in memo:
        b = choose_block(graph, req.train)
        table = costs.ENTRY_COST_TRAIN if req.train else costs.ENTRY_COST
        memo[("work", req.train)] = count_pairs(graph, b) * b * b * table[b] / _graphs(graph)
    return memo[("work", req.train)]


def _gpu_tier(name: str, req: Request) -> int:
    """0 on CPU; on a GPU the engine's place in the measured order (:data:`costs.GPU_ORDER`),
    the engines outside it after."""
    if req.device == "cpu":
        return 0
    order = costs.GPU_ORDER
    return order.index(name) if name in order else len(order)


def _dense_cost(req: Request, graph: AttentionGraph | None, memo: dict) -> Cost | None:
    """n_q·n_k·DENSE_ENTRY_COST (SDPA's fused kernel scores an entry for less than a block
    entry), within its memory cap: DENSE_LIMIT (DENSE_LIMIT // 32 where it materialises the
    scores: a map other than softmax, dropout, a modifier, key padding off the CPU:
    :func:`~sparseattn.engines.dense.fused_with_padding`); on a GPU, first in the order up to
    GPU_DENSE_LIMIT, not a candidate above."""
    if graph is None:
        return None
    if req.device != "cpu":
        return (0, 0.0) if req.entries <= costs.GPU_DENSE_LIMIT else None
    fused = req.prob_map is not None and req.prob_map.is_softmax
    padding = req.key_padding and not fused_with_padding(req.device)
    fused = fused and not (req.dropout or req.score_mod or padding)
    if req.entries > (costs.DENSE_LIMIT if fused else costs.DENSE_LIMIT // 32):
        return None
    entry = costs.DENSE_ENTRY_COST_TRAIN if req.train else costs.DENSE_ENTRY_COST
    return (0, req.shape[2] * req.shape[3] * entry)


def _block_cost(req: Request, graph: AttentionGraph | None, memo: dict) -> Cost | None:
    return None if graph is None else (_gpu_tier("block", req), _block_work(req, graph, memo))


def _gather_cost(req: Request, graph: AttentionGraph | None, memo: dict) -> Cost | None:
    """E / BLOCK_MIN_FILL per graph: a gathered edge costs 12 block entries."""
    if graph is None:
        return None
    return (_gpu_tier("gather", req), graph.col.numel() / _graphs(graph) / costs.BLOCK_MIN_FILL)


def _flex_cost(req: Request, graph: AttentionGraph | None, memo: dict) -> Cost | None:
    """On a GPU, second in the order; on CPU FLEX_ENTRY_COST × its work at block 128, which
    only replaces the block engine where it is the cheaper of the two."""
    if graph is None:
        return None
    if req.device != "cpu":
        return (_gpu_tier("flex", req), 0.0)
    if "flex_work" not in memo:
        pairs = count_pairs(graph, FLEX_BLOCK)
        memo["flex_work"] = pairs * FLEX_BLOCK**2 * costs.FLEX_ENTRY_COST / _graphs(graph)
    return (0, memo["flex_work"])


def _triton_cost(req: Request, graph: AttentionGraph | None, memo: dict) -> Cost | None:
    """Third in the GPU order; for the dense pattern, its fused full rows come first."""
    return (-1, 0.0) if graph is None else (_gpu_tier("triton", req), 0.0)


def _rows_cost(req: Request, graph: AttentionGraph | None, memo: dict) -> Cost | None:
    """The dense pattern's own route (no n² graph; SDPA for softmax); not for other graphs,
    whose rows the graph engines read faster."""
    return (0, 0.0) if graph is None else None


def _full_rows_entmax(q, k, v, prob_map, scale, key_valid, dropout_p, causal, score_mod=None):
    """The Triton kernels' fused full rows (no dropout: its reasons)."""
    return full_rows_entmax(q, k, v, prob_map, scale, key_valid, causal, score_mod=score_mod)


SPECS: dict[str, EngineSpec] = {
    spec.name: spec
    for spec in (
        EngineSpec(
            "dense",
            dense_attention,
            "the masked n_q × n_k reference: O(n²) memory, fastest for small score matrices",
            row_alpha=True,
            cost=_dense_cost,
        ),
        EngineSpec(
            "rows",
            rows_attention,
            "full (or wide) rows a chunk of queries at a time: sparse maps on the dense pattern",
            row_alpha=True,
            cost=_rows_cost,
            full_rows=full_rows_attention,
        ),
        EngineSpec(
            "block",
            block_attention,
            "block-sparse matrix products over the graph's non-empty blocks: any map",
            row_alpha=True,
            cost=_block_cost,
        ),
        EngineSpec(
            "gather",
            gather_attention,
            "neighbour lists chunked by degree: graphs too scattered for blocks",
            cost=_gather_cost,
        ),
        EngineSpec(
            "flex",
            flex_engine,
            "torch's compiled FlexAttention on the graph's BlockMask: softmax",
            dtypes=_HALF_AND_FLOAT,
            maps=_softmax_only,
            backward_devices=frozenset({"cuda"}),
            dropout=False,
            gqa=True,
            available=flex_available,
            refuses=flex_refuses,
            cost=_flex_cost,
            bind=bind_flex,
        ),
        EngineSpec(
            "triton",
            functools.partial(triton_entmax_attention, check=False),
            "fused Triton kernels for α-entmax and sparsemax on the graph's block layout",
            devices=frozenset({"cuda"}),
            dtypes=_HALF_AND_FLOAT,
            maps=triton_map_reason,
            dropout=False,
            gqa=True,
            mod_kinds=triton_mod_reason,
            available=_triton_available,
            refuses=triton_entmax_unsupported,
            cost=_triton_cost,
            full_rows=_full_rows_entmax,
        ),
    )
}

#: The engines by name, as callables (what ``sparse_attention`` runs).
ENGINES: dict[str, Callable[..., Tensor]] = {name: spec.run for name, spec in SPECS.items()}


def reasons(engine: str, *call: Any) -> list[str]:
    """Why ``engine`` cannot compute this call, (q, k, v, prob_map[, dropout_p[, score_mod]])
    as :meth:`Request.of` takes it: its declared reasons, else its finer check; empty if none."""
    return request_reasons(engine, Request.of(*call), call)


def unsupported(engine: str, *call: Any) -> str | None:
    """None if ``engine`` can compute this call (as :func:`reasons` takes it), else why not
    (its reasons, joined)."""
    return "; ".join(reasons(engine, *call)) or None


def request_reasons(name: str, req: Request, call: tuple) -> list[str]:
    """Why engine ``name`` cannot compute ``req``; ``call`` = (q, k, v, prob_map, dropout_p[,
    score_mod]) for its finer check (a ``score_mod`` that is a bool is left out)."""
    spec = SPECS[name]
    found = spec.not_supported_reasons(req)
    if not found and spec.refuses is not None:
        mod = call[5] if len(call) > 5 and callable(call[5]) else None
        finer = spec.refuses(*call[:5], score_mod=mod)
        found = [] if finer is None else [finer]
    return found


def choose(req: Request, graph: AttentionGraph | None, call: tuple) -> str:
    """``engine="auto"``: the cheapest engine of the table without reasons (``graph`` None for
    the dense pattern; ``call`` as :func:`request_reasons` takes it), kept per request on the
    graph (the dense pattern's in a module-wide memo). A ValueError with every engine's
    reasons when none can compute the request."""
    key = _decision_key(req)
    if graph is None:
        if key is None:
            return _cheapest(req, None, call, {})
        return _DENSE_DECISIONS.get(key, lambda: _cheapest(req, None, call, {}))
    memo = graph.cached(("auto",), dict)
    if key is not None and key in memo:
        return memo[key]
    chosen = _cheapest(req, graph, call, memo)
    if key is not None:
        memo[key] = chosen
    return chosen


#: The dense pattern's decisions, per request key (no graph to keep them on).
_DENSE_DECISIONS = Memo(256)


def _cheapest(req: Request, graph: AttentionGraph | None, call: tuple, memo: dict) -> str:
    found, why = {}, {}
    for name, spec in SPECS.items():
        why[name] = request_reasons(name, req, call)
        cost = None if why[name] else spec.cost(req, graph, memo)
        if cost is not None:
            found[name] = cost
    if not found:
        listed = "; ".join(f"{name}: {', '.join(r) or 'no cost here'}" for name, r in why.items())
        raise ValueError(f"no engine can compute this call — {listed}")
    return min(found, key=found.get)


def _decision_key(req: Request) -> tuple | None:
    """What a decision depends on (the limits too: tests and benchmarks move them), or None
    when the map's parameters are not hashable (or α is a tensor): decided every call."""
    rho = req.prob_map
    if rho is not None and rho.alpha is not None:
        return None
    what = None if rho is None else (rho.name, tuple(rho.params.items()))
    key = (dataclasses.replace(req, prob_map=None), what, costs.DENSE_LIMIT, costs.GPU_DENSE_LIMIT)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def checked(name: str) -> Callable[..., Tensor]:
    """Engine ``name`` as a public function: a call the table says it cannot compute raises a
    ValueError with the reasons (``sparse_attention`` calls the table's entry directly)."""
    spec = SPECS[name]

    @functools.wraps(spec.run)
    def run(q, k, v, graph, prob_map, scale, key_valid=None, dropout_p=0.0, **options):
        reason = unsupported(name, q, k, v, prob_map, dropout_p, options.get("score_mod"))
        if reason is not None:
            raise ValueError(f"engine={name!r} cannot run this call: {reason}")
        return spec.run(q, k, v, graph, prob_map, scale, key_valid, dropout_p, **options)

    return run


#: FlexAttention on a graph, checked (:func:`sparseattn.engines.flex.flex_engine`).
flex_attention_engine = checked("flex")
