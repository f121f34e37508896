"""Block layouts of the Triton α-entmax kernels (:mod:`sparseattn.engines.triton_entmax`).

A :class:`BlockLayout` lists the (query block, key block) pairs the kernels visit, by row and by
column, with the partial pairs' masks as row bits (:func:`graph_layout`; :func:`dense_layout`
and :func:`causal_layout` need no graph); :func:`split_plan` cuts long query blocks into
chunks. Plain torch: no triton needed.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..graph import AttentionGraph
from .layout import block_pairs

__all__ = [
    "BLOCKS",
    "BlockLayout",
    "SplitPlan",
    "causal_layout",
    "dense_layout",
    "graph_layout",
    "pack_rows",
    "split_plan",
]

#: Block sizes the kernels take (square tiles; ``tl.dot`` needs at least 16).
BLOCKS = (16, 32, 64, 128)


@dataclass
class BlockLayout:
    """Block layout of G graphs for the kernels: CSR rows of (query block, key block) pairs.

    Attributes:
        block, graphs: tile size b; G (program (batch, head) uses ``graph_index[batch·H + head]``).
        n_q, n_k: queries and keys; nbq = ceil(n_q / b), nbk = ceil(n_k / b).
        row_ptr: int32[G·nbq + 1], the pairs of row block g·nbq + i by row (CSR).
        pair_kb: int32[P], the key block of each pair (ascending within a row block).
        pair_mask: int32[P], −1 for a full pair, else its index into ``masks``.
        masks: int64[P_partial, b, ⌈b / 64⌉], the partial pairs' element masks as row bits
            (:func:`pack_rows`).
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
            names = ("row_ptr", "pair_kb", "pair_mask", "masks", "col_ptr", "col_pair", "col_qb")
            moved = {name: getattr(self, name).to(device) for name in names}
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


@dataclass
class SplitPlan:
    """Which query blocks of a layout the split kernels take, and their chunks.

    Attributes:
        row_end: int32[G·nbq], each row block's end pair for the main kernel (its start where
            the block is split).
        ch_rb, ch_start, ch_end: int32[C], chunk c covers pairs ch_start[c] : ch_end[c] of
            row block ch_rb[c] (= g·nbq + query block).
        long_rb, long_c0, long_c1: int32[R], split row block r and its chunks.
        order: the main kernels' query blocks longest first, made on first use.
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
    per non-empty query block, cut into chunks of about twice that mean (at least 8 pairs);
    where the main kernel would run fewer programs than the device's ``sms`` multiprocessors
    (``heads`` programs per query block: decoding), every query block, into chunks making about
    two programs per multiprocessor. None when no block is cut. Cached on the layout."""
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


@functools.lru_cache(maxsize=16)
def _full_layout(n_q: int, n_k: int, block: int, causal: bool, device: torch.device) -> BlockLayout:
    make = causal_layout if causal else dense_layout
    return make(n_q, n_k, block).to(device)
