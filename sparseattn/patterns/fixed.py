"""The named static patterns of the papers (Yun et al. eqs. 4–6, Longformer, BigBird, random).

Every graph is built from neighbour lists in O(n·K); nothing scans all n² pairs except
``dense()``, whose graph *is* n². Indices are 0-based (the papers count from 1).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ..graph import AttentionGraph
from ..validate import check_finite_float, check_int, check_seed
from .base import Pattern, _member, _positions, _RowsPattern, _Width, check_positive, union

__all__ = [
    "Dense",
    "Window",
    "Stride",
    "BlockLocal",
    "FixedSummary",
    "Star",
    "GlobalTokens",
    "ItemGlobalTokens",
    "Random",
    "RandomBlocks",
    "dense",
    "window",
    "strided",
    "fixed",
    "star",
    "global_tokens",
    "random",
    "random_blocks",
    "longformer",
    "bigbird",
    "block_local",
]


def _table(index: Tensor, n: int) -> AttentionGraph:
    """Graph from an (n, K) neighbour table whose out-of-range entries are dropped."""
    return AttentionGraph.from_neighbours(index, (index >= 0) & (index < n), n)


@dataclasses.dataclass(frozen=True, repr=False)
class Dense(_RowsPattern):
    """A_k = [n]: full attention."""

    def _rows(self, n: int, start: int) -> AttentionGraph:  # rows start..n-1 (offset queries)
        return AttentionGraph(
            torch.arange(n - start + 1) * n, torch.arange(n).repeat(n - start), n - start, n
        )

    def _allows(self, q_idx: Tensor, kv_idx: Tensor, n: int) -> Tensor:
        return torch.ones_like(q_idx, dtype=torch.bool)

    def _predicate(self, n_t, const, n):
        return lambda q, kv: (q >= 0) & (kv >= 0)

    def build(self, q: Tensor, k: Tensor) -> AttentionGraph:
        n_q, n_k = q.shape[-2], k.shape[-2]  # dense also serves cross-attention
        crow = torch.arange(n_q + 1) * n_k
        return AttentionGraph(crow, torch.arange(n_k).repeat(n_q), n_q, n_k)


@dataclasses.dataclass(frozen=True, repr=False)
class Window(_RowsPattern, _Width):
    """Yun eq. (4), A¹: A_k = [n] ∩ {k − ⌈w/2⌉, …, k + ⌊w/2⌋} (w + 1 keys inside the sequence)."""

    def _rows(self, n: int, start: int) -> AttentionGraph:  # rows start..n-1 (offset queries)
        i = torch.arange(start, n)  # offsets past ±(n − 1) are clamped: no huge w allocations
        return AttentionGraph.from_ranges(i - min(math.ceil(self.w / 2), n), i + 1 + self.w // 2, n)

    def _allows(self, q_idx: Tensor, kv_idx: Tensor, n: int) -> Tensor:
        delta = kv_idx - q_idx
        return (delta >= -math.ceil(self.w / 2)) & (delta <= self.w // 2)

    def _predicate(self, n_t, const, n):
        lo, hi = const(-math.ceil(self.w / 2)), const(self.w // 2)
        return lambda q, kv: (kv - q >= lo) & (kv - q <= hi)


@dataclasses.dataclass(frozen=True, repr=False)
class Stride(_RowsPattern, _Width):
    """Yun eq. (4), A²: A_k = [n] ∩ {…, k − 2w, k − w, k, k + w, k + 2w, …}."""

    def _rows(self, n: int, start: int) -> AttentionGraph:  # rows start..n-1 (offset queries)
        steps = torch.arange(-(-n // self.w)) * min(self.w, n)  # w >= n: the diagonal only
        return _table(torch.arange(start, n)[:, None] % self.w + steps, n)

    def _allows(self, q_idx: Tensor, kv_idx: Tensor, n: int) -> Tensor:
        return (kv_idx - q_idx) % self.w == 0

    def _predicate(self, n_t, const, n):
        w = const(self.w)
        return lambda q, kv: (kv - q) % w == 0


@dataclasses.dataclass(frozen=True, repr=False)
class BlockLocal(_RowsPattern):
    """Attend within the own block of ``block`` tokens; also Yun eq. (5), A¹ (FIXED, w = block)."""

    block: int

    def __post_init__(self) -> None:
        check_positive("block", self.block)

    def _rows(self, n: int, start: int) -> AttentionGraph:  # rows start..n-1 (offset queries)
        first = torch.arange(start, n) // self.block * self.block
        return AttentionGraph.from_ranges(first, first + min(self.block, n), n)

    def _allows(self, q_idx: Tensor, kv_idx: Tensor, n: int) -> Tensor:
        return q_idx // self.block == kv_idx // self.block

    def _predicate(self, n_t, const, n):
        b = const(self.block)
        return lambda q, kv: q // b == kv // b


@dataclasses.dataclass(frozen=True, repr=False)
class FixedSummary(_RowsPattern, _Width):
    """Yun eq. (5), A²: A_k = [n] ∩ ({k} ∪ {w, 2w, 3w, …}) — the last token of every segment."""

    def _rows(self, n: int, start: int) -> AttentionGraph:  # rows start..n-1 (offset queries)
        w = min(self.w, n + 1)  # w > n: no segment end inside the sequence
        summary = torch.arange(w - 1, n, w).view(1, -1).expand(n - start, -1)
        return _table(torch.cat([torch.arange(start, n)[:, None], summary], 1), n)

    def _allows(self, q_idx: Tensor, kv_idx: Tensor, n: int) -> Tensor:
        return (kv_idx == q_idx) | (kv_idx % self.w == self.w - 1)

    def _predicate(self, n_t, const, n):
        w, last = const(self.w), const(self.w - 1)
        return lambda q, kv: (kv == q) | (kv % w == last)


@dataclasses.dataclass(frozen=True, repr=False)
class Star(_Width):
    """Yun eq. (6), STAR (Guo et al.): the relay token is the last position n; it attends to all
    and all attend to it; token k < n attends to its 2w + 1 cyclic neighbours in [n − 1]:
    A_k = {n} ∪ {(i − 1) mod (n − 1) + 1 : i ∈ {k − w, …, k + w}},  A_n = [n].
    """

    def _graph(self, n: int) -> AttentionGraph:
        m = n - 1  # ordinary tokens 0..n-2; relay n-1
        rows = [torch.full((n,), m)]
        cols = [torch.arange(n)]
        if m > 0:
            w = min(self.w, m)  # a wider ring only repeats keys
            ring = (torch.arange(m)[:, None] + torch.arange(-w, w + 1)) % m
            relay = torch.full((m, 1), m)
            table = torch.cat([ring, relay], 1)
            rows.append(torch.arange(m).repeat_interleave(table.shape[1]))
            cols.append(table.reshape(-1))
        return AttentionGraph.from_edges(torch.cat(rows), torch.cat(cols), n, n)

    def _allows(self, q_idx: Tensor, kv_idx: Tensor, n: int) -> Tensor:
        m = n - 1
        relay = (q_idx == m) | (kv_idx == m)
        dist = (kv_idx - q_idx) % max(m, 1)
        return relay | (dist <= self.w) | (dist >= m - self.w)

    def _predicate(self, n_t, const, n):
        m, ring, w, far = n_t - 1, const(max(n - 1, 1)), const(self.w), const(n - 1 - self.w)

        def star(q: Tensor, kv: Tensor) -> Tensor:
            dist = (kv - q) % ring
            return (q == m) | (kv == m) | (dist <= w) | (dist >= far)

        return star


@dataclasses.dataclass(frozen=True, repr=False)
class GlobalTokens(_RowsPattern):
    """Global tokens (Longformer, BigBird): each attends to all keys and all attend to it;
    ``tokens`` an int g (the first g positions) or explicit positions (those >= n dropped)."""

    tokens: int | tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.tokens, (tuple, list)):
            check_positive("global_tokens", self.tokens)
        else:
            tokens = tuple(sorted({check_int("global_tokens[i]", t, 0) for t in self.tokens}))
            object.__setattr__(self, "tokens", tokens)
            if not self.tokens:
                raise ValueError("global_tokens must be an int >= 1 or a non-empty list of ints")

    def positions(self, n: int) -> Tensor:
        return _positions(self.tokens, n)

    def _rows(self, n: int, start: int) -> AttentionGraph:  # rows start..n-1 (offset queries)
        g, m = self.positions(n), n - start
        gq = g[g >= start] - start  # global queries among the rows
        rows = torch.cat([gq.repeat_interleave(n), torch.arange(m).repeat_interleave(g.numel())])
        cols = torch.cat([torch.arange(n).repeat(gq.numel()), g.repeat(m)])
        return AttentionGraph.from_edges(rows, cols, m, n)

    def _allows(self, q_idx: Tensor, kv_idx: Tensor, n: int) -> Tensor:
        g = self._on(("positions", n), q_idx.device, lambda: self.positions(n))
        return torch.isin(q_idx, g) | torch.isin(kv_idx, g)

    def _predicate(self, n_t, const, n):
        member = _member(self.tokens, const)
        return None if member is None else lambda q, kv: member(q) | member(kv)


def _random_subsets(rows: int, n: int, k: int, gen: torch.Generator) -> Tensor:
    """LongTensor[rows, k]: for each row a uniform random k-subset of [n], in O(rows·k) expected
    (the first k distinct values of an i.i.d. uniform sequence; short rows drawn again)."""
    if 2 * k > n:  # dense regime: a random permutation per row costs O(n) = O(k)
        return torch.rand(rows, n, generator=gen).argsort(-1)[:, :k]
    out = torch.empty(rows, k, dtype=torch.long)
    todo = torch.arange(rows)
    draws = 2 * k + 8
    while todo.numel():
        cand = torch.randint(n, (todo.numel(), draws), generator=gen)
        sorted_cand, order = cand.sort(dim=-1, stable=True)
        first = torch.ones_like(cand, dtype=torch.bool)
        first[:, 1:] = sorted_cand[:, 1:] != sorted_cand[:, :-1]
        first_pos = torch.full_like(cand, draws).scatter_(
            1, order, torch.where(first, order, torch.full_like(order, draws))
        )
        pos, _ = first_pos.sort(-1)
        ok = pos[:, k - 1] < draws
        out[todo[ok]] = cand[ok].gather(1, pos[ok, :k])
        todo = todo[~ok]
        draws *= 2
    return out


@dataclasses.dataclass(frozen=True, repr=False)
class Random(Pattern):
    """RANDOM (Yun §5): each query attends to ``k`` keys drawn uniformly without replacement
    (or ``round(density · n)``, at least 1), independently per query, from ``seed``."""

    k: int | None = None
    density: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.k is None) == (self.density is None):
            raise ValueError("random pattern: give exactly one of k or density")
        if self.k is not None:
            check_positive("k", self.k)
        else:
            check_finite_float("density", self.density, 0.0, 1.0, low_open=True)
        check_seed("seed", self.seed)

    def keys_per_query(self, n: int) -> int:
        k = self.k if self.k is not None else max(1, round(self.density * n))
        return min(k, n)

    def edge_keys(self, n: int) -> Tensor:
        """LongTensor[n·k], sorted: the drawn edges as keys i·n + j (drawn once per n, cached)."""

        def draw(n: int) -> Tensor:
            gen = torch.Generator().manual_seed(self.seed)
            table = _random_subsets(n, n, self.keys_per_query(n), gen).sort(-1).values
            return (torch.arange(n)[:, None] * n + table).reshape(-1)

        return self._draw(n, draw)

    def _graph(self, n: int) -> AttentionGraph:
        return AttentionGraph.from_neighbours((self.edge_keys(n) % n).view(n, -1), None, n)

    def _allows(self, q_idx: Tensor, kv_idx: Tensor, n: int) -> Tensor:
        # binary search: O(log E) per pair, no n x n table
        keys = self._on(("edge_keys", n), q_idx.device, lambda: self.edge_keys(n))
        query = q_idx * n + kv_idx
        return keys[torch.searchsorted(keys, query).clamp(max=keys.numel() - 1)] == query


@dataclasses.dataclass(frozen=True, repr=False)
class RandomBlocks(Pattern):
    """BigBird's random attention: every query block of size ``block`` attends to
    ``random_blocks`` key blocks drawn uniformly without replacement (from ``seed``)."""

    random_blocks: int
    block: int
    seed: int = 0

    def __post_init__(self) -> None:
        check_positive("random_blocks", self.random_blocks)
        check_positive("block", self.block)
        check_seed("seed", self.seed)

    def block_table(self, n: int) -> Tensor:
        """LongTensor[ceil(n/b), r]: the key blocks chosen by each query block (drawn once per
        n from ``seed``, cached)."""

        def draw(n: int) -> Tensor:
            nb = -(-n // self.block)
            gen = torch.Generator().manual_seed(self.seed)
            return _random_subsets(nb, nb, min(self.random_blocks, nb), gen)

        return self._draw(n, draw)

    def _graph(self, n: int) -> AttentionGraph:
        table = self.block_table(n)  # (nb, r)
        keys = (table[:, :, None] * self.block + torch.arange(min(self.block, n))).flatten(1)
        per_query = keys[torch.arange(n) // self.block]
        return _table(per_query, n)

    def _allows(self, q_idx: Tensor, kv_idx: Tensor, n: int) -> Tensor:
        table = self._on(("block_table", n), q_idx.device, lambda: self.block_table(n))
        table = table[q_idx.clamp(0, n - 1) // self.block]
        return (table == (kv_idx // self.block)[..., None]).any(-1)


# --------------------------------------------------------------------------- factories
def dense() -> Pattern:
    """Full attention, A_k = [n]."""
    return Dense()


def window(w: int) -> Pattern:
    """Sliding window, Yun eq. (4) A¹: keys k − ⌈w/2⌉ … k + ⌊w/2⌋ (so ``window(512)`` is ±256)."""
    return Window(w)


def strided(w: int, part: int | None = None) -> Pattern:
    """STRIDED (Child et al.; Yun eq. 4): ``part=1`` the window A¹, ``part=2`` the stride A²,
    ``None`` their union (Yun §5.1 UNION). ``strided(w).parts`` gives (A¹, A²)."""
    parts = (Window(w), Stride(w))
    return _pick("strided", parts, part, union)


def fixed(w: int, part: int | None = None) -> Pattern:
    """FIXED (Child et al.; Yun eq. 5): ``part=1`` own segment of w, ``part=2`` {k} ∪ segment
    ends, ``None`` their union. ``fixed(w).parts`` gives (A¹, A²)."""
    check_positive("w", w)  # named w here, not BlockLocal's block
    parts = (BlockLocal(w), FixedSummary(w))
    return _pick("fixed", parts, part, union)


def _pick(name, parts, part, union):
    if part is None:
        return union(*parts, name=name)
    if part not in (1, 2):
        raise ValueError(f"part must be 1, 2 or None (the union), got {part!r}")
    return parts[part - 1]


def star(w: int) -> Pattern:
    """STAR (Guo et al.; Yun eq. 6) with the relay token at the last position."""
    return Star(w)


def global_tokens(tokens: int | Sequence[int]) -> Pattern:
    """Global tokens: the first ``tokens`` positions (int) or the given positions."""
    return _global(tokens)


@dataclasses.dataclass(frozen=True, repr=False)
class ItemGlobalTokens(Pattern):
    """Global tokens that differ per batch item (Longformer's ``global_attention_mask``, the
    question tokens of QA): item b's tokens ``tokens[b]`` attend to every key and every query
    attends to them. Graphs have batch shape (B, 1), broadcast over the heads (B must be the
    inputs' batch); :meth:`allows` returns a leading (B, 1) too. Positions ≥ n are dropped.
    """

    tokens: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if isinstance(self.tokens, (str, bytes)) or not isinstance(self.tokens, Sequence):
            raise TypeError(
                f"tokens must be one sequence of positions per item, got {self.tokens!r}"
            )
        items = []
        for b, item in enumerate(self.tokens):
            if isinstance(item, (str, bytes)) or not isinstance(item, Sequence):
                raise TypeError(f"tokens[{b}] must be a sequence of positions, got {item!r}")
            items.append(tuple(sorted({check_int(f"tokens[{b}][i]", t, 0) for t in item})))
        if not items:
            raise ValueError("tokens must hold one sequence of positions per batch item")
        object.__setattr__(self, "tokens", tuple(items))

    @classmethod
    def from_mask(cls, mask: Tensor) -> ItemGlobalTokens:
        """From a (B, n) bool mask, True at each item's global tokens."""
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.dim() != 2:
            raise TypeError("a global token mask must be a (batch, n) bool tensor")
        return cls(tuple(tuple(row.nonzero().flatten().tolist()) for row in mask.cpu()))

    def table(self, n: int) -> Tensor:
        """(B, n) bool: True at item b's global tokens below n."""
        out = torch.zeros(len(self.tokens), n, dtype=torch.bool)
        for b, item in enumerate(self.tokens):
            out[b, [t for t in item if t < n]] = True
        return out

    def _graph(self, n: int) -> AttentionGraph:
        table = self.table(n)
        bsz = table.shape[0]
        item, g = table.nonzero(as_tuple=True)  # item b's global positions
        base = item * n  # row offset of item b
        rows = torch.cat(
            [(base + g).repeat_interleave(n), (base[:, None] + torch.arange(n)).flatten()]
        )
        cols = torch.cat([torch.arange(n).repeat(g.numel()), g.repeat_interleave(n)])
        return AttentionGraph.from_edges(rows, cols, n, n, (bsz, 1))

    def _allows(self, q_idx: Tensor, kv_idx: Tensor, n: int) -> Tensor:
        table = self._on(("table", n), q_idx.device, lambda: self.table(n))
        member = lambda i: table[:, i.clamp(0, n - 1)]  # noqa: E731 - (B, *i.shape)
        out = member(q_idx) | member(kv_idx)
        return out.view(table.shape[0], 1, *q_idx.shape)


def _global(tokens: int | Sequence[int] | Sequence[Sequence[int]] | Tensor) -> Pattern:
    if isinstance(tokens, Tensor) and tokens.dtype == torch.bool:
        return ItemGlobalTokens.from_mask(tokens)
    if (
        isinstance(tokens, Sequence)
        and tokens
        and all(isinstance(t, Sequence) and not isinstance(t, (str, bytes)) for t in tokens)
    ):
        return ItemGlobalTokens(tuple(tuple(t) for t in tokens))
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, (int, Sequence, Tensor)):
        raise TypeError(
            f"global_tokens must be an int or a sequence of ints, got {type(tokens).__name__}"
        )
    return GlobalTokens(tokens if isinstance(tokens, int) else tuple(tokens))


def random(k: int | None = None, density: float | None = None, seed: int = 0) -> Pattern:
    """RANDOM: ``k`` (or ``density·n``) uniform random keys per query, seeded."""
    return Random(k, density, seed)


def random_blocks(random_blocks: int, block: int, seed: int = 0) -> Pattern:
    """BigBird random block attention."""
    return RandomBlocks(random_blocks, block, seed)


def block_local(block: int) -> Pattern:
    """Block-diagonal local attention in blocks of ``block`` tokens."""
    return BlockLocal(block)


def longformer(
    w: int, global_tokens: int | Sequence[int] | Sequence[Sequence[int]] | Tensor = 0
) -> Pattern:
    """Longformer (Beltagy et al. 2020): window(w) ∪ global tokens — the first
    ``global_tokens`` positions (an int), the given positions, or positions per batch item
    (:class:`ItemGlobalTokens`: a (B, n) bool mask as Longformer's ``global_attention_mask``,
    or one sequence per item). None by default (until 2026-11-29: token 0)."""
    if isinstance(global_tokens, int) and not isinstance(global_tokens, bool):
        none = check_int("global_tokens", global_tokens, 0) == 0
    else:
        none = isinstance(global_tokens, (list, tuple)) and not global_tokens
    parts = (Window(w),) if none else (Window(w), _global(global_tokens))
    return union(*parts, name="longformer")


def bigbird(
    w: int,
    global_tokens: int | Sequence[int] = 1,
    random_blocks: int = 1,
    block: int = 16,
    seed: int = 0,
) -> Pattern:
    """BigBird (Zaheer et al.): window(w) ∪ global tokens ∪ ``random_blocks`` random key blocks
    per query block of ``block`` tokens."""
    return union(
        Window(w), _global(global_tokens), RandomBlocks(random_blocks, block, seed), name="bigbird"
    )
