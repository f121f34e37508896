"""Per-family rules: which keys a range of query rows needs, which rows are global, and the
graph of a range of rows — each without building the pattern's whole graph.

Three generic functions dispatch on the pattern's class (``functools.singledispatch``); a new
pattern family plugs in with ``key_intervals.register(MyPattern)`` (and, optionally,
``global_candidates.register`` and ``row_graph.register``):

``key_intervals(pattern, n, lo, hi)``
    The keys read by the query rows lo … hi − 1 at length n, ∪_{lo ≤ i < hi} A_i, as an
    interval set (:mod:`.intervals`). Contract: exact outside [lo, hi); inside [lo, hi) it may
    hold more (those keys are local to whoever owns the rows, so they never travel). Cost:
    O(number of intervals), never O(n·K): windows, blocks and global tokens give O(1)
    intervals, strides O(n/w), random patterns O(rows · k).
``global_candidates(pattern, n)``
    Rows that read all or nearly all keys (Longformer's and BigBird's global tokens, STAR's
    relay, BigBird's first and last block, full rows of a block layout): the planner computes
    them by merging partial results across ranks instead of fetching their keys.
``row_graph(pattern, n, lo, hi, heads)``
    The pattern's rows lo … hi − 1 as an AttentionGraph (hi − lo queries, n keys), in
    O(rows · K) for the window, block, global-token, causal and union families; other
    patterns slice their (cached) full graph.

Patterns without a rule fall back to their exact graph up to ``FALLBACK_MAX_N`` and raise a
ValueError naming the class beyond it; data-dependent patterns (top-k, predicted) raise: their
keys depend on q·k over all keys, which no plan can know in advance.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from ..graph import AttentionGraph
from ..patterns.base import Causal, Pattern
from ..patterns.bigbird_blocks import BigBirdBlocks
from ..patterns.blocks import BlockLayout, _ConfigPattern
from ..patterns.causal import (
    CausalGlobal,
    CausalRandomBlocks,
    CausalSegment,
    CausalStride,
    CausalSummary,
    CausalWindow,
    _CausalPattern,
)
from ..patterns.compose import HeadSplit, Union
from ..patterns.diagonal import NoDiagonal
from ..patterns.fixed import (
    BlockLocal,
    Dense,
    FixedSummary,
    GlobalTokens,
    Random,
    RandomBlocks,
    Star,
    Stride,
    Window,
)
from . import intervals as iv

__all__ = [
    "FALLBACK_MAX_N",
    "global_candidates",
    "key_intervals",
    "row_graph",
    "take_rows",
]

#: Largest n at which a pattern without a rule is planned from its exact graph.
FALLBACK_MAX_N = 4096


def _check_static(pattern: object) -> None:
    if getattr(pattern, "data_dependent", False):
        raise ValueError(
            f"pattern {pattern!r} is data-dependent: its keys depend on q·k over every key, so "
            "no plan can say in advance which keys a shard needs; context parallelism takes "
            "static patterns and AttentionGraphs"
        )


def _fallback_graph(pattern: object, n: int, heads: int | None = None) -> AttentionGraph:
    """The exact graph of a pattern without a rule, at a length where building it is cheap."""
    _check_static(pattern)
    if isinstance(pattern, AttentionGraph):
        return pattern
    if not isinstance(pattern, Pattern):
        raise TypeError(
            f"pattern must be a Pattern or an AttentionGraph, got {type(pattern).__name__}"
        )
    if n > FALLBACK_MAX_N:
        raise ValueError(
            f"no key-interval rule for {type(pattern).__name__} and n={n} > FALLBACK_MAX_N="
            f"{FALLBACK_MAX_N}: planning it would build its whole graph. Register a rule with "
            "sparseattn.parallel.rules.key_intervals.register"
        )
    if isinstance(pattern, HeadSplit):
        return pattern.graph(n, num_heads=heads or len(pattern.patterns))
    return pattern.graph(n)


def _graph_keys(graph: AttentionGraph, lo: int, hi: int) -> np.ndarray:
    """Exact keys of rows lo … hi − 1 of a graph, over all its leading (batch, head) entries."""
    cols = take_rows(graph, torch.arange(lo, hi)).col
    return iv.from_points(cols.numpy())


def take_rows(graph: AttentionGraph, rows: torch.Tensor) -> AttentionGraph:
    """The graph's query rows ``rows`` (a LongTensor of row indices, in that order) in every
    leading entry: a graph of len(rows) queries with the same keys and batch shape."""
    n_graphs = graph.num_rows // graph.n_q if graph.n_q else 0
    flat = (torch.arange(n_graphs)[:, None] * graph.n_q + rows.to(torch.long)).reshape(-1)
    starts, stops = graph.crow[flat], graph.crow[flat + 1]
    degrees = stops - starts
    crow = torch.zeros(flat.numel() + 1, dtype=torch.long)
    torch.cumsum(degrees, 0, out=crow[1:])
    total = int(crow[-1])
    shift = torch.repeat_interleave(starts - crow[:-1], degrees, output_size=total)
    col = graph.col[torch.arange(total) + shift]
    return AttentionGraph(crow, col, rows.numel(), graph.n_k, graph.batch_shape, graph.causal)


# ------------------------------------------------------------------ key_intervals
@functools.singledispatch
def key_intervals(pattern: object, n: int, lo: int, hi: int) -> np.ndarray:
    """Keys of the query rows [lo, hi) at length n (see the module docstring)."""
    return _graph_keys(_fallback_graph(pattern, n), lo, hi)


@key_intervals.register
def _(pattern: AttentionGraph, n: int, lo: int, hi: int) -> np.ndarray:
    return _graph_keys(pattern, lo, hi)


@key_intervals.register
def _(pattern: Dense, n: int, lo: int, hi: int) -> np.ndarray:
    return iv.span(0, n)


@key_intervals.register
def _(pattern: Window, n: int, lo: int, hi: int) -> np.ndarray:
    # Yun eq. (4) A¹: row i reads i − ⌈w/2⌉ … i + ⌊w/2⌋
    return iv.span(max(0, lo - math.ceil(pattern.w / 2)), min(n, hi + pattern.w // 2))


def _residues(n: int, w: int, lo: int, hi: int, stop: int) -> np.ndarray:
    """Keys j < stop with j ≡ i (mod w) for some row lo <= i < hi (hi − lo < w)."""
    first = lo % w + w * np.arange(-1, n // w + 1, dtype=np.int64)
    return iv.clip(iv.merge(np.stack([first, first + (hi - lo)], 1)), 0, stop)


@key_intervals.register
def _(pattern: Stride, n: int, lo: int, hi: int) -> np.ndarray:
    w = pattern.w
    if w >= n:  # only the diagonal lies inside the sequence
        return iv.span(lo, hi)
    return iv.span(0, n) if hi - lo >= w else _residues(n, w, lo, hi, n)


@key_intervals.register
def _(pattern: BlockLocal, n: int, lo: int, hi: int) -> np.ndarray:
    b = pattern.block
    return iv.span(lo // b * b, min(n, ((hi - 1) // b + 1) * b))


@key_intervals.register
def _(pattern: FixedSummary, n: int, lo: int, hi: int) -> np.ndarray:
    ends = np.arange(pattern.w - 1, n, pattern.w, dtype=np.int64)  # Yun eq. (5) A²
    return iv.union(iv.span(lo, hi), iv.from_points(ends))


@key_intervals.register
def _(pattern: Star, n: int, lo: int, hi: int) -> np.ndarray:
    m = n - 1  # the relay is position m; the ring is 0 … m − 1 (Yun eq. 6)
    if hi > m:
        return iv.span(0, n)
    w = min(pattern.w, m)
    a, b = lo - w, hi + w
    if b - a >= m:
        return iv.span(0, n)
    ring = [[max(a, 0), min(b, m)], [a + m, m] if a < 0 else [0, 0], [0, b - m]]
    return iv.union(iv.merge(ring), iv.span(m, n))


def _positions(pattern: GlobalTokens | CausalGlobal, n: int) -> np.ndarray:
    return pattern.positions(n).numpy().astype(np.int64)


@key_intervals.register
def _(pattern: GlobalTokens, n: int, lo: int, hi: int) -> np.ndarray:
    g = _positions(pattern, n)
    if np.any((g >= lo) & (g < hi)):
        return iv.span(0, n)
    return iv.from_points(g)


@key_intervals.register
def _(pattern: Random, n: int, lo: int, hi: int) -> np.ndarray:
    keys = pattern.edge_keys(n)  # sorted i·n + j
    a, b = torch.searchsorted(keys, torch.tensor([lo * n, hi * n])).tolist()
    return iv.from_points((keys[a:b] % n).numpy())


@key_intervals.register
def _(pattern: RandomBlocks, n: int, lo: int, hi: int) -> np.ndarray:
    b = pattern.block
    chosen = pattern.block_table(n)[lo // b : (hi - 1) // b + 1]
    return iv.clip(iv.blocks(chosen.numpy(), b, n), 0, n)


@key_intervals.register
def _(pattern: Union, n: int, lo: int, hi: int) -> np.ndarray:
    return iv.union(*(key_intervals(p, n, lo, hi) for p in pattern.parts))


@key_intervals.register
def _(pattern: HeadSplit, n: int, lo: int, hi: int) -> np.ndarray:
    return iv.union(*(key_intervals(p, n, lo, hi) for p in pattern.patterns))


@key_intervals.register
def _(pattern: NoDiagonal, n: int, lo: int, hi: int) -> np.ndarray:
    _check_static(pattern)
    return key_intervals(pattern.base, n, lo, hi)  # the diagonal lies inside [lo, hi)


@key_intervals.register
def _(pattern: Causal, n: int, lo: int, hi: int) -> np.ndarray:
    # keys j < lo read by some row i >= lo satisfy j <= i: the base's keys, cut at hi − 1
    return iv.clip(key_intervals(pattern.base, n, lo, hi), 0, hi)


@key_intervals.register
def _(pattern: CausalWindow, n: int, lo: int, hi: int) -> np.ndarray:
    return iv.span(max(0, lo - pattern.w + 1), hi)


@key_intervals.register
def _(pattern: CausalStride, n: int, lo: int, hi: int) -> np.ndarray:
    w = pattern.w
    return iv.span(0, hi) if hi - lo >= w else _residues(n, w, lo, hi, hi)


@key_intervals.register
def _(pattern: CausalSegment, n: int, lo: int, hi: int) -> np.ndarray:
    w = pattern.w  # Child's FIXED A¹: the own segment up to the row
    return iv.span(lo // w * w, hi)


@key_intervals.register
def _(pattern: CausalSummary, n: int, lo: int, hi: int) -> np.ndarray:
    w, c = pattern.w, pattern.c
    first = np.arange(w - c, hi, w, dtype=np.int64)
    summary = iv.clip(iv.merge(np.stack([first, first + c], 1)), 0, hi)
    return iv.union(iv.span(lo, hi), summary)


@key_intervals.register
def _(pattern: CausalGlobal, n: int, lo: int, hi: int) -> np.ndarray:
    g = _positions(pattern, n)
    inside = g[(g >= lo) & (g < hi)]
    if len(inside):  # a global row reads every key up to itself
        return iv.union(iv.span(0, int(inside.max()) + 1), iv.from_points(g[g < hi]))
    return iv.from_points(g[g < lo])


@key_intervals.register
def _(pattern: CausalRandomBlocks, n: int, lo: int, hi: int) -> np.ndarray:
    b = pattern.block
    chosen = pattern.block_table(n)[lo // b : (hi - 1) // b + 1].numpy()
    return iv.clip(iv.blocks(chosen[chosen >= 0], b, n), 0, hi)


@key_intervals.register
def _(pattern: BigBirdBlocks, n: int, lo: int, hi: int) -> np.ndarray:
    b, nb = pattern.block, pattern.num_blocks(n)
    first, last = lo // b, (hi - 1) // b
    if first == 0 or last == nb - 1:  # a global block row reads every key
        return iv.span(0, n)
    table = pattern.block_table(n)[:, first - 1 : last].numpy()  # rows 1 … nb − 2 at i − 1
    band = np.arange(first - 1, last + 2)
    return iv.blocks(np.concatenate([band, [0, nb - 1], table.reshape(-1)]), b, n)


def _layout_blocks(pattern: BlockLayout, n: int) -> int:
    nb = pattern.layout.shape[-1]
    if -(-n // pattern.block) != nb:
        raise ValueError(
            f"a layout of {nb} blocks of {pattern.block} covers n in "
            f"({(nb - 1) * pattern.block}, {nb * pattern.block}], got n={n}"
        )
    return nb


@key_intervals.register
def _(pattern: BlockLayout, n: int, lo: int, hi: int) -> np.ndarray:
    _layout_blocks(pattern, n)
    b = pattern.block
    rows = pattern.layout[:, lo // b : (hi - 1) // b + 1].any(0).any(0)
    keys = iv.blocks(np.flatnonzero(rows.numpy()), b, n)
    return iv.clip(keys, 0, hi) if pattern.causal_mask else keys


@key_intervals.register
def _(pattern: _ConfigPattern, n: int, lo: int, hi: int) -> np.ndarray:
    return key_intervals(pattern._layout(n), n, lo, hi)


# ------------------------------------------------------------------ global candidates
@functools.singledispatch
def global_candidates(pattern: object, n: int) -> np.ndarray:
    """Rows that read all or nearly all keys (sorted positions). Without a rule: the rows of
    the exact graph that read every key (up to ``FALLBACK_MAX_N``; none beyond)."""
    if n > FALLBACK_MAX_N and not isinstance(pattern, AttentionGraph):
        return _NONE.copy()
    graph = _fallback_graph(pattern, n)
    full = (graph.degrees.reshape(-1, graph.n_q) == graph.n_k).any(0)
    return np.flatnonzero(full.numpy()).astype(np.int64)


_NONE = np.zeros(0, dtype=np.int64)


def _no_globals(pattern: Pattern, n: int) -> np.ndarray:
    return _NONE.copy()


# Families whose rows never read (nearly) all keys — or, for dense, all read all of them:
# then every row would be global, and fetching the keys is the plan.
for _family in (Dense, Window, Stride, BlockLocal, FixedSummary, Random, RandomBlocks):
    global_candidates.register(_family)(_no_globals)


@global_candidates.register
def _(pattern: Star, n: int) -> np.ndarray:
    return np.array([n - 1], dtype=np.int64)


@global_candidates.register
def _(pattern: GlobalTokens, n: int) -> np.ndarray:
    return _positions(pattern, n)


@global_candidates.register
def _(pattern: CausalGlobal, n: int) -> np.ndarray:
    return _positions(pattern, n)


def _union_points(*arrays: np.ndarray) -> np.ndarray:
    return np.unique(np.concatenate([np.zeros(0, dtype=np.int64), *arrays]))


@global_candidates.register
def _(pattern: Union, n: int) -> np.ndarray:
    return _union_points(*(global_candidates(p, n) for p in pattern.parts))


@global_candidates.register
def _(pattern: HeadSplit, n: int) -> np.ndarray:
    return _union_points(*(global_candidates(p, n) for p in pattern.patterns))


@global_candidates.register
def _(pattern: NoDiagonal, n: int) -> np.ndarray:
    return global_candidates(pattern.base, n)


@global_candidates.register
def _(pattern: Causal, n: int) -> np.ndarray:
    return global_candidates(pattern.base, n)


global_candidates.register(_CausalPattern)(_no_globals)  # CausalGlobal has its own rule


@global_candidates.register
def _(pattern: BigBirdBlocks, n: int) -> np.ndarray:
    b = pattern.block
    pattern.num_blocks(n)
    return np.r_[np.arange(b), np.arange(n - b, n)].astype(np.int64)


@global_candidates.register
def _(pattern: BlockLayout, n: int) -> np.ndarray:
    _layout_blocks(pattern, n)
    if pattern.causal_mask:
        return np.zeros(0, dtype=np.int64)
    full = pattern.layout.any(0).all(-1).numpy()  # block rows that read every key block
    rows = np.arange(n, dtype=np.int64)
    return rows[full[rows // pattern.block]]


@global_candidates.register
def _(pattern: _ConfigPattern, n: int) -> np.ndarray:
    return global_candidates(pattern._layout(n), n)


# ------------------------------------------------------------------ row graphs
@functools.singledispatch
def row_graph(pattern: object, n: int, lo: int, hi: int, heads: int = 1) -> AttentionGraph:
    """Rows lo … hi − 1 of the pattern's graph at length n (hi − lo queries, n keys)."""
    _check_static(pattern)
    if isinstance(pattern, AttentionGraph):
        graph = pattern
    elif isinstance(pattern, HeadSplit):
        graph = pattern.graph(n, num_heads=heads)
    else:
        graph = pattern.graph(n)
    return take_rows(graph, torch.arange(lo, hi))


def _ranges(start: torch.Tensor, stop: torch.Tensor, n: int) -> AttentionGraph:
    return AttentionGraph.from_ranges(start, stop, n)


@row_graph.register
def _(pattern: Dense, n: int, lo: int, hi: int, heads: int = 1) -> AttentionGraph:
    i = torch.arange(lo, hi)
    return _ranges(torch.zeros_like(i), torch.full_like(i, n), n)


@row_graph.register
def _(pattern: Window, n: int, lo: int, hi: int, heads: int = 1) -> AttentionGraph:
    i = torch.arange(lo, hi)
    return _ranges(i - min(math.ceil(pattern.w / 2), n), i + 1 + pattern.w // 2, n)


@row_graph.register
def _(pattern: BlockLocal, n: int, lo: int, hi: int, heads: int = 1) -> AttentionGraph:
    first = torch.arange(lo, hi) // pattern.block * pattern.block
    return _ranges(first, first + min(pattern.block, n), n)


@row_graph.register
def _(pattern: GlobalTokens, n: int, lo: int, hi: int, heads: int = 1) -> AttentionGraph:
    g, m = pattern.positions(n), hi - lo
    gq = g[(g >= lo) & (g < hi)] - lo
    rows = torch.cat([gq.repeat_interleave(n), torch.arange(m).repeat_interleave(g.numel())])
    cols = torch.cat([torch.arange(n).repeat(gq.numel()), g.repeat(m)])
    return AttentionGraph.from_edges(rows, cols, m, n)


@row_graph.register
def _(pattern: _CausalPattern, n: int, lo: int, hi: int, heads: int = 1) -> AttentionGraph:
    # a causal family's row i depends on i alone: rows lo … hi − 1 of the graph at length hi
    rows = pattern._rows(hi, lo)
    return AttentionGraph(rows.crow, rows.col, hi - lo, n, rows.batch_shape, True)


@row_graph.register
def _(pattern: Causal, n: int, lo: int, hi: int, heads: int = 1) -> AttentionGraph:
    base = row_graph(pattern.base, n, lo, hi, heads)
    r = base.row_indices()
    keep = base.col <= r % base.n_q + lo
    return AttentionGraph.from_edges(r[keep], base.col[keep], hi - lo, n, base.batch_shape, True)


@row_graph.register
def _(pattern: NoDiagonal, n: int, lo: int, hi: int, heads: int = 1) -> AttentionGraph:
    _check_static(pattern)
    base = row_graph(pattern.base, n, lo, hi, heads)
    r = base.row_indices()
    keep = base.col != r % base.n_q + lo
    return AttentionGraph.from_edges(r[keep], base.col[keep], hi - lo, n, base.batch_shape)


@row_graph.register
def _(pattern: Union, n: int, lo: int, hi: int, heads: int = 1) -> AttentionGraph:
    _check_static(pattern)
    parts = [row_graph(p, n, lo, hi, heads) for p in pattern.parts]
    return functools.reduce(AttentionGraph.union, parts)
