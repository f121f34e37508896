"""Triton engine for α-entmax and sparsemax attention on a pattern's block layout (issue 26).

Computes Yun et al. eq. (3), out_i = Σ_{j ∈ A_i} ρ(scale · q_i·k_j)_j v_j, with ρ = α-entmax,
p = [(α − 1)s − τ]₊^{1/(α−1)} (Peters et al. 2019; α = 2 is sparsemax), by fused Triton kernels
(:mod:`sparseattn.engines._entmax_kernels`) that visit only the (query block, key block) pairs
of the graph's block layout: each row's threshold τ is found over the row's own key tiles by a
few Newton passes (exact for α = 1.5 and 2), then p·V is accumulated; the backward reuses τ,
skips pairs without non-zero weights and needs no n × n tensor (memory O(n·d + pairs)).

Entry points:

* :func:`triton_entmax_attention` — the engines' signature
  ``(q, k, v, graph, prob_map, scale, key_valid=None, dropout_p=0.0) -> out``;
* :func:`entmax_attention` — the same on a :class:`BlockLayout` (e.g. :func:`dense_layout` or
  :func:`causal_layout`, which need no graph: the dense and causal patterns as layouts);
* :func:`triton_entmax_unsupported` — None if a request can run here, else why not.

Score modifiers: the library's own (:mod:`sparseattn.score_mods`: ``bias``, ``alibi``,
``softcap`` and chains with at most one of each) reach the kernels as a description
(:func:`kernel_mod`: which, in which order, the bias tensor, the slopes, the cap), applied to
the scaled scores before ρ, forward and backward, with the gradients of the bias and of ALiBi
slopes that require them. Any other callable cannot run inside the kernels:
:func:`triton_mod_reason` says so, and the engine table routes such calls elsewhere.

Triton is imported on first use only: ``import sparseattn`` works without it. The kernels run
on CUDA tensors, or on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before
triton is first imported, and while the kernels run).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from ..graph import AttentionGraph
from ..maps import ProbabilityMap
from ..score_mods import alibi, steps
from .layout import block_pairs

__all__ = [
    "BlockLayout",
    "KernelMod",
    "causal_layout",
    "dense_layout",
    "entmax_attention",
    "full_rows_entmax",
    "graph_layout",
    "kernel_mod",
    "split_plan",
    "triton_entmax_attention",
    "triton_entmax_unsupported",
    "triton_map_reason",
    "triton_mod_reason",
    "tuning",
]

#: Block sizes the kernels take (square tiles; ``tl.dot`` needs at least 16).
BLOCKS = (16, 32, 64, 128)
#: Default block on a GPU (to be measured: speed on a GPU is not yet known) and under the
#: interpreter (fewer, larger tiles run faster there).
DEFAULT_BLOCK = {"cuda": 64, "cpu": 32}
#: Most threshold passes per query block (rows stop earlier when converged; only float ties
#: at τ or bisection for α > 2 come near it).
MAX_IT = 40
#: Per-tile row maxima kept per row in pass 0: the threshold search starts at their subset's
#: threshold, a lower bound (Gaussian rows, n = 1024 and 4096: 3 passes per 64-row block
#: instead of 5–6 from max − 1; scripts/triton_entmax_passes.py).
TOPK = 8
#: For α − 1 below this the maps compute in float64 (``maps._WIDEN_BELOW``); the kernels
#: compute in float32, so they refuse such α.
MIN_ALPHA_GAP = 1e-3
#: Whether the threshold passes skip the tiles below every open row's threshold (a branch per
#: tile) or visit every tile (no branch: the loads pipeline). Which is faster on a GPU depends
#: on how many tiles the rows skip; ``sparseattn bench gpu`` measures both.
SKIP_TILES = True
#: Warps per program for each block size, and software-pipelining stages of the tile loops of
#: the forward and the backward kernels (None: Triton's default, 3 on an H100). Measured at
#: block 64 on an H100 (``sparseattn bench gpu``'s tiles section, causal, n = 32768): 4 warps
#: beat 8 by 1.2-2x; with 2 stages the forward took 13-16% less time than with 3, the
#: backward 1.3-1.7x more (docs/benchmarks.md, the H100's run 5).
WARPS = {16: 4, 32: 4, 64: 4, 128: 8}
STAGES: dict[str, int | None] = {"forward": 2, "backward": None}
#: Largest head dim (registers of one tile).
MAX_HEAD_DIM = 256
#: Split the query blocks that visit more than this many times the mean number of key blocks
#: (the block of a Longformer's or BigBird's global tokens visits all of them) into chunks of
#: about twice the mean, one program per chunk, the passes one launch each (None: no split).
#: 1.5-entmax and sparsemax only (their exact closed forms end the search in a few passes).
#: Off until a GPU measures it (``tuning(split_long=4.0)``; docs/engines.md, "Where the
#: Longformer time may go").
SPLIT_LONG: float | None = None
#: Threshold passes of a split query block (one launch each; rows done early skip them, and a
#: row still open after them is renormalised). Its start is the main kernel's, so it takes the
#: same passes: at most 4 per 64-row block on the Gaussian rows of docs/engines.md's "Work
#: counts".
SPLIT_PASSES = 8
#: Launch every head's query blocks longest first (by pairs; grid (B·H, nbq)) instead of in
#: query-block order, head after head: the GPU starts programs in grid order, so the short
#: ones then fill the end (causal: the longest blocks are the last ones; the global tokens'
#: block of a later head starts late). A list schedule of the pair counts on 264 slots
#: (132 SMs, two programs each) ends at 1.32 / 1.01 times its lower bound in query-block
#: order / longest first for causal at n = 8192, 1.07 / 1.00 at 32768, 1.25 / 1.00 for
#: Longformer at 32768 (scripts/layout_balance.py; docs/engines.md). Off until a GPU measures
#: it (``tuning(longest_first=True)``): it also changes which heads share the L2 cache.
LONGEST_FIRST = False

_UNSET: Any = object()


@contextlib.contextmanager
def tuning(
    block: int | None = None,
    skip_tiles: bool | None = None,
    warps: int | None = None,
    stages: int | None = _UNSET,
    topk: int | None = None,
    split_long: float | None = _UNSET,
    longest_first: bool | None = None,
) -> Iterator[None]:
    """Run the GPU kernels with other knobs inside the ``with`` block, then restore them (the
    bench's tiles section): ``block`` the GPU default tile, ``skip_tiles`` :data:`SKIP_TILES`,
    ``warps`` :data:`WARPS` at that block, ``stages`` both kernels' :data:`STAGES` (None:
    Triton's default), ``topk`` :data:`TOPK`, ``split_long`` :data:`SPLIT_LONG`,
    ``longest_first`` :data:`LONGEST_FIRST`. Not thread-safe: the knobs are module state,
    read when a kernel is launched."""
    global SKIP_TILES, TOPK, SPLIT_LONG, LONGEST_FIRST
    saved = (DEFAULT_BLOCK["cuda"], SKIP_TILES, dict(WARPS), dict(STAGES), TOPK, SPLIT_LONG)
    saved += (LONGEST_FIRST,)
    try:
        if block is not None:
            if block not in BLOCKS:
                raise ValueError(f"block must be one of {BLOCKS}, got {block!r}")
            DEFAULT_BLOCK["cuda"] = block
        if skip_tiles is not None:
            SKIP_TILES = skip_tiles
        if warps is not None:
            WARPS[DEFAULT_BLOCK["cuda"]] = warps
        if stages is not _UNSET:
            STAGES.update(forward=stages, backward=stages)
        if topk is not None:
            if topk not in (1, 2, 4, 8, 16, 32, 64):  # tl.arange needs a power of two
                raise ValueError(f"topk must be a power of two up to 64, got {topk!r}")
            TOPK = topk
        if split_long is not _UNSET:
            if split_long is not None and not split_long > 1:
                raise ValueError(f"split_long must be None or > 1, got {split_long!r}")
            SPLIT_LONG = split_long
        if longest_first is not None:
            LONGEST_FIRST = bool(longest_first)
        yield
    finally:
        DEFAULT_BLOCK["cuda"], SKIP_TILES = saved[:2]
        TOPK, SPLIT_LONG, LONGEST_FIRST = saved[4:]
        for knobs, old in ((WARPS, saved[2]), (STAGES, saved[3])):
            knobs.clear()
            knobs.update(old)


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


# ---------------------------------------------------------------------------- layouts
@dataclass
class BlockLayout:
    """Block layout of G graphs for the kernels: CSR rows of (query block, key block) pairs.

    Attributes:
        block: tile size b (queries and keys).
        graphs: G; program (batch, head) uses graph ``graph_index[batch·H + head]``.
        n_q, n_k: queries and keys; nbq = ceil(n_q / b), nbk = ceil(n_k / b).
        row_ptr: int32[G·nbq + 1], pairs of row block g·nbq + i are
            ``row_ptr[g·nbq + i] : row_ptr[g·nbq + i + 1]``.
        pair_kb: int32[P], the key block of each pair (ascending within a row block).
        pair_mask: int32[P], −1 for a full pair, else its index into ``masks``.
        masks: int64[P_partial, b, ⌈b / 64⌉], the element masks of the partial pairs as
            row bits: bit c % 64 of word c // 64 of row r is 1 where (query offset r, key
            offset c) is an edge (:func:`pack_rows`).
        col_ptr: int32[G·nbk + 1], the same pairs by key block (the backward's dK, dV).
        col_pair: int32[P], pair index of each column entry; col_qb: int32[P], its query block.
    """

    block: int
    graphs: int
    n_q: int
    n_k: int
    row_ptr: Tensor
    pair_kb: Tensor
    pair_mask: Tensor
    masks: Tensor
    col_ptr: Tensor
    col_pair: Tensor
    col_qb: Tensor
    _on: dict = field(default_factory=dict, repr=False)

    @property
    def nbq(self) -> int:
        return -(-self.n_q // self.block)

    @property
    def nbk(self) -> int:
        return -(-self.n_k // self.block)

    @property
    def pairs(self) -> int:
        """Number of (query block, key block) pairs the kernels visit."""
        return int(self.pair_kb.numel())

    def to(self, device: torch.device) -> BlockLayout:
        """This layout with its tensors on ``device`` (copied once, cached on the layout)."""
        if self.row_ptr.device == device:
            return self
        if device not in self._on:
            moved = {
                name: getattr(self, name).to(device)
                for name in (
                    "row_ptr",
                    "pair_kb",
                    "pair_mask",
                    "masks",
                    "col_ptr",
                    "col_pair",
                    "col_qb",
                )
            }
            self._on[device] = BlockLayout(
                self.block, self.graphs, self.n_q, self.n_k, **moved, _on=self._on
            )
        return self._on[device]


def _check_block(block: int) -> None:
    if block not in BLOCKS:
        raise ValueError(f"block must be one of {BLOCKS}, got {block!r}")


def _from_pairs(
    rb: Tensor, kb: Tensor, part: Tensor, masks: Tensor, graphs: int, n_q: int, n_k: int, b: int
) -> BlockLayout:
    """Layout from pairs sorted by (global row block rb = g·nbq + i, key block kb)."""
    nbq, nbk = -(-n_q // b), -(-n_k // b)
    row_ptr = torch.zeros(graphs * nbq + 1, dtype=torch.long)
    row_ptr[1:] = torch.bincount(rb, minlength=graphs * nbq).cumsum(0)
    column = (rb // nbq) * nbk + kb
    order = torch.argsort(column * nbq + rb % nbq, stable=True)
    col_ptr = torch.zeros(graphs * nbk + 1, dtype=torch.long)
    col_ptr[1:] = torch.bincount(column, minlength=graphs * nbk).cumsum(0)
    i32 = torch.int32
    return BlockLayout(
        b,
        graphs,
        n_q,
        n_k,
        row_ptr.to(i32),
        kb.to(i32),
        part.to(i32),
        pack_rows(masks),
        col_ptr.to(i32),
        order.to(i32),
        (rb % nbq)[order].to(i32),
    )


def pack_rows(masks: Tensor) -> Tensor:
    """bool (P, b, b) element masks → int64 (P, b, ⌈b / 64⌉) row words: bit c % 64 of word
    c // 64 of row r is ``masks[p, r, c]`` (bit 63 is the sign bit)."""
    p, b, _ = masks.shape
    words = -(-b // 64)
    padded = torch.zeros(p, b, words * 64, dtype=torch.long, device=masks.device)
    padded[..., :b] = masks
    shifts = torch.arange(64, dtype=torch.long, device=masks.device)
    return (padded.view(p, b, words, 64) << shifts).sum(-1).contiguous()  # distinct bits: OR


def dense_layout(n_q: int, n_k: int, block: int) -> BlockLayout:
    """Every query block visits every key block, all pairs full (the dense pattern)."""
    _check_block(block)
    nbq, nbk = -(-n_q // block), -(-n_k // block)
    rb = torch.arange(nbq).repeat_interleave(nbk)
    kb = torch.arange(nbk).repeat(nbq)
    none = torch.zeros(0, block, block, dtype=torch.bool)
    return _from_pairs(rb, kb, torch.full_like(rb, -1), none, 1, n_q, n_k, block)


def causal_layout(n_q: int, n_k: int, block: int) -> BlockLayout:
    """Causal attention as a layout: query i (at position n_k − n_q + i, so n_q < n_k is
    decoding or prefill in pieces) visits keys j ≤ n_k − n_q + i; blocks crossing the
    diagonal are partial with their triangle as mask tile. O(nbq · nbk) pairs, no graph."""
    _check_block(block)
    if n_q > n_k:
        raise ValueError(f"causal_layout needs n_q <= n_k, got n_q={n_q}, n_k={n_k}")
    off = n_k - n_q
    nbq = -(-n_q // block)
    qb = torch.arange(nbq)
    last_row = torch.clamp((qb + 1) * block, max=n_q) - 1
    count = (off + last_row) // block + 1
    rb = qb.repeat_interleave(count)
    kb = torch.arange(int(count.sum())) - (count.cumsum(0) - count).repeat_interleave(count)
    full = (kb + 1) * block - 1 <= off + rb * block
    part = torch.full_like(rb, -1)
    part[~full] = torch.arange(int((~full).sum()))
    r = torch.arange(block)
    qpos = off + rb[~full, None, None] * block + r[None, :, None]
    kpos = kb[~full, None, None] * block + r[None, None, :]
    return _from_pairs(rb, kb, part, kpos <= qpos, 1, n_q, n_k, block)


def graph_layout(graph: AttentionGraph, block: int) -> BlockLayout:
    """The block layout of ``graph`` (all its batch_shape graphs) at ``block``, built in
    O(E + partial pairs · b²) by ``block_pairs`` and cached on the graph."""
    _check_block(block)

    def make() -> BlockLayout:
        pairs = block_pairs(graph, block, partial=True)
        nbk = -(-graph.n_k // block)
        partial = ~pairs.full
        part = torch.full_like(pairs.keys, -1)
        part[partial] = torch.arange(int(partial.sum()))
        masks = torch.zeros(int(partial.sum()), block, block, dtype=torch.bool)
        if pairs.e_pair is not None and pairs.e_pair.numel():
            masks[part[pairs.e_pair], pairs.e_q, pairs.e_k] = True
        graphs = max(1, math.prod(graph.batch_shape))
        return _from_pairs(
            pairs.keys // nbk, pairs.keys % nbk, part, masks, graphs, graph.n_q, graph.n_k, block
        )

    return graph.cached(("triton_entmax_layout", block), make)


def _graph_index(batch_shape: tuple[int, ...], bsz: int, heads: int, device) -> Tensor:
    """int32[B·H]: which of the prod(batch_shape) graphs each (batch, head) uses."""
    ids = torch.arange(max(1, math.prod(batch_shape)), dtype=torch.int32).reshape(batch_shape)
    try:
        ids = ids.expand(bsz, heads)
    except RuntimeError as err:
        raise ValueError(
            f"graph batch_shape {batch_shape} must broadcast to (batch, heads) = {(bsz, heads)}"
        ) from err
    return ids.reshape(-1).contiguous().to(device)


# ---------------------------------------------------------------------------- requests
def _alpha_of(prob_map: ProbabilityMap) -> float | str:
    """α of an entmax/sparsemax map, or why the kernels cannot compute the map."""
    if prob_map.name == "sparsemax":
        return 2.0
    if prob_map.name != "entmax":
        return f"the Triton entmax kernels compute α-entmax and sparsemax only, not {prob_map!r}"
    if prob_map.alpha is not None:
        return "the Triton entmax kernels take a fixed α, not a tensor (learnable) α"
    alpha = float(prob_map.params.get("alpha", 1.5))
    if alpha == 1.0:
        return "entmax(1) is softmax: the Triton entmax kernels need α > 1"
    if alpha - 1.0 < MIN_ALPHA_GAP:
        return f"α − 1 < {MIN_ALPHA_GAP} needs float64 thresholds; the Triton kernels use float32"
    return alpha


def triton_map_reason(prob_map: ProbabilityMap | None) -> str | None:
    """None if the kernels compute ``prob_map`` (α-entmax with a fixed α > 1, sparsemax),
    else why not (the engine table's map check)."""
    if prob_map is None:
        return "the probability map is unknown (the Triton kernels compute entmax/sparsemax)"
    alpha = _alpha_of(prob_map)
    return alpha if isinstance(alpha, str) else None


def triton_mod_reason(kinds: tuple[str, ...] | None) -> str | None:
    """None if the kernels apply a score modifier made of these elementary modifiers
    (``score_mods.steps``' kinds, in order; None: another callable), else why not (the engine
    table's modifier check)."""
    if kinds is None:
        return (
            "the Triton kernels apply the library's score modifiers only (score_mods.bias, "
            "alibi, softcap and chains of them), which they take as a description: another "
            "function cannot run inside them"
        )
    repeated = sorted({kind for kind in kinds if kinds.count(kind) > 1})
    if repeated:
        return (
            "the Triton kernels take at most one bias, one alibi and one softcap in a chain, "
            f"not {', '.join(f'{kinds.count(kind)} × {kind}' for kind in repeated)}"
        )
    return None


def _score_mod_reason(score_mod: Any, q: Tensor, k: Tensor) -> str | None:
    """Why the kernels cannot apply ``score_mod`` to scores of q and k (None if they can)."""
    found = steps(score_mod)
    why = triton_mod_reason(None if found is None else tuple(mod.kind for mod in found))
    if why is not None or found is None:
        return why
    heads = q.shape[1]
    for mod in found:
        tensor = getattr(mod, "t" if mod.kind == "bias" else "slopes", None)
        if tensor is not None and tensor.device != q.device:
            return f"score_mod {mod!r} reads a tensor on {tensor.device}, inputs on {q.device}"
        if mod.kind == "bias":
            try:
                mod.check((q.shape[0], heads, q.shape[2], k.shape[2]))
            except ValueError as err:
                return str(err)
        if mod.kind == "alibi" and tensor is not None and tensor.numel() < heads:
            return f"alibi has {tensor.numel()} slopes for {heads} query heads"
    return None


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
    wrong_map = triton_map_reason(prob_map)
    if wrong_map is not None:
        return wrong_map
    if dropout_p:
        return "the Triton entmax kernels have no attention dropout"
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"the Triton entmax kernels take float32/bfloat16/float16, not {q.dtype}"
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        return "q, k and v must share one dtype and one device"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "q, k, v must be (batch, heads, n, d)"
    if q.shape[0] != k.shape[0] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        return (
            f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit: "
            "one batch, k and v one length, q and k one head dim"
        )
    if k.shape[1] != v.shape[1] or q.shape[1] % k.shape[1]:
        return (
            f"query heads ({q.shape[1]}) must be a multiple of the key/value heads "
            f"({k.shape[1]}, {v.shape[1]})"
        )
    if max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        return f"head dims above {MAX_HEAD_DIM} are not supported"
    if graph is not None and (graph.n_q, graph.n_k) != (q.shape[2], k.shape[2]):
        return f"graph is {graph.n_q} × {graph.n_k}, inputs {q.shape[2]} × {k.shape[2]}"
    if score_mod is not None:
        wrong_mod = _score_mod_reason(score_mod, q, k)
        if wrong_mod is not None:
            return wrong_mod
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


# ---------------------------------------------------------------------------- split blocks
@dataclass
class SplitPlan:
    """Which query blocks of a layout the split kernels take, and their chunks.

    Attributes:
        row_end: int32[G·nbq], each row block's end pair for the main kernel: its own end,
            or its start where the block is split (the main kernel then leaves it empty).
        ch_rb, ch_start, ch_end: int32[C], chunk c covers pairs ch_start[c] : ch_end[c] of
            row block ch_rb[c] (= g·nbq + query block).
        long_rb, long_c0, long_c1: int32[R], split row block r and its chunks.
        order: the main kernels' query blocks longest first (``LONGEST_FIRST``), made on
            first use.
    """

    row_end: Tensor
    ch_rb: Tensor
    ch_start: Tensor
    ch_end: Tensor
    long_rb: Tensor
    long_c0: Tensor
    long_c1: Tensor
    order: Tensor | None = field(default=None, repr=False)


def split_plan(
    layout: BlockLayout, factor: float, device: torch.device, heads: int = 1, sms: int = 1
) -> SplitPlan | None:
    """The query blocks of ``layout`` with more than ``factor`` times the mean number of pairs
    per non-empty query block, cut into chunks of about twice that mean (at least 8 pairs).
    When the main kernel would run fewer programs than the device has multiprocessors
    (``sms``; non-empty query blocks × ``heads``, the launch's batch·heads: decoding, one
    query block against a long cache), every query block is cut instead, into chunks that
    make about two programs per multiprocessor (as flash-decoding splits one query's keys).
    None when no block is cut. Cached on the layout per (factor, device, heads, sms)."""
    key = ("split", factor, device, heads, sms)
    if key not in layout._on:
        row_ptr = layout.row_ptr.cpu().long()
        counts = row_ptr[1:] - row_ptr[:-1]
        busy = int((counts > 0).sum())
        mean = counts.sum().item() / max(1, busy)
        chunk = max(8, math.ceil(2 * mean))
        long = (counts > factor * mean) & (counts > chunk)
        if busy * heads < sms:  # too few programs to fill the device
            chunk = max(8, math.ceil(counts.sum().item() * heads / (2 * sms)))
            long = counts > chunk
        long = torch.nonzero(long).flatten()
        plan = None
        if long.numel():
            per = (counts[long] + chunk - 1) // chunk
            first = torch.cumsum(per, 0) - per
            ch_rb = long.repeat_interleave(per)
            ch_start = row_ptr[ch_rb] + chunk * (
                torch.arange(int(per.sum())) - first.repeat_interleave(per)
            )
            ch_end = torch.minimum(ch_start + chunk, row_ptr[ch_rb + 1])
            row_end = row_ptr[1:].clone()
            row_end[long] = row_ptr[long]

            def i32(t: Tensor) -> Tensor:
                return t.to(device=device, dtype=torch.int32)

            plan = SplitPlan(
                *map(i32, (row_end, ch_rb, ch_start, ch_end, long, first, first + per))
            )
        layout._on[key] = plan
    return layout._on[key]


def _rows(
    layout: BlockLayout, plan: SplitPlan | None, longest_first: bool
) -> tuple[Tensor, Tensor]:
    """Each row block's end pair for the main kernels (the split blocks' left empty) and,
    with ``longest_first``, every layout graph's query blocks by decreasing pairs (int32
    [G·nbq], cached on the layout; else a placeholder)."""
    row_end = layout.row_ptr[1:] if plan is None else plan.row_end
    if not longest_first:
        return row_end, row_end

    def order() -> Tensor:
        counts = (row_end.long() - layout.row_ptr[:-1].long()).view(layout.graphs, layout.nbq)
        by_length = torch.argsort(counts, dim=1, descending=True, stable=True)
        return by_length.to(torch.int32).flatten().contiguous()

    if plan is not None:
        if plan.order is None:
            plan.order = order()
        return row_end, plan.order
    key = ("order", row_end.device)
    if key not in layout._on:
        layout._on[key] = order()
    return row_end, layout._on[key]


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


def _split_factor(alpha: float) -> float | None:
    """:data:`SPLIT_LONG` for 1.5-entmax and sparsemax; None (no split) for other α, whose
    search may take up to MAX_IT passes (bisection for α > 2), a launch pair each."""
    return None if _mode(alpha) == 0 else SPLIT_LONG


def _launch_split(
    plan: SplitPlan, q: Tensor, k: Tensor, v: Tensor, layout: BlockLayout, gidx: Tensor,
    key_ok: Tensor, consts: dict, outs: tuple[Tensor, ...], alpha: float, scale: float,
    need_grad: bool, mod_args: tuple,
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
    top = torch.empty(bh, chunks, TOPK, block, dtype=torch.float32, device=dev)
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
        D=d, DV=dv, BD=bd, BLOCK=block, MODE=mode, TOPK=TOPK, **scored,
    )  # fmt: skip
    kern._split_init[(longs, bh)](
        state, part, top, passes, *merged, q.shape[2], bh, layout.nbq, chunks, am1, r,
        BLOCK=block, MODE=mode, TOPK=TOPK,
    )  # fmt: skip
    for _ in range(SPLIT_PASSES):
        kern._split_sums[(chunks, bh)](
            q, k, v, tmax, part, state, *on_chunks, *sizes, chunks, bh, mul, r, *mod_args,
            D=d, DV=dv, BD=bd, BLOCK=block, MODE=mode, SKIP=SKIP_TILES, **scored,
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


# ---------------------------------------------------------------------------- score modifiers
@dataclass
class KernelMod:
    """A score modifier as the kernels take it (:func:`kernel_mod`).

    Attributes:
        code: the kernels' compile-time ``MOD`` (:mod:`._entmax_kernels`): bits 0-1 the bias,
            bits 2-3 ALiBi (1: before the softcap, or without one; 2: after it), bit 4 the
            softcap; 0 is no modifier.
        bias: the bias as the modifier holds it, 4-D (size-1 dims broadcast), or None.
        slopes: ALiBi's slopes m_h, one per query head at least (the modifier's own tensor,
            or the paper's computed for its head count), or None.
        cap: the softcap's c (1.0 without one).
    """

    code: int
    bias: Tensor | None = None
    slopes: Tensor | None = None
    cap: float = 1.0


def kernel_mod(score_mod: Any, heads: int, device: torch.device) -> KernelMod | str:
    """``score_mod`` as the kernels take it for ``heads`` query heads on ``device``, or why
    they cannot (:func:`triton_mod_reason`)."""
    found = steps(score_mod)
    why = triton_mod_reason(None if found is None else tuple(mod.kind for mod in found))
    if why is not None or found is None:
        return why or ""
    out = KernelMod(0)
    at = 1  # 2 once the softcap has been applied
    for mod in found:
        if mod.kind == "bias":
            out.code |= at
            out.bias = mod.t
        elif mod.kind == "alibi":
            out.code |= at << 2
            out.slopes = mod.slopes
            if out.slopes is None:
                out.slopes = _paper_slopes(mod.heads, heads, device)
        else:
            out.code |= 16
            out.cap, at = mod.cap, 2
    return out


@functools.lru_cache(maxsize=32)
def _paper_slopes(model_heads: int, heads: int, device: torch.device) -> Tensor:
    """``alibi(model_heads)``'s slopes of query heads 0 … heads − 1, on ``device`` (made once)."""
    return alibi(model_heads).computed_slopes(heads, device)


@functools.lru_cache(maxsize=8)
def _placeholder(device: torch.device) -> Tensor:
    """A float32 tensor of one element on ``device``, made once: the pointer the kernels take
    for a modifier's tensor they do not read (no allocation per call)."""
    return torch.zeros(1, dtype=torch.float32, device=device)


def _strides(t: Tensor) -> list[int]:
    """t's strides, 0 along its size-1 dims (they broadcast)."""
    return [0 if size == 1 else stride for size, stride in zip(t.shape, t.stride(), strict=True)]


def _mod_args(
    mod: KernelMod | None, q: Tensor, scale: float, alpha: float, grads: tuple = (None, None)
) -> tuple:
    """The kernels' score-modifier arguments (``MB, mb_b, mb_h, mb_i, mb_j, MSL, m_cap,
    m_scale, m_am1, MDB, MDSL``): bias and strides, slopes, cap, scale, α − 1 and the
    gradients' buffers ``grads`` (bias, slopes; None: none). Placeholders without ``mod``
    (never read or written: ``MOD`` = 0 compiles them out)."""
    dummy = _placeholder(q.device)
    if mod is None:
        return (dummy, 0, 0, 0, 0, dummy, 1.0, 1.0, 1.0, dummy, dummy)
    bias = dummy if mod.bias is None else mod.bias
    strides = [0, 0, 0, 0] if mod.bias is None else _strides(bias)
    slopes = dummy if mod.slopes is None else mod.slopes
    d_bias, d_slopes = (dummy if g is None else g for g in grads)
    return (bias, *strides, slopes, mod.cap, scale, alpha - 1.0, d_bias, d_slopes)


def _mod_grad_code(mod: KernelMod | None, sizes: tuple[int, ...], bias: bool, slopes: bool) -> int:
    """The dq kernels' ``MOD_GRAD`` for scores of ``sizes`` (B, H, n_q, n_k): bits 0-1 the
    bias's gradient (``bias``: wanted) — 1 stored, each entry one program's; 2 added
    atomically, where the bias broadcasts over batch, heads or keys; 3 summed over the tile's
    rows, then added, where it broadcasts over the queries —, bit 2 the slopes'."""
    code = 4 if slopes else 0
    if bias and mod is not None and mod.bias is not None:
        (bb, hb, nq, nk), (b, h, n_q, n_k) = mod.bias.shape, sizes
        if nq == 1 and n_q > 1:
            code |= 3
        elif (bb == 1 and b > 1) or (hb == 1 and h > 1) or (nk == 1 and n_k > 1):
            code |= 2
        else:
            code |= 1
    return code


# ---------------------------------------------------------------------------- the function
def _mode(alpha: float) -> int:
    return 2 if alpha == 2.0 else 1 if alpha == 1.5 else 0


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
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Run the forward kernel on contiguous q, k, v (with the score modifier ``mod``). Returns
    out (B, H, n_q, d_v), τ + m per row (B, H, n_q) float32, Σ g v / Σ g (B, H, n_q, d_v) and
    the non-zero flags int8 (B·H, pairs) — the last two only with ``need_grad`` — and the
    threshold passes each program took, int32 (B·H, nbq)."""
    bsz, heads, n_q = q.shape[:3]
    dv, pairs, dev = v.shape[-1], max(1, layout.pairs), q.device
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
    split = _split_factor(alpha)
    plan = None
    if split is not None:
        plan = split_plan(layout, split, dev, bsz * heads, _multiprocessors(dev))
    consts = _constants(q, v, layout, alpha, key_ok is not None, "forward", mod)
    mod_args = _mod_args(mod, q, scale, alpha)
    row_end, order = _rows(layout, plan, LONGEST_FIRST)
    _kernels()._forward[_grid(layout, bsz * heads, LONGEST_FIRST)](
        q, k, v, out, tau, gv, nz, tmax, passes,
        layout.row_ptr, row_end, order, layout.pair_kb, layout.pair_mask, layout.masks, gidx,
        key_ok_t, *_sizes(q, k), layout.nbq, pairs,
        scale * (alpha - 1.0), alpha - 1.0, 1.0 / (alpha - 1.0), *mod_args,
        NEED_GRAD=need_grad, MAX_IT=MAX_IT, TOPK=TOPK, SKIP=SKIP_TILES,
        LONGEST_FIRST=LONGEST_FIRST, **consts,
    )  # fmt: skip
    if plan is not None:  # after the main kernel, which left the split blocks empty
        outs = (out, tau, gv, nz, tmax, passes)
        _launch_split(
            plan, q, k, v, layout, gidx, key_ok_t, consts, outs, alpha, scale, need_grad, mod_args
        )
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
        key_ok, alpha, scale, need_grad, mod); ``bias`` and ``slopes`` are the modifier's
        tensors (``mod.bias``, ``mod.slopes``: inputs here, for their gradients)."""
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, tau, gv, nz, _ = _launch_forward(q, k, v, *launch)
        layout, gidx, key_ok, alpha, scale, need_grad, mod = launch
        key_ok_t = torch.zeros(1, dtype=torch.int8, device=q.device) if key_ok is None else key_ok
        if need_grad:
            ctx.save_for_backward(q, k, v, tau, gv, nz, bias, slopes)
            ctx.mod = None if mod is None else (mod.code, mod.cap)
            ctx.layout, ctx.gidx, ctx.key_ok = layout, gidx, key_ok_t
            ctx.has_key_ok, ctx.alpha, ctx.scale = key_ok is not None, alpha, scale
            # the forward's knobs, whatever they are at the backward
            ctx.split, ctx.longest_first = _split_factor(alpha), LONGEST_FIRST
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_out: Tensor):
        kern = _kernels()
        q, k, v, tau, gv, nz, bias, slopes = ctx.saved_tensors
        layout, alpha, scale = ctx.layout, ctx.alpha, ctx.scale
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
        common = _constants(q, v, layout, alpha, ctx.has_key_ok, "backward", mod)
        mul, r = scale * (alpha - 1.0), 1.0 / (alpha - 1.0)
        plan = None
        if ctx.split is not None:
            plan = split_plan(layout, ctx.split, q.device, bsz * heads, _multiprocessors(q.device))
        row_end, order = _rows(layout, plan, ctx.longest_first)
        kern._backward_dq[_grid(layout, bsz * heads, ctx.longest_first)](
            q, k, v, do, dq, tau, delta, nz,
            layout.row_ptr, row_end, order, layout.pair_kb, layout.pair_mask, layout.masks,
            ctx.gidx, ctx.key_ok, *sizes, layout.nbq, nz.shape[1], mul, scale, r, *mod_args,
            LONGEST_FIRST=ctx.longest_first, MOD_GRAD=mod_grad, **common,
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
        return dq, dk, dvv, d_bias, d_slopes, None, None, None, None, None, None, None


def _sizes(q: Tensor, k: Tensor) -> tuple[int, int, int, int]:
    """The kernels' size arguments n_q, n_k, H, HKV."""
    return q.shape[2], k.shape[2], q.shape[1], k.shape[1]


def _constants(
    q: Tensor, v: Tensor, layout: BlockLayout, alpha: float, has_key_ok: bool, kernel: str,
    mod: KernelMod | None = None,
) -> dict:  # fmt: skip
    """The compile-time arguments all three kernels take (``MOD``: the score modifier's
    code), their warps and the ``kernel``'s (``"forward"`` or ``"backward"``) stages."""
    d, dv, block, stages = q.shape[-1], v.shape[-1], layout.block, STAGES[kernel]
    return dict(
        D=d, DV=dv, BD=_pow2(d), BDV=_pow2(dv), BLOCK=block, MODE=_mode(alpha),
        HAS_KEY_OK=has_key_ok, PARTIAL=layout.masks.shape[0] > 0, PREC=_precision(q),
        UPCAST=_upcast(q), MOD=0 if mod is None else mod.code, num_warps=WARPS[block],
        **({} if stages is None else {"num_stages": stages}),
    )  # fmt: skip


def _pow2(x: int) -> int:
    return max(16, 1 << (x - 1).bit_length())


def _precision(q: Tensor) -> str:
    """Exact float32 products for float32 inputs (the thresholds are sensitive to score
    errors); bf16/fp16 products accumulate in float32 anyway."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _upcast(q: Tensor) -> bool:
    """Products in float32 under the interpreter for bfloat16 (its bf16 ``tl.dot`` is wrong
    in triton 3.9); on a GPU the tensor cores multiply bf16 directly."""
    return q.dtype == torch.bfloat16 and q.device.type == "cpu"


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
) -> Tensor:
    """α-entmax attention (α > 1; 2 = sparsemax) over a block layout, Yun et al. eq. (3).

    Args:
        q: (B, H, n_q, d); k: (B, H_kv, n_k, d); v: (B, H_kv, n_k, d_v), H a multiple of
            H_kv (GQA: query head h uses key/value head h // (H / H_kv)); float32, bfloat16 or
            float16, on CUDA (or CPU under Triton's interpreter).
        layout: from :func:`graph_layout`, :func:`dense_layout` or :func:`causal_layout`.
        alpha: α > 1 (1.5 and 2 exact; others Newton/bisection to float precision).
        scale: score scale, default 1/sqrt(d).
        key_valid: (B, n_k) bool, True for real keys. A row left without keys gives 0.
        graph_index: int32 (B·H,), the layout graph of each (batch, head); default all 0.
        score_mod: a score modifier of :mod:`sparseattn.score_mods` (``bias``, ``alibi``,
            ``softcap``, a chain with at most one of each), applied to the scaled scores
            before ρ (FlexAttention's convention: h the query head, indices in q and k).
    Returns:
        (B, H, n_q, d_v) in the inputs' dtype; differentiable in q, k and v, and in the
        modifier's bias and ALiBi slopes where they require grad.
    Raises:
        ValueError: a score modifier the kernels cannot take (:func:`triton_mod_reason`).
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
    return _EntmaxAttention.apply(
        q, k, v, bias, slopes, layout, graph_index, key_ok, float(alpha), scale, need_grad, mod
    )


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
) -> Tensor:
    """α-entmax / sparsemax attention on ``graph`` by the Triton kernels (engine signature).

    Shapes: q (B, H, n_q, d), k (B, H_kv, n_k, d), v (B, H_kv, n_k, d_v) → (B, H, n_q, d_v);
    ``graph`` static (batch_shape ()) or batched ((H,), (B, H)); ``key_valid`` (B, n_k),
    True for real keys. ``block``: tile size of the layout (default ``DEFAULT_BLOCK``).
    Raises ValueError with the reason of :func:`triton_entmax_unsupported` when it cannot run;
    ``check=False`` skips that check: the engine table's entry, called by ``sparse_attention``,
    which has checked the request already (host time on every call). ``score_mod``: as
    :func:`entmax_attention` takes it.
    """
    why = None
    if check:
        why = triton_entmax_unsupported(q, k, v, prob_map, dropout_p, graph, score_mod)
    if why is not None:
        raise ValueError(why)
    alpha = _alpha_of(prob_map)
    block = DEFAULT_BLOCK.get(q.device.type, 64) if block is None else block
    layout = graph_layout(graph, block)
    bsz, heads = q.shape[:2]
    gidx = graph.cached(
        ("triton_entmax_graph_index", bsz, heads, q.device),
        lambda: _graph_index(graph.batch_shape, bsz, heads, q.device),
    )
    return entmax_attention(q, k, v, layout, alpha, scale, key_valid, gidx, score_mod)


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
) -> Tensor:
    """The dense pattern (``sa.dense()``, or causal: queries at the end of the keys) by the
    Triton kernels, without a graph: the dense or causal layout, built once per (n_q, n_k,
    block, device). Shapes, ``key_valid`` (True for real keys) and ``score_mod`` as
    :func:`triton_entmax_attention`."""
    block = DEFAULT_BLOCK.get(q.device.type, 64) if block is None else block
    layout = _full_layout(q.shape[2], k.shape[2], block, causal, q.device)
    alpha = _alpha_of(prob_map)
    return entmax_attention(q, k, v, layout, alpha, scale, key_valid, None, score_mod)


@functools.lru_cache(maxsize=16)
def _full_layout(n_q: int, n_k: int, block: int, causal: bool, device: torch.device) -> BlockLayout:
    make = causal_layout if causal else dense_layout
    return make(n_q, n_k, block).to(device)
