"""Block engine: block-sparse attention as batched matrix products over non-empty blocks.

The graph is laid out in square blocks of ``block`` tokens. A *row block* (``block``
consecutive queries of one graph) attends to the key blocks that hold at least one of its
edges. Its key blocks are *full* (every (query, key) pair of the block is an edge) or
*partial* (an element mask is needed). Each query's map ρ sees its whole row of selected
blocks, with the element mask of the partial blocks as ``valid`` (Yun et al. eq. 3 computed
on a superset of A_i and masked back to it).

Row blocks are grouped by their (number of full, number of partial) key blocks — as the gather
engine groups rows by degree — so a few dense rows (global tokens) form their own small group
instead of padding every row block to n keys. Each group is cut into chunks of at most
``budget`` score entries; peak memory beyond q, k, v and the output is O(budget).

Two ways to compute a chunk:

* **split softmax** (softmax, no key padding, no dropout, d_v = d, CPU): the run of
  consecutive full blocks — widened by the band's partial edge blocks under one broadcast
  bias (:func:`_band`) — goes through torch's fused CPU flash-attention kernel as a strided
  view of K and V, which returns the log-sum-exp of each row; full blocks off the run go
  through the kernel gathered; the other partial blocks are scored, masked and exponentiated
  here; the parts are merged by their log-sum-exps. Backward uses the same split: given the
  *merged* output and log-sum-exp each part adds exactly its share of dQ, dK, dV
  (dS = P ⊙ (dP − rowsum(dO ⊙ O)) decomposes over any split of the keys) — the full blocks
  through the flash backward kernel from b = 64, by the closed form below that.
* **general** (any map, key padding, dropout): scores of all blocks side by side, ρ on the
  masked row, weights · V. Backward recomputes each chunk; softmax uses its closed form
  dS = P ⊙ (dP − Σ P⊙dP), any other map autograd on the recomputed chunk; dropout masks are
  replayed from the saved RNG state.

Both backward passes keep only q, k, v, the output and (split) the row log-sum-exps, and add
dK, dV into one buffer with ``index_add_``: O(n·d + budget) memory for training too.

The plan (block pairs, groups, element masks of partial blocks) is built once per
(graph, block) in O(E + partial pairs · block²) and cached on the graph object.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import FunctionCtx

from ..graph import PIECE_EDGES, AttentionGraph
from ..maps import ProbabilityMap
from .precision import compute_dtype

__all__ = [
    "BlockPairs",
    "BlockPlan",
    "block_attention",
    "block_pairs",
    "block_plan",
    "choose_block",
    "count_pairs",
]

#: Block sizes the engine chooses from when ``block=None``.
BLOCK_SIZES = (16, 32, 64, 128)
#: Relative cost of one scored entry at each block size (matrix-product efficiency and
#: per-chunk overhead, measured on this machine; docs/benchmarks.md, "block size").
ENTRY_COST = {16: 1.6, 32: 1.1, 64: 1.0, 128: 0.92}
#: The same for forward + backward (the backward's small per-row-block matrix products make
#: small blocks relatively dearer when training).
ENTRY_COST_TRAIN = {16: 2.2, 32: 1.2, 64: 1.0, 128: 0.85}

#: Score entries per chunk by device type: on CPU small chunks keep the temporaries in cache;
#: on a GPU one chunk must fill the device (2²⁴ fp32 entries = 64 MiB; docs/benchmarks.md).
BUDGET = {"cpu": 1 << 18, "cuda": 1 << 24}

#: Below this fraction of useful entries in the block layout ``engine="auto"`` gathers instead:
#: ~60–110 ns per gathered edge against ~4–8 ns per scored block entry (1-thread CPU time, fp32,
#: d = 64, softmax; docs/engines.md, "auto rule"), break-even near 1/15.
BLOCK_MIN_FILL = 1 / 15

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
#: From this block size on, the full blocks' backward goes through torch's flash backward
#: kernel; below it, the closed form here (`python -m sparseattn.bench.calibrate --blocks 4096`
#: on both: flash 7–30% faster per entry at b ≥ 64, as fast at b = 32, slower at b = 16).
FLASH_BACKWARD_BLOCK = 64


@dataclass
class _Group:
    rows: Tensor  # LongTensor[m]: row-block ids g·nbq + i
    full: Tensor  # LongTensor[m, Cf]: key-block ids g·nbk + j of the full blocks
    part: Tensor  # LongTensor[m, Cp]: key-block ids of the partial blocks
    keep: Tensor | None  # uint8[m, b, Cp·b]: 1 where a partial block has an edge


@dataclass
class _Chunk:
    rows: Tensor  # LongTensor[m]
    full: Tensor  # LongTensor[m, Cf]
    part: Tensor  # LongTensor[m, Cp]
    keep: Tensor | None  # uint8[m, b, Cp·b]
    run: tuple[int, int] | None  # full[r, j] = start + r·step + j, or None
    bias: Tensor | None = None  # float[b, Cf·b]: 0 / −inf over ``full`` (split path, banded)
    shared: bool = False  # every row block has the same partial key blocks (global columns)
    extra: Tensor | None = None  # LongTensor[m, Ce]: full blocks off the run (split path)
    first: int | None = None  # rows == first + arange(m): row slices are views

    def take(self, x: Tensor) -> Tensor:
        """The chunk's row blocks of x (L, G·nb, ...): a view when they are consecutive."""
        if self.first is None:
            return x.index_select(1, self.rows)
        return x[:, self.first : self.first + self.rows.numel()]


def _segments(full: Tensor, keep: Tensor | None = None):
    """Cut a group's rows into [start, end) segments whose full key blocks form one run of
    consecutive blocks moving by a fixed step per row (``(first, step)``), or None.

    With ``keep`` (the partial blocks' element masks) a run is also cut where the masks
    change, so that the band edges of most rows can join it (:func:`_band`); pieces shorter
    than 4 rows are merged with their neighbours.
    """
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
    """Split each row's full key blocks (sorted ids, (m, Cf)) into its longest stretch of
    consecutive blocks, cut to the group's shortest such stretch (m, R), and the others
    (m, Cf − R) or None — BigBird's band apart from its random blocks, so the band can still
    be a strided view."""
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


def _band(full: Tensor, part: Tensor, keep: Tensor, run: tuple[int, int], b: int):
    """Move the partial blocks that extend a run of full blocks (``run = (start, step)``) on
    either side, with the same element mask in every row, into the run.

    Returns (full, part, keep, bias, run): the widened run and its additive bias (b, Cf·b),
    0 on edges and −inf elsewhere, shared by all rows (broadcast, no per-row mask), and the
    partial blocks left over. A window pattern's band becomes one flash call per chunk.
    """
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
        block: block size b.
        graphs: G (1 for a static graph).
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
    groups: list[_Group]
    pairs: int
    partial: int
    edges: int

    @property
    def fill(self) -> float:
        """Useful fraction of the scored entries, edges / (pairs · b²)."""
        return self.edges / max(1, self.pairs * self.block * self.block)

    def chunks(self, lead: int, budget: int, split: bool = False) -> list[_Chunk]:
        """Chunks of at most ``budget`` materialised score entries for L = ``lead`` riding
        (batch, head) pairs, never straddling a run of consecutive full key blocks (cached).

        With ``split`` (the split-softmax path) full blocks are streamed by the flash kernel
        and only their gathered keys and values are materialised: they count a quarter; partial
        blocks that extend a run on either side with the same element mask in every row block
        of the run (the edges of a band) join it, masked by an additive bias (:func:`_band`).
        """
        cache = self.__dict__.setdefault("_chunks", {})
        if (lead, budget, split) not in cache:
            out, b = [], self.block
            for grp in self.groups:
                main, others = _longest_run(grp.full) if split else (grp.full, None)
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
                    for s in range(0, hi - lo, step):
                        e = min(s + step, hi - lo)
                        at = None if run is None else (run[0] + s * run[1], run[1])
                        pt = part[s:e]
                        shared = split and e - s > 1 and bool((pt == pt[:1]).all())
                        rows = grp.rows[lo + s : lo + e]
                        first = int(rows[0]) if int(rows[-1] - rows[0]) == e - s - 1 else None
                        out.append(
                            _Chunk(
                                rows,
                                full[s:e],
                                pt,
                                None if keep is None else keep[s:e],
                                at,
                                bias,
                                shared,
                                None if not ce else extra[s:e],
                                first,
                            )
                        )
            cache[(lead, budget, split)] = out
        return cache[(lead, budget, split)]

    def to(self, device: torch.device) -> BlockPlan:
        """The plan with its index tensors on ``device`` (copied once, cached on this plan,
        so that its chunks are cut once per device too)."""
        if not self.groups or self.groups[0].rows.device == device:
            return self
        cache = self.__dict__.setdefault("_on", {})
        if device not in cache:
            groups = [
                _Group(
                    g.rows.to(device),
                    g.full.to(device),
                    g.part.to(device),
                    None if g.keep is None else g.keep.to(device),
                )
                for g in self.groups
            ]
            cache[device] = BlockPlan(
                self.block,
                self.graphs,
                self.nbq,
                self.nbk,
                groups,
                self.pairs,
                self.partial,
                self.edges,
            )
        return cache[device]


@dataclass
class BlockPairs:
    """The non-empty (row block, key block) pairs of a graph at one block size, in order.

    Attributes:
        keys: LongTensor[P], sorted pair keys (g·nbq + i)·nbk + j.
        counts: LongTensor[P], edges in each pair.
        full: BoolTensor[P], whether every entry of the pair is an edge.
        e_pair, e_q, e_k: LongTensor[E_p] for each edge of a partial pair: the pair's index
            and the edge's query and key offsets inside the block (None unless asked for).
    """

    keys: Tensor
    counts: Tensor
    full: Tensor
    e_pair: Tensor | None = None
    e_q: Tensor | None = None
    e_k: Tensor | None = None


def block_pairs(graph: AttentionGraph, block: int, partial: bool = False) -> BlockPairs:
    """The block pairs of ``graph`` at ``block``, in one pass over the edges, O(E + P).

    The pass goes piece by piece (``graph.row_pieces``) so that its temporaries stay small;
    with ``partial`` it also lists the edges of the partial pairs (the element masks).
    """
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
    """Number of non-empty (row block, key block) pairs of ``graph`` at this block size.

    Block sizes that are multiples of ``BLOCK_SIZES[0]`` are counted from that size's pairs
    (cached on the graph, one pass over the edges for all of them); others take their own pass.
    """
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
    """The block size of ``BLOCK_SIZES`` with the least estimated work pairs·b²·ENTRY_COST[b]
    (``ENTRY_COST_TRAIN`` when gradients will be computed).

    Block sizes above half the sequence length are not considered. Cached on the graph.
    """

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
        groups.append(_Group(rbs, ids[:, :cf].contiguous(), ids[:, cf:].contiguous(), keep))
    return BlockPlan(
        block, g_count, nbq, nbk, groups, pairs.keys.numel(), int((~full).sum()), graph.col.numel()
    )


class _Runner:
    """What the per-chunk computations need, shared by forward and backward."""

    def __init__(self, plan, prob_map, scale, key_ok, dropout_p, budget, lead, cpu, same_d, dtype):
        self.plan, self.prob_map, self.scale, self.dtype = plan, prob_map, scale, dtype
        self.key_ok, self.dropout_p, self.lead = key_ok, dropout_p, lead
        self.softmax = prob_map.is_softmax
        self.split = self.softmax and key_ok is None and not dropout_p and cpu and same_d
        self.chunks = plan.chunks(lead, budget, self.split)

    # -- helpers ------------------------------------------------------------------------
    def gather(self, x: Tensor, keys: Tensor) -> Tensor:
        """Key blocks (L, m, C·b, e) of the blocked tensor x (L, G·nbk, b, e)."""
        m, c = keys.shape
        return x.index_select(1, keys.reshape(-1)).view(x.shape[0], m, c * self.plan.block, -1)

    def full_blocks(self, x: Tensor, chunk: _Chunk) -> Tensor:
        """The chunk's full key blocks of x (L, G·nbk, b, e): a strided view (no copy) when
        they are one run of consecutive blocks moving by a fixed step per row block."""
        if chunk.run is None or not x.is_contiguous():
            return self.gather(x, chunk.full)
        b, e = self.plan.block, x.shape[-1]
        (m, cf), (start, step) = chunk.full.shape, chunk.run
        return x.as_strided(
            (x.shape[0], m, cf * b, e),
            (x.stride(0), step * b * e, e, 1),
            x.storage_offset() + start * b * e,
        )

    def keep(self, p: Tensor) -> Tensor | None:
        """Dropout keep-mask scaled by 1/(1 − p), drawn from the global RNG (replayed)."""
        if not self.dropout_p:
            return None
        return torch.empty_like(p).bernoulli_(1 - self.dropout_p).div_(1 - self.dropout_p)

    # -- general path -------------------------------------------------------------------
    def general_inputs(self, full: Tensor, part: Tensor, keep: Tensor | None):
        """All key blocks of a chunk side by side, the row's edge mask (uint8 (m, b, C·b) or
        None) and the key-padding mask (bool (L, m, 1, C·b) or None)."""
        keys = torch.cat([full, part], 1)
        if keep is not None and full.shape[1]:
            m, b = keep.shape[:2]
            ones = keep.new_ones(m, b, full.shape[1] * self.plan.block)
            keep = torch.cat([ones, keep], -1)
        ok = None
        if self.key_ok is not None:
            ok = self.gather(self.key_ok.unsqueeze(-1), keys).transpose(-1, -2)
        return keys, keep, ok

    def weights(self, s: Tensor, keep: Tensor | None, ok: Tensor | None, alpha=None) -> Tensor:
        """ρ on the chunk's rows; ``s`` is consumed (the softmax path works in place);
        ``alpha`` (L, m, b, 1): the rows' α of an ``entmax(tensor)`` map."""
        if self.softmax:
            masks = [m.to(s.dtype) for m in (keep, ok) if m is not None]
            p, _, total = _masked_exp(s, masks, None)
            return p.div_(torch.where(total > 0, total, 1.0).unsqueeze(-1))  # empty rows → 0
        valid = None if keep is None else keep.bool()
        if ok is not None:
            valid = ok if valid is None else valid & ok
        rho = self.prob_map if alpha is None else self.prob_map.with_alpha(alpha)
        return rho(s) if valid is None else rho(s, valid)

    # -- split softmax path -------------------------------------------------------------
    def partial_exp(self, qs: Tensor, kc: Tensor, keep: Tensor, lse: Tensor | None):
        """exp(scores − shift) on the partial blocks, exactly 0 where there is no edge.

        Forward (``lse`` None): shift is the row max; returns (p, row max, row sum).
        Backward: shift is the merged log-sum-exp; returns (p, None, None).
        """
        s = _mm(qs, kc.transpose(-1, -2))
        return _masked_exp(s, [keep.to(s.dtype)], lse)


#: exp(x) for x below this is replaced by exp(_FLOOR) (< 1e-34 of the row max's weight):
#: torch's exp is 10-100x slower on −inf and on arguments whose result underflows.
_FLOOR = -80.0


def _masked_exp(s: Tensor, masks: list[Tensor], lse: Tensor | None):
    """exp(s − shift) ⊙ masks (0/1 floats broadcasting to s), in place on s.

    Masked entries are pushed far down by an additive bias (so that the row max ignores them)
    and zeroed by the product; no −inf and no underflowing exp is ever evaluated, and bool
    ops (several times slower than float ops in torch on CPU) are avoided. With ``lse`` the
    shift is ``lse``; else the row max, returned with the row sum (a row without any entry
    gets max −big and sum 0).
    """
    big = torch.finfo(s.dtype).max / 4
    for m in masks:
        s.add_(m.sub(1.0).mul_(big))
    if lse is not None:
        s.sub_(lse.unsqueeze(-1))
        mx = None
    else:
        mx = s.amax(-1, keepdim=True)
        s.sub_(mx)
    p = s.clamp_min_(_FLOOR).exp_()
    for m in masks:
        p.mul_(m)
    if mx is None:
        return p, None, None
    return p, mx.squeeze(-1), p.sum(-1)


class _BlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, q: Tensor, k: Tensor, v: Tensor, alpha, run: _Runner) -> Tensor:
        ctx.run, ctx.dtype = run, q.dtype
        qp, kp, vp = (_blocked(t, run) for t in (q, k, v))  # in run.dtype (fp32 for half on CPU)
        out = qp.new_empty(*qp.shape[:-1], v.shape[-1])
        if run.split:
            lse_all = qp.new_empty(qp.shape[:-1])
            for ch in run.chunks:
                o, lse = _split_forward(run, ch.take(qp), kp, vp, ch)
                out.index_copy_(1, ch.rows, o)
                lse_all.index_copy_(1, ch.rows, lse)
            ctx.shapes = q.shape, k.shape, v.shape
            ctx.save_for_backward(qp, kp, vp, out, lse_all)  # blocked: no second copy
            return _unblock(out, q.shape).to(q.dtype)
        if run.dropout_p:
            ctx.rng = _rng_state(q.device)
        ap = None if alpha is None else _blocked_alpha(alpha, run)
        for ch in run.chunks:
            rows = ch.rows
            keys, blk, ok = run.general_inputs(ch.full, ch.part, ch.keep)
            qs = qp.index_select(1, rows).mul_(run.scale)
            a = None if ap is None else ap.index_select(1, rows)
            p = run.weights(torch.matmul(qs, run.gather(kp, keys).transpose(-1, -2)), blk, ok, a)
            keep = run.keep(p)
            if keep is not None:
                p = p * keep
            out.index_copy_(1, rows, torch.matmul(p, run.gather(vp, keys)))
        ctx.shapes = q.shape, k.shape, v.shape
        ctx.save_for_backward(qp, kp, vp, ap)
        return _unblock(out, q.shape).to(q.dtype)

    @staticmethod
    def backward(ctx: FunctionCtx, grad_out: Tensor):
        run: _Runner = ctx.run
        qp, kp, vp = ctx.saved_tensors[:3]
        q_shape = ctx.shapes[0]
        gp = _blocked(grad_out.contiguous(), run)
        dq, dk, dv = torch.zeros_like(qp), torch.zeros_like(kp), torch.zeros_like(vp)
        b = run.plan.block
        if run.split:
            out, lse_all = ctx.saved_tensors[3:]
            for ch in run.chunks:
                _split_backward(run, qp, kp, vp, gp, out, lse_all, dq, dk, dv, ch)
            return (*_unblocked_grads(ctx.dtype, (dq, dk, dv), ctx.shapes), None, None)
        ap = ctx.saved_tensors[3]
        want_alpha = ap is not None and ctx.needs_input_grad[3]
        dap = torch.zeros_like(ap) if want_alpha else None
        with replayed_rng(qp.device, ctx.rng if run.dropout_p else None):
            for ch in run.chunks:
                rows = ch.rows
                keys, blk, ok = run.general_inputs(ch.full, ch.part, ch.keep)
                flat = keys.reshape(-1)
                qs = qp.index_select(1, rows).mul_(run.scale)
                kc, vc = run.gather(kp, keys), run.gather(vp, keys)
                s = torch.matmul(qs, kc.transpose(-1, -2))
                if not run.softmax:
                    s.requires_grad_()
                a = None if ap is None else ap.index_select(1, rows).requires_grad_(want_alpha)
                with torch.enable_grad():
                    p = run.weights(s, blk, ok, a)
                keep = run.keep(p)
                pd = p.detach() if keep is None else p.detach() * keep
                go = gp.index_select(1, rows)
                dv.index_add_(1, flat, _per_block(torch.matmul(pd.transpose(-1, -2), go), b))
                dp = torch.matmul(go, vc.transpose(-1, -2))
                if keep is not None:
                    dp.mul_(keep)
                if run.softmax:
                    pp = p.detach()
                    ds = pp * (dp - (pp * dp).sum(-1, keepdim=True))
                elif want_alpha:
                    ds, da = torch.autograd.grad(p, (s, a), dp)
                    dap.index_copy_(1, rows, da)
                else:
                    (ds,) = torch.autograd.grad(p, s, dp)
                dq.index_copy_(1, rows, torch.matmul(ds, kc).mul_(run.scale))
                dk.index_add_(1, flat, _per_block(torch.matmul(ds.transpose(-1, -2), qs), b))
        d_alpha = None if dap is None else _unblock(dap, (*q_shape[:3], 1))
        return (*_unblocked_grads(ctx.dtype, (dq, dk, dv), ctx.shapes), d_alpha, None)


def _unblocked_grads(dtype: torch.dtype, grads, shapes) -> tuple[Tensor, ...]:
    """dQ, dK, dV from the blocked layout back to their inputs' shapes, in the inputs' dtype."""
    return tuple(_unblock(g, s).to(dtype) for g, s in zip(grads, shapes, strict=True))


def _blocked_alpha(alpha: Tensor, run: _Runner) -> Tensor:
    """Per-row α (B, H, n_q, 1) → (L, G·nbq, b, 1) like the queries; padded rows get α = 2."""
    b = run.plan.block
    return F.pad(alpha, (0, 0, 0, -alpha.shape[-2] % b), value=2.0).reshape(run.lead, -1, b, 1)


def _per_block(x: Tensor, b: int) -> Tensor:
    """(L, m, C·b, e) → (L, m·C, b, e) for ``index_add_`` over key blocks."""
    return x.reshape(x.shape[0], -1, b, x.shape[-1])


def _split_forward(run, qc, kp, vp, ch):
    """Split-softmax forward of one chunk: (output (L, m, b, d), row log-sum-exp (L, m, b)).

    Up to three parts, merged by their log-sum-exps: the run (a strided view, with the band's
    bias), the full blocks off the run (gathered), the partial blocks (gathered, masked here).
    """
    halves = []
    if ch.full.shape[1]:
        halves.append(
            _flash(
                qc,
                run.full_blocks(kp, ch),
                run.full_blocks(vp, ch),
                0.0,
                False,
                attn_mask=_bias(ch.bias, qc),
                scale=run.scale,
            )
        )
    if ch.extra is not None:
        halves.append(
            _flash(
                qc, run.gather(kp, ch.extra), run.gather(vp, ch.extra), 0.0, False, scale=run.scale
            )
        )
    if ch.part.shape[1]:
        part = ch.part[:1] if ch.shared else ch.part
        kc, vc = run.gather(kp, part), run.gather(vp, part)
        if ch.shared:  # scale the smaller side: the one shared key block, else the queries
            p, mx, total = run.partial_exp(qc, kc * run.scale, ch.keep, None)
        else:
            p, mx, total = run.partial_exp(qc * run.scale, kc, ch.keep, None)
        o2 = _mm(p, vc).div_(torch.where(total > 0, total, 1.0).unsqueeze(-1))
        halves.append((o2, mx + total.log()))
    o, lse = halves[0]
    for o2, lse2 in halves[1:]:
        merged = torch.logaddexp(lse, lse2)
        o = o.mul_((lse - merged).exp_().unsqueeze(-1)).add_(
            o2.mul_((lse2 - merged).exp_().unsqueeze(-1))
        )
        lse = merged
    return o, lse


def _mm(a: Tensor, b: Tensor) -> Tensor:
    """a @ b for a (L, m, r, k) and b (L, m, k, c), or b (L, 1, k, c) shared by the m row
    blocks: then one (L, m·r, k) @ (L, k, c) product instead of m small ones."""
    if b.shape[1] == 1 and a.shape[1] > 1:
        lead, m, r = a.shape[:3]
        return torch.matmul(a.reshape(lead, m * r, -1), b[:, 0]).view(lead, m, r, -1)
    return torch.matmul(a, b)


def _mm_t(a: Tensor, b: Tensor, shared: bool) -> Tensor:
    """aᵀ @ b per row block (L, m, c, e), or summed over the m row blocks (L, 1, c, e)."""
    if not shared:
        return torch.matmul(a.transpose(-1, -2), b)
    lead = a.shape[0]
    return torch.matmul(
        a.reshape(lead, -1, a.shape[-1]).transpose(1, 2), b.reshape(lead, -1, b.shape[-1])
    ).unsqueeze(1)


def _bias(bias: Tensor | None, qc: Tensor) -> Tensor | None:
    """A band bias (b, Cf·b) broadcast (stride 0) to the flash kernel's (L, m, b, Cf·b)."""
    if bias is None:
        return None
    return bias.to(qc.device, qc.dtype).expand(*qc.shape[:2], *bias.shape)


def _split_backward(run, qp, kp, vp, gp, out, lse_all, dq, dk, dv, ch):
    b, rows, full, part, keep = run.plan.block, ch.rows, ch.full, ch.part, ch.keep
    qc, go, oc, lse = (ch.take(x) for x in (qp, gp, out, lse_all))
    delta = (go * oc).sum(-1, keepdim=True)
    dqc = None
    if full.shape[1]:
        kf, vf = run.full_blocks(kp, ch), run.full_blocks(vp, ch)
        dqc, dk1, dv1 = _full_backward(run, qc, go, oc, delta, lse, kf, vf, ch.bias)
        dk.index_add_(1, full.reshape(-1), _per_block(dk1, b))
        dv.index_add_(1, full.reshape(-1), _per_block(dv1, b))
    if ch.extra is not None:
        kc, vc = run.gather(kp, ch.extra), run.gather(vp, ch.extra)
        dq2, dk1, dv1 = _full_backward(run, qc, go, oc, delta, lse, kc, vc, None)
        dqc = dq2 if dqc is None else dqc.add_(dq2)
        dk.index_add_(1, ch.extra.reshape(-1), _per_block(dk1, b))
        dv.index_add_(1, ch.extra.reshape(-1), _per_block(dv1, b))
    if part.shape[1]:
        if ch.shared:
            part = part[:1]
        flat = part.reshape(-1)
        kc, vc = run.gather(kp, part), run.gather(vp, part)
        qs = qc * run.scale
        p, _, _ = run.partial_exp(qs, kc, keep, lse)
        dv.index_add_(1, flat, _per_block(_mm_t(p, go, ch.shared), b))
        ds = p.mul_(_mm(go, vc.transpose(-1, -2)).sub_(delta))
        dq2 = _mm(ds, kc).mul_(run.scale)
        dqc = dq2 if dqc is None else dqc.add_(dq2)
        dk.index_add_(1, flat, _per_block(_mm_t(ds, qs, ch.shared), b))
    dq.index_copy_(1, rows, dqc)


def _full_backward(run, qc, go, oc, delta, lse, kf, vf, bias):
    """The full (and band) blocks' share of dQ, dK, dV, given the merged output ``oc`` and
    log-sum-exp: (dQ (L, m, b, d), dK and dV shaped like ``kf``, ``vf``). K and V (kf, vf)
    stay strided views for a run; ``bias`` is the band's (b, Cf·b) bias or None.

    From ``FLASH_BACKWARD_BLOCK`` on, torch's flash backward kernel; below it the closed
    form dS = P ⊙ (dP − δ) with P recomputed, one riding (batch, head) at a time so that P is
    only (m, b, Cf·b) (the kernel copies and zero-fills its key-side gradients per row block,
    which costs most on small blocks).
    """
    if qc.shape[-2] >= FLASH_BACKWARD_BLOCK:
        return _flash_backward(
            go, qc, kf, vf, oc, lse, 0.0, False, attn_mask=_bias(bias, qc), scale=run.scale
        )
    masks = [] if bias is None else [(bias == 0).to(qc.device, qc.dtype)]
    dqc, dk1, dv1 = torch.empty_like(qc), qc.new_empty(kf.shape), qc.new_empty(vf.shape)
    for i in range(qc.shape[0]):
        qs = qc[i] * run.scale
        p, _, _ = _masked_exp(torch.bmm(qs, kf[i].transpose(1, 2)), masks, lse[i])
        torch.bmm(p.transpose(1, 2), go[i], out=dv1[i])
        ds = p.mul_(torch.bmm(go[i], vf[i].transpose(1, 2)).sub_(delta[i]))
        torch.bmm(ds, kf[i], out=dqc[i]).mul_(run.scale)
        torch.bmm(ds.transpose(1, 2), qs, out=dk1[i])
    return dqc, dk1, dv1


def _rng_state(device: torch.device) -> Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


@contextlib.contextmanager
def replayed_rng(device: torch.device, state: Tensor | None):
    """Backward's dropout masks drawn again as in forward: the RNG of ``device`` set to
    ``state`` (saved by :func:`_rng_state` before the forward's draws) inside, and restored
    after; ``state`` None (no dropout) does nothing."""
    cuda = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda, enabled=state is not None):
        if state is not None:
            _set_rng_state(device, state)
        yield


def _set_rng_state(device: torch.device, state: Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _blocked(x: Tensor, run: _Runner) -> Tensor:
    """(B, H, n, e) → contiguous (L, G·nb, b, e) in ``run.dtype``, zero-padded to a multiple of
    the block size.

    Inputs of any strides (the transposed views of a fused projection) or of half precision
    on CPU (computed in float32, :mod:`.precision`) are copied once here, O(n·e), so that
    every block below is a dense slice and every run a strided view of it.
    """
    b = run.plan.block
    pad = -x.shape[-2] % b
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    x = x.reshape(run.lead, -1, b, x.shape[-1])
    return x.to(run.dtype, memory_format=torch.contiguous_format)


def _unblock(x: Tensor, shape: torch.Size) -> Tensor:
    return x.reshape(shape[0], shape[1], -1, x.shape[-1])[:, :, : shape[2]]


def _lead_and_graph(graph: AttentionGraph, bsz: int, heads: int) -> tuple[int, AttentionGraph]:
    """How the (B, H) pairs ride along: L = B·H / G, with G the graphs the plan covers."""
    shape = graph.batch_shape
    if math.prod(shape) == 1:
        return bsz * heads, _squeezed(graph, len(shape))
    if all(s == 1 for s in shape[:-1]) and shape[-1] == heads:
        return bsz, _squeezed(graph, len(shape) - 1)
    return 1, graph.expand((bsz, heads))


def _squeezed(graph: AttentionGraph, dims: int) -> AttentionGraph:
    """``graph`` without its ``dims`` leading size-1 batch dims; the same object on every call
    (cached on the graph), so that its block plan is built once."""
    if not dims:
        return graph
    return graph.cached(("squeezed", dims), lambda: graph[(0,) * dims])


def block_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    graph: AttentionGraph,
    prob_map: ProbabilityMap,
    scale: float,
    key_padding_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    block: int | None = None,
    budget: int | None = None,
) -> Tensor:
    """Block-sparse attention, Yun eq. (3) (same contract as ``dense_attention``).

    Args:
        q: (B, H, n_q, d); k: (B, H, n_k, d); v: (B, H, n_k, d_v).
        graph: static (batch_shape ()) or batched ((H,), (B, H), ...) AttentionGraph.
        prob_map: any ProbabilityMap; it sees each query's row of all its selected blocks,
            with the element mask as ``valid``.
        scale: score scale.
        key_padding_mask: (B, n_k) bool, True for real keys.
        dropout_p: dropout on the attention weights.
        block: block size (16–128 are sensible); None picks one by :func:`choose_block`.
        budget: most score entries per chunk (a single row block may exceed it); None:
            ``BUDGET`` for the inputs' device type.
    Returns:
        (B, H, n_q, d_v).
    """
    bsz, heads = q.shape[:2]
    lead, graph = _lead_and_graph(graph, bsz, heads)
    if block is None:
        train = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        block = choose_block(graph, train)
    plan = block_plan(graph, block).to(q.device)
    key_ok = None
    if key_padding_mask is not None:
        kpm = key_padding_mask.to(q.device)
        pad = -kpm.shape[-1] % plan.block
        if pad:
            kpm = F.pad(kpm, (0, pad), value=False)
        key_ok = kpm[:, None, :].expand(bsz, heads, -1).reshape(lead, -1, plan.block)
    budget = BUDGET.get(q.device.type, BUDGET["cuda"]) if budget is None else budget
    run = _Runner(
        plan,
        prob_map,
        scale,
        key_ok,
        dropout_p,
        budget,
        lead,
        q.device.type == "cpu",
        q.shape[-1] == v.shape[-1],
        compute_dtype(q),
    )
    return _BlockAttention.apply(q, k, v, prob_map.row_alpha(bsz, heads, q.shape[2]), run)
