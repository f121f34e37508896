"""Pattern: a rule {A_k} that yields an AttentionGraph for any length n (Yun et al. §3.1), and
the two patterns its own operators make: ``pattern.causal()`` (:class:`Causal`) and
``a | b`` (:class:`Union`, Yun §5.1 UNION)."""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Callable, Hashable, Sequence
from typing import ClassVar

import torch
from torch import Tensor

from ..graph import AttentionGraph
from ..memo import Memo
from ..validate import check_positive

__all__ = ["GRAPH_CACHE_SIZE", "Pattern", "Causal", "Union", "check_positive", "union"]

#: Graphs (with their engines' plans) a pattern object keeps, one per length n (and head count
#: for a head split), the least recently used first out.
GRAPH_CACHE_SIZE = 8

#: The bounds of a pattern's memos: its graphs, its random draws (one per length), the
#: tensors its predicate reads, on the host and each device it ran on, and what
#: ``sparse_attention`` resolved for its calls (one per call signature).
MEMO_SIZES = {
    "graphs": GRAPH_CACHE_SIZE,
    "draws": GRAPH_CACHE_SIZE,
    "tensors": 4 * GRAPH_CACHE_SIZE,
    "calls": GRAPH_CACHE_SIZE,
}


@dataclasses.dataclass(frozen=True)
class Pattern(abc.ABC):
    """A sparsity pattern: for each length n, the sets A_k ⊆ [n] of keys query k attends to.

    Static patterns implement :meth:`_graph` (O(n·K), no n² scan) and :meth:`_allows`
    (a vectorised predicate, FlexAttention's ``mask_mod``). A pattern object caches its graphs
    per n (``GRAPH_CACHE_SIZE`` lengths) and the engines their plans on the graph, so a call at
    a seen length skips building and planning. Data-dependent patterns
    (``data_dependent = True``) override :meth:`build`. Indices are 0-based.
    """

    data_dependent: ClassVar[bool] = False

    def __getstate__(self) -> dict:
        """What pickle and ``copy.deepcopy`` keep: the pattern's fields, not its memos."""
        return {k: v for k, v in self.__dict__.items() if k != "_memos"}

    def memo(self, kind: str) -> Memo:
        """This pattern's memo of ``kind`` (a key of :data:`MEMO_SIZES`), made on first use.

        A frozen dataclass keeps its memos beside its fields, out of its equality, hash,
        pickles and copies."""
        memos = self.__dict__.get("_memos")
        if memos is None:
            memos = self.__dict__.setdefault("_memos", {})
        memo = memos.get(kind)
        if memo is None:
            memo = memos.setdefault(kind, Memo(MEMO_SIZES[kind]))
        return memo

    @property
    def name(self) -> str:
        return type(self).__name__.lower()

    # -- to implement -------------------------------------------------------------------
    @abc.abstractmethod
    def _graph(self, n: int) -> AttentionGraph: ...

    @abc.abstractmethod
    def _allows(self, q_idx: Tensor, kv_idx: Tensor, n: int) -> Tensor: ...

    # -- public ---------------------------------------------------------------------------
    def graph(self, n: int, n_q: int | None = None) -> AttentionGraph:
        """The AttentionGraph of this pattern at length n (cached per n).

        With ``n_q < n`` (causal patterns only; docs/causal.md): the last n_q rows of
        ``graph(n)``, queries at positions n − n_q … n − 1 against all n keys — prefill in
        pieces, or decoding — cached per (n, n_q). A non-causal pattern raises a ValueError.
        """
        check_positive("n", n)
        if n_q is None or n_q == n:
            graph = self._cached(n, self._graph)
        else:
            self._check_offset(n, n_q)
            graph = self._cached((n, n_q), lambda n, n_q: self._rows(n, n - n_q))
        if graph.predicate is None:
            graph.predicate = functools.partial(self.mask_mod, n, n_q)
        return graph

    @property
    def is_causal(self) -> bool:
        """Whether every query i attends only to keys j <= i (then queries at an offset work)."""
        return False

    def _check_offset(self, n: int, n_q: int) -> None:
        check_positive("n_q", n_q)
        if n_q > n:
            raise ValueError(
                f"n_q must be at most n_k = {n} (queries are the last n_q of the "
                f"n_k positions), got n_q={n_q}"
            )
        if not self.is_causal:
            raise ValueError(
                f"pattern {self!r} is not causal: queries at an offset (n_q={n_q} < n_k={n}) "
                "are defined for causal patterns only — use pattern.causal(), a causal pattern "
                "(causal_strided, causal_fixed, sliding_window, causal_bigbird), or for "
                "cross-attention dense(), topk(k) or an AttentionGraph"
            )

    def _rows(self, n: int, start: int) -> AttentionGraph:
        """Rows start … n − 1 of ``graph(n)`` (n − start queries, n keys). This default slices
        the cached full graph's CSR rows; patterns that can build the rows directly override it
        (O(rows·K), no full graph — what decoding against a growing cache needs)."""
        full = self.graph(n)
        crow = full.crow[start:]
        col = full.col[int(crow[0]) :]
        return AttentionGraph(crow - crow[0], col, n - start, n, (), full.causal)

    def _cached(self, key: Hashable, make: Callable[..., AttentionGraph]) -> AttentionGraph:
        """``make(*key)`` (or ``make(key)``), kept in this pattern's graph memo."""
        return self.memo("graphs").get(
            key, lambda: make(*key) if isinstance(key, tuple) else make(key)
        )

    def _draw(self, n: int, draw: Callable[[int], Tensor]) -> Tensor:
        """``draw(n)``, a random table, made once per n and kept in this pattern's memo, with
        functorch transforms and torch-function modes off (a first call from inside
        ``create_block_mask``'s vmap draws the same table): ``allows`` only indexes it."""

        def make() -> Tensor:
            with torch._C._DisableFuncTorch(), torch._C.DisableTorchFunction():
                return draw(n)

        return self.memo("draws").get(n, make)

    def _on(self, key: Hashable, device: torch.device, make: Callable[[], Tensor]) -> Tensor:
        """A tensor this pattern's predicate holds (global positions, a drawn table): ``make()``
        on the host, and its copy on ``device``, made once and kept in this pattern's memo. A
        hit only peeks (no lock): compiled FlexAttention traces the ``mask_mod``."""
        memo = self.memo("tensors")
        device = torch.device(device)
        tensor = memo.peek((key, device))
        if tensor is None:
            cpu = torch.device("cpu")
            host = memo.get((key, cpu), lambda: make().to(cpu))
            tensor = memo.get((key, device), lambda: host.to(device))
        return tensor

    def allows(self, q_idx: Tensor, kv_idx: Tensor, n: int) -> Tensor:
        """Vectorised predicate: may query ``q_idx`` attend to key ``kv_idx`` at length n? A
        BoolTensor of their broadcast shape: FlexAttention's ``mask_mod`` with n bound."""
        check_positive("n", n)
        # a Python int index joins the other index's device
        dev = next((t.device for t in (q_idx, kv_idx) if isinstance(t, Tensor)), None)
        q_idx, kv_idx = torch.broadcast_tensors(
            torch.as_tensor(q_idx, device=dev), torch.as_tensor(kv_idx, device=dev)
        )
        inside = (q_idx >= 0) & (q_idx < n) & (kv_idx >= 0) & (kv_idx < n)
        return inside & self._allows(q_idx.long(), kv_idx.long(), n)

    def mask_mod(
        self, n: int, n_q: int | None = None, device: torch.device | str | None = None
    ) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor] | None:
        """This pattern's ``graph(n, n_q)`` as a FlexAttention ``mask_mod(b, h, q_idx, kv_idx)``
        computed element-wise (no table look-ups), or None where the pattern has no such form.
        Its constants (parameters, n, the query offset) are 0-d int32 tensors on ``device``,
        not Python ints, which a compiled kernel would guard by value (one kernel per length).
        """
        dev = torch.device("cpu") if device is None else torch.device(device)

        def const(x: int) -> Tensor:
            return torch.full((), x, dtype=torch.int32, device=dev)  # a fill, no host copy

        pred = self._predicate(const(n), const, n)
        if pred is None:
            return None
        if n_q is None or n_q == n:
            return lambda b, h, q_idx, kv_idx: pred(q_idx, kv_idx)
        offset = const(n - n_q)  # queries are the last n_q positions
        return lambda b, h, q_idx, kv_idx: pred(q_idx + offset, kv_idx)

    def _predicate(
        self, n_t: Tensor, const: Callable[[int], Tensor], n: int
    ) -> Callable[[Tensor, Tensor], Tensor] | None:
        """:meth:`_allows` written with element-wise tensor ops only and every constant made
        by ``const`` (n as the 0-d tensor ``n_t``; the int ``n`` only for choices that do not
        change the predicate's form), or None (the default: no such form)."""
        return None

    def build(self, q: Tensor, k: Tensor) -> AttentionGraph:
        """The graph for inputs q: (B, H, n_q, d), k: (B, H, n_k, d) — what engines call.
        n_q < n_k puts the queries at positions n_k − n_q … n_k − 1 (causal patterns only)."""
        return self.graph(*self._lengths(q, k))

    def _lengths(self, q: Tensor, k: Tensor) -> tuple[int, int]:
        """(n_k, n_q) for self-attention or, for a causal pattern, queries at an offset."""
        n_q, n_k = q.shape[-2], k.shape[-2]
        if n_q != n_k and (n_q > n_k or not self.is_causal):
            raise ValueError(
                f"pattern {self!r} defines self-attention graphs (n_q == n_k), and for causal "
                f"patterns the last n_q <= n_k queries; got n_q={n_q}, n_k={n_k}. For "
                "cross-attention use dense(), topk(k) or an AttentionGraph."
            )
        return n_k, n_q

    def _self_attention_length(self, q: Tensor, k: Tensor) -> int:
        n_q, n_k = q.shape[-2], k.shape[-2]
        if n_q != n_k:
            raise ValueError(
                f"pattern {self!r} defines self-attention graphs (n_q == n_k); got n_q={n_q}, "
                f"n_k={n_k}. For cross-attention use dense(), topk(k) or an AttentionGraph."
            )
        return n_q

    def causal(self) -> Pattern:
        """Causal variant: the same pattern restricted to keys j <= query i."""
        return Causal(self)

    def to_block_mask(
        self, n: int, block: int = 128, device: torch.device | str = "cpu", **graph_kwargs
    ):
        """This pattern at length n as a FlexAttention ``BlockMask`` of leading shape (1, 1)
        (or (1, H) for a head split, ``graph_kwargs`` going to :meth:`graph`), built from the
        graph's block layout in O(E) and cached with the graph per (block, ``device``); its
        ``mask_mod`` is exactly :meth:`allows`."""
        from ..engines.flex import cached_block_mask

        check_positive("block", block)
        return cached_block_mask(self.graph(n, **graph_kwargs), block, device)

    def __or__(self, other: Pattern) -> Pattern:
        return union(self, other)

    def params(self) -> dict:
        """The pattern's parameters, for listings and reports."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{self.name}({args})"


class _RowsPattern(Pattern):
    """A static pattern that builds any range of its rows directly (``_rows(n, start)``,
    O(rows·K)); its graph is all of its rows."""

    def _graph(self, n: int) -> AttentionGraph:
        return self._rows(n, 0)


@dataclasses.dataclass(frozen=True, repr=False)
class _Width(Pattern):
    """A pattern of one width ``w`` >= 1 (windows, strides, segments)."""

    w: int

    def __post_init__(self) -> None:
        check_positive("w", self.w)


@dataclasses.dataclass(frozen=True, repr=False)
class Causal(Pattern):
    """``base`` restricted to j <= i (the lower triangle); its density uses n(n+1)/2."""

    base: Pattern

    @property
    def name(self) -> str:
        return f"causal {self.base.name}"

    @property
    def is_causal(self) -> bool:
        return True

    def _graph(self, n: int) -> AttentionGraph:
        return self.base.graph(n).tril()

    def _rows(self, n: int, start: int) -> AttentionGraph:
        rows = self.base._rows(n, start)  # then keep keys j <= start + row
        r = rows.row_indices()
        keep = rows.col <= r + start
        return AttentionGraph.from_edges(r[keep], rows.col[keep], n - start, n, (), causal=True)

    def _allows(self, q_idx: Tensor, kv_idx: Tensor, n: int) -> Tensor:
        return self.base.allows(q_idx, kv_idx, n) & (kv_idx <= q_idx)

    def _predicate(self, n_t, const, n):
        base = None if self.base.data_dependent else self.base._predicate(n_t, const, n)
        return None if base is None else lambda q, kv: base(q, kv) & (kv <= q)

    def causal(self) -> Pattern:
        return self

    def __repr__(self) -> str:
        return f"{self.base!r}.causal()"


#: Most explicit global positions written out as a chain of comparisons in a ``mask_mod``.
MEMBER_TERMS = 16


def _positions(tokens: int | tuple[int, ...], n: int) -> Tensor:
    """LongTensor: the global positions below n, the first ``tokens`` or the given ones."""
    if isinstance(tokens, int):
        return torch.arange(min(tokens, n))
    pos = torch.tensor(tokens, dtype=torch.long)
    return pos[pos < n]


def _member(tokens: int | tuple[int, ...], const):
    """idx ↦ whether idx is a global position, element-wise (for ``Pattern._predicate``):
    ``idx < g`` for the first g positions, a chain of equalities for up to ``MEMBER_TERMS``
    explicit positions, else None."""
    if isinstance(tokens, int):
        g = const(tokens)
        return lambda idx: idx < g
    if len(tokens) > MEMBER_TERMS:
        return None
    pos = [const(p) for p in tokens]
    return lambda idx: functools.reduce(torch.logical_or, [idx == p for p in pos])


@dataclasses.dataclass(frozen=True, repr=False)
class Union(Pattern):
    """UNION: A_k = ∪_l A_k^l (every layer and head uses the union of the parts)."""

    parts: tuple[Pattern, ...]
    label: str = "union"

    @property
    def name(self) -> str:
        return self.label

    @property
    def data_dependent(self) -> bool:  # type: ignore[override]
        return any(p.data_dependent for p in self.parts)

    @property
    def is_causal(self) -> bool:
        return all(p.is_causal for p in self.parts)

    def _graph(self, n: int) -> AttentionGraph:
        return functools.reduce(AttentionGraph.union, (p.graph(n) for p in self.parts))

    def _rows(self, n: int, start: int) -> AttentionGraph:
        return functools.reduce(AttentionGraph.union, (p._rows(n, start) for p in self.parts))

    def _allows(self, q_idx: Tensor, kv_idx: Tensor, n: int) -> Tensor:
        return functools.reduce(torch.logical_or, (p.allows(q_idx, kv_idx, n) for p in self.parts))

    def _predicate(self, n_t, const, n):
        preds = [None if p.data_dependent else p._predicate(n_t, const, n) for p in self.parts]
        if any(p is None for p in preds):
            return None
        return lambda q, kv: functools.reduce(torch.logical_or, [p(q, kv) for p in preds])

    def build(self, q: Tensor, k: Tensor) -> AttentionGraph:
        if not self.data_dependent:
            return super().build(q, k)  # the cached graph of this length
        self._lengths(q, k)  # offset queries only when every part is causal
        graphs = (p.build(q, k).to(q.device) for p in self.parts)  # static parts: cached copy
        return functools.reduce(AttentionGraph.union, graphs)

    def __repr__(self) -> str:
        inner = ", ".join(repr(p) for p in self.parts)
        return f"union({inner})" if self.label == "union" else f"{self.label}[{inner}]"


def union(*patterns: Pattern, name: str = "union") -> Union:
    """UNION of patterns (Yun §5.1): a query attends to a key if any part allows it."""
    _check_patterns(patterns)
    return Union(tuple(patterns), name)


def _check_patterns(patterns: Sequence[Pattern]) -> None:
    if not patterns:
        raise ValueError("give at least one pattern")
    for p in patterns:
        if not isinstance(p, Pattern):
            raise TypeError(f"expected Pattern objects, got {type(p).__name__}")
