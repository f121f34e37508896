"""Sparse attention on a sequence sharded over a process group (context parallelism).

Rank r holds the queries, keys and values of its shard (:mod:`.plan`). One call runs:

1. **fingerprint** — every rank all-gathers a few int64s (shard length, shapes, dtype, a
   digest of the pattern, map, scale, engine, boundaries, which inputs need gradients, and
   whether its own inputs passed the checks); any disagreement raises the same ValueError on
   every rank before any data moves;
2. **halo exchange** — one ``all_to_all_single``: each rank sends exactly the keys and values
   (and key padding) the plan says the other ranks' rows read;
3. **global rows** — every rank scores the global queries against its own keys; the partial
   results merge by all-reduces: the row max, then for softmax Σ e^(z−m)·v and Σ e^(z−m)
   (log-sum-exp), for sparsemax, 1.5-entmax and α-entmax the threshold τ found by the
   algorithms of :mod:`sparseattn.fastmaps` (Michelot; Newton with the exact closed-form
   finish; safeguarded Newton) with the row sums all-reduced at every step, so every rank
   holds the same τ and the support is the one of the whole row;
4. **local rows** — :func:`sparseattn.sparse_attention` on the shard's other rows against
   [received keys + own keys] in global order, with the rows' graph remapped onto that key
   order: every engine runs as it is, chosen by the same ``auto`` table.

The backward (one ``autograd.Function``) runs the local rows' backward, the global rows'
closed forms (softmax: dS = P ⊙ (dP − dO·O); the sparse maps: dS = s⊙dP − s·Σ(s⊙dP)/Σs with
s = p^(2−α), Σ all-reduced), then sends the gradients of received keys back to their owners,
which sum them. With one rank nothing is communicated: the call is
:func:`sparseattn.sparse_attention`.

One piece: one autograd call, whose forward and backward share the call's setup, the halo
exchange and the global rows' all-reduced merges.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from ..attention import _check_qkv
from ..attention import sparse_attention as _single
from ..engines import ENGINES
from ..graph import AttentionGraph
from ..maps import ProbabilityMap, _Support, resolve_prob_map
from ..patterns.base import Causal, Pattern
from ..patterns.compose import PatternCycle
from ..patterns.fixed import Dense
from ..validate import all_finite, check_bool, check_choice, check_finite_float, check_positive
from . import comm
from . import intervals as iv
from .plan import Plan, check_boundaries, even_boundaries, plan
from .rules import row_graph

__all__ = ["map_kind", "sparse_attention"]

#: Plans and per-rank set-ups kept per process (the least recently used go first).
CACHE_SIZE = 8
#: Most threshold steps of the global rows (each all-reduces a few values per row).
MAX_STEPS = 100

_FIELDS = (
    "error", "n_local", "batch", "heads", "kv_heads", "d", "d_v", "dtype", "pattern", "map",
    "scale", "engine", "enable_gqa", "key_padding", "grad", "boundaries", "block", "max_kv",
)  # fmt: skip


def map_kind(rho: ProbabilityMap) -> str | None:
    """How global rows of ``rho`` merge across ranks: "softmax", "hardmax", "sparsemax"
    (sparsemax, entmax(2), sparselin_gen), "entmax15", "entmax" (other α), or None (no
    merge: a per-row α tensor). ``maps.support(ρ)`` merges as ρ does."""
    if isinstance(rho, _Support):
        return map_kind(rho.rho)
    if rho.alpha is not None:
        return None
    if rho.is_softmax:
        return "softmax"
    alpha = rho.params.get("alpha")
    if rho.name in ("sparsemax", "sparselin_gen") or (rho.name == "entmax" and alpha == 2.0):
        return "sparsemax"
    if rho.name == "entmax":
        return "entmax15" if alpha == 1.5 else "entmax"
    return "hardmax" if rho.name == "hardmax" else None


# ------------------------------------------------------------------ the public call
def sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: Pattern | AttentionGraph,
    *,
    group: object = None,
    prob_map: str | ProbabilityMap = "softmax",
    engine: str = "auto",
    scale: float | None = None,
    key_padding_mask: Tensor | None = None,
    enable_gqa: bool = False,
    boundaries: Sequence[int] | None = None,
    block: int = 1,
    max_kv_bytes: int | None = None,
) -> Tensor:
    """Sparse attention (Yun et al. eq. 3) on this rank's shard of a sequence sharded over
    ``group``: gathered over the ranks, the outputs and the gradients of q, k, v are those
    of :func:`sparseattn.sparse_attention` on the whole sequence.

    Args:
        q: (batch, heads, n_r, d) — this rank's queries, positions boundaries[r] …
            boundaries[r + 1] − 1 of the global sequence; k, v: (batch, kv_heads, n_r, d),
            (batch, kv_heads, n_r, d_v), the keys and values at the same positions.
        pattern: a static Pattern or an AttentionGraph at the global length N = Σ n_r.
        group: the process group (None: the default group; without an initialised default
            group, or with one rank, this is :func:`sparseattn.sparse_attention`).
        prob_map, engine, scale, enable_gqa: as in :func:`sparseattn.sparse_attention`.
        key_padding_mask: (batch, n_r) bool, True for this rank's keys to ignore.
        boundaries: the P + 1 shard boundaries; default: near-equal contiguous shards
            (:func:`~sparseattn.parallel.plan.even_boundaries`) of N.
        block: round the received key intervals out to multiples of ``block`` (1: exact).
        max_kv_bytes: refuse a plan whose keys and values on some rank (own + received)
            exceed this many bytes.
    Returns:
        (batch, heads, n_r, d_v): this rank's rows of the output.
    Raises:
        ValueError/TypeError — on every rank, before any data moves — when a rank's inputs
        fail the checks of :func:`sparseattn.sparse_attention`, when ranks disagree on the
        pattern, map, shapes, dtype or options, when the shard lengths do not match the
        boundaries, when a plan exceeds ``max_kv_bytes``, when an item's keys are all
        padding, and for a data-dependent pattern or (with global rows) a map that cannot be
        merged across ranks (a per-row α tensor).

    Every rank of the group must make the same calls in the same order, and every rank must
    run the backward when one does (as with DDP).
    """
    size = comm.group_size(group)
    if size == 1:
        if boundaries is not None and isinstance(q, Tensor):
            check_boundaries(boundaries, q.shape[-2])
        if max_kv_bytes is not None and isinstance(k, Tensor) and isinstance(v, Tensor):
            held = k.numel() * k.element_size() + v.numel() * v.element_size()
            if held > check_positive("max_kv_bytes", max_kv_bytes):
                raise ValueError(
                    f"the keys and values hold {held} bytes, more than max_kv_bytes={max_kv_bytes}"
                )
        options = {"prob_map": prob_map, "engine": engine, "scale": scale}
        options |= {"key_padding_mask": key_padding_mask, "enable_gqa": enable_gqa}
        return _single(q, k, v, pattern, **options)
    rank = comm.group_rank(group)
    error: Exception | None = None
    call = None
    options = (prob_map, engine, scale, key_padding_mask, enable_gqa, boundaries, block)
    try:
        call = _Call.check(q, k, v, pattern, *options, max_kv_bytes)
    except (TypeError, ValueError) as err:
        error = err
    device = _control_device(group, q)
    table = comm.all_gather_rows(_fingerprint(call, error, device), group)
    bounds = _agree(table, rank, error, boundaries)
    call.group, call.rank = group, rank
    call.plan = _cached_plan(pattern, bounds, block, call.digest)
    call.setup = _cached_setup(call)
    call.check_plan()
    # one more small all-reduce: does some rank have a row without keys, and which batch
    # items have a real key on some rank (the setup is cached per rank, so this runs always)
    flags = [torch.tensor([call.setup.empty_rows])]
    if call.valid is not None:
        flags.append(call.valid.any(-1).to(torch.int64).cpu())
    flags = comm.all_reduce(torch.cat(flags).to(device), group, "control", dist.ReduceOp.MAX)
    if bool(flags[0]):
        raise ValueError(
            f"pattern {pattern!r} leaves query rows with no allowed key at n={call.plan.n}; "
            "every query needs at least one key"
        )
    if call.valid is not None:
        has = flags[1:].to(torch.bool)
        if not bool(has.all()):
            items = (~has).nonzero().flatten().tolist()
            raise ValueError(
                f"key_padding_mask ignores every key of batch item(s) {items[:8]} on every "
                "rank: True marks a key to ignore (padding), as in nn.MultiheadAttention; a "
                "mask that is True for real tokens must be inverted (key_padding_mask=~mask)"
            )
    return _ContextParallel.apply(q, k, v, call)


def _control_device(group: object, q: object) -> torch.device:
    """Where the small control tensors live: the inputs' device under NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl" and isinstance(q, Tensor):
        return q.device
    return torch.device("cpu")


@dataclasses.dataclass(eq=False)
class _Call:
    """One call's checked arguments, and (after the agreement) its plan and set-up."""

    q: Tensor
    k: Tensor
    v: Tensor
    pattern: object
    rho: ProbabilityMap
    kind: str | None
    engine: str
    scale: float
    valid: Tensor | None  # (batch, n_r), True for real keys
    enable_gqa: bool
    needs: tuple[bool, bool, bool]
    max_kv: int | None
    support: bool
    digest: str
    fields: dict
    group: object = None
    rank: int = 0
    plan: Plan | None = None
    setup: _Setup | None = None

    @classmethod
    def check(cls, q, k, v, pattern, prob_map, engine, scale, key_padding_mask, enable_gqa,
              boundaries, block, max_kv_bytes) -> _Call:  # fmt: skip
        """This rank's inputs checked as :func:`sparseattn.sparse_attention` checks them
        (q, k and v are always checked for NaN and inf on CPU: a value another rank reads
        must fail here, on every rank, and not in that rank's engine)."""
        enable_gqa = check_bool("enable_gqa", enable_gqa)
        _check_qkv(q, k, v, enable_gqa)
        if q.shape[-2] != k.shape[-2]:
            raise ValueError(
                f"q and k must hold the same positions of the sequence (self-attention), got "
                f"{q.shape[-2]} queries and {k.shape[-2]} keys on this rank"
            )
        if isinstance(pattern, PatternCycle):
            raise TypeError("a cycle of patterns is per layer: pass cycle[layer]")
        if not isinstance(pattern, (Pattern, AttentionGraph)):
            raise TypeError(
                f"pattern must be a Pattern or an AttentionGraph, got {type(pattern).__name__}"
            )
        if getattr(pattern, "data_dependent", False):
            raise ValueError(
                f"pattern {pattern!r} is data-dependent: its keys depend on q·k over every "
                "key, so no plan can say which keys a shard needs; context parallelism takes "
                "static patterns and AttentionGraphs"
            )
        rho = resolve_prob_map(prob_map)
        if rho.alpha is not None and rho.alpha.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                "a learnable α tensor (requires_grad) is not supported under context "
                "parallelism: its gradient would not reach it; pass alpha.detach() or a number"
            )
        check_choice("engine", engine, ["auto", *ENGINES])
        if scale is None:
            scale = 1.0 / math.sqrt(q.shape[-1])
        scale = check_finite_float("scale", scale)
        if boundaries is not None:
            boundaries = check_boundaries(boundaries)
        block = check_positive("block", block)
        if max_kv_bytes is not None:
            max_kv_bytes = check_positive("max_kv_bytes", max_kv_bytes)
        valid = None
        if key_padding_mask is not None:
            expected = (q.shape[0], k.shape[-2])
            ok = isinstance(key_padding_mask, Tensor) and key_padding_mask.dtype == torch.bool
            if not ok or tuple(key_padding_mask.shape) != expected:
                raise ValueError(
                    f"key_padding_mask must be a bool tensor of shape {expected} (this rank's "
                    "keys; True = ignore that key)"
                )
            valid = ~key_padding_mask.to(q.device)
        train = torch.is_grad_enabled()
        needs = tuple(bool(train and t.requires_grad) for t in (q, k, v))
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.device.type == "cpu" and not all_finite(t):
                raise ValueError(f"{name} contains NaN or inf")
        inner = rho.rho if isinstance(rho, _Support) else rho
        map_text = f"{rho.name}/{inner.name}{sorted(inner.params.items())}"
        map_text += comm.describe(inner.alpha)
        digest = comm.describe(pattern)
        shapes = (q.shape[-2], q.shape[0], q.shape[1], k.shape[1], q.shape[-1], v.shape[-1])
        fields = dict(zip(_FIELDS[1:7], shapes, strict=True))
        fields |= {
            "dtype": comm.digest(str(q.dtype)),
            "pattern": comm.digest(digest),
            "map": comm.digest(map_text),
            "scale": comm.float_bits(scale),
            "engine": comm.digest(engine),
            "enable_gqa": int(enable_gqa),
            "key_padding": int(valid is not None),
            "grad": needs[0] + 2 * needs[1] + 4 * needs[2],
            "boundaries": comm.digest(repr(boundaries)),
            "block": block,
            "max_kv": -1 if max_kv_bytes is None else max_kv_bytes,
        }
        support = isinstance(rho, _Support)
        return cls(q, k, v, pattern, rho, map_kind(rho), engine, scale, valid, enable_gqa,
                   needs, max_kv_bytes, support, digest, fields)  # fmt: skip

    def check_plan(self) -> None:
        """Refusals that follow from the plan (the same on every rank)."""
        p = self.plan
        if len(p.global_rows) and self.kind is None:
            raise ValueError(
                f"prob_map {self.rho!r} cannot merge global rows across ranks (the pattern "
                f"has {len(p.global_rows)} rows that read keys on other ranks): use a fixed "
                "α or softmax, sparsemax, hardmax"
            )
        if self.max_kv is not None:
            q, k, v = self.q, self.k, self.v
            shape = {"batch": q.shape[0], "heads": q.shape[1], "kv_heads": k.shape[1]}
            shape |= {"d": q.shape[-1], "d_v": v.shape[-1], "dtype": q.dtype}
            kv = max(p.traffic(r, **shape)["kv"] for r in range(p.world_size))
            if kv > self.max_kv:
                raise ValueError(
                    f"the plan holds up to {kv} bytes of keys and values on one rank, more "
                    f"than max_kv_bytes={self.max_kv}"
                )


def _fingerprint(call: _Call | None, error: Exception | None, device) -> Tensor:
    values = [1 if error is not None else 0]
    values += [-1] * (len(_FIELDS) - 1) if call is None else [call.fields[f] for f in _FIELDS[1:]]
    return torch.tensor(values, dtype=torch.int64, device=device)


def _agree(
    table: Tensor, rank: int, error: Exception | None, boundaries: Sequence[int] | None
) -> tuple[int, ...]:
    """Raise on every rank unless all ranks passed their checks and agree; the boundaries."""
    table = table.cpu()
    bad = table[:, 0].nonzero().flatten().tolist()
    if error is not None:
        raise type(error)(f"{error} (rank {rank}; every rank of the group stops)") from error
    if bad:
        raise ValueError(
            f"rank(s) {bad} of the group refused their inputs (see the error there); every "
            "rank stops before any data moves"
        )
    for i, name in enumerate(_FIELDS):
        if name == "n_local":
            continue
        column = table[:, i]
        if not bool((column == column[0]).all()):
            what = {"pattern": "the pattern", "map": "the prob_map", "dtype": "the dtype"}
            hashed = ("pattern", "map", "dtype", "boundaries", "engine")
            shown = "" if name in hashed else f": {column.tolist()}"
            raise ValueError(
                f"the ranks of the group disagree on {what.get(name, name)} (one value per "
                f"rank{shown}); every rank must call with the same arguments"
            )
    sizes = table[:, 1].tolist()
    n = sum(sizes)
    bounds = even_boundaries(n, len(sizes)) if boundaries is None else tuple(boundaries)
    expected = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    if len(expected) != len(sizes) or expected != sizes or bounds[-1] != n:
        raise ValueError(
            f"mismatched shard lengths: the ranks hold {sizes} positions (N = {n}), but the "
            f"{'given' if boundaries is not None else 'near-equal'} sharding of N over "
            f"{len(sizes)} ranks has {expected}"
        )
    return bounds


# ------------------------------------------------------------------ plans and set-ups
_PLANS: OrderedDict = OrderedDict()
_SETUPS: OrderedDict = OrderedDict()


def _lru(cache: OrderedDict, key, make):
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    value = cache[key] = make()
    while len(cache) > CACHE_SIZE:
        cache.popitem(last=False)
    return value


def _cached_plan(pattern, bounds: tuple[int, ...], block: int, digest: str) -> Plan:
    return _lru(
        _PLANS, (digest, bounds, block),
        lambda: plan(pattern, bounds[-1], boundaries=bounds, block=block),
    )  # fmt: skip


@dataclasses.dataclass(eq=False)
class _Setup:
    """What one rank derives from a plan for a number of heads (cached)."""

    n_local: int
    n_before: int  # received keys that precede the own shard in global order
    n_ext: int
    send_idx: Tensor  # own keys to send, by destination rank
    send_rows: list[int]
    recv_rows: list[int]
    local_idx: Tensor | None  # the non-global rows (local indices); None: every row
    graph: AttentionGraph | Pattern | None  # the local rows on the extended keys
    global_slots: Tensor  # which of the global rows this rank owns …
    global_local: Tensor  # … at which local rows
    global_mask: Tensor | None  # (*batch_shape, g, n_r): the global rows' keys on this shard
    empty_rows: int  # how many local rows read no key (an error, on every rank)


def _cached_setup(call: _Call) -> _Setup:
    p = call.plan
    key = (call.digest, p.boundaries, p.block, call.rank, call.q.shape[1])
    return _lru(_SETUPS, key, lambda: _make_setup(call.pattern, p, call.rank, call.q.shape[1]))


def _make_setup(pattern, p: Plan, rank: int, heads: int) -> _Setup:
    rp = p.ranks[rank]
    lo, hi, n = rp.start, rp.stop, p.n
    ext = rp.keys
    n_before = iv.total(iv.clip(ext, 0, lo))
    send_idx = np.concatenate([iv.as_index(x) - lo for x in rp.send])
    local_rows = iv.as_index(rp.local_rows)
    local_idx = None if len(local_rows) == rp.size else torch.from_numpy(local_rows - lo)
    graph: AttentionGraph | Pattern | None = None
    empty = 0
    if len(local_rows):
        if type(pattern) is Dense or (isinstance(pattern, Causal) and type(pattern.base) is Dense):
            graph = pattern  # every key (dense) or every key up to the shard (causal): no graph
        else:
            graph = _local_graph(pattern, n, rp.local_rows, ext, heads)
            empty = int((graph.degrees == 0).sum())
    g = p.global_rows
    mine = (g >= lo) & (g < hi)
    mask = _global_mask(pattern, n, g, lo, hi, heads) if len(g) else None
    return _Setup(
        rp.size, n_before, iv.total(ext), torch.from_numpy(send_idx),
        [iv.total(x) for x in rp.send], [iv.total(x) for x in rp.recv], local_idx, graph,
        torch.from_numpy(np.flatnonzero(mine)), torch.from_numpy(g[mine] - lo), mask, empty,
    )  # fmt: skip


def _runs_graph(pattern, n: int, runs: np.ndarray, heads: int) -> AttentionGraph:
    """The pattern's rows of the given row intervals, stacked in order."""
    graphs = [row_graph(pattern, n, int(a), int(b), heads) for a, b in runs]
    if len(graphs) == 1:
        return graphs[0]
    rows, cols, offset = [], [], 0
    m = sum(gr.n_q for gr in graphs)
    shape = graphs[0].batch_shape
    for gr in graphs:
        r = gr.row_indices()
        rows.append(r // gr.n_q * m + r % gr.n_q + offset)
        cols.append(gr.col)
        offset += gr.n_q
    return AttentionGraph.from_edges(torch.cat(rows), torch.cat(cols), m, n, shape)


def _local_graph(pattern, n: int, runs: np.ndarray, ext: np.ndarray, heads: int):
    """The non-global rows' graph with its keys renumbered onto the extended key tensor."""
    graph = _runs_graph(pattern, n, runs, heads)
    col = torch.from_numpy(iv.locate(ext, graph.col.numpy()))
    return AttentionGraph(graph.crow, col, graph.n_q, iv.total(ext), graph.batch_shape)


def _global_mask(pattern, n: int, g: np.ndarray, lo: int, hi: int, heads: int) -> Tensor:
    """(*batch_shape, g, n_r) bool: which of this shard's keys each global row reads."""
    graph = _runs_graph(pattern, n, iv.from_points(g), heads)
    r = graph.row_indices()
    keep = (graph.col >= lo) & (graph.col < hi)
    mask = torch.zeros(graph.num_rows, hi - lo, dtype=torch.bool)
    mask[r[keep], graph.col[keep] - lo] = True
    return mask.view(*graph.batch_shape, len(g), hi - lo)


# ------------------------------------------------------------------ the autograd Function
class _ContextParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, call: _Call) -> Tensor:
        s, group = call.setup, call.group
        k_ext, v_ext, valid_ext = _halo(k, v, call.valid, s, group)
        out = q.new_empty(*q.shape[:3], v.shape[-1])
        merged = None
        if s.global_mask is not None:
            merged = _GlobalRows(q, k, v, call)
            out[:, :, s.global_local.to(q.device)] = merged.forward()
        local = None
        if s.graph is not None:
            local = _LocalRows(q, k_ext, v_ext, valid_ext, call)
            if local.local_idx is None:
                out = local.out.detach()
            else:
                out[:, :, local.local_idx] = local.out.detach()
        ctx.call, ctx.local, ctx.merged = call, local, merged
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        call, s = ctx.call, ctx.call.setup
        q, k, v = call.q, call.k, call.v
        dq = torch.zeros_like(q) if call.needs[0] else None
        d_ext = [None, None]
        if ctx.local is not None:
            idx = ctx.local.local_idx
            dq_loc, d_ext = ctx.local.backward(grad if idx is None else grad.index_select(2, idx))
            if dq is not None:
                dq = dq_loc  # q's shape: zero at the global rows
        dk = torch.zeros_like(k) if call.needs[1] else None
        dv = torch.zeros_like(v) if call.needs[2] else None
        if ctx.merged is not None:
            ctx.merged.backward(grad, dq, dk, dv)
        if call.needs[1] or call.needs[2]:
            _halo_back(d_ext, dk, dv, k, v, s, call.group)
        return dq, dk, dv, None


def _to_rows(t: Tensor, idx: Tensor) -> Tensor:
    """(B, H, n, x) at positions idx → (len(idx), B·H·x)."""
    sel = t.index_select(2, idx)
    return sel.permute(2, 0, 1, 3).reshape(idx.numel(), t.shape[0] * t.shape[1] * t.shape[3])


def _from_rows(rows: Tensor, bsz: int, heads: int) -> Tensor:
    """(m, B·H·x) → (B, H, m, x)."""
    width = rows.shape[1] // (bsz * heads)
    return rows.reshape(rows.shape[0], bsz, heads, width).permute(1, 2, 0, 3)


def _halo(k: Tensor, v: Tensor, valid: Tensor | None, s: _Setup, group):
    """The extended keys, values and validity: [received from lower ranks, own, received from
    higher ranks], in global order, as new tensors (no autograd history)."""
    bsz, kvh, _, d = k.shape
    idx = s.send_idx.to(k.device)
    parts = [_to_rows(k, idx), _to_rows(v, idx)]
    if valid is not None:
        parts.append(valid.index_select(1, idx).t().to(k.dtype))
    recv = comm.all_to_all(torch.cat(parts, 1), s.send_rows, s.recv_rows, group, "halo")
    kd, vd = bsz * kvh * d, bsz * kvh * v.shape[-1]
    kr = _from_rows(recv[:, :kd], bsz, kvh)
    vr = _from_rows(recv[:, kd : kd + vd], bsz, kvh)
    b = s.n_before

    def extend(own: Tensor, got: Tensor, dim: int) -> Tensor:
        got_lo, got_hi = got.narrow(dim, 0, b), got.narrow(dim, b, got.shape[dim] - b)
        return torch.cat([got_lo, own.detach(), got_hi], dim)

    valid_ext = None
    if valid is not None:
        valid_ext = extend(valid, recv[:, kd + vd :].t() != 0, 1)
    return extend(k, kr, 2), extend(v, vr, 2), valid_ext


def _halo_back(d_ext, dk: Tensor | None, dv: Tensor | None, k, v, s: _Setup, group) -> None:
    """Send the gradients of received keys and values back to their owners; add what comes
    back for the own keys into dk, dv (a key sent to several ranks sums their gradients)."""
    bsz, kvh, _, d = k.shape
    b, n = s.n_before, s.n_local
    got = torch.cat([torch.arange(b), torch.arange(b + n, s.n_ext)]).to(k.device)
    parts = []
    for grad, own, t in ((d_ext[0], dk, k), (d_ext[1], dv, v)):
        if grad is None:
            grad = t.new_zeros(bsz, kvh, s.n_ext, t.shape[-1])
        if own is not None:
            own += grad.narrow(2, b, n)
        parts.append(_to_rows(grad, got))
    back = comm.all_to_all(torch.cat(parts, 1), s.recv_rows, s.send_rows, group, "halo_grad")
    idx = s.send_idx.to(k.device)
    kd = bsz * kvh * d
    if dk is not None:
        dk.index_add_(2, idx, _from_rows(back[:, :kd], bsz, kvh).to(dk.dtype))
    if dv is not None:
        dv.index_add_(2, idx, _from_rows(back[:, kd:], bsz, kvh).to(dv.dtype))


class _LocalRows:
    """The non-global rows: the engines on the extended keys, with autograd kept locally."""

    def __init__(self, q: Tensor, k_ext: Tensor, v_ext: Tensor, valid_ext, call: _Call):
        s = call.setup
        train = any(call.needs)
        self.leaves = (
            q.detach().requires_grad_(call.needs[0]),
            k_ext.requires_grad_(call.needs[1]),
            v_ext.requires_grad_(call.needs[2]),
        )
        qq, kk, vv = self.leaves
        self.local_idx = None if s.local_idx is None else s.local_idx.to(q.device)
        with torch.enable_grad() if train else contextlib.nullcontext():
            q_sel = qq if self.local_idx is None else qq.index_select(2, self.local_idx)
            self.out = _attend_items(q_sel, kk, vv, valid_ext, call)

    def backward(self, grad: Tensor):
        wanted = [t for t in self.leaves if t.requires_grad]
        if not wanted or not self.out.requires_grad:
            return None, [None, None]
        grads = iter(torch.autograd.grad(self.out, wanted, grad, allow_unused=True))
        dq, dk, dv = (next(grads) if t.requires_grad else None for t in self.leaves)
        if self.leaves[0].requires_grad and dq is None:
            dq = torch.zeros_like(self.leaves[0])
        return dq, [dk, dv]


def _attend_items(q: Tensor, k: Tensor, v: Tensor, valid: Tensor | None, call: _Call) -> Tensor:
    """sparseattn.sparse_attention on the extended keys; batch items whose extended keys are
    all padding (their rows read no real key: zero rows, as on one process) are left out of
    the call, which refuses them."""
    s = call.setup
    kwargs = {"prob_map": call.rho, "engine": call.engine, "scale": call.scale}
    kwargs["enable_gqa"] = call.enable_gqa
    if valid is None:
        return _single(q, k, v, s.graph, **kwargs)
    has = valid.any(-1)
    if bool(has.all()):
        return _single(q, k, v, s.graph, key_padding_mask=~valid, **kwargs)
    out = q.new_zeros(*q.shape[:3], v.shape[-1]) + (q.sum() + k.sum() + v.sum()) * 0
    if bool(has.any()):
        items = has.nonzero().flatten()
        part = _single(
            q[items], k[items], v[items], s.graph, key_padding_mask=~valid[items], **kwargs
        )
        out = out.index_put((items,), part)
    return out


# ------------------------------------------------------------------ global rows
class _GlobalRows:
    """The global rows, merged across ranks (module docstring, step 3). Products run in the
    inputs' dtype (float32 for half precision), the merge — maxima, sums, thresholds,
    weights — and its all-reduces in float64. Query heads that share a key/value head are
    stacked along the rows (no copy of k and v, as ``attention.group_queries``)."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, call: _Call):
        self.call = call
        s = call.setup
        bsz, heads, _, d = q.shape
        g = s.global_mask.shape[-2]
        self.shape = (bsz, heads, g)
        self.ct = q.dtype if q.dtype in (torch.float32, torch.float64) else torch.float32
        qg = torch.zeros(bsz, heads, g, d, dtype=torch.float64, device=q.device)
        qg[:, :, s.global_slots] = q[:, :, s.global_local].detach().double()
        self.qg = comm.all_reduce(qg, call.group, "global_forward").to(self.ct)
        self.kl = k.detach().to(self.ct)
        self.vl = v.detach().to(self.ct)
        valid = s.global_mask.to(q.device)
        if call.valid is not None:
            valid = valid & call.valid[:, None, None, :]
        self.valid = valid.expand(bsz, heads, g, s.n_local)

    def _grouped(self, t: Tensor) -> Tensor:
        """(B, H, g, x) → (B, kv_heads, H/kv_heads·g, x) in the product dtype."""
        kv_heads = self.kl.shape[1]
        rows = t.shape[1] // kv_heads * t.shape[2]
        return t.to(self.ct).reshape(t.shape[0], kv_heads, rows, t.shape[-1])

    def _rows(self, t: Tensor) -> Tensor:
        """(B, kv_heads, H/kv_heads·g, x) → (B, H, g, x) in float64."""
        return t.double().reshape(*self.shape, t.shape[-1])

    def _sum(self, t: Tensor, kind: str = "global_forward") -> Tensor:
        return comm.all_reduce(t, self.call.group, kind)

    def forward(self) -> Tensor:
        call = self.call
        z = self._rows(self._grouped(self.qg) @ self.kl.transpose(-1, -2)) * call.scale
        zm = z.masked_fill(~self.valid, -math.inf)
        m = zm.amax(-1) if zm.shape[-1] else zm.new_full(zm.shape[:-1], -math.inf)
        m = comm.all_reduce(m, call.group, "global_forward", dist.ReduceOp.MAX)
        m = torch.where(torch.isfinite(m), m, 0.0)[..., None]
        kind = call.kind
        rho = call.rho.rho if call.support else call.rho  # the map whose support is asked
        self.factor = 1.0
        if kind == "softmax":  # log-sum-exp: e^(z − m) with m the max over every rank
            e = torch.where(self.valid, (z - m).exp(), 0.0)
            den = self._sum(e.sum(-1, keepdim=True))
            p = e / torch.where(den > 0, den, 1.0)
        elif kind == "hardmax":
            top = (self.valid & (z == m)).double()
            p = top / self._sum(top.sum(-1, keepdim=True)).clamp_min(1.0)
        else:
            alpha = 2.0 if kind == "sparsemax" else rho.params["alpha"]
            if rho.name == "sparselin_gen":  # sparsemax(z / (1 − λ)), Yun B.2
                self.factor = 1.0 / (1.0 - rho.params["lam"])
            self.alpha = alpha
            scale = self.factor if kind == "sparsemax" else alpha - 1.0
            x = torch.where(self.valid, (z - m) * scale, -math.inf)
            rows = x.shape[0] * x.shape[1] * x.shape[2]
            p = self._threshold(x.reshape(rows, x.shape[-1]), kind, alpha).view(x.shape)
        if call.support:  # the support indicator of the map (forward only)
            p = (p > 0).double()
        self.p = p
        self.o = self._sum(self._rows(self._grouped(p) @ self.vl))
        return self.o[:, :, call.setup.global_slots].to(call.q.dtype)

    def _threshold(self, x: Tensor, kind: str, alpha: float) -> Tensor:
        """p (R, K) of rows x (R, K) whose max over all ranks is 0 (−inf: not a key)."""
        rows = x.shape[0]
        t = x.new_full((rows, 1), -1.0)
        tau = t.clone()
        active = torch.ones(rows, dtype=torch.bool, device=x.device)
        group = self.call.group

        def step_sum(parts: list[Tensor]) -> Tensor:
            comm._add("steps", 1)
            return comm.all_reduce(torch.cat(parts, 1), group, "global_step")

        if kind == "sparsemax":  # Michelot: τ ← (Σ_S x − 1)/|S|, S = {x > τ}, until S is stable
            k_old = None
            for _ in range(MAX_STEPS):
                dd = (x - t).clamp_min(0.0)
                stats = step_sum(
                    [dd.sum(-1, keepdim=True), (dd > 0).double().sum(-1, keepdim=True)]
                )
                k = stats[:, 1:]
                if k_old is not None:
                    done = active & (k == k_old).squeeze(1)
                    tau[done] = t[done]
                    active &= ~done
                if not comm.any_left(active, group):
                    break
                t = torch.where(
                    active[:, None] & (k > 0), t + (stats[:, :1] - 1) / k.clamp_min(1), t
                )
                k_old = k
            tau[active] = t[active]
            return (x - tau).clamp_min(0.0)
        if kind == "entmax15":  # Newton on ‖[x − τ]₊‖₂ − 1, finished by the closed form on S
            for _ in range(MAX_STEPS):
                dd = (x - t).clamp_min(0.0)
                sums = [dd.sum(-1, keepdim=True), dd.square().sum(-1, keepdim=True)]
                stats = step_sum([*sums, (dd > 0).double().sum(-1, keepdim=True)])
                total, sq, k = stats[:, :1], stats[:, 1:2], stats[:, 2:]
                kc = k.clamp_min(1.0)
                mean = total / kc
                var = sq / kc - mean.square()
                exact = t + mean - ((1 - kc * var) / kc).clamp_min(0.0).sqrt()
                check = self._sum((x > exact).double().sum(-1, keepdim=True), "global_step")
                done = active & (check == k).squeeze(1)
                tau[done] = exact[done]
                active &= ~done
                if not comm.any_left(active, group):
                    break
                norm = sq.sqrt()
                newton = t + norm * (norm - 1) / total.clamp_min(torch.finfo(x.dtype).tiny)
                t = torch.where(active[:, None], newton, t)
            tau[active] = t[active]
            return (x - tau).clamp_min(0.0).square()
        # any other α: safeguarded Newton to float precision, then Σp = 1 (as one process)
        r = 1.0 / (alpha - 1.0)
        eps, tiny = torch.finfo(x.dtype).eps, torch.finfo(x.dtype).tiny
        count = self._sum(torch.isfinite(x).double().sum(-1, keepdim=True)).clamp_min(1.0)
        lo, hi = t.clone(), -count.pow(1.0 - alpha)
        for _ in range(MAX_STEPS):
            dd = (x - t).clamp_min(0.0)
            below = torch.where(dd > 0, dd.pow(r - 1.0), 0.0)  # d^(r−1) on the support
            stats = step_sum([dd.pow(r).sum(-1, keepdim=True), below.sum(-1, keepdim=True)])
            total, slope = stats[:, :1], stats[:, 1:] * r
            f = total - 1
            lo = torch.where(f >= 0, t, lo)
            hi = torch.where(f <= 0, t, hi)
            move = r * (total - total.pow(1.0 - 1.0 / r)) if r > 1 else f
            newton = t + move / slope.clamp_min(tiny)
            new = torch.where((newton >= lo) & (newton <= hi), newton, (lo + hi) / 2)
            done = active & (((new - t).abs() <= 4 * eps) | (hi - lo <= 4 * eps)).squeeze(1)
            tau[done] = new[done]
            active &= ~done
            t = torch.where(active[:, None], new, t)
            if not comm.any_left(active, group):
                break
        tau[active] = t[active]
        p = (x - tau).clamp_min(0.0).pow(r)
        total = self._sum(p.sum(-1, keepdim=True))
        return p / torch.where(total > 0, total, 1.0)

    def backward(self, grad: Tensor, dq: Tensor | None, dk: Tensor | None, dv: Tensor | None):
        call, s = self.call, self.call.setup
        do = torch.zeros(*self.shape, self.o.shape[-1], dtype=torch.float64, device=grad.device)
        do[:, :, s.global_slots] = grad[:, :, s.global_local].double()
        do = self._sum(do, "global_backward")
        dp = self._rows(self._grouped(do) @ self.vl.transpose(-1, -2))
        p = self.p
        if call.kind == "softmax" and not call.support:
            ds = p * (dp - (do * self.o).sum(-1, keepdim=True))
        elif call.kind == "hardmax" or call.support:
            ds = torch.zeros_like(p)
        else:
            if self.alpha == 2.0:
                sp = (p > 0).double()
            else:
                sp = torch.where(p > 0, p.pow(2.0 - self.alpha), 0.0)
            stats = self._sum(
                torch.cat([(sp * dp).sum(-1, keepdim=True), sp.sum(-1, keepdim=True)], -1),
                "global_backward",
            )
            ratio = stats[..., :1] / torch.where(stats[..., 1:] > 0, stats[..., 1:], 1.0)
            ds = (sp * dp - sp * ratio) * self.factor
        ds = self._grouped(ds * call.scale)
        dqg = self._sum(self._rows(ds @ self.kl), "global_backward")
        if dq is not None:
            dq[:, :, s.global_local] += dqg[:, :, s.global_slots].to(dq.dtype)
        if dk is not None:  # the stacked rows sum over the query heads of a key/value head
            dk += (ds.transpose(-1, -2) @ self._grouped(self.qg)).to(dk.dtype)
        if dv is not None:
            dv += (self._grouped(p).transpose(-1, -2) @ self._grouped(do)).to(dv.dtype)
