"""Causal patterns as their papers define them (docs/causal.md).

``pattern.causal()`` intersects a bidirectional pattern with the lower triangle (for Yun's eq. 4
that keeps only ⌈w/2⌉ previous tokens); the patterns here are the autoregressive originals:
Child et al.'s (2019) STRIDED and FIXED, the sliding window with attention sinks (causal
Longformer, Mistral, StreamingLLM) and causal BigBird. Every row i depends on i alone (not on
n), and each pattern builds any range of rows (queries at an offset, ``graph(n_k, n_q)``) in
O(rows · K) without the full graph. Indices are 0-based.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import torch
from torch import Tensor

from ..graph import AttentionGraph
from ..validate import check_int, check_seed
from .base import Pattern, _member, _positions, _RowsPattern, _Width, check_positive, union

__all__ = [
    "CausalWindow",
    "CausalStride",
    "CausalSegment",
    "CausalSummary",
    "CausalGlobal",
    "CausalRandomBlocks",
    "causal_strided",
    "causal_fixed",
    "sliding_window",
    "causal_bigbird",
]


def _table(index: Tensor, valid: Tensor, n: int) -> AttentionGraph:
    """Causal graph from an (n_q, K) neighbour table; entries where ``valid`` is False dropped."""
    return AttentionGraph.from_neighbours(index, valid, n, causal=True)


class _CausalPattern(_RowsPattern):
    """A causal static pattern whose rows are built directly: implement ``_rows(n, start)``."""

    @property
    def name(self) -> str:
        """The class name in snake case: ``CausalWindow`` is "causal_window"."""
        return re.sub(r"(?<!^)(?=[A-Z])", "_", type(self).__name__).lower()

    @property
    def is_causal(self) -> bool:
        return True

    def causal(self) -> Pattern:
        return self


@dataclasses.dataclass(frozen=True, repr=False)
class CausalWindow(_CausalPattern, _Width):
    """The previous w tokens including the query: A_i = {max(0, i − w + 1), …, i}.

    Child et al.'s STRIDED A¹ (their reference code's ``local`` mask; the paper's formula
    counts one more) and the causal sliding window of Longformer / Mistral.
    """

    def _rows(self, n: int, start: int) -> AttentionGraph:
        index = torch.arange(start, n)[:, None] + torch.arange(1 - min(self.w, n), 1)
        return _table(index, index >= 0, n)

    def _allows(self, q_idx: Tensor, kv_idx: Tensor, n: int) -> Tensor:
        return (kv_idx <= q_idx) & (kv_idx > q_idx - self.w)

    def _predicate(self, n_t, const, n):
        w = const(self.w)
        return lambda q, kv: (kv <= q) & (kv > q - w)


@dataclasses.dataclass(frozen=True, repr=False)
class CausalStride(_CausalPattern, _Width):
    """Child et al.'s STRIDED A²: A_i = {j ≤ i : (i − j) mod w = 0} (every w-th token back)."""

    def _rows(self, n: int, start: int) -> AttentionGraph:
        back = torch.arange((n - 1) // self.w, -1, -1) * self.w  # ascending keys i − m·w
        index = torch.arange(start, n)[:, None] - back
        return _table(index, index >= 0, n)

    def _allows(self, q_idx: Tensor, kv_idx: Tensor, n: int) -> Tensor:
        return (kv_idx <= q_idx) & ((q_idx - kv_idx) % self.w == 0)

    def _predicate(self, n_t, const, n):
        w = const(self.w)
        return lambda q, kv: (kv <= q) & ((q - kv) % w == 0)


@dataclasses.dataclass(frozen=True, repr=False)
class CausalSegment(_CausalPattern, _Width):
    """Child et al.'s FIXED A¹: A_i = {j ≤ i : ⌊j/w⌋ = ⌊i/w⌋} (the own segment up to i)."""

    def _rows(self, n: int, start: int) -> AttentionGraph:
        rows = torch.arange(start, n)[:, None]
        index = rows // self.w * self.w + torch.arange(min(self.w, n))
        return _table(index, index <= rows, n)

    def _allows(self, q_idx: Tensor, kv_idx: Tensor, n: int) -> Tensor:
        return (kv_idx <= q_idx) & (kv_idx // self.w == q_idx // self.w)

    def _predicate(self, n_t, const, n):
        w = const(self.w)
        return lambda q, kv: (kv <= q) & (kv // w == q // w)


@dataclasses.dataclass(frozen=True, repr=False)
class CausalSummary(_CausalPattern, _Width):
    """Child et al.'s FIXED A² with the query itself: A_i = {i} ∪ {j ≤ i : j mod w ≥ w − c}
    (the last c positions of every segment up to i; {i}, Yun eq. 5's, feeds the first ones)."""

    c: int = 1

    def __post_init__(self) -> None:
        check_positive("w", self.w)
        check_int("c", self.c, 1)
        if self.c > self.w:
            raise ValueError(
                f"c must be at most w = {self.w} (positions per segment), got c={self.c}"
            )

    def _rows(self, n: int, start: int) -> AttentionGraph:
        keys = torch.arange(n)
        summary = keys[keys % self.w >= self.w - self.c]
        rows = torch.arange(start, n)[:, None]
        index = torch.cat([summary.expand(n - start, -1), rows], 1)
        return _table(index, index <= rows, n)  # unsorted rows: from_edges sorts and dedups

    def _allows(self, q_idx: Tensor, kv_idx: Tensor, n: int) -> Tensor:
        summary = (kv_idx % self.w >= self.w - self.c) & (kv_idx <= q_idx)
        return summary | (kv_idx == q_idx)

    def _predicate(self, n_t, const, n):
        w, first = const(self.w), const(self.w - self.c)
        return lambda q, kv: ((kv % w >= first) & (kv <= q)) | (kv == q)


@dataclasses.dataclass(frozen=True, repr=False)
class CausalGlobal(_CausalPattern):
    """Causal global tokens (attention sinks): every query i attends to the global positions
    p ≤ i, and a global query attends to every key j ≤ i. ``tokens``: an int g (the first g
    positions, StreamingLLM's sinks) or explicit positions."""

    tokens: int | tuple[int, ...]

    def __post_init__(self) -> None:
        if isinstance(self.tokens, int) and not isinstance(self.tokens, bool):
            check_positive("global_tokens", self.tokens)
            return
        if isinstance(self.tokens, (str, bytes)) or not isinstance(self.tokens, (Sequence, Tensor)):
            raise TypeError(
                f"global_tokens must be an int or a sequence of ints, got "
                f"{type(self.tokens).__name__}"
            )
        tokens = tuple(sorted({check_int("global_tokens[i]", int(t), 0) for t in self.tokens}))
        if not tokens:
            raise ValueError("global_tokens must be an int >= 1 or a non-empty list of ints")
        object.__setattr__(self, "tokens", tokens)

    def positions(self, n: int) -> Tensor:
        return _positions(self.tokens, n)

    def _rows(self, n: int, start: int) -> AttentionGraph:
        g, m = self.positions(n), n - start
        rows = torch.arange(start, n)
        keep = g[None, :] <= rows[:, None]  # (m, |g|): the global keys each query sees
        r_parts = [torch.arange(m)[:, None].expand(-1, g.numel())[keep]]
        c_parts = [g.expand(m, -1)[keep]]
        for p in g[g >= start].tolist():  # a global query: every key up to itself
            r_parts.append(torch.full((p + 1,), p - start))
            c_parts.append(torch.arange(p + 1))
        return AttentionGraph.from_edges(torch.cat(r_parts), torch.cat(c_parts), m, n, (), True)

    def _allows(self, q_idx: Tensor, kv_idx: Tensor, n: int) -> Tensor:
        g = self._on(("positions", n), q_idx.device, lambda: self.positions(n))
        return (kv_idx <= q_idx) & (torch.isin(q_idx, g) | torch.isin(kv_idx, g))

    def _predicate(self, n_t, const, n):
        member = _member(self.tokens, const)
        return None if member is None else lambda q, kv: (kv <= q) & (member(q) | member(kv))


@dataclasses.dataclass(frozen=True, repr=False)
class CausalRandomBlocks(_CausalPattern):
    """Causal BigBird random attention: query block b (of ``block`` tokens) attends to
    ``random_blocks`` key blocks drawn uniformly without replacement among blocks 0 … b; a
    query i keeps the keys j ≤ i of them. The draw of block b depends on (seed, b) only, so
    rows do not change with n (decoding sees the rows of the full-length graph)."""

    random_blocks: int
    block: int
    seed: int = 0

    def __post_init__(self) -> None:
        check_positive("random_blocks", self.random_blocks)
        check_positive("block", self.block)
        check_seed("seed", self.seed)

    def block_choice(self, first: int, last: int) -> Tensor:
        """LongTensor[last − first + 1, r]: the sorted key blocks of query blocks first … last
        (entries −1 where block b has fewer than r blocks to choose from). O(r) per block."""
        r = self.random_blocks
        out = torch.full((last - first + 1, r), -1, dtype=torch.long)
        for b in range(first, last + 1):
            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + b) % 2**64)
            if b + 1 <= 2 * r:  # few candidates: a permutation
                pick = torch.randperm(b + 1, generator=gen)[:r]
            else:  # draw with replacement until r distinct (expected < 2r draws)
                seen: list[int] = []
                while len(seen) < r:
                    for x in torch.randint(b + 1, (2 * r,), generator=gen).tolist():
                        if x not in seen and len(seen) < r:
                            seen.append(x)
                pick = torch.tensor(seen)
            out[b - first, : pick.numel()] = pick.sort().values
        return out

    def _rows(self, n: int, start: int) -> AttentionGraph:
        b = self.block
        first, last = start // b, (n - 1) // b
        choice = self.block_choice(first, last)  # (blocks, r)
        keys = (choice[:, :, None] * b + torch.arange(b)).flatten(1)  # (blocks, r·b), ascending
        ok = (choice >= 0).repeat_interleave(b, 1)
        rows = torch.arange(start, n)
        per = rows // b - first
        index = keys[per]
        return _table(index, ok[per] & (index <= rows[:, None]), n)

    def block_table(self, n: int) -> Tensor:
        """``block_choice`` of every query block at length n, drawn once per n and cached
        (``Pattern._draw``)."""
        return self._draw(n, lambda n: self.block_choice(0, (n - 1) // self.block))

    def _allows(self, q_idx: Tensor, kv_idx: Tensor, n: int) -> Tensor:
        table = self._on(("block_table", n), q_idx.device, lambda: self.block_table(n))
        table = table[q_idx.clamp(0, n - 1) // self.block]  # (..., r)
        hit = (table == (kv_idx // self.block)[..., None]).any(-1)
        return hit & (kv_idx <= q_idx)


# --------------------------------------------------------------------------- factories
def causal_strided(w: int, part: int | None = None) -> Pattern:
    """Child et al.'s causal STRIDED: ``part=1`` the previous w tokens (A¹), ``part=2`` every
    w-th token back {j ≤ i : (i − j) mod w = 0} (A²), ``None`` their union (Yun §5.1 UNION).
    ``causal_strided(w).parts`` gives (A¹, A²) for MULTIHEAD / SEQUENTIAL configurations."""
    from .fixed import _pick

    parts = (CausalWindow(w), CausalStride(w))
    return _pick("causal_strided", parts, part, union)


def causal_fixed(w: int, part: int | None = None, c: int = 1) -> Pattern:
    """Child et al.'s causal FIXED: ``part=1`` the own segment of w up to i (A¹), ``part=2``
    {i} ∪ the last ``c`` positions of every segment up to i (A²), ``None`` their union."""
    from .fixed import _pick

    parts = (CausalSegment(w), CausalSummary(w, c))
    return _pick("causal_fixed", parts, part, union)


def sliding_window(w: int, sinks: int | Sequence[int] = 0) -> Pattern:
    """Causal sliding window of the previous w tokens (including the query), plus ``sinks``
    global tokens (the first ``sinks`` positions, or explicit positions) that every later
    query attends to and that attend to everything before them — causal Longformer
    (Beltagy et al.), Mistral's window, StreamingLLM's attention sinks (Xiao et al.)."""
    window = CausalWindow(w)
    if isinstance(sinks, int) and not isinstance(sinks, bool):
        check_int("sinks", sinks, 0)
        if sinks == 0:
            return window
    return union(window, CausalGlobal(sinks), name="sliding_window")


def causal_bigbird(
    w: int,
    global_tokens: int | Sequence[int] = 1,
    random_blocks: int = 1,
    block: int = 16,
    seed: int = 0,
) -> Pattern:
    """Causal BigBird (Zaheer et al.): the previous w tokens ∪ causal global tokens ∪
    ``random_blocks`` random key blocks per query block, drawn among the blocks up to it."""
    return union(
        CausalWindow(w),
        CausalGlobal(global_tokens),
        CausalRandomBlocks(random_blocks, block, seed),
        name="causal_bigbird",
    )
