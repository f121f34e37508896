"""Sparse attention on a sequence sharded over a process group (context parallelism).

Rank r holds the queries, keys and values of its shard (:mod:`.plan`). One call runs:

1. **fingerprint** — every rank all-gathers a few int64s (shard length, shapes, dtype, a
   digest of the pattern, map, scale, engine, boundaries, which inputs need gradients, and
   whether its own inputs passed the checks); any disagreement raises the same ValueError on
   every rank before any data moves;
2. **halo exchange** — one ``all_to_all_single``: each rank sends exactly the keys and values
   (and key padding) the plan says the other ranks' rows read;
3. **global rows** (:mod:`.global_rows`) — every rank scores the global queries against its
   own keys; the partial results merge by all-reduces (log-sum-exp for softmax, the
   threshold τ of the sparse maps found with the row sums all-reduced at every step), so
   every rank holds the whole row's weights;
4. **local rows** — :func:`sparseattn.sparse_attention` on the shard's other rows against
   [received keys + own keys] in global order, with the rows' graph remapped onto that key
   order: every engine runs as it is, chosen by the same ``auto`` table.

The backward (one ``autograd.Function``) runs the local rows' backward, the global rows'
closed forms, then sends the gradients of received keys back to their owners, which sum them.
With one rank nothing is communicated: the call is :func:`sparseattn.sparse_attention`. What
a rank derives from the plan (the halo's lists, the local rows' graph, the global rows' mask)
is built once and kept (:mod:`.setup`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..attention import _check_qkv
from ..attention import sparse_attention as _single
from ..engines import ENGINES
from ..graph import AttentionGraph
from ..maps import ProbabilityMap, _Support, resolve_prob_map
from ..patterns.base import Pattern
from ..patterns.compose import PatternCycle
from ..validate import all_finite, check_bool, check_choice, check_finite_float, check_positive
from . import comm
from .global_rows import GlobalRows
from .plan import Plan, check_boundaries, even_boundaries
from .setup import Setup, cached_plan, cached_setup

__all__ = ["map_kind", "sparse_attention"]


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
    call.plan = cached_plan(pattern, bounds, block, call.digest)
    call.setup = cached_setup(pattern, call.plan, call.rank, q.shape[1], call.digest)
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
    setup: Setup | None = None

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


# ------------------------------------------------------------------ the autograd Function
class _ContextParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, call: _Call) -> Tensor:
        s, group = call.setup, call.group
        k_ext, v_ext, valid_ext = _halo(k, v, call.valid, s, group)
        out = q.new_empty(*q.shape[:3], v.shape[-1])
        merged = None
        if s.global_mask is not None:
            merged = GlobalRows(q, k, v, call)
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


def _halo(k: Tensor, v: Tensor, valid: Tensor | None, s: Setup, group):
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


def _halo_back(d_ext, dk: Tensor | None, dv: Tensor | None, k, v, s: Setup, group) -> None:
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
