"""Triton engine for α-entmax and sparsemax attention on a pattern's block layout (issue 26).

Yun et al. eq. (3) with ρ = α-entmax, p = [(α − 1)s − τ]₊^{1/(α−1)} (Peters et al. 2019; α = 2
is sparsemax), by fused Triton kernels (:mod:`sparseattn.engines._entmax_kernels`) that visit
only the (query block, key block) pairs of the graph's block layout; memory O(n·d + pairs),
forward and backward (docs/engines.md, "Triton α-entmax kernels").

Entry points: :func:`triton_entmax_attention` (the engines' signature), :func:`entmax_attention`
(on a :class:`BlockLayout`, :mod:`._entmax_layout`) and :func:`triton_entmax_unsupported`
(:mod:`._entmax_args`: what the kernels take). Triton is imported on first use only; the
kernels run on CUDA, or on CPU under Triton's interpreter (``TRITON_INTERPRET=1``).

The knobs are a frozen :class:`TritonOptions`, passed per call or set for a ``with`` block
by :func:`tuning` (a context variable: per thread and asyncio task); a call keeps its options
for its backward. The entries are looked up here at call time. One piece: the launches,
the autograd function and the entries share the options and the module state tests patch.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib
import math
import os
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from ..graph import AttentionGraph
from ..maps import ProbabilityMap
from ._entmax_args import (
    KernelMod,
    _alpha_of,
    _mod_args,
    _mod_grad_code,
    _mode,
    _pow2,
    _request_reason,
    _sizes,
    kernel_mod,
    triton_map_reason,
    triton_mod_reason,
)
from ._entmax_layout import (
    BLOCKS,
    BlockLayout,
    SplitPlan,
    _full_layout,
    _graph_index,
    _rows,
    causal_layout,
    dense_layout,
    graph_layout,
    pack_rows,
    split_plan,
)

__all__ = [
    "BLOCKS",
    "DEFAULT_OPTIONS",
    "BlockLayout",
    "KernelMod",
    "TritonOptions",
    "causal_layout",
    "current_options",
    "dense_layout",
    "entmax_attention",
    "full_rows_entmax",
    "graph_layout",
    "kernel_mod",
    "pack_rows",
    "split_plan",
    "triton_entmax_attention",
    "triton_entmax_unsupported",
    "triton_map_reason",
    "triton_mod_reason",
    "tuning",
]

#: Most threshold passes per query block (rows stop earlier when converged).
MAX_IT = 40
#: Threshold passes of a split query block (a row still open after them is renormalised).
SPLIT_PASSES = 8


@dataclasses.dataclass(frozen=True)
class TritonOptions:
    """The kernels' knobs (docs/engines.md, "Triton α-entmax kernels"), per call (``options=``)
    or for a ``with`` block (:func:`tuning`): ``block`` the tile on a GPU when a call names
    none, ``warps`` one value or {block: warps}, ``stages`` (forward, backward) or one value
    for both (None: Triton's), ``topk`` the per-tile maxima that start the threshold search,
    ``skip_tiles``, ``split_long`` (None: no split), ``longest_first``."""

    block: int = 64
    warps: int | tuple[tuple[int, int], ...] = ((16, 4), (32, 4), (64, 4), (128, 8))
    stages: int | None | tuple[int | None, int | None] = (2, None)
    topk: int = 8
    skip_tiles: bool = True
    split_long: float | None = None
    longest_first: bool = False

    def __post_init__(self) -> None:
        if hasattr(self.warps, "items"):  # frozen and hashable: the table as pairs
            object.__setattr__(self, "warps", tuple(sorted(self.warps.items())))
        if not isinstance(self.stages, tuple):
            object.__setattr__(self, "stages", (self.stages, self.stages))
        if self.block not in BLOCKS:
            raise ValueError(f"block must be one of {BLOCKS}, got {self.block!r}")
        if self.topk not in (1, 2, 4, 8, 16, 32, 64):  # tl.arange needs a power of two
            raise ValueError(f"topk must be a power of two up to 64, got {self.topk!r}")
        if self.split_long is not None and not self.split_long > 1:
            raise ValueError(f"split_long must be None or > 1, got {self.split_long!r}")

    def num_warps(self, block: int) -> int:
        """The warps per program at ``block``."""
        return self.warps if isinstance(self.warps, int) else dict(self.warps)[block]


DEFAULT_OPTIONS = TritonOptions()
#: The options of the calls without ``options=``: :func:`tuning`'s, per thread and task.
_OPTIONS = contextvars.ContextVar("sparseattn_triton_options", default=DEFAULT_OPTIONS)


@contextlib.contextmanager
def tuning(**knobs: Any) -> Iterator[TritonOptions]:
    """The calls without ``options=`` in the ``with`` block, in this thread or asyncio task
    only, use the current options with ``knobs`` (:class:`TritonOptions`' fields) replaced;
    yields those options."""
    token = _OPTIONS.set(dataclasses.replace(_OPTIONS.get(), **knobs))
    try:
        yield _OPTIONS.get()
    finally:
        _OPTIONS.reset(token)


def current_options() -> TritonOptions:
    """The options of a call without ``options=`` here: the innermost :func:`tuning`'s."""
    return _OPTIONS.get()


_KERNELS: ModuleType | None = None


def _kernels() -> ModuleType:
    """The kernel module, imported on first use (raises ImportError without triton)."""
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = importlib.import_module("._entmax_kernels", __package__)
    return _KERNELS


def _split_kernels() -> ModuleType:
    """The split query blocks' kernels (:mod:`._entmax_split`), imported on first use."""
    _kernels()
    return importlib.import_module("._entmax_split", __package__)


def _interpreted() -> bool:
    """Whether the kernels run under Triton's interpreter: TRITON_INTERPRET=1 must have been
    set before triton was imported (its own library functions are built at import)."""
    import triton.language as tl

    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    interpreted = type(_kernels()._forward).__name__ == "InterpretedFunction"
    return interpreted and type(tl.zeros).__name__ != "JITFunction"


# ---------------------------------------------------------------------------- requests
def triton_entmax_unsupported(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    prob_map: ProbabilityMap | None,
    dropout_p: float = 0.0,
    graph: AttentionGraph | None = None,
    score_mod: Any = None,
) -> str | None:
    """None if :func:`triton_entmax_attention` can compute this request (with ``score_mod``,
    a score modifier, when given), else why not."""
    why = _request_reason(q, k, v, prob_map, dropout_p, graph, score_mod)
    if why is not None:
        return why
    try:
        _kernels()
    except ImportError:
        return "triton is not installed (pip install triton)"
    if q.device.type != "cuda" and not (q.device.type == "cpu" and _interpreted()):
        return (
            f"the Triton kernels run on CUDA tensors, not {q.device.type} (on CPU only under "
            "Triton's interpreter: TRITON_INTERPRET=1 set before triton is imported)"
        )
    return None


# ---------------------------------------------------------------------------- launches
def _grid(layout: BlockLayout, programs: int, longest_first: bool) -> tuple[int, int]:
    """The main kernels' grid: (nbq, B·H), or (B·H, nbq) longest first (``_query_block``)."""
    return (programs, layout.nbq) if longest_first else (layout.nbq, programs)


@functools.lru_cache(maxsize=8)
def _multiprocessors(device: torch.device) -> int:
    """The device's multiprocessors (SMs); 1 on CPU, where the interpreter runs programs one
    after another."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def _split_factor(alpha: float, options: TritonOptions) -> float | None:
    """``split_long`` for 1.5-entmax and sparsemax; None (no split) for other α, whose search
    may take up to MAX_IT passes (bisection for α > 2), a launch pair each."""
    return None if _mode(alpha) == 0 else options.split_long


def _launch_split(
    plan: SplitPlan, q: Tensor, k: Tensor, v: Tensor, layout: BlockLayout, gidx: Tensor,
    key_ok: Tensor, consts: dict, outs: tuple[Tensor, ...], alpha: float, scale: float,
    need_grad: bool, mod_args: tuple, options: TritonOptions,
) -> None:  # fmt: skip
    """The split query blocks: pass 0 per chunk, merged; :data:`SPLIT_PASSES` threshold
    passes, each per chunk then merged; the last pass per chunk, merged into ``outs`` (out,
    τ, Σ g V / Σ g, the non-zero flags, tile maxima, passes: what the main kernel writes)."""
    kern = _split_kernels()
    out, tau, gv, nz, tmax, passes = outs
    bh, dev = q.shape[0] * q.shape[1], q.device
    block, dvp = layout.block, _pow2(v.shape[-1])
    chunks, longs = plan.ch_rb.numel(), plan.long_rb.numel()
    part = torch.empty(bh, chunks, 4, block, dtype=torch.float32, device=dev)
    top = torch.empty(bh, chunks, options.topk, block, dtype=torch.float32, device=dev)
    state = torch.empty(6, bh, q.shape[2], dtype=torch.float32, device=dev)
    acc = torch.empty(bh, chunks, block, dvp, dtype=torch.float32, device=dev)
    g_acc = torch.empty_like(acc) if need_grad else acc
    sizes = (*_sizes(q, k), layout.nbq, tmax.shape[1])
    mul, am1, r = scale * (alpha - 1.0), alpha - 1.0, 1.0 / (alpha - 1.0)
    d, dv, bd, mode = consts["D"], consts["DV"], consts["BD"], consts["MODE"]
    keys = ("HAS_KEY_OK", "PARTIAL", "PREC", "UPCAST", "MOD", "num_warps")
    scored = {key: consts[key] for key in keys}
    on_chunks = (plan.ch_rb, plan.ch_start, plan.ch_end, layout.pair_kb, layout.pair_mask)
    on_chunks += (layout.masks, gidx, key_ok)
    merged = (plan.long_rb, plan.long_c0, plan.long_c1, gidx)
    kern._split_pass0[(chunks, bh)](
        q, k, v, tmax, part, top, *on_chunks, *sizes, chunks, mul, *mod_args,
        D=d, DV=dv, BD=bd, BLOCK=block, MODE=mode, TOPK=options.topk, **scored,
    )  # fmt: skip
    kern._split_init[(longs, bh)](
        state, part, top, passes, *merged, q.shape[2], bh, layout.nbq, chunks, am1, r,
        BLOCK=block, MODE=mode, TOPK=options.topk,
    )  # fmt: skip
    for _ in range(SPLIT_PASSES):
        kern._split_sums[(chunks, bh)](
            q, k, v, tmax, part, state, *on_chunks, *sizes, chunks, bh, mul, r, *mod_args,
            D=d, DV=dv, BD=bd, BLOCK=block, MODE=mode, SKIP=options.skip_tiles, **scored,
        )  # fmt: skip
        kern._split_update[(longs, bh)](
            state, part, passes, *merged, q.shape[2], bh, layout.nbq, chunks, am1, r,
            BLOCK=block, MODE=mode,
        )  # fmt: skip
    kern._split_last[(chunks, bh)](
        q, k, v, tmax, nz, part, acc, g_acc, state, *on_chunks, *sizes, chunks, bh, mul, r,
        *mod_args, D=d, DV=dv, BD=bd, BDV=dvp, BLOCK=block, MODE=mode, NEED_GRAD=need_grad,
        **scored,
    )  # fmt: skip
    kern._split_finish[(longs, bh)](
        out, tau, gv, state, part, acc, g_acc, *merged, q.shape[2], bh, layout.nbq, chunks,
        DV=dv, BDV=dvp, BLOCK=block, MODE=mode, NEED_GRAD=need_grad,
        num_warps=consts["num_warps"],
    )  # fmt: skip


def _launch_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: BlockLayout,
    gidx: Tensor,
    key_ok: Tensor | None,
    alpha: float,
    scale: float,
    need_grad: bool,
    mod: KernelMod | None = None,
    options: TritonOptions | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Run the forward kernel on contiguous q, k, v (score modifier ``mod``; ``options`` or the
    current ones). Returns out (B, H, n_q, d_v), τ + m per row (B, H, n_q) float32, Σ g v / Σ g
    (B, H, n_q, d_v) and the non-zero flags int8 (B·H, pairs) — the last two only with
    ``need_grad`` — and the threshold passes each program took, int32 (B·H, nbq)."""
    bsz, heads, n_q = q.shape[:3]
    dv, pairs, dev = v.shape[-1], max(1, layout.pairs), q.device
    opt = options or _OPTIONS.get()
    out = torch.empty(bsz, heads, n_q, dv, dtype=q.dtype, device=dev)
    tau = torch.empty(bsz, heads, n_q, dtype=torch.float32, device=dev)
    dummy = torch.zeros(1, dtype=torch.float32, device=dev)
    tmax = torch.empty(bsz * heads, pairs, dtype=torch.float32, device=dev)
    passes = torch.empty(bsz * heads, layout.nbq, dtype=torch.int32, device=dev)
    gv, nz = dummy, dummy
    if need_grad:  # Σ g v / Σ g per row, and whether each (pair, head) holds a non-zero
        gv = torch.empty(bsz, heads, n_q, dv, dtype=torch.float32, device=dev)
        nz = torch.empty(bsz * heads, pairs, dtype=torch.int8, device=dev)
    key_ok_t = dummy.to(torch.int8) if key_ok is None else key_ok
    plan, split = None, _split_factor(alpha, opt)
    if split is not None:
        plan = split_plan(layout, split, dev, bsz * heads, _multiprocessors(dev))
    consts = _constants(q, v, layout, alpha, key_ok is not None, 0, mod, opt)
    mod_args = _mod_args(mod, q, scale, alpha)
    row_end, order = _rows(layout, plan, opt.longest_first)
    _kernels()._forward[_grid(layout, bsz * heads, opt.longest_first)](
        q, k, v, out, tau, gv, nz, tmax, passes,
        layout.row_ptr, row_end, order, layout.pair_kb, layout.pair_mask, layout.masks, gidx,
        key_ok_t, *_sizes(q, k), layout.nbq, pairs,
        scale * (alpha - 1.0), alpha - 1.0, 1.0 / (alpha - 1.0), *mod_args,
        NEED_GRAD=need_grad, MAX_IT=MAX_IT, TOPK=opt.topk, SKIP=opt.skip_tiles,
        LONGEST_FIRST=opt.longest_first, **consts,
    )  # fmt: skip
    if plan is not None:  # after the main kernel, which left the split blocks empty
        outs = (out, tau, gv, nz, tmax, passes)
        _launch_split(plan, q, k, v, layout, gidx, key_ok_t, consts, outs, alpha, scale, need_grad,
                      mod_args, opt)  # fmt: skip
    return out, tau, gv, nz, passes


class _EntmaxAttention(torch.autograd.Function):
    """Fused α-entmax attention on a block layout; backward by the closed form (module doc)."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        bias: Tensor | None,
        slopes: Tensor | None,
        *launch: Any,
    ) -> Tensor:
        """``launch``: the arguments of :func:`_launch_forward` after q, k, v (layout, gidx,
        key_ok, alpha, scale, need_grad, mod, options: the backward's too); ``bias`` and
        ``slopes`` are the modifier's tensors (inputs here, for their gradients)."""
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, tau, gv, nz, _ = _launch_forward(q, k, v, *launch)
        layout, gidx, key_ok, alpha, scale, need_grad, mod, ctx.options = launch
        key_ok_t = torch.zeros(1, dtype=torch.int8, device=q.device) if key_ok is None else key_ok
        if need_grad:
            ctx.save_for_backward(q, k, v, tau, gv, nz, bias, slopes)
            ctx.mod = None if mod is None else (mod.code, mod.cap)
            ctx.layout, ctx.gidx, ctx.key_ok = layout, gidx, key_ok_t
            ctx.has_key_ok, ctx.alpha, ctx.scale = key_ok is not None, alpha, scale
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_out: Tensor):
        kern = _kernels()
        q, k, v, tau, gv, nz, bias, slopes = ctx.saved_tensors
        layout, alpha, scale, opt = ctx.layout, ctx.alpha, ctx.scale, ctx.options
        n_q, n_k, heads, hkv = sizes = _sizes(q, k)
        bsz = q.shape[0]
        do = grad_out.to(q.dtype).contiguous()
        delta = (do.float() * gv).sum(-1).contiguous()  # δ_i = Σ_j g dp / Σ_j g
        dq, dk, dvv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        mod = None if ctx.mod is None else KernelMod(ctx.mod[0], bias, slopes, ctx.mod[1])
        want_bias, want_slopes = ctx.needs_input_grad[3:5]
        d_bias = d_slopes = None
        if want_bias:
            d_bias = torch.zeros(bias.shape, dtype=torch.float32, device=q.device)
        if want_slopes:
            d_slopes = torch.zeros(slopes.shape, dtype=torch.float32, device=q.device)
        mod_args = _mod_args(mod, q, scale, alpha, (d_bias, d_slopes))
        mod_grad = _mod_grad_code(mod, (bsz, heads, n_q, n_k), want_bias, want_slopes)
        common = _constants(q, v, layout, alpha, ctx.has_key_ok, 1, mod, opt)
        mul, r = scale * (alpha - 1.0), 1.0 / (alpha - 1.0)
        plan, split = None, _split_factor(alpha, opt)
        if split is not None:
            plan = split_plan(layout, split, q.device, bsz * heads, _multiprocessors(q.device))
        row_end, order = _rows(layout, plan, opt.longest_first)
        kern._backward_dq[_grid(layout, bsz * heads, opt.longest_first)](
            q, k, v, do, dq, tau, delta, nz,
            layout.row_ptr, row_end, order, layout.pair_kb, layout.pair_mask, layout.masks,
            ctx.gidx, ctx.key_ok, *sizes, layout.nbq, nz.shape[1], mul, scale, r, *mod_args,
            LONGEST_FIRST=opt.longest_first, MOD_GRAD=mod_grad, **common,
        )  # fmt: skip
        if plan is not None:  # the split query blocks' dq: partial sums per chunk, added
            chunks, bd = plan.ch_rb.numel(), common["BD"]
            dqp = torch.empty(
                bsz * heads, chunks, layout.block, bd, dtype=torch.float32, device=q.device
            )
            split_kern = _split_kernels()
            split_kern._split_dq[(chunks, bsz * heads)](
                q, k, v, do, tau, delta, nz, dqp,
                plan.ch_rb, plan.ch_start, plan.ch_end, layout.pair_kb, layout.pair_mask,
                layout.masks, ctx.gidx, ctx.key_ok,
                *sizes, layout.nbq, nz.shape[1], chunks, mul, r, *mod_args,
                MOD_GRAD=mod_grad, **common,
            )  # fmt: skip
            split_kern._split_dq_finish[(plan.long_rb.numel(), bsz * heads)](
                dq, dqp, plan.long_rb, plan.long_c0, plan.long_c1, ctx.gidx,
                n_q, layout.nbq, chunks, scale, D=common["D"], BD=bd, BLOCK=layout.block,
            )  # fmt: skip
        kern._backward_dkdv[(layout.nbk, bsz * hkv)](
            q, k, v, do, dk, dvv, tau, delta, nz,
            layout.col_ptr, layout.col_pair, layout.col_qb, layout.pair_mask, layout.masks,
            ctx.gidx, ctx.key_ok,
            *sizes, layout.nbk, nz.shape[1], mul, scale, r, *mod_args,
            GROUP=heads // hkv, **common,
        )  # fmt: skip
        d_bias = None if d_bias is None else d_bias.to(bias.dtype)
        d_slopes = None if d_slopes is None else d_slopes.to(slopes.dtype)
        return dq, dk, dvv, d_bias, d_slopes, *(None,) * 8


def _constants(
    q: Tensor, v: Tensor, layout: BlockLayout, alpha: float, has_key_ok: bool, kernel: int,
    mod: KernelMod | None, options: TritonOptions,
) -> dict:  # fmt: skip
    """The compile-time arguments all three kernels take (``MOD``: the score modifier's
    code), their warps and the ``kernel``'s (0 forward, 1 backward) stages."""
    d, dv, block, stages = q.shape[-1], v.shape[-1], layout.block, options.stages[kernel]
    # PREC: exact products for float32 inputs (the thresholds are sensitive to score errors);
    # UPCAST: bfloat16 products in float32 under the interpreter (its bf16 tl.dot is wrong)
    return dict(
        D=d, DV=dv, BD=_pow2(d), BDV=_pow2(dv), BLOCK=block, MODE=_mode(alpha),
        HAS_KEY_OK=has_key_ok, PARTIAL=layout.masks.shape[0] > 0,
        PREC="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=q.dtype == torch.bfloat16 and q.device.type == "cpu",
        MOD=0 if mod is None else mod.code, num_warps=options.num_warps(block),
        **({} if stages is None else {"num_stages": stages}),
    )  # fmt: skip


def entmax_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: BlockLayout,
    alpha: float,
    scale: float | None = None,
    key_valid: Tensor | None = None,
    graph_index: Tensor | None = None,
    score_mod: Any = None,
    options: TritonOptions | None = None,
) -> Tensor:
    """α-entmax attention (α > 1; 2 = sparsemax) over a block layout, Yun et al. eq. (3).

    q (B, H, n_q, d), k (B, H_kv, n_k, d), v (B, H_kv, n_k, d_v) → (B, H, n_q, d_v), H a
    multiple of H_kv (GQA), float32/bfloat16/float16 on CUDA (or CPU under the interpreter);
    ``layout`` from :func:`graph_layout`, :func:`dense_layout` or :func:`causal_layout`;
    ``scale`` default 1/sqrt(d); ``key_valid`` (B, n_k), True for real keys (a row without keys
    gives 0); ``graph_index`` int32 (B·H,), the layout graph of each (batch, head), default 0;
    ``score_mod`` one of the library's (a ValueError for others, :func:`triton_mod_reason`);
    ``options`` the knobs (default :func:`current_options`), the backward's too.
    Differentiable in q, k, v and the modifier's bias and ALiBi slopes.
    """
    bsz, heads, n_q, d = q.shape
    if (layout.n_q, layout.n_k) != (n_q, k.shape[2]):
        raise ValueError(f"layout is {layout.n_q} × {layout.n_k}, inputs are {n_q} × {k.shape[2]}")
    if not alpha > 1.0:
        raise ValueError(f"alpha must be > 1, got {alpha}")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    layout = layout.to(q.device)
    if graph_index is None:
        graph_index = torch.zeros(bsz * heads, dtype=torch.int32, device=q.device)
    key_ok = None
    if key_valid is not None:
        key_ok = key_valid.to(device=q.device, dtype=torch.int8).contiguous()
    mod = None
    if score_mod is not None:
        mod = kernel_mod(score_mod, heads, q.device)
        if isinstance(mod, str):
            raise ValueError(mod)
        if mod.bias is not None:  # one layout for the bias and its gradient
            mod.bias = mod.bias.contiguous()
    bias, slopes = (None, None) if mod is None else (mod.bias, mod.slopes)
    inputs = [t for t in (q, k, v, bias, slopes) if t is not None]
    need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    launch = (layout, graph_index, key_ok, float(alpha), scale, need_grad, mod)
    return _EntmaxAttention.apply(q, k, v, bias, slopes, *launch, options or _OPTIONS.get())


def triton_entmax_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    graph: AttentionGraph,
    prob_map: ProbabilityMap,
    scale: float,
    key_valid: Tensor | None = None,
    dropout_p: float = 0.0,
    block: int | None = None,
    *,
    check: bool = True,
    score_mod: Any = None,
    options: TritonOptions | None = None,
) -> Tensor:
    """α-entmax / sparsemax attention on ``graph`` by the Triton kernels (engine signature).

    Arguments as :func:`entmax_attention`'s, ``graph`` static or batched ((H,), (B, H)) and
    ``block`` its layout's tile (default the options'). A ValueError with the reason of
    :func:`triton_entmax_unsupported` unless ``check=False`` (the engine table's entry).
    """
    why = None
    if check:
        why = triton_entmax_unsupported(q, k, v, prob_map, dropout_p, graph, score_mod)
    if why is not None:
        raise ValueError(why)
    alpha, options = _alpha_of(prob_map), options or _OPTIONS.get()
    layout = graph_layout(graph, block or _block(q, options))
    bsz, heads = q.shape[:2]
    gidx = graph.cached(
        ("triton_entmax_graph_index", bsz, heads, q.device),
        lambda: _graph_index(graph.batch_shape, bsz, heads, q.device),
    )
    return entmax_attention(q, k, v, layout, alpha, scale, key_valid, gidx, score_mod, options)


def full_rows_entmax(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    prob_map: ProbabilityMap,
    scale: float,
    key_valid: Tensor | None,
    causal: bool,
    block: int | None = None,
    score_mod: Any = None,
    options: TritonOptions | None = None,
) -> Tensor:
    """The dense pattern (``sa.dense()``, or causal: queries at the end of the keys) by the
    Triton kernels, without a graph: the dense or causal layout, built once per (n_q, n_k,
    block, device). Other arguments as :func:`triton_entmax_attention`'s."""
    alpha, options = _alpha_of(prob_map), options or _OPTIONS.get()
    layout = _full_layout(q.shape[2], k.shape[2], block or _block(q, options), causal, q.device)
    return entmax_attention(q, k, v, layout, alpha, scale, key_valid, None, score_mod, options)


def _block(q: Tensor, options: TritonOptions) -> int:
    """The tile of a call that names none: the options' on a GPU, 32 under the interpreter."""
    return 32 if q.device.type == "cpu" else options.block
