"""Assumption 1 of Yun et al. (2020), §3.2, checked on a cycle of sparsity patterns.

For patterns {A_k^1}, …, {A_k^p} at length n (0-based tokens here; the paper counts from 1):

1. *self-loops*: k ∈ A_k^l for every token k and layer l;
2. *chain*: a permutation γ with γ(i) ∈ ∪_l A_{γ(i+1)}^l for all i — a Hamiltonian path in the
   directed graph with an edge j → k whenever k attends to j in some layer;
3. *hops*: the least s with S_k^s = [n] for every k, where S_k^1 = A_k^1 and
   S_k^t = ∪_{j ∈ A_k^{l_t}} S_j^{t−1} with l_t = (t − 1) mod p + 1.

The sets S_k^t are kept as packed bitsets, one row of ⌈n/64⌉ int64 words per token; a step ORs
the rows of each token's neighbours (a gather plus an in-place halving fold), so one step costs
O(|edges| · n/64) word operations and memory stays O(n²/8) bytes — 2 MiB at n = 4096.

One piece: the three conditions are checked on one packed cycle of graphs (``_Cycle``), and
the report runs them together.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import time
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from ...graph import AttentionGraph
from ...patterns import Pattern, PatternCycle
from ...validate import check_choice, check_int, check_positive

__all__ = [
    "Assumption1Report",
    "ChainResult",
    "HopsResult",
    "assumption1",
    "cycle_graphs",
    "find_chain",
    "hops",
    "named_pattern",
]

PatternLike = Pattern | PatternCycle | AttentionGraph | Sequence[Pattern | AttentionGraph]

#: Word budget of one gather buffer in the hop recursion (int64 words; 4 Mi words = 32 MiB).
_GATHER_WORDS = 1 << 22
#: Most int64 words the p + 1 bitset states of the hop recursion may take (8 GiB).
_MAX_STATE_WORDS = 1 << 30


# --------------------------------------------------------------------------- inputs
def cycle_graphs(patterns: PatternLike, n: int | None = None) -> tuple[AttentionGraph, ...]:
    """The graphs (A^1, …, A^p) of a pattern cycle at length n (Yun et al. §3.1, cycling blocks).

    Args:
        patterns: a Pattern (p = 1), a PatternCycle, an AttentionGraph, or a sequence of
            Patterns/AttentionGraphs (layer l uses entry l mod p).
        n: the sequence length; needed for Patterns, checked against AttentionGraphs.
    Returns:
        p unbatched self-attention graphs of size n × n.
    """
    if isinstance(patterns, PatternCycle):
        items: Sequence = patterns.patterns
    elif isinstance(patterns, Pattern | AttentionGraph):
        items = (patterns,)
    elif isinstance(patterns, Sequence) and not isinstance(patterns, str):
        items = tuple(patterns)
    else:
        raise TypeError(
            "patterns must be a Pattern, a PatternCycle, an AttentionGraph or a sequence of "
            f"them, got {type(patterns).__name__}"
        )
    if not items:
        raise ValueError("patterns must hold at least one pattern")
    if n is not None:
        n = check_positive("n", n)
    graphs = []
    for item in items:
        if isinstance(item, AttentionGraph):
            graph = item
        elif isinstance(item, Pattern):
            if item.data_dependent:
                raise ValueError(f"{item!r} is data-dependent: build its graph and pass that")
            if n is None:
                raise ValueError("n is required to build the graphs of Patterns")
            graph = item.graph(n)
        else:
            kind = type(item).__name__
            raise TypeError(f"expected Pattern or AttentionGraph entries, got {kind}")
        if graph.batch_shape:
            raise ValueError(f"graphs must be unbatched, got batch_shape {graph.batch_shape}")
        if graph.n_q != graph.n_k:
            raise ValueError(f"self-attention graphs need n_q == n_k, got {graph.n_q}, {graph.n_k}")
        if n is not None and graph.n_q != n:
            raise ValueError(f"graph has {graph.n_q} tokens, expected n={n}")
        n = graph.n_q
        graphs.append(graph)
    return tuple(graphs)


@dataclasses.dataclass(frozen=True)
class _Cycle:
    """The graphs of a cycle with the per-edge data every check needs, computed once."""

    graphs: tuple[AttentionGraph, ...]
    loops: tuple[Tensor, ...]  # Bool[n] per layer: k ∈ A_k^l
    union_rows: Tensor  # LongTensor[E]: query k of every edge of ∪_l A^l, sorted by (k, j)
    union_cols: Tensor  # LongTensor[E]: key j of every edge of ∪_l A^l
    union_keys: Tensor  # LongTensor[E]: k * n + j, sorted

    @property
    def n(self) -> int:
        return self.graphs[0].n_q

    @classmethod
    def of(cls, patterns: PatternLike, n: int | None) -> _Cycle:
        if isinstance(patterns, _Cycle):
            return patterns
        graphs = cycle_graphs(patterns, n)
        n = graphs[0].n_q
        loops, keys = [], []
        for g in graphs:
            rows = g.row_indices()
            mask = torch.zeros(n, dtype=torch.bool)
            mask[rows[rows == g.col]] = True
            loops.append(mask)
            keys.append(rows * n + g.col)
        union = torch.unique(torch.cat(keys)) if len(keys) > 1 else keys[0]
        return cls(graphs, tuple(loops), union // n, union % n, union)

    def allows(self, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        """Bool: does ``q_idx`` attend to ``kv_idx`` in some layer (binary search)."""
        query = q_idx * self.n + kv_idx
        keys = self.union_keys
        if keys.numel() == 0:
            return torch.zeros_like(query, dtype=torch.bool)
        pos = torch.searchsorted(keys, query).clamp_(max=keys.numel() - 1)
        return keys[pos] == query


# --------------------------------------------------------------------------- bitsets
def _pack_mask(mask: np.ndarray, words: int) -> np.ndarray:
    """Bool[m, n] rows -> int64[m, words] bitsets (numpy packbits, zero-padded)."""
    packed = np.packbits(mask, axis=1)
    out = np.zeros((mask.shape[0], words * 8), dtype=np.uint8)
    out[:, : packed.shape[1]] = packed
    return out.view(np.int64)


def _pack(graph: AttentionGraph, words: int) -> Tensor:
    """Int64[n + 1, words] bitsets of the rows of ``graph``; the extra last row is zero."""
    n = graph.n_q
    bits = np.zeros((n + 1, words), dtype=np.int64)
    step = max(1, (1 << 24) // n)  # rows per dense chunk (16 MB of bools)
    crow = graph.crow
    for start in range(0, n, step):
        stop = min(n, start + step)
        lo, hi = int(crow[start]), int(crow[stop])
        counts = (crow[start + 1 : stop + 1] - crow[start:stop]).numpy()
        local = np.repeat(np.arange(stop - start), counts)
        mask = np.zeros((stop - start, n), dtype=bool)
        mask[local, graph.col[lo:hi].numpy()] = True
        bits[start:stop] = _pack_mask(mask, words)
    return torch.from_numpy(bits)


def _full_row(n: int, words: int) -> Tensor:
    """Int64[words]: the bitset of [n]."""
    return torch.from_numpy(_pack_mask(np.ones((1, n), dtype=bool), words)[0])


def _popcounts(state: Tensor, n: int) -> Tensor:
    """LongTensor[n]: the size of each of the first n bitset rows."""
    as_bytes = state[:n].contiguous().numpy().view(np.uint8)
    return torch.from_numpy(np.unpackbits(as_bytes, axis=1).sum(1, dtype=np.int64))


@dataclasses.dataclass(frozen=True)
class _Chunk:
    rows: Tensor  # LongTensor[m]
    index: Tensor  # LongTensor[K * m], slot-major neighbour rows; padding -> the zero row n
    m: int
    k: int


def _plan(graph: AttentionGraph) -> list[_Chunk]:
    """Split the rows, sorted by degree, into gather chunks of at most ``_GATHER_WORDS`` words."""
    n = graph.n_q
    words = -(-n // 64)
    degrees = graph.degrees
    order = torch.argsort(degrees, stable=True)
    sorted_deg = degrees[order].tolist()
    chunks = []
    start = 0
    while start < n:
        stop = start + 1
        while stop < n and (stop + 1 - start) * max(sorted_deg[stop], 1) * words <= _GATHER_WORDS:
            stop += 1
        rows = order[start:stop]
        index, valid = graph.neighbours(rows)
        if index.shape[1] == 0:  # rows attending to nothing
            index = torch.full((rows.numel(), 1), n)
        else:
            index = index.masked_fill(~valid, n)
        chunks.append(_Chunk(rows, index.t().reshape(-1), rows.numel(), index.shape[1]))
        start = stop
    return chunks


def _step(state: Tensor, plan: list[_Chunk], out: Tensor, work: Tensor) -> None:
    """out[k] = OR_{j ∈ A_k} state[j] for every k (the recursion of Yun §3.2), in place."""
    words = state.shape[1]
    for chunk in plan:
        buf = work[: chunk.k * chunk.m * words].view(chunk.k, chunk.m, words)
        torch.index_select(state, 0, chunk.index, out=buf.view(chunk.k * chunk.m, words))
        k = chunk.k
        while k > 1:  # halving fold over contiguous slot blocks: x[:h] |= x[k-h:k]
            h = k // 2
            buf[:h].bitwise_or_(buf[k - h : k])
            k -= h
        out.index_copy_(0, chunk.rows, buf[0])


# --------------------------------------------------------------------------- 1.3 hops
@dataclasses.dataclass(frozen=True)
class HopsResult:
    """Assumption 1.3: ``hops`` = least s with S_k^s = [n] for all k, or None with ``reason``."""

    hops: int | None
    reason: str
    steps: int  # recursion steps computed


def hops(
    patterns: PatternLike, n: int | None = None, max_hops: int | None = None, start: int = 0
) -> HopsResult:
    """The least s with S_k^s = [n] for every token k (Yun et al. Assumption 1.3, §3.2).

    S_k^1 = A_k^1 and S_k^t = ∪_{j ∈ A_k^{(t−1) mod p + 1}} S_j^{t−1}. ``start`` = l rotates
    the cycle so that it begins with layer l + 1 (0-based l; the paper's definition is
    ``start=0``). When every pattern has self-loops (1.1) the sets only grow, so the recursion
    stops at the first period without change (a fixed point: s does not exist). Without
    self-loops the sequence is eventually periodic; a repeated state at the same phase proves s
    does not exist, and ``max_hops`` (default 4·p·n + 16) bounds the search otherwise.
    """
    start = check_int("start", start, 0)
    if max_hops is not None:
        max_hops = check_positive("max_hops", max_hops)
    cyc = _Cycle.of(patterns, n)
    p, n = len(cyc.graphs), cyc.n
    if start >= p:
        raise ValueError(f"start must lie in [0, {p}), got {start}")
    if (p + 1) * (n + 1) * -(-n // 64) > _MAX_STATE_WORDS:
        raise ValueError(
            f"n={n} tokens with p={p} layers need {(p + 1) * (n + 1) * -(-n // 64) * 8:,} bytes "
            f"of reach sets; at most {_MAX_STATE_WORDS * 8:,} are allocated"
        )
    graphs = cyc.graphs[start:] + cyc.graphs[:start]
    monotone = all(bool(mask.all()) for mask in cyc.loops)
    limit = 4 * p * n + 16 if max_hops is None else max_hops
    words = -(-n // 64)
    full = _full_row(n, words).expand(n, words)
    plans: list[list[_Chunk] | None] = [None] * p
    work: Tensor | None = None
    # p + 1 rotating buffers: S^t lives in buffer t mod (p + 1); S^{t+1} overwrites S^{t-p}.
    if bool((graphs[0].degrees == n).all()):  # S^1 = A^1 = [n]: nothing to pack
        return HopsResult(1, _reached(n, 1), 1)
    states = [torch.zeros(n + 1, words, dtype=torch.int64) for _ in range(p + 1)]
    states[1] = _pack(graphs[0], words)
    seen: dict[tuple[int, bytes], int] = {}
    t = 1
    while True:
        state = states[t % (p + 1)]
        if torch.equal(state[:n], full):
            return HopsResult(t, _reached(n, t), t)
        if monotone:
            if t > p and torch.equal(state, states[(t - p) % (p + 1)]):
                return HopsResult(None, _never(state, n, t, "fixed point"), t)
        else:
            key = ((t - 1) % p, hashlib.blake2b(state.numpy().tobytes(), digest_size=16).digest())
            if key in seen:
                why = f"state of layer {seen[key]} repeats"
                return HopsResult(None, _never(state, n, t, why), t)
            seen[key] = t
        if t >= limit:
            return HopsResult(None, f"not reached within max_hops={limit} layers", t)
        layer = t % p
        if plans[layer] is None:
            plans[layer] = _plan(graphs[layer])
            need = max(c.m * c.k for c in plans[layer]) * words
            if work is None or work.numel() < need:
                work = torch.empty(need, dtype=torch.int64)
        _step(state, plans[layer], states[(t + 1) % (p + 1)], work)
        t += 1


def strided_hops(w: int, n: int, config: str) -> int:
    """The closed rule for STRIDED(w)'s hops s at length n (Assumption 1.3; eq. 4: window
    k − ⌈w/2⌉ … k + ⌊w/2⌋, stride k + ℤw, ∩ [n]), what :func:`hops` computes (docs/analysis.md;
    ``scripts/strided_hops.py`` checks it over a grid).

    config: "window-first" (A¹ → A²), "stride-first" (A² → A¹) or "union".
    """
    lo, hi = -(-w // 2), w // 2  # the window reaches ⌈w/2⌉ back and ⌊w/2⌋ forward
    window_covers = n <= hi + 1  # every window already holds [n]
    if config == "window-first":
        return 1 if window_covers else (2 if w <= 2 else 3)
    if config == "stride-first":
        if w == 1:
            return 1
        if window_covers or w == 2:
            return 2
        return 4 if n <= w + lo - 2 else 3
    if config == "union":
        if w == 1 or window_covers or (w, n) == (2, 3):  # (2, 3): the stride adds the far end
            return 1
        middle = lo - 1 <= n % w <= hi + 1
        return 3 if n >= w + hi + 2 and not middle else 2
    raise ValueError(f"config must be window-first, stride-first or union, got {config!r}")


def _reached(n: int, t: int) -> str:
    return f"every token reaches all {n} tokens after {t} layer{'s' if t > 1 else ''}"


def _never(state: Tensor, n: int, t: int, why: str) -> str:
    counts = _popcounts(state, n)
    k = int(torch.argmin(counts))
    return f"never ({why} at layer {t}): token {k} reaches only {int(counts[k])} of {n} tokens"


# --------------------------------------------------------------------------- 1.2 chain
@dataclasses.dataclass(frozen=True)
class ChainResult:
    """Assumption 1.2: a chain γ (0-based, γ[i] ∈ ∪_l A^l_{γ[i+1]}) or None.

    ``status`` is one of "identity", "reverse", "found", "none exists",
    "search budget exhausted"; ``reason`` says how it was decided.
    """

    path: tuple[int, ...] | None
    status: str
    reason: str


def _is_chain(cyc: _Cycle, path: Tensor) -> bool:
    return bool(cyc.allows(path[1:], path[:-1]).all())


def _components(n: int, src: Tensor, dst: Tensor, removed: Tensor) -> int:
    """Number of weakly connected components among the tokens not ``removed``."""
    keep = ~removed[src] & ~removed[dst]
    src, dst = src[keep], dst[keep]
    labels = torch.arange(n)
    while True:
        new = labels.clone()
        new.scatter_reduce_(0, dst, labels[src], "amin")
        new.scatter_reduce_(0, src, labels[dst], "amin")
        while True:  # pointer jumping: a label is a token of the same component
            jumped = new[new]
            if torch.equal(jumped, new):
                break
            new = jumped
        if torch.equal(new, labels):
            break
        labels = new
    return int(torch.unique(labels[~removed]).numel())


def _no_path_reason(cyc: _Cycle) -> str | None:
    """A cheap proof that no Hamiltonian path exists, or None when none was found."""
    n = cyc.n
    rows = cyc.union_rows
    cols = cyc.union_cols
    other = rows != cols
    src, dst = cols[other], rows[other]  # edge j -> k: k attends to j
    has_in = torch.zeros(n, dtype=torch.bool).index_fill_(0, dst, True)
    has_out = torch.zeros(n, dtype=torch.bool).index_fill_(0, src, True)
    if int((~has_in).sum()) > 1:
        firsts = torch.nonzero(~has_in).flatten()[:3].tolist()
        count = int((~has_in).sum())
        return f"{count} tokens (e.g. {firsts}) attend to no other token; only γ(1) may"
    if int((~has_out).sum()) > 1:
        lasts = torch.nonzero(~has_out).flatten()[:3].tolist()
        count = int((~has_out).sum())
        return f"{count} tokens (e.g. {lasts}) are attended by no other token; only γ(n) may"
    removed = torch.zeros(n, dtype=torch.bool)
    parts = _components(n, src, dst, removed)
    if parts > 1:
        return f"the graph has {parts} weakly connected components"
    # Removing a set X of hubs must leave at most |X| + 1 components (a path visits X at most
    # |X| times, and each visit can join two pieces).
    degree = torch.bincount(src, minlength=n) + torch.bincount(dst, minlength=n)
    order = torch.argsort(degree, descending=True)
    sizes = {1 << i for i in range(7)} | {int((degree >= n / 2).sum())}
    for size in sorted(s for s in sizes if 0 < s < n - 1):
        removed = torch.zeros(n, dtype=torch.bool)
        removed[order[:size]] = True
        parts = _components(n, src, dst, removed)
        if parts > size + 1:
            return (
                f"removing the {size} best-connected tokens leaves {parts} > {size + 1} "
                "weakly connected components"
            )
    return None


def _search(cyc: _Cycle, budget: int) -> tuple[list[int] | None, bool]:
    """Depth-first search for a Hamiltonian path in the graph j -> k (k attends to j).

    Order: the successor with the fewest unvisited predecessors first (hard-to-enter tokens
    early), then the fewest onward moves (Warnsdorff). Pruning: an unvisited token whose
    predecessors are all visited ("orphan") can only come next; an unvisited token without
    unvisited successors ("sink") can only come last. Returns (path or None, exhausted) where
    ``exhausted`` is False when the search space was covered.
    """
    n = cyc.n
    rows = cyc.union_rows
    cols = cyc.union_cols
    other = rows != cols
    src, dst = cols[other], rows[other]
    by_src = torch.argsort(src, stable=True)
    out_ptr = torch.zeros(n + 1, dtype=torch.long)
    torch.cumsum(torch.bincount(src, minlength=n), 0, out=out_ptr[1:])
    out_flat, out_ptr_l = dst[by_src].tolist(), out_ptr.tolist()
    successors = [out_flat[out_ptr_l[v] : out_ptr_l[v + 1]] for v in range(n)]
    by_dst = torch.argsort(dst, stable=True)
    in_ptr = torch.zeros(n + 1, dtype=torch.long)
    torch.cumsum(torch.bincount(dst, minlength=n), 0, out=in_ptr[1:])
    in_flat, in_ptr_l = src[by_dst].tolist(), in_ptr.tolist()
    predecessors = [in_flat[in_ptr_l[v] : in_ptr_l[v + 1]] for v in range(n)]
    rem_out = [len(x) for x in successors]  # unvisited successors
    rem_in = [len(x) for x in predecessors]  # unvisited predecessors
    visited = bytearray(n)
    orphans = {v for v in range(n) if rem_in[v] == 0}
    sinks = {v for v in range(n) if rem_out[v] == 0}

    def visit(v: int) -> None:
        visited[v] = 1
        orphans.discard(v)
        sinks.discard(v)
        for y in successors[v]:
            rem_in[y] -= 1
            if rem_in[y] == 0 and not visited[y]:
                orphans.add(y)
        for y in predecessors[v]:
            rem_out[y] -= 1
            if rem_out[y] == 0 and not visited[y]:
                sinks.add(y)

    def leave(v: int) -> None:
        visited[v] = 0
        for y in successors[v]:
            rem_in[y] += 1
            orphans.discard(y)
        for y in predecessors[v]:
            rem_out[y] += 1
            sinks.discard(y)
        if rem_in[v] == 0:
            orphans.add(v)
        if rem_out[v] == 0:
            sinks.add(v)

    def moves(v: int, left: int):
        if len(orphans) > 1 or len(sinks) > 1:
            return iter(())
        if orphans:  # the orphan must come next; it needs an edge from v
            (w,) = orphans
            return iter((w,) if w in successors[v] else ())
        cands = [w for w in successors[v] if not visited[w] and (left == 1 or w not in sinks)]
        return iter(sorted(cands, key=lambda w: (rem_in[w], rem_out[w])))

    sources = [k for k in range(n) if not predecessors[k]]
    starts = sources if sources else sorted(range(n), key=lambda k: (rem_in[k], -rem_out[k]))
    expansions = 0
    for start in starts:
        path = [start]
        visit(start)
        stack = [moves(start, n - 1)]
        while stack:
            if len(path) == n:
                return path, False
            for w in stack[-1]:
                if not visited[w]:
                    expansions += 1
                    if expansions > budget:
                        return None, True
                    visit(w)
                    path.append(w)
                    stack.append(moves(w, n - len(path)))
                    break
            else:
                stack.pop()
                leave(path.pop())
    return None, False


def find_chain(patterns: PatternLike, n: int | None = None, budget: int = 200_000) -> ChainResult:
    """Assumption 1.2: a permutation γ with γ(i) ∈ ∪_l A^l_{γ(i+1)} (a Hamiltonian path).

    Tries the identity and the reverse permutation first (O(n) edge tests), then cheap proofs
    that no path exists (more than one token without a predecessor or successor, a
    disconnected graph, or hubs whose removal leaves too many components), then an exact
    depth-first search limited to ``budget`` expansions.
    """
    budget = check_int("budget", budget, 0)
    cyc = _Cycle.of(patterns, n)
    n = cyc.n
    if n == 1:
        return ChainResult((0,), "identity", "a single token")
    identity = torch.arange(n)
    if _is_chain(cyc, identity):
        return ChainResult(tuple(range(n)), "identity", "token i+1 attends to token i")
    if _is_chain(cyc, identity.flip(0)):
        return ChainResult(tuple(range(n - 1, -1, -1)), "reverse", "token i attends to token i+1")
    reason = _no_path_reason(cyc)
    if reason is not None:
        return ChainResult(None, "none exists", reason)
    path, exhausted = _search(cyc, budget)
    if path is not None:
        return ChainResult(tuple(path), "found", "depth-first search")
    if exhausted:
        return ChainResult(None, "search budget exhausted", f"no path within {budget} expansions")
    return ChainResult(None, "none exists", "exhaustive depth-first search")


# --------------------------------------------------------------------------- report
@dataclasses.dataclass(frozen=True)
class Assumption1Report:
    """Yun et al. Assumption 1 for a cycle of p patterns at length n (0-based tokens).

    Attributes:
        self_loops: 1.1, k ∈ A_k^l for all k and l.
        missing_self_loops: per layer, the number of tokens that do not attend to themselves.
        chain: 1.2, the permutation γ (or None); ``chain_status``/``chain_reason`` say how.
        hops: 1.3, the least s with S_k^s = [n] for all k (or None); ``hops_reason`` says why.
        hops_by_start: s for the cycle rotated to start at layer l (entry 0 is ``hops``); the
            construction of Lemma 7 can start its all-max-shift layers at any phase.
        connections: per layer, the number of (query, key) pairs |{(k, j): j ∈ A_k^l}|.
        sparsity: per layer, 1 − connections / n².
        seconds: wall time of the analysis.
    """

    n: int
    layers: tuple[str, ...]
    self_loops: bool
    missing_self_loops: tuple[int, ...]
    chain: tuple[int, ...] | None
    chain_status: str
    chain_reason: str
    hops: int | None
    hops_reason: str
    hops_by_start: tuple[int | None, ...]
    connections: tuple[int, ...]
    sparsity: tuple[float, ...]
    seconds: float

    @property
    def p(self) -> int:
        return len(self.layers)

    @property
    def satisfied(self) -> bool:
        """All three parts of Assumption 1 hold."""
        return self.self_loops and self.chain is not None and self.hops is not None

    def summary_rows(self, shown: int = 8) -> list[tuple[str, str]]:
        """(check, result) rows for a table; chains longer than ``shown`` are abbreviated."""
        rows = [("layers (p)", f"{self.p}: " + " → ".join(self.layers))]
        if self.self_loops:
            rows.append(("1.1 self-loops", "yes"))
        else:
            per = ", ".join(f"layer {i + 1}: {m}" for i, m in enumerate(self.missing_self_loops))
            rows.append(("1.1 self-loops", f"no — tokens with k ∉ A_k: {per}"))
        if self.chain_status in ("identity", "reverse"):
            chain = f"yes, γ = {self.chain_status}"
        elif self.chain is not None:
            head = ", ".join(map(str, self.chain[:shown]))
            more = ", …" if len(self.chain) > shown else ""
            chain = f"yes, γ = ({head}{more}) by search"
        else:
            chain = f"{self.chain_status}: {self.chain_reason}"
        rows.append(("1.2 chain γ", chain))
        if self.hops is None:
            rows.append(("1.3 hops s", self.hops_reason))
        else:
            hops_text = str(self.hops)
            others = [
                f"from layer {i + 1}: {h if h is not None else 'never'}"
                for i, h in enumerate(self.hops_by_start)
                if i > 0
            ]
            if others:
                hops_text += f" ({'; '.join(others)})"
            rows.append(("1.3 hops s", hops_text))
        rows.append(("connections / layer", " | ".join(f"{c:,}" for c in self.connections)))
        rows.append(("sparsity / layer", " | ".join(f"{x:.2%}" for x in self.sparsity)))
        rows.append(("satisfied", "yes" if self.satisfied else "no"))
        rows.append(("time", f"{self.seconds:.2f} s"))
        return rows

    def to_dict(self) -> dict:
        """A JSON-ready dict (``chain`` as a list, plus ``satisfied`` and ``p``)."""
        out = dataclasses.asdict(self)
        out["chain"] = None if self.chain is None else list(self.chain)
        out["satisfied"] = self.satisfied
        out["p"] = self.p
        return out


def assumption1(
    patterns: PatternLike,
    n: int | None = None,
    *,
    chain_budget: int = 200_000,
    max_hops: int | None = None,
) -> Assumption1Report:
    """Check Yun et al. (2020) Assumption 1 (§3.2) for a pattern cycle at length n.

    Args:
        patterns: a Pattern (p = 1), a PatternCycle (SEQUENTIAL), an AttentionGraph or a
            sequence of them; layer l uses entry l mod p.
        n: sequence length (required for Patterns).
        chain_budget: expansions allowed to the exact Hamiltonian-path search (1.2).
        max_hops: bound on the recursion (1.3) when self-loops are missing (see :func:`hops`).
    Returns:
        An :class:`Assumption1Report`.
    """
    start = time.perf_counter()
    chain_budget = check_int("chain_budget", chain_budget, 0)
    if max_hops is not None:
        max_hops = check_positive("max_hops", max_hops)
    cyc = _Cycle.of(patterns, n)
    n, graphs = cyc.n, cyc.graphs
    missing = tuple(int((~mask).sum()) for mask in cyc.loops)
    chain = find_chain(cyc, budget=chain_budget)
    reach = [hops(cyc, max_hops=max_hops, start=layer) for layer in range(len(graphs))]
    if isinstance(patterns, PatternCycle):
        names = tuple(repr(p) for p in patterns.patterns)
    elif isinstance(patterns, Pattern):
        names = (repr(patterns),)
    elif isinstance(patterns, AttentionGraph):
        names = ("graph",)
    else:
        names = tuple("graph" if isinstance(p, AttentionGraph) else repr(p) for p in patterns)
    edges = tuple(int(g.num_edges) for g in graphs)
    return Assumption1Report(
        n=n,
        layers=names,
        self_loops=not any(missing),
        missing_self_loops=missing,
        chain=chain.path,
        chain_status=chain.status,
        chain_reason=chain.reason,
        hops=reach[0].hops,
        hops_reason=reach[0].reason,
        hops_by_start=tuple(r.hops for r in reach),
        connections=edges,
        sparsity=tuple(1 - e / (n * n) for e in edges),
        seconds=time.perf_counter() - start,
    )


def named_pattern(
    name: str, config: str | None = None, **params: int | float
) -> Pattern | PatternCycle:
    """A pattern of ``sparseattn.patterns.NAMED`` with its example parameters updated by
    ``params``, in a head configuration (Yun §5.1).

    ``config="sequential"`` turns a union pattern into the cycle of its parts (layer l uses
    part l mod p); ``"union"`` keeps the union. The default is sequential for "strided" and
    "fixed" (their two parts A¹, A², as analysed in Yun §3.4) and union otherwise.
    """
    from ...patterns import NAMED, Union, cycle

    check_choice("name", name, sorted(NAMED))
    if config is not None:
        check_choice("config", config, ("union", "sequential"))
    factory, example = NAMED[name]
    accepted = set(inspect.signature(factory).parameters)
    unknown = sorted(set(params) - accepted)
    if unknown:
        raise ValueError(f"{name} takes parameters {sorted(accepted)}, not {unknown}")
    pattern = factory(**{**example, **params})
    if pattern.data_dependent:
        raise ValueError(f"{name} is data-dependent: its graph depends on the queries and keys")
    if config is None:
        config = "sequential" if name in ("strided", "fixed") else "union"
    if config == "union":
        return pattern
    if not isinstance(pattern, Union):
        raise ValueError(f"{name} has a single part; 'sequential' needs a union of patterns")
    return cycle(*pattern.parts)
