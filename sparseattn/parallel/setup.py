"""What one rank of a context-parallel call derives from the plan (:mod:`.plan`), kept per
process: the plan itself, and per (rank, heads) the halo's send and receive lists, the local
rows' graph renumbered onto the extended keys ([received from lower ranks, own, received from
higher ranks], in global order) and the global rows' mask of this shard's keys. Built once per
pattern, boundaries, block and heads (the :data:`CACHE_SIZE` most recently used), so that a
repeated call does no planning.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import numpy as np
import torch
from torch import Tensor

from ..graph import AttentionGraph
from ..patterns.base import Causal, Pattern
from ..patterns.fixed import Dense
from . import intervals as iv
from .plan import Plan, plan
from .rules import row_graph

__all__ = ["CACHE_SIZE", "Setup", "cached_plan", "cached_setup"]

#: Plans and per-rank set-ups kept per process (the least recently used go first).
CACHE_SIZE = 8

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


def cached_plan(pattern, bounds: tuple[int, ...], block: int, digest: str) -> Plan:
    return _lru(
        _PLANS, (digest, bounds, block),
        lambda: plan(pattern, bounds[-1], boundaries=bounds, block=block),
    )  # fmt: skip


@dataclasses.dataclass(eq=False)
class Setup:
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


def cached_setup(pattern, p: Plan, rank: int, heads: int, digest: str) -> Setup:
    """:func:`_make_setup`'s set-up of ``rank`` for ``heads`` heads, kept per (pattern digest,
    boundaries, block, rank, heads)."""
    key = (digest, p.boundaries, p.block, rank, heads)
    return _lru(_SETUPS, key, lambda: _make_setup(pattern, p, rank, heads))


def _make_setup(pattern, p: Plan, rank: int, heads: int) -> Setup:
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
    return Setup(
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
