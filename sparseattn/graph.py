"""AttentionGraph: who may attend to whom (Yun et al. §3.1, the sets A_k).

Storage is compressed sparse rows (CSR) over the *flattened* rows: a graph with leading shape
``batch_shape`` (``()`` for a static pattern, ``(heads,)`` or ``(batch, heads)``) and ``n_q``
queries has ``R = prod(batch_shape) * n_q`` rows; row ``r`` holds the sorted, unique key indices
``col[crow[r]:crow[r + 1]]``. Not one padded ``(n_q, K)`` table: a global token's row holds all
n keys, and padding every row to it would make Longformer, BigBird and STAR cost O(n²); the
engines' padded views (:meth:`AttentionGraph.neighbours`) are padded per group of rows.

One piece: the class and its constructors, views and algebra share one representation.
"""

from __future__ import annotations

import bisect
import math
import warnings
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

import torch
from torch import Tensor

from .memo import Memo
from .validate import check_int, check_positive

__all__ = ["PIECE_EDGES", "PLANS_PER_GRAPH", "AttentionGraph"]

#: Entries a graph's memo keeps: the engines' plans, block masks and device copies of one
#: graph (a few per engine, block size and device), least recently used first out.
PLANS_PER_GRAPH = 64

T = TypeVar("T")

#: Edges per piece of the O(E) passes over a graph (union, block planning). Temporaries of a
#: few MiB are re-used by the C allocator, while larger ones come as fresh pages every time
#: (glibc maps blocks over 32 MiB anew): whole-graph passes ran ~7x slower than their
#: arithmetic at n = 8192 (docs/engines.md, "The user path").
PIECE_EDGES = 1 << 20


def _check_index_tensor(name: str, t: object) -> None:
    """An integer tensor of indices (floats would be truncated silently)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be an integer tensor, got {type(t).__name__}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")


def _device(device: torch.device | str) -> torch.device:
    """``device`` with an index for CUDA (``"cuda"`` → ``cuda:<current>``), so that cache keys
    and comparisons with a tensor's ``.device`` agree."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def broadcast_or_none(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    """Broadcast two shapes like tensors do, or None when they do not broadcast.

    Plain Python: ``torch.broadcast_shapes`` costs ~1 s on its first call (it imports sympy).
    """
    out = []
    for x, y in zip(
        reversed((1,) * (len(b) - len(a)) + tuple(a)),
        reversed((1,) * (len(a) - len(b)) + tuple(b)),
        strict=True,
    ):
        if x != y and 1 not in (x, y):
            return None
        out.append(y if x == 1 else x)
    return tuple(reversed(out))


class AttentionGraph:
    """A sparse attention graph G = {(i, j) : query i may attend to key j}.

    Args:
        crow: LongTensor[R + 1], row pointers over the ``R = prod(batch_shape) * n_q`` rows.
        col: LongTensor[E], key indices, sorted and unique within each row.
        n_q, n_k: numbers of queries and keys.
        batch_shape: leading (batch, heads)-like dims; ``()`` means one graph shared by all.
        causal: whether the graph is causal (no edge above the diagonal; ``density`` divides
            by n(n+1)/2, Sparsefinder eq. 5).

    The raw constructor trusts its inputs: use :meth:`from_neighbours`, :meth:`from_dense`,
    :meth:`from_edges`.
    """

    def __init__(
        self,
        crow: Tensor,
        col: Tensor,
        n_q: int,
        n_k: int,
        batch_shape: Sequence[int] = (),
        causal: bool = False,
    ) -> None:
        self.crow = crow
        self.col = col
        self.n_q = int(n_q)
        self.n_k = int(n_k)
        self.batch_shape = tuple(int(s) for s in batch_shape)
        self.causal = bool(causal)
        #: ``predicate(device)``: this graph's edge set as an element-wise FlexAttention
        #: ``mask_mod`` on ``device`` (or None), set by the static pattern that built it
        #: (:meth:`Pattern.mask_mod`); None for graphs made any other way.
        self.predicate: Callable[[torch.device], Callable | None] | None = None
        #: what the engines derive from this graph (:meth:`cached`)
        self.memo = Memo(PLANS_PER_GRAPH)

    def __getstate__(self) -> dict:
        """What pickle and ``copy.deepcopy`` keep: the edges, not the engines' cached plans
        (an empty memo) nor the predicate (a pattern's; a pickled graph is a plain edge set)."""
        return {**self.__dict__, "predicate": None}

    # ------------------------------------------------------------------ cache and device
    @property
    def device(self) -> torch.device:
        """Where ``crow`` and ``col`` live."""
        return self.col.device

    def cached(self, key: Hashable, make: Callable[[], T]) -> T:
        """``make()``, computed once per ``key`` and kept on this graph: what engines derive
        from a graph lives and dies with it. Keys are tuples whose first item names the owner,
        e.g. ``("block_plan", 64)``; anything device-specific has the device in its key."""
        return self.memo.get(key, make)

    def uncache(self, owner: str | None = None) -> None:
        """Drop the cached entries of ``owner`` (the first item of their keys), or all; the
        benchmarks time planning from a cold graph this way."""
        self.memo.discard(
            None if owner is None else lambda k: (k[0] if isinstance(k, tuple) else k) != owner
        )

    def to(self, device: torch.device | str) -> AttentionGraph:
        """This graph with ``crow`` and ``col`` on ``device``: ``self`` when they are there,
        else a copy made once per device and cached on this graph (its own cache then holds
        what engines derive on that device). O(E) the first time, free afterwards."""
        device = _device(device)
        if self.col.device == device:
            return self
        return self.cached(("to", device), lambda: self._copy_to(device))

    def _copy_to(self, device: torch.device) -> AttentionGraph:
        copy = AttentionGraph(
            self.crow.to(device),
            self.col.to(device),
            self.n_q,
            self.n_k,
            self.batch_shape,
            self.causal,
        )
        copy.predicate = self.predicate  # the same edge set
        return copy

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_edges(
        cls,
        rows: Tensor,
        cols: Tensor,
        n_q: int,
        n_k: int,
        batch_shape: Sequence[int] = (),
        causal: bool = False,
    ) -> AttentionGraph:
        """Graph from flat edge lists (duplicates allowed, any order), O(E log E): ``rows``
        index the flattened rows ``[0, prod(batch_shape) * n_q)``, ``cols`` the keys."""
        _check_index_tensor("rows", rows)
        _check_index_tensor("cols", cols)
        n_q, n_k = check_int("n_q", n_q, 0), check_int("n_k", n_k, 0)
        batch_shape = tuple(check_int("batch_shape[i]", b, 0) for b in batch_shape)
        n_rows = math.prod(batch_shape) * n_q
        if rows.numel() != cols.numel():
            raise ValueError(
                f"rows and cols must hold one entry per edge, got {rows.numel()} and {cols.numel()}"
            )
        rows = rows.reshape(-1).long()
        cols = cols.reshape(-1).long()
        if rows.numel() and (cols.min() < 0 or cols.max() >= n_k):
            raise ValueError(
                f"key indices must lie in [0, {n_k}), got [{cols.min()}, {cols.max()}]"
            )
        key = rows * n_k + cols
        if key.numel() > 1 and not bool((key[1:] > key[:-1]).all()):  # not sorted and unique
            key = torch.unique(key)  # sorted: by row, then by key
            rows, cols = key // n_k, key % n_k
        if rows.numel() and (int(rows[0]) < 0 or int(rows[-1]) >= n_rows):  # rows now sorted
            raise ValueError(
                f"row indices must lie in [0, {n_rows}), got [{int(rows[0])}, {int(rows[-1])}]"
            )
        counts = torch.bincount(rows, minlength=n_rows)
        crow = torch.zeros(n_rows + 1, dtype=torch.long, device=rows.device)
        torch.cumsum(counts, 0, out=crow[1:])
        return cls(crow, cols, n_q, n_k, batch_shape, causal)

    @classmethod
    def from_ranges(
        cls, start: Tensor, stop: Tensor, n_k: int, causal: bool = False
    ) -> AttentionGraph:
        """Graph whose query i attends to the keys start[i] … stop[i] − 1 (windows, blocks);
        ``start``, ``stop``: LongTensor[n_q], clamped to [0, n_k]. O(n_q + E), no (n_q, K) table."""
        start = start.clamp(0, n_k)
        degrees = (stop.clamp(max=n_k) - start).clamp_min(0)
        dev = start.device
        crow = torch.zeros(start.numel() + 1, dtype=torch.long, device=dev)
        torch.cumsum(degrees, 0, out=crow[1:])
        col = torch.empty(int(crow[-1]), dtype=torch.long, device=dev)
        graph = cls(crow, col, start.numel(), n_k, (), causal)
        shift = start - crow[:-1]  # col[e] = e + shift[row of e]
        for lo, hi in graph.row_pieces():
            e0, e1 = int(crow[lo]), int(crow[hi])
            piece = torch.arange(e0, e1, out=graph.col[e0:e1])
            piece += torch.repeat_interleave(shift[lo:hi], degrees[lo:hi], output_size=e1 - e0)
        return graph

    @classmethod
    def from_neighbours(
        cls, index: Tensor, valid: Tensor | None, n_k: int, causal: bool = False
    ) -> AttentionGraph:
        """Graph from a padded neighbour-list table ``index`` LongTensor[..., n_q, K] of key
        indices, ``valid`` a BoolTensor broadcastable to it or None (all valid)."""
        _check_index_tensor("index", index)
        n_k = check_int("n_k", n_k, 0)
        if index.dim() < 2:
            raise ValueError(f"index must have shape (..., n_q, K), got {tuple(index.shape)}")
        if valid is None:
            valid = torch.ones_like(index, dtype=torch.bool)
        elif not isinstance(valid, Tensor) or valid.dtype != torch.bool:
            raise TypeError("valid must be a bool tensor broadcastable to index, or None")
        elif broadcast_or_none(tuple(index.shape), tuple(valid.shape)) is None:
            raise ValueError(
                f"valid of shape {tuple(valid.shape)} does not broadcast to index's "
                f"{tuple(index.shape)} (..., n_q, K)"
            )
        elif valid.device != index.device:
            raise ValueError(f"valid is on {valid.device}, index on {index.device}")
        index, valid = torch.broadcast_tensors(index, valid)
        *batch_shape, n_q, k = index.shape
        if k < 2 or bool((index[..., 1:] > index[..., :-1]).all()):
            # rows already sorted and unique (windows, strides, blocks): CSR directly, O(n·K)
            cols = index[valid]
            if cols.numel() and (cols.min() < 0 or cols.max() >= n_k):
                raise ValueError(
                    f"key indices must lie in [0, {n_k}), got [{cols.min()}, {cols.max()}]"
                )
            crow = torch.zeros(
                math.prod(batch_shape) * n_q + 1, dtype=torch.long, device=index.device
            )
            torch.cumsum(valid.sum(-1).reshape(-1), 0, out=crow[1:])
            return cls(crow, cols, n_q, n_k, batch_shape, causal)
        rows = torch.arange(math.prod(batch_shape) * n_q, device=index.device)
        rows = rows.view(*batch_shape, n_q, 1).expand_as(index)
        return cls.from_edges(rows[valid], index[valid], n_q, n_k, batch_shape, causal)

    @classmethod
    def from_dense(cls, mask: Tensor, causal: bool = False) -> AttentionGraph:
        """Graph from a boolean mask ``[..., n_q, n_k]`` (True = may attend). O(n_q * n_k)."""
        if not isinstance(mask, Tensor):
            raise TypeError(
                f"mask must be a bool tensor of shape (..., n_q, n_k), got {type(mask).__name__}"
                " (a nested list: wrap it in torch.tensor(..., dtype=torch.bool))"
            )
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor, got {mask.dtype}")
        if mask.dim() < 2:
            raise ValueError(f"mask must have shape (..., n_q, n_k), got {tuple(mask.shape)}")
        *batch_shape, n_q, n_k = mask.shape
        flat = mask.reshape(-1, n_k)
        rows, cols = flat.nonzero(as_tuple=True)
        counts = flat.sum(-1)
        crow = torch.zeros(flat.shape[0] + 1, dtype=torch.long, device=mask.device)
        torch.cumsum(counts, 0, out=crow[1:])
        return cls(crow, cols, n_q, n_k, batch_shape, causal)

    # ------------------------------------------------------------------ basic facts
    @property
    def num_rows(self) -> int:
        """R = prod(batch_shape) * n_q."""
        return self.crow.numel() - 1

    @property
    def degrees(self) -> Tensor:
        """LongTensor[*batch_shape, n_q]: |A_i|, the number of keys each query attends to."""
        return (self.crow[1:] - self.crow[:-1]).view(*self.batch_shape, self.n_q)

    @property
    def max_degree(self) -> int:
        return int(self.degrees.max()) if self.num_rows else 0

    def _per_graph(self, x: Tensor) -> Tensor | int | float:
        return x.item() if not self.batch_shape else x

    @property
    def num_edges(self) -> Tensor | int:
        """Edge count |G|: an int for an unbatched graph, else LongTensor[*batch_shape]."""
        return self._per_graph(self.degrees.sum(-1))

    @property
    def possible_edges(self) -> int:
        """Denominator of density: n_q * n_k, or when causal the pairs j <= i (n(n + 1)/2,
        Sparsefinder eq. 5; the last n_q queries of n_k positions when n_q < n_k)."""
        if self.causal:
            return self.n_q * (self.n_k - self.n_q) + self.n_q * (self.n_q + 1) // 2
        return self.n_q * self.n_k

    @property
    def density(self) -> Tensor | float:
        """|G| / possible edges; a float for an unbatched graph, else a tensor per graph."""
        return self._per_graph(self.degrees.sum(-1).double() / self.possible_edges)

    @property
    def sparsity(self) -> Tensor | float:
        """1 − density (Sparsefinder eq. 5; Yun Table 1 reports it as a percentage)."""
        return 1 - self.density

    def row_indices(self) -> Tensor:
        """LongTensor[E]: the flattened row of every stored edge (CSR expanded to COO)."""
        return torch.repeat_interleave(
            torch.arange(self.num_rows, device=self.device),
            self.crow[1:] - self.crow[:-1],
            output_size=self.col.numel(),
        )

    def row_pieces(self, align: int = 1, max_rows: int | None = None) -> list[tuple[int, int]]:
        """Flattened-row ranges [lo, hi) covering all rows, each about ``PIECE_EDGES`` edges
        (a single long row may exceed it) and at most ``max_rows`` rows, cut only at multiples
        of ``align`` rows within a graph or at a graph's edge (so row blocks stay whole)."""
        if not self.num_rows:
            return []
        n_graphs = self.num_rows // self.n_q
        cuts = torch.arange(n_graphs)[:, None] * self.n_q + torch.arange(0, self.n_q, align)
        cuts = [*cuts.reshape(-1).tolist(), self.num_rows]
        edges = self.crow[cuts].tolist()
        step = len(cuts) if max_rows is None else max(1, max_rows // align)
        out, i = [], 0
        while i < len(cuts) - 1:
            j = bisect.bisect_right(edges, edges[i] + PIECE_EDGES) - 1
            j = min(max(j, i + 1), i + step, len(cuts) - 1)
            out.append((cuts[i], cuts[j]))
            i = j
        return out

    # ------------------------------------------------------------------ views
    def neighbours(self, rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Padded neighbour lists (index LongTensor[m, K], valid BoolTensor[m, K]) of the
        flattened rows ``rows`` (LongTensor[m], default all), K their largest degree; padded
        slots hold 0 (a valid key, so gathers are safe)."""
        if rows is None:
            rows = torch.arange(self.num_rows, device=self.device)
        start = self.crow[rows]
        count = self.crow[rows + 1] - start
        k = int(count.max()) if rows.numel() else 0
        slot = torch.arange(k, device=self.device)
        valid = slot < count[:, None]
        pos = (start[:, None] + slot).masked_fill_(~valid, 0)
        index = self.col[pos] if self.col.numel() else torch.zeros_like(pos)
        return index.masked_fill_(~valid, 0), valid

    def to_neighbours(self) -> tuple[Tensor, Tensor]:
        """The whole graph as ``(index, valid)`` of shape ``[*batch_shape, n_q, K]``."""
        index, valid = self.neighbours()
        shape = (*self.batch_shape, self.n_q, index.shape[-1])
        return index.view(shape), valid.view(shape)

    def allows(self, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        """Vectorised edge test for an unbatched graph: BoolTensor of the broadcast shape, by
        binary search over the sorted edge keys (no n_q x n_k table)."""
        if self.batch_shape:
            raise ValueError(f"allows needs an unbatched graph, got batch_shape {self.batch_shape}")
        q_idx, kv_idx = torch.broadcast_tensors(torch.as_tensor(q_idx), torch.as_tensor(kv_idx))
        graph = self.to(q_idx.device)  # the indices' device (a mask_mod runs on the inputs')
        keys = graph.cached(("edge_keys",), graph._edge_keys)
        query = (q_idx.long() * self.n_k + kv_idx.long()).reshape(-1)
        pos = torch.searchsorted(keys, query).clamp_(max=max(keys.numel() - 1, 0))
        hit = keys[pos] == query if keys.numel() else torch.zeros_like(query, dtype=torch.bool)
        return hit.view(q_idx.shape)

    def to_dense(self) -> Tensor:
        """BoolTensor[*batch_shape, n_q, n_k] (True where query i may attend to key j)."""
        mask = torch.zeros(self.num_rows, self.n_k, dtype=torch.bool, device=self.device)
        mask[self.row_indices(), self.col] = True
        return mask.view(*self.batch_shape, self.n_q, self.n_k)

    def to_csr(self) -> Tensor:
        """``torch.sparse_csr_tensor`` of shape (n_q, n_k) with float ones (unbatched graphs)."""
        if self.batch_shape:
            raise ValueError(
                f"to_csr needs an unbatched graph; this one has batch_shape {self.batch_shape}: "
                "select one first, e.g. graph[b, h]"
            )
        values = torch.ones(self.col.numel(), device=self.device)
        with warnings.catch_warnings():  # "CSR support is in beta"
            warnings.simplefilter("ignore")
            return torch.sparse_csr_tensor(
                self.crow, self.col, values, (self.n_q, self.n_k), check_invariants=False
            )

    def to_block_layout(self, block: int) -> Tensor:
        """BoolTensor[*batch_shape, ceil(n_q/b), ceil(n_k/b)]: blocks holding at least one edge."""
        block = check_positive("block", block)
        nb_q, nb_k = -(-self.n_q // block), -(-self.n_k // block)
        rows = self.row_indices()
        brow = (rows // self.n_q) * nb_q + (rows % self.n_q) // block
        layout = torch.zeros(
            math.prod(self.batch_shape) * nb_q, nb_k, dtype=torch.bool, device=self.device
        )
        layout[brow, self.col // block] = True
        return layout.view(*self.batch_shape, nb_q, nb_k)

    def __getitem__(self, idx: int | tuple[int, ...]) -> AttentionGraph:
        """Select leading (batch, head) entries with integers: ``graph[b, h]``."""
        idx = idx if isinstance(idx, tuple) else (idx,)
        if len(idx) > len(self.batch_shape) or not all(isinstance(i, int) for i in idx):
            raise IndexError(f"index with at most {len(self.batch_shape)} integers, got {idx}")
        flat = 0
        for i, size in zip(idx, self.batch_shape, strict=False):
            if not -size <= i < size:
                raise IndexError(f"index {i} out of range for size {size}")
            flat = flat * size + (i % size)
        rest = self.batch_shape[len(idx) :]
        span = math.prod(rest) * self.n_q
        first = flat * span
        crow = self.crow[first : first + span + 1]
        col = self.col[crow[0] : crow[-1]]
        return AttentionGraph(crow - crow[0], col, self.n_q, self.n_k, rest, self.causal)

    # ------------------------------------------------------------------ algebra
    def expand(self, batch_shape: Sequence[int]) -> AttentionGraph:
        """Broadcast the leading dims to ``batch_shape`` (copies edges; O(E * repeats)); the
        same object on every call (cached on this graph), so that what an engine keeps on it
        (a plan, index arrays on a device) is built once."""
        batch_shape = tuple(batch_shape)
        if batch_shape == self.batch_shape:
            return self
        if broadcast_or_none(self.batch_shape, batch_shape) != batch_shape:
            raise ValueError(f"cannot expand batch_shape {self.batch_shape} to {batch_shape}")
        return self.cached(("expanded", batch_shape), lambda: self._expanded(batch_shape))

    def _expanded(self, batch_shape: tuple[int, ...]) -> AttentionGraph:
        dev = self.device
        ids = torch.arange(math.prod(self.batch_shape), device=dev).view(self.batch_shape)
        ids = ids.expand(batch_shape).reshape(-1)
        src = (ids[:, None] * self.n_q + torch.arange(self.n_q, device=dev)).reshape(-1)
        counts = self.crow[src + 1] - self.crow[src]
        crow = torch.zeros(src.numel() + 1, dtype=torch.long, device=dev)
        torch.cumsum(counts, 0, out=crow[1:])
        total = int(crow[-1])
        rows = torch.arange(src.numel(), device=dev)
        new_row = torch.repeat_interleave(rows, counts, output_size=total)
        pos = self.crow[src][new_row] + torch.arange(total, device=dev) - crow[new_row]
        return AttentionGraph(crow, self.col[pos], self.n_q, self.n_k, batch_shape, self.causal)

    def _edge_keys(self) -> Tensor:
        return self.row_indices() * self.n_k + self.col

    def _aligned(self, other: AttentionGraph) -> tuple[AttentionGraph, AttentionGraph]:
        if not isinstance(other, AttentionGraph):
            raise TypeError(f"expected an AttentionGraph, got {type(other).__name__}")
        if (self.n_q, self.n_k) != (other.n_q, other.n_k):
            raise ValueError(
                f"graphs have different sizes: {(self.n_q, self.n_k)} vs {(other.n_q, other.n_k)}"
            )
        shape = broadcast_or_none(self.batch_shape, other.batch_shape)
        if shape is None:
            raise ValueError(
                f"batch shapes {self.batch_shape} and {other.batch_shape} do not broadcast"
            )
        return self.expand(shape), other.expand(shape)

    def union(self, other: AttentionGraph) -> AttentionGraph:
        """G ∪ G' (Yun §5.1 UNION), broadcasting leading dims: a merge piece by piece, the
        smaller side's keys located in the larger's by binary search, O(E_small · log E_large + E).
        """
        a, b = self._aligned(other)
        both = AttentionGraph(a.crow + b.crow, a.col, a.n_q, a.n_k, a.batch_shape)
        cols, counts = [], []
        for lo, hi in both.row_pieces():
            big, small = (a, b) if a._piece_size(lo, hi) >= b._piece_size(lo, hi) else (b, a)
            keys, new = big._piece_keys(lo, hi), small._piece_keys(lo, hi)
            pos = torch.searchsorted(keys, new)
            if keys.numel():
                seen = keys[pos.clamp(max=keys.numel() - 1)] == new
                pos, new = pos[~seen], new[~seen]
            # the i-th fresh key (sorted) lands after pos[i] keys of the big side and i fresh
            at = pos + torch.arange(pos.numel(), device=a.device)
            from_small = torch.zeros(keys.numel() + at.numel(), dtype=torch.bool, device=a.device)
            from_small[at] = True
            piece = torch.empty(from_small.numel(), dtype=torch.long, device=a.device)
            piece[at] = new % a.n_k
            piece[~from_small] = big.col[big.crow[lo] : big.crow[hi]]
            cols.append(piece)
            degrees = big.crow[lo + 1 : hi + 1] - big.crow[lo:hi]
            counts.append(degrees + torch.bincount(new // a.n_k, minlength=hi - lo))
        crow = torch.zeros_like(a.crow)
        if counts:
            torch.cumsum(torch.cat(counts), 0, out=crow[1:])
        col = torch.cat(cols) if cols else a.col[:0]
        return AttentionGraph(crow, col, a.n_q, a.n_k, a.batch_shape, a.causal and b.causal)

    def _piece_size(self, lo: int, hi: int) -> int:
        return int(self.crow[hi] - self.crow[lo])

    def _piece_keys(self, lo: int, hi: int) -> Tensor:
        """Sorted keys (row − lo)·n_k + col of the edges of flattened rows lo … hi − 1."""
        e0, e1 = int(self.crow[lo]), int(self.crow[hi])
        deg = self.crow[lo + 1 : hi + 1] - self.crow[lo:hi]
        rows = torch.arange(hi - lo, device=self.device)
        rows = torch.repeat_interleave(rows, deg, output_size=e1 - e0)
        return rows * self.n_k + self.col[e0:e1]

    def intersection(self, other: AttentionGraph) -> AttentionGraph:
        """G ∩ G', broadcasting leading dims."""
        a, b = self._aligned(other)
        keys = a._edge_keys()
        keys = keys[torch.isin(keys, b._edge_keys())]
        return AttentionGraph.from_edges(
            keys // a.n_k, keys % a.n_k, a.n_q, a.n_k, a.batch_shape, a.causal or b.causal
        )

    __or__ = union
    __and__ = intersection

    def tril(self) -> AttentionGraph:
        """Keep only edges with key <= query (the causal restriction), marked causal."""
        if self.n_q != self.n_k:
            raise ValueError(f"causal graphs need n_q == n_k, got {self.n_q} and {self.n_k}")
        rows = self.row_indices()
        keep = self.col <= rows % self.n_q
        return AttentionGraph.from_edges(
            rows[keep], self.col[keep], self.n_q, self.n_k, self.batch_shape, causal=True
        )

    def __eq__(self, other: object) -> bool:
        """Same sizes, leading dims and edge set (the ``causal`` flag is metadata)."""
        if not isinstance(other, AttentionGraph):
            return NotImplemented
        return (
            (self.n_q, self.n_k, self.batch_shape) == (other.n_q, other.n_k, other.batch_shape)
            and torch.equal(self.crow, other.crow)
            and torch.equal(self.col, other.col)
        )

    __hash__ = None  # mutable tensors inside

    def __repr__(self) -> str:
        return (
            f"AttentionGraph(n_q={self.n_q}, n_k={self.n_k}, batch_shape={self.batch_shape}, "
            f"edges={int(self.col.numel())}, max_degree={self.max_degree}, causal={self.causal})"
        )
