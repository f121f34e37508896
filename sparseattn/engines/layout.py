"""The block layout of an attention graph and the block engine's plan over it.

A *row block* (``block`` queries of one graph) pairs with the key blocks holding one of its
edges, *full* or *partial* (an element mask). :func:`block_pairs` lists the pairs in one pass
over the edges; :func:`count_pairs` and :func:`choose_block` size the layout; :func:`block_plan`
groups the row blocks into chunks (:class:`BlockPlan`) for :mod:`.block`, cached on the graph.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..graph import PIECE_EDGES, PLANS_PER_GRAPH, AttentionGraph
from ..memo import Memo
from .costs import ENTRY_COST, ENTRY_COST_TRAIN

__all__ = [
    "BLOCK_SIZES",
    "BlockChunk",
    "BlockGroup",
    "BlockPairs",
    "BlockPlan",
    "SegmentRun",
    "block_pairs",
    "block_plan",
    "choose_block",
    "count_pairs",
    "select_blocks",
]

#: Block sizes the engine chooses from when ``block=None``.
BLOCK_SIZES = (16, 32, 64, 128)


@dataclass
class BlockGroup:
    rows: Tensor  # LongTensor[m]: row-block ids g·nbq + i
    full: Tensor  # LongTensor[m, Cf]: key-block ids g·nbk + j of the full blocks
    part: Tensor  # LongTensor[m, Cp]: key-block ids of the partial blocks
    keep: Tensor | None  # uint8[m, b, Cp·b]: 1 where a partial block has an edge


@dataclass
class BlockChunk:
    rows: Tensor  # LongTensor[m]
    full: Tensor  # LongTensor[m, Cf]
    part: Tensor  # LongTensor[m, Cp]
    keep: Tensor | None  # uint8[m, b, Cp·b]
    run: tuple[int, int] | None  # full[r, j] = start + r·step + j, or None
    bias: Tensor | None = None  # float[b, Cf·b]: 0 / −inf over ``full`` (split path, banded)
    shared: bool = False  # every row block has the same partial key blocks (global columns)
    extra: Tensor | None = None  # LongTensor[m, Ce]: full blocks off the run (split path)
    first: int | None = None  # rows == first + arange(m): row slices are views
    cols: Tensor | None = None  # shared: the offsets in its Cp·b keys that some row uses
    extra_shared: bool = False  # every row block has the same ``extra`` (gathered once)

    def take(self, x: Tensor) -> Tensor:
        """The chunk's row blocks of x (L, G·nb, ...): a view when they are consecutive."""
        if self.first is None:
            return select_blocks(x, self.rows)
        return x[:, self.first : self.first + self.rows.numel()]


def select_blocks(x: Tensor, index: Tensor) -> Tensor:
    """x[:, index] for x (L, N, ...): ``index_select`` on a contiguous x, advanced indexing on a
    strided one (a view of a projection), where ``index_select`` would first copy all of x."""
    return x.index_select(1, index) if x.is_contiguous() else x[:, index]


def _segments(full: Tensor, keep: Tensor | None = None):
    """Cut a group's rows into [start, end) segments whose full key blocks form one run of
    consecutive blocks moving by a fixed step per row (``(first, step)``), or None; with
    ``keep`` (the partial blocks' masks) also where the masks change, so that the band edges
    can join the run (:func:`_band`), pieces shorter than 4 rows staying with a neighbour."""
    m, cf = full.shape
    if cf == 0 or m == 0:
        return [(0, m, None)]
    contig = (full[:, 1:] - full[:, :-1] == 1).all(1) if cf > 1 else full.new_ones(m, dtype=bool)
    first = full[:, 0]
    delta = first[1:] - first[:-1]
    cut = ~(contig[1:] & contig[:-1])
    cut[1:] |= delta[1:] != delta[:-1]
    if keep is not None and keep.numel():
        change = (keep[1:] != keep[:-1]).flatten(1).any(1)
        cut |= change & _long_pieces(change)
    bounds = [0, *(cut.nonzero().squeeze(1) + 1).tolist(), m]
    out: list[tuple[int, int, tuple[int, int] | None]] = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        step = int(delta[lo]) if hi - lo > 1 else 0
        run = (int(first[lo]), step) if bool(contig[lo]) and step >= 0 else None
        if run is None and out and out[-1][2] is None and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi, None)
        else:
            out.append((lo, hi, run))
    return out


def _long_pieces(change: Tensor, least: int = 4) -> Tensor:
    """Which of the cuts at ``change`` (bool per gap between rows) to keep: those bounding a
    piece of at least ``least`` rows on either side (short pieces stay with a neighbour)."""
    at = change.nonzero().squeeze(1).tolist()
    keep = torch.zeros_like(change)
    edges = [-1, *at, change.numel()]
    for i, c in enumerate(at):
        if c - edges[i] >= least or edges[i + 2] - c >= least:
            keep[c] = True
    return keep


def _longest_run(full: Tensor) -> tuple[Tensor, Tensor | None]:
    """Split each row's full key blocks (sorted ids, (m, Cf)) into its longest run of
    consecutive blocks, cut to the group's shortest (m, R), and the others (m, Cf − R) or None:
    BigBird's band apart from its random blocks, still a strided view."""
    m, cf = full.shape
    if cf < 2 or m == 0:
        return full, None
    cur = full.new_ones(m)
    best, end = cur.clone(), full.new_zeros(m)
    for j in range(1, cf):
        cur = torch.where(full[:, j] == full[:, j - 1] + 1, cur + 1, 1)
        better = cur > best
        best, end = torch.where(better, cur, best), torch.where(better, j, end)
    length = int(best.min())
    if length == cf:
        return full, None
    idx = (end - best + 1)[:, None] + torch.arange(length, device=full.device)
    off = full.new_ones(m, cf, dtype=torch.bool)
    off[torch.arange(m, device=full.device)[:, None], idx] = False
    return full.gather(1, idx), full[off].view(m, cf - length)


def _diagonal_run(
    full: Tensor, rows: Tensor, nbq: int, nbk: int
) -> tuple[Tensor, Tensor | None] | None:
    """Like :func:`_longest_run`, around each row's own key block: the run of full key blocks
    i − a … i + c that every row of the group holds about its diagonal block i (a and c the
    group's least reach to either side), (m, a + c + 1), and the others (m, Cf − a − c − 1) or
    None. Its first block moves by one per row, so consecutive row blocks make one segment
    even where a row's longest run lies elsewhere (BigBird's random blocks, drawn per head,
    next to one another or to the band). None where it does not apply: n_q ≠ n_k, a row
    without its diagonal block among the full ones, or no block beside the diagonal."""
    m, cf = full.shape
    if nbq != nbk or cf < 2 or m == 0:
        return None
    diag = rows  # row block g·nbq + i: its diagonal key block g·nbk + i (nbq = nbk)
    hit = full == diag[:, None]
    if not bool(hit.any(1).all()):
        return None
    at = hit.to(torch.uint8).argmax(1)

    def reach(step: int) -> int:
        alive, count = torch.ones_like(hit[:, 0]), torch.zeros_like(at)
        for t in range(1, cf):
            j = at + step * t
            inside = (j >= 0) & (j < cf)
            same = full.gather(1, j.clamp(0, cf - 1)[:, None]).squeeze(1) == diag + step * t
            alive = alive & inside & same
            if not bool(alive.any()):
                break
            count = count + alive
        return int(count.min())

    left, right = reach(-1), reach(1)
    length = left + right + 1
    if length == 1:
        return None
    if length == cf:
        return full, None
    idx = (at - left)[:, None] + torch.arange(length, device=full.device)
    off = torch.ones_like(hit)
    off[torch.arange(m, device=full.device)[:, None], idx] = False
    return full.gather(1, idx), full[off].view(m, cf - length)


def _runs(grp: BlockGroup, nbq: int, nbk: int) -> tuple[Tensor, Tensor | None]:
    """A group's full key blocks as (a run per row, the others or None): the run about each
    row's own block (:func:`_diagonal_run`) where it is at least as long as the group's
    longest common run (:func:`_longest_run`), else that one."""
    longest = _longest_run(grp.full)
    diagonal = _diagonal_run(grp.full, grp.rows, nbq, nbk)
    if diagonal is not None and diagonal[0].shape[1] >= longest[0].shape[1]:
        return diagonal
    return longest


def _band(full: Tensor, part: Tensor, keep: Tensor, run: tuple[int, int], b: int):
    """Move the partial blocks that extend a run of full blocks (``run = (start, step)``) on
    either side, with the same element mask in every row, into the run: (full, part, keep,
    bias, run), the widened run with its additive bias (b, Cf·b), 0 on edges and −inf
    elsewhere, shared by all rows, and the partial blocks left over."""
    m, cp = part.shape
    kv = keep.view(m, b, cp, b)
    same = (kv == kv[:1]).permute(2, 0, 1, 3).reshape(cp, -1).all(1)  # per slot
    slots = list(range(cp))

    def grow(edge_of) -> list[int]:  # slots of the next blocks outwards, while they qualify
        taken: list[int] = []
        while True:
            edge = edge_of(len(taken))
            hit = next((j for j in slots if same[j] and (part[:, j] == edge).all()), None)
            if hit is None:
                return taken
            taken.append(hit)
            slots.remove(hit)

    left = grow(lambda i: full[:, 0] - 1 - i)[::-1]
    right = grow(lambda i: full[:, -1] + 1 + i)
    if not left and not right:
        return full, part, keep, None, run
    ids = torch.cat([part[:, left], full, part[:, right]], 1)
    inner = keep.new_ones(b, full.shape[1] * b)
    band = torch.cat([kv[0, :, left].reshape(b, -1), inner, kv[0, :, right].reshape(b, -1)], 1)
    bias = torch.zeros(band.shape, device=band.device).masked_fill_(band == 0, float("-inf"))
    rest = torch.tensor(slots, dtype=torch.long, device=part.device)
    keep = kv[:, :, rest].reshape(m, b, -1) if slots else None
    return ids.contiguous(), part[:, rest].contiguous(), keep, bias, (run[0] - len(left), run[1])


@dataclass
class BlockPlan:
    """The block layout of a graph with G = prod(batch_shape) graphs, as the engine runs it.

    Attributes:
        block, graphs: block size b and G (1 for a static graph).
        nbq, nbk: query and key blocks per graph, ceil(n / b).
        groups: row blocks grouped by (full, partial) key-block counts.
        pairs: non-empty (row block, key block) pairs; ``pairs · b²`` entries are scored.
        partial: how many of those pairs need an element mask.
        edges: edges of the graph (the useful entries).
    """

    block: int
    graphs: int
    nbq: int
    nbk: int
    groups: list[BlockGroup]
    pairs: int
    partial: int
    edges: int
    #: its chunk lists (per lead, budget and path) and device copies
    memo: Memo = field(default_factory=lambda: Memo(PLANS_PER_GRAPH), repr=False, compare=False)

    @property
    def fill(self) -> float:
        """Useful fraction of the scored entries, edges / (pairs · b²)."""
        return self.edges / max(1, self.pairs * self.block * self.block)

    def chunks(self, lead: int, budget: int, split: bool = False) -> list[BlockChunk]:
        """Chunks of at most ``budget`` materialised score entries for L = ``lead`` riding
        (batch, head) pairs, never straddling a run of consecutive full key blocks (cached).
        With ``split`` (the split-softmax path) full blocks count a quarter (the flash kernel
        streams them) and a band's edge blocks join its run (:func:`_band`)."""
        return self._cut(lead, budget, split)[0]

    def runs(self, lead: int, budget: int, width: int) -> list[SegmentRun]:
        """The split path's chunks (:meth:`chunks`) by run segment, for the forward (cached).

        The flash kernel streams the keys and keeps its temporaries per thread, so a run of
        full blocks is not cut by ``budget``: one flash call covers a segment's run (then one
        call per band, not per chunk: fewer calls, and a row block's band stays in cache for
        the next). A segment whose row blocks all share their partial key blocks (the global
        columns of Longformer) and have no gathered full blocks is ``complete``: its shared
        columns are scored for the whole segment too, when they are at most ``width`` (the
        head dim d: scores no larger than the output); else the chunks take them."""

        def make() -> list[SegmentRun]:
            out = []
            for whole, pieces, complete in self._cut(lead, budget, True)[1]:
                if complete and whole.part.shape[1]:  # shared columns: scores ≤ the output
                    cols = whole.part.shape[1] * self.block if whole.cols is None else None
                    complete = (cols or whole.cols.numel()) <= width
                if whole is not None and not complete:  # the run alone; chunks do the rest
                    whole = dataclasses.replace(
                        whole,
                        part=whole.part[:, :0],
                        keep=None,
                        cols=None,
                        extra=None,
                        extra_shared=False,
                    )
                out.append(SegmentRun(whole, pieces, complete))
            return out

        return self.memo.get(("runs", lead, budget, width), make)

    def _cut(self, lead: int, budget: int, split: bool):
        return self.memo.get(
            ("chunks", lead, budget, split), lambda: self._chunks(lead, budget, split)
        )

    def _chunks(self, lead: int, budget: int, split: bool):
        """(the chunks, and per run segment: (the whole segment as one chunk or None, its
        chunks, whether the whole may compute everything)); see :meth:`chunks`, :meth:`runs`."""
        out, segments, b = [], [], self.block
        for grp in self.groups:
            main, others = _runs(grp, self.nbq, self.nbk) if split else (grp.full, None)
            for lo, hi, run in _segments(main, grp.keep if split else None):
                full, part = main[lo:hi], grp.part[lo:hi]
                keep = None if grp.keep is None else grp.keep[lo:hi]
                extra = None if others is None else others[lo:hi]
                bias = None
                if run is None and extra is not None:  # no run: all full blocks gathered
                    full, extra = torch.cat([full, extra], 1), None
                if split and run is not None and keep is not None:
                    full, part, keep, bias, run = _band(full, part, keep, run, b)
                cf, cp = full.shape[1], part.shape[1]
                ce = 0 if extra is None else extra.shape[1]
                if not split:
                    weight = cf + cp
                else:  # a run is a view, gathered full blocks count a quarter (streamed)
                    weight = cp + 1 + (ce + 3) // 4 if run is not None else cp + (cf + 3) // 4
                step = max(1, budget // (lead * b * b * weight))
                rows, m = grp.rows[lo:hi], hi - lo
                cut = [
                    _chunk(rows, full, part, keep, run, bias, extra, s, min(s + step, m), split)
                    for s in range(0, m, step)
                ]
                out.extend(cut)
                whole, complete = None, False
                if split and run is not None and cf and len(cut) > 1:
                    # gathered blocks that every row holds (BigBird's global blocks): the
                    # whole segment's forward takes them too, gathered once and expanded
                    whole = _chunk(rows, full, part, keep, run, bias, extra, 0, m, True)
                    complete = (not ce or whole.extra_shared) and (not cp or whole.shared)
                segments.append((whole, cut, complete))
        return out, segments

    def to(self, device: torch.device) -> BlockPlan:
        """The plan with its index tensors on ``device`` (copied once, cached on this plan,
        so that its chunks are cut once per device too)."""
        if not self.groups or self.groups[0].rows.device == device:
            return self

        def make() -> BlockPlan:
            groups = [
                BlockGroup(
                    g.rows.to(device),
                    g.full.to(device),
                    g.part.to(device),
                    None if g.keep is None else g.keep.to(device),
                )
                for g in self.groups
            ]
            return dataclasses.replace(self, groups=groups, memo=Memo(PLANS_PER_GRAPH))

        return self.memo.get(("to", device), make)


def _used_columns(keep: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """For partial blocks shared by a chunk's rows, keep (m, b, C): the columns some row
    uses (None: all) and keep on those (None: all ones, no mask), e.g. Longformer's g global
    keys in a block of b: the others are never scored."""
    used = keep.amax((0, 1)) > 0
    cols = None if bool(used.all()) else used.nonzero().squeeze(1)
    if cols is not None:
        keep = keep[:, :, cols]
    return (None if bool(keep.all()) else keep), cols


def _chunk(rows, full, part, keep, run, bias, extra, s, e, split) -> BlockChunk:
    """Row blocks [s, e) of a segment (its row blocks ``rows``, its blocks and run) as a
    chunk; on the split path a partial block shared by all its rows is marked, scored only
    on the columns some row uses, and gathered blocks shared by all its rows are marked."""
    pt = part[s:e]
    shared = split and e - s > 1 and bool((pt == pt[:1]).all()) and pt.shape[1] > 0
    kp, cols = None if keep is None else keep[s:e], None
    if shared and kp is not None:
        kp, cols = _used_columns(kp)
    ids = rows[s:e]
    first = int(ids[0]) if int(ids[-1] - ids[0]) == e - s - 1 else None
    ex = None if extra is None else extra[s:e]
    return BlockChunk(
        ids,
        full[s:e],
        pt,
        kp,
        None if run is None else (run[0] + s * run[1], run[1]),
        bias,
        shared,
        ex,
        first,
        cols=cols,
        extra_shared=ex is not None and e - s > 1 and bool((ex == ex[:1]).all()),
    )


@dataclass
class SegmentRun:
    """One run segment of the split path's forward (:meth:`BlockPlan.runs`)."""

    whole: BlockChunk | None  # the segment as one chunk (None: its chunks do everything)
    pieces: list[BlockChunk]  # its chunks
    complete: bool  # ``whole`` computes everything (else only its run, in one flash call)


@dataclass
class BlockPairs:
    """The non-empty (row block, key block) pairs of a graph at one block size, in order.

    Attributes:
        keys: LongTensor[P], sorted pair keys (g·nbq + i)·nbk + j.
        counts: LongTensor[P], edges in each pair.
        full: BoolTensor[P], whether every entry of the pair is an edge.
        e_pair, e_q, e_k: LongTensor[E_p], each partial pair's edges: the pair and the query
            and key offsets in the block (None unless asked for).
    """

    keys: Tensor
    counts: Tensor
    full: Tensor
    e_pair: Tensor | None = None
    e_q: Tensor | None = None
    e_k: Tensor | None = None


def block_pairs(graph: AttentionGraph, block: int, partial: bool = False) -> BlockPairs:
    """The block pairs of ``graph`` at ``block``, in one pass over the edges piece by piece,
    O(E + P); with ``partial`` also the edges of the partial pairs (the element masks)."""
    n_q, n_k = graph.n_q, graph.n_k
    nbq, nbk = -(-n_q // block), -(-n_k // block)
    keys, counts, full, e_pair, e_q, e_k = [], [], [], [], [], []
    found = 0
    shift = block.bit_length() - 1 if block & (block - 1) == 0 else None  # b = 2^shift
    max_rows = max(block, PIECE_EDGES // max(1, nbk) * block)
    for lo, hi in graph.row_pieces(align=block, max_rows=max_rows):
        rows = torch.arange(lo, hi, device=graph.device)
        local = rows % n_q
        rb = (rows // n_q) * nbq + local // block
        base, span = int(rb[0]), int(rb[-1] - rb[0]) + 1
        deg = graph.crow[lo + 1 : hi + 1] - graph.crow[lo:hi]
        e0, e1 = int(graph.crow[lo]), int(graph.crow[hi])
        col = graph.col[e0:e1]
        key = torch.repeat_interleave((rb - base) * nbk, deg, output_size=e1 - e0)
        key += col >> shift if shift is not None else col // block
        cnt = torch.bincount(key, minlength=span * nbk)
        nz = cnt.nonzero().squeeze(1)
        real_rows = (n_q - ((nz // nbk + base) % nbq) * block).clamp(max=block)
        whole = cnt[nz] == real_rows * block  # count <= rows · keys: the key block is whole too
        keys.append(nz + base * nbk)
        counts.append(cnt[nz])
        full.append(whole)
        if partial and not bool(whole.all()):
            index = torch.full((span * nbk,), -1, dtype=torch.long, device=graph.device)
            index[nz[~whole]] = (~whole).nonzero().squeeze(1) + found
            pair = index[key]
            at = (pair >= 0).nonzero().squeeze(1)  # the edges of partial pairs (few)
            row = torch.searchsorted(graph.crow[lo + 1 : hi + 1], at + e0, right=True)
            e_pair.append(pair[at])
            e_q.append(local[row] % block)
            e_k.append(col[at] % block)
        found += nz.numel()
    dev = graph.device
    out = BlockPairs(_cat(keys, dev), _cat(counts, dev), _cat(full, dev, torch.bool))
    if partial:
        out.e_pair, out.e_q, out.e_k = _cat(e_pair, dev), _cat(e_q, dev), _cat(e_k, dev)
    return out


def _cat(parts: list[Tensor], device: torch.device, dtype: torch.dtype = torch.long) -> Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype, device=device)


def count_pairs(graph: AttentionGraph, block: int) -> int:
    """Number of non-empty (row block, key block) pairs of ``graph`` at this block size
    (multiples of ``BLOCK_SIZES[0]`` counted from that size's pairs, cached on the graph)."""
    base = BLOCK_SIZES[0]
    if block % base:
        return int(block_pairs(graph, block).keys.numel())
    keys = graph.cached(("block_pairs", base), lambda: block_pairs(graph, base).keys)
    nbq0, nbk0 = -(-graph.n_q // base), -(-graph.n_k // base)
    nbq, nbk = -(-graph.n_q // block), -(-graph.n_k // block)
    rb, kb = keys // nbk0, keys % nbk0
    rb = (rb // nbq0) * nbq + (rb % nbq0) * base // block
    return int(torch.unique(rb * nbk + kb * base // block).numel())


def choose_block(graph: AttentionGraph, train: bool = False) -> int:
    """The block size of ``BLOCK_SIZES`` (up to half the sequence length) with the least
    estimated work pairs·b²·ENTRY_COST[b] (``ENTRY_COST_TRAIN`` with gradients); cached."""

    def choose() -> int:
        n = max(graph.n_q, graph.n_k)
        sizes = [b for b in BLOCK_SIZES if b == BLOCK_SIZES[0] or 2 * b <= n]
        table = ENTRY_COST_TRAIN if train else ENTRY_COST
        cost = {b: count_pairs(graph, b) * b * b * table[b] for b in sizes}
        return min(cost, key=cost.get)

    return graph.cached(("block_choice", train), choose)


def block_plan(graph: AttentionGraph, block: int) -> BlockPlan:
    """The block plan of ``graph`` at ``block`` (built once, cached on the graph)."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    return graph.cached(("block_plan", block), lambda: _build_plan(graph, block))


def _build_plan(graph: AttentionGraph, block: int) -> BlockPlan:
    n_q, n_k = graph.n_q, graph.n_k
    nbq, nbk = -(-n_q // block), -(-n_k // block)
    g_count = max(1, math.prod(graph.batch_shape))
    dev = graph.device
    pairs = block_pairs(graph, block, partial=True)
    pair_rb, pair_kb, full = pairs.keys // nbk, pairs.keys % nbk, pairs.full
    # order pairs by row block, full ones first, then by key block (stable)
    order = torch.argsort(pair_rb * 2 + (~full).long(), stable=True)
    per_rb = torch.bincount(pair_rb, minlength=g_count * nbq)
    n_full = torch.bincount(pair_rb[full], minlength=g_count * nbq)
    first = torch.cumsum(per_rb, 0) - per_rb
    key_ids = ((pair_rb // nbq) * nbk + pair_kb)[order]
    slot_of_pair = torch.empty_like(order)
    slot_of_pair[order] = torch.arange(order.numel(), device=dev) - first[pair_rb[order]]

    e_rb = pair_rb[pairs.e_pair]
    e_q, e_k = pairs.e_q, pairs.e_k
    e_slot = slot_of_pair[pairs.e_pair] - n_full[e_rb]  # slot among the row block's partial pairs

    # row blocks grouped by (full, partial) counts; each partial edge goes to its group's
    # element mask at flat index ((row block in group · b + q) · Cp + slot) · b + k
    combo = n_full * (nbk + 1) + (per_rb - n_full)
    uniq, grp_of_rb = torch.unique(combo, return_inverse=True)
    rb_order = torch.argsort(grp_of_rb, stable=True)  # ascending row blocks within a group
    grp_size = torch.bincount(grp_of_rb, minlength=uniq.numel())
    grp_first = torch.cumsum(grp_size, 0) - grp_size
    pos_in_grp = torch.empty_like(rb_order)
    pos_in_grp[rb_order] = (
        torch.arange(rb_order.numel(), device=dev) - grp_first[grp_of_rb[rb_order]]
    )
    e_grp = grp_of_rb[e_rb]
    flat = (pos_in_grp[e_rb] * block + e_q) * (uniq % (nbk + 1))[e_grp] + e_slot
    flat = flat * block + e_k
    e_order = torch.argsort(e_grp, stable=True)
    flat = flat[e_order].split(torch.bincount(e_grp, minlength=uniq.numel()).tolist())
    extra = nbq * block - n_q

    groups = []
    for gi, key in enumerate(uniq.tolist()):
        cf, cp = divmod(key, nbk + 1)
        lo = int(grp_first[gi])
        rbs = rb_order[lo : lo + int(grp_size[gi])]
        ids = key_ids[first[rbs][:, None] + torch.arange(cf + cp, device=dev)]
        keep = None
        if cp:
            m = rbs.numel()
            allowed = torch.zeros(m * block * cp * block, dtype=torch.bool, device=dev)
            allowed[flat[gi]] = True
            allowed = allowed.view(m, block, cp * block)
            short = ((rbs % nbq) == nbq - 1).nonzero().squeeze(1)
            if extra and short.numel():  # queries past n_q see every slot (finite, discarded)
                allowed[short, block - extra :] = True
            keep = allowed.to(torch.uint8)
        groups.append(BlockGroup(rbs, ids[:, :cf].contiguous(), ids[:, cf:].contiguous(), keep))
    return BlockPlan(
        block, g_count, nbq, nbk, groups, pairs.keys.numel(), int((~full).sum()), graph.col.numel()
    )
