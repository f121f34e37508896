"""Block layouts as patterns, and the six DeepSpeed sparsity configurations (docs/engines.md,
"DeepSpeed layouts").

A DeepSpeed *block layout* is an integer tensor (H, n/b, n/b) whose entry (h, i, j) is 1 when,
in head h, the queries of block i attend to the keys of block j. :func:`from_block_layout` turns
one into a Pattern (graph batch_shape () when all heads agree, else (H,)); the config classes
rebuild DeepSpeed's layouts under its class and parameter names (``make_layout(seq_len)``), and
``config.pattern()`` gives the Pattern for any length. Simplifications: random blocks come from
a seeded ``torch.Generator`` (unidirectional ones among blocks ≤ the row); a unidirectional
layout ends with a ``tril`` (DeepSpeed's Fixed keeps the upper half of a g × g global block),
and its pattern adds the element-level triangle inside diagonal blocks; a length that is not a
multiple of the block uses ceil(n/b) blocks and drops the tokens past n.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from ..graph import AttentionGraph
from .base import Pattern, check_positive

__all__ = [
    "BSLongformerSparsityConfig",
    "BigBirdSparsityConfig",
    "BlockLayout",
    "DenseSparsityConfig",
    "FixedSparsityConfig",
    "LocalSlidingWindowSparsityConfig",
    "SparsityConfig",
    "VariableSparsityConfig",
    "from_block_layout",
]


def _layout_graph(layout: Tensor, block: int, n: int, causal: bool) -> AttentionGraph:
    """Expand a bool layout (H, nb, nb) to token edges for length n (O(edges))."""
    heads, nb, _ = layout.shape
    if -(-n // block) != nb:
        raise ValueError(
            f"a layout of {nb} blocks of {block} covers n in "
            f"({(nb - 1) * block}, {nb * block}], got n={n}"
        )
    shared = bool((layout == layout[:1]).all())
    if shared:
        layout = layout[:1]
    h, i, j = layout.nonzero(as_tuple=True)
    offs = torch.arange(min(block, n))  # a block longer than n: only its first n offsets
    q = (i[:, None, None] * block + offs[:, None]).expand(-1, len(offs), len(offs))
    k = (j[:, None, None] * block + offs[None, :]).expand(-1, len(offs), len(offs))
    keep = (q < n) & (k < n)
    if causal:
        keep &= k <= q
    rows = (h[:, None, None] * n + q)[keep]
    batch_shape = () if shared else (heads,)
    return AttentionGraph.from_edges(rows, k[keep], n, n, batch_shape, causal=causal)


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class BlockLayout(Pattern):
    """A pattern given by a block layout: query i may attend to key j in head h iff
    ``layout[h, i // block, j // block]`` (and j <= i when ``causal``).

    ``layout`` is a bool tensor (H, nb, nb); the pattern applies to lengths n with
    ceil(n / block) == nb.
    """

    layout: Tensor
    block: int
    causal_mask: bool = False

    @property
    def name(self) -> str:
        return "block_layout"

    @property
    def shared(self) -> bool:
        """Whether all heads have the same layout (then the graph is shared by all heads)."""
        return bool((self.layout == self.layout[:1]).all())

    def _graph(self, n: int) -> AttentionGraph:
        return _layout_graph(self.layout, self.block, n, self.causal_mask)

    def _allows(self, q_idx: Tensor, kv_idx: Tensor, n: int) -> Tensor:
        if not self.shared:
            raise TypeError("this layout differs per head: use allows_head(h, q_idx, kv_idx, n)")
        return self.allows_head(torch.zeros_like(q_idx), q_idx, kv_idx, n)

    def allows_head(self, head: Tensor, q_idx: Tensor, kv_idx: Tensor, n: int) -> Tensor:
        """FlexAttention-shaped predicate (h, q_idx, kv_idx) at length n."""
        head, q_idx, kv_idx = torch.broadcast_tensors(
            torch.as_tensor(head), torch.as_tensor(q_idx), torch.as_tensor(kv_idx)
        )
        nb = self.layout.shape[-1]
        inside = (q_idx >= 0) & (q_idx < n) & (kv_idx >= 0) & (kv_idx < n)
        qb = (q_idx // self.block).clamp(0, nb - 1)
        kb = (kv_idx // self.block).clamp(0, nb - 1)
        layout = self._on(("layout",), q_idx.device, lambda: self.layout)
        out = inside & layout[head.long(), qb.long(), kb.long()]
        return out & (kv_idx <= q_idx) if self.causal_mask else out

    def params(self) -> dict:
        heads, nb, _ = self.layout.shape
        return {"heads": heads, "blocks": nb, "block": self.block, "causal": self.causal_mask}

    def causal(self) -> Pattern:
        return BlockLayout(self.layout.tril(), self.block, True)


def from_block_layout(layout: Tensor, block: int, causal: bool = False) -> BlockLayout:
    """A Pattern from a DeepSpeed-style block layout (H, nb, nb) or (nb, nb), bool or integer
    (non-zero = attend), of ``block`` tokens per block; ``causal`` also restricts every query
    to keys j <= i. Its graphs have batch_shape () if all heads agree, else (H,)."""
    check_positive("block", block)
    if not isinstance(layout, Tensor):
        raise TypeError(f"layout must be a tensor, got {type(layout).__name__}")
    if layout.dim() == 2:
        layout = layout[None]
    if layout.dim() != 3 or layout.shape[1] != layout.shape[2] or layout.shape[1] == 0:
        raise ValueError(f"layout must have shape (heads, nb, nb), got {tuple(layout.shape)}")
    if layout.is_floating_point() or layout.is_complex():
        raise TypeError(f"layout must be bool or integer, got {layout.dtype}")
    return BlockLayout(layout.detach().cpu() != 0, block, causal)


# --------------------------------------------------------------------------- DeepSpeed configs
@dataclasses.dataclass
class SparsityConfig(abc.ABC):
    """Base of the DeepSpeed-style configs: ``make_layout(seq_len)`` → LongTensor (H, nb, nb).

    Args (DeepSpeed's names):
        num_heads, block: H and the tokens per block.
        different_layout_per_head: compute each head's layout separately (else head 0's).
        attention: ``"bidirectional"`` or ``"unidirectional"`` (block lower triangle, and a
            causal element mask in :meth:`pattern`).
        seed: seed of the random blocks (DeepSpeed: unseeded).
    """

    num_heads: int
    block: int = 16
    different_layout_per_head: bool = False
    attention: str = "bidirectional"
    seed: int = 0

    def __post_init__(self) -> None:
        check_positive("num_heads", self.num_heads)
        check_positive("block", self.block)
        if self.attention not in ("bidirectional", "unidirectional"):
            raise ValueError(
                f"attention must be 'bidirectional' or 'unidirectional', got {self.attention!r}"
            )

    @property
    def unidirectional(self) -> bool:
        return self.attention == "unidirectional"

    def make_layout(self, seq_len: int) -> Tensor:
        """LongTensor (num_heads, seq_len/block, seq_len/block) of 0/1 (DeepSpeed's API)."""
        check_positive("seq_len", seq_len)
        if seq_len % self.block:
            raise ValueError(f"seq_len ({seq_len}) must be a multiple of block ({self.block})")
        nb = seq_len // self.block
        gen = torch.Generator().manual_seed(self.seed)
        heads = self.num_heads if self.different_layout_per_head else 1
        layout = torch.zeros(self.num_heads, nb, nb, dtype=torch.bool)
        for h in range(heads):
            layout[h] = self._head_layout(h, nb, gen)
        if heads == 1:
            layout[:] = layout[0]
        if self.unidirectional:
            layout = layout.tril()
        return layout.long()

    @abc.abstractmethod
    def _head_layout(self, h: int, nb: int, gen: torch.Generator) -> Tensor:
        """Bool (nb, nb) layout of head h (before the unidirectional lower triangle)."""

    def pattern(self) -> Pattern:
        """The Pattern that builds this config's layout at any length (see module notes)."""
        return _ConfigPattern(self)

    # shared pieces ------------------------------------------------------------------------
    def _sliding(self, nb: int, window_blocks: int) -> Tensor:
        """Row i attends to blocks i − w … i + w, w = window_blocks // 2."""
        idx = torch.arange(nb)
        return (idx[None, :] - idx[:, None]).abs() <= window_blocks // 2

    def _random(self, nb: int, count: int, gen: torch.Generator) -> Tensor:
        """Each row attends to ``count`` distinct random blocks (among blocks <= row when
        unidirectional)."""
        out = torch.zeros(nb, nb, dtype=torch.bool)
        if count == 0:
            return out
        keys = torch.rand(nb, nb, generator=gen)
        if self.unidirectional:
            keys = keys.masked_fill(torch.ones(nb, nb, dtype=torch.bool).triu(1), -1.0)
        top = keys.topk(min(count, nb), dim=-1).indices
        out.scatter_(1, top, True)
        return out.tril() if self.unidirectional else out

    def _check_fits(self, nb: int, **sizes: int) -> None:
        for name, size in sizes.items():
            if size > nb:
                raise ValueError(f"{name} ({size}) exceeds the number of blocks ({nb})")


@dataclasses.dataclass
class DenseSparsityConfig(SparsityConfig):
    """Every block attends to every block (DeepSpeed ``DenseSparsityConfig``)."""

    def _head_layout(self, h: int, nb: int, gen: torch.Generator) -> Tensor:
        return torch.ones(nb, nb, dtype=torch.bool)


@dataclasses.dataclass
class FixedSparsityConfig(SparsityConfig):
    """FIXED (Child et al. 2019; DeepSpeed ``FixedSparsityConfig``).

    Local: blocks are cut into windows of ``num_local_blocks``; a block attends to its window.
    Global: in every window the ``num_global_blocks`` blocks ending ``(1 + h mod
    num_different_global_patterns) · num_global_blocks`` from the window's end are global
    columns (all rows attend to them; unidirectional: rows at or after them); with
    ``horizontal_global_attention`` they also attend to everything (bidirectional only).
    A short last window puts its global blocks at the same offset, or at the sequence end.
    """

    num_local_blocks: int = 4
    num_global_blocks: int = 1
    horizontal_global_attention: bool = False
    num_different_global_patterns: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("num_local_blocks", self.num_local_blocks)
        check_positive("num_global_blocks", self.num_global_blocks)
        check_positive("num_different_global_patterns", self.num_different_global_patterns)
        if self.num_local_blocks % self.num_global_blocks:
            raise ValueError("num_local_blocks must be a multiple of num_global_blocks")
        if self.num_different_global_patterns > self.num_local_blocks // self.num_global_blocks:
            raise ValueError(
                "num_different_global_patterns must be at most "
                "num_local_blocks // num_global_blocks"
            )
        if self.num_different_global_patterns > 1 and not self.different_layout_per_head:
            raise ValueError("num_different_global_patterns > 1 needs different_layout_per_head")
        if self.horizontal_global_attention and self.unidirectional:
            raise ValueError("horizontal_global_attention needs bidirectional attention")

    def _head_layout(self, h: int, nb: int, gen: torch.Generator) -> Tensor:
        w, g = self.num_local_blocks, self.num_global_blocks
        idx = torch.arange(nb)
        layout = (idx[:, None] // w) == (idx[None, :] // w)
        first = w - (1 + h % self.num_different_global_patterns) * g
        end = nb - nb % w
        starts = list(range(first, end, w))
        if end < nb:
            starts.append(min(end + first, nb - g))
        for s in starts:
            layout[(0 if not self.unidirectional else s) :, s : s + g] = True
            if self.horizontal_global_attention:
                layout[s : s + g, :] = True
        return layout


def _global_ranges(starts: Sequence[int], ends: Sequence[int] | None) -> list[tuple[int, int]]:
    """The global blocks [start, end) of a config (one block per start without ``ends``),
    checked."""
    if ends is None:
        return [(s, s + 1) for s in starts]
    if len(ends) != len(starts):
        raise ValueError("global_block_end_indices must pair up with global_block_indices")
    if any(s >= e for s, e in zip(starts, ends, strict=True)):
        raise ValueError("each global block range needs start < end")
    return list(zip(starts, ends, strict=True))


@dataclasses.dataclass
class VariableSparsityConfig(SparsityConfig):
    """Variable windows + global + random blocks (DeepSpeed ``VariableSparsityConfig``).

    Local: consecutive windows of ``local_window_blocks[0]``, ``[1]``, … blocks, the last size
    repeating to the end; a block attends to its window. Global: the blocks
    ``global_block_indices`` (or the ranges [start, end) with ``global_block_end_indices``)
    are attended by every row (unidirectional: rows at or after them), and attend to
    everything with ``horizontal_global_attention``. Random: ``num_random_blocks`` per row.
    """

    num_random_blocks: int = 0
    local_window_blocks: Sequence[int] = (4,)
    global_block_indices: Sequence[int] = (0,)
    global_block_end_indices: Sequence[int] | None = None
    horizontal_global_attention: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_random_blocks < 0:
            raise ValueError(f"num_random_blocks must be >= 0, got {self.num_random_blocks}")
        if not self.local_window_blocks or min(self.local_window_blocks) < 1:
            raise ValueError("local_window_blocks must be a non-empty list of positive sizes")
        _global_ranges(self.global_block_indices, self.global_block_end_indices)
        if self.horizontal_global_attention and self.unidirectional:
            raise ValueError("horizontal_global_attention needs bidirectional attention")

    def _head_layout(self, h: int, nb: int, gen: torch.Generator) -> Tensor:
        self._check_fits(nb, num_random_blocks=self.num_random_blocks)
        layout = self._random(nb, self.num_random_blocks, gen)
        start, sizes = 0, list(self.local_window_blocks)
        while start < nb:
            size = sizes.pop(0) if len(sizes) > 1 else sizes[0]
            layout[start : start + size, start : start + size] = True
            start += size
        for s, e in _global_ranges(self.global_block_indices, self.global_block_end_indices):
            if s < nb:
                layout[(0 if not self.unidirectional else s) :, s:e] = True
                if self.horizontal_global_attention:
                    layout[s:e, :] = True
        return layout


@dataclasses.dataclass
class BigBirdSparsityConfig(SparsityConfig):
    """BigBird (Zaheer et al. 2020; DeepSpeed ``BigBirdSparsityConfig``): ``num_random_blocks``
    random blocks per row, a sliding window of ``num_sliding_window_blocks`` blocks, and the
    first ``num_global_blocks`` blocks global (their rows and columns are full)."""

    num_random_blocks: int = 1
    num_sliding_window_blocks: int = 3
    num_global_blocks: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_random_blocks < 0:
            raise ValueError(f"num_random_blocks must be >= 0, got {self.num_random_blocks}")
        check_positive("num_sliding_window_blocks", self.num_sliding_window_blocks)
        check_positive("num_global_blocks", self.num_global_blocks)

    def _head_layout(self, h: int, nb: int, gen: torch.Generator) -> Tensor:
        self._check_fits(
            nb,
            num_random_blocks=self.num_random_blocks,
            num_sliding_window_blocks=self.num_sliding_window_blocks,
            num_global_blocks=self.num_global_blocks,
        )
        layout = self._random(nb, self.num_random_blocks, gen)
        layout |= self._sliding(nb, self.num_sliding_window_blocks)
        layout[: self.num_global_blocks, :] = True
        layout[:, : self.num_global_blocks] = True
        return layout


@dataclasses.dataclass
class BSLongformerSparsityConfig(SparsityConfig):
    """Block-sparse Longformer (Beltagy et al. 2020; DeepSpeed ``BSLongformerSparsityConfig``):
    a sliding window of ``num_sliding_window_blocks`` blocks plus global blocks at
    ``global_block_indices`` (or ranges [start, end) with ``global_block_end_indices``),
    whose rows and columns are full."""

    num_sliding_window_blocks: int = 3
    global_block_indices: Sequence[int] = (0,)
    global_block_end_indices: Sequence[int] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("num_sliding_window_blocks", self.num_sliding_window_blocks)
        _global_ranges(self.global_block_indices, self.global_block_end_indices)

    def _head_layout(self, h: int, nb: int, gen: torch.Generator) -> Tensor:
        self._check_fits(nb, num_sliding_window_blocks=self.num_sliding_window_blocks)
        layout = self._sliding(nb, self.num_sliding_window_blocks)
        for s, e in _global_ranges(self.global_block_indices, self.global_block_end_indices):
            if s < nb:
                layout[s:e, :] = True
                layout[:, s:e] = True
        return layout


@dataclasses.dataclass
class LocalSlidingWindowSparsityConfig(SparsityConfig):
    """A sliding window of ``num_sliding_window_blocks`` blocks (DeepSpeed
    ``LocalSlidingWindowSparsityConfig``; its default is unidirectional)."""

    num_sliding_window_blocks: int = 3
    attention: str = "unidirectional"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("num_sliding_window_blocks", self.num_sliding_window_blocks)

    def _head_layout(self, h: int, nb: int, gen: torch.Generator) -> Tensor:
        self._check_fits(nb, num_sliding_window_blocks=self.num_sliding_window_blocks)
        return self._sliding(nb, self.num_sliding_window_blocks)


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class _ConfigPattern(Pattern):
    """The pattern of a config: at length n, the layout for ceil(n/b) blocks, truncated."""

    config: SparsityConfig

    @property
    def name(self) -> str:
        return type(self.config).__name__

    def _layout(self, n: int) -> BlockLayout:
        b = self.config.block
        layout = self.config.make_layout(-(-n // b) * b)
        return BlockLayout(layout != 0, b, self.config.unidirectional)

    def _graph(self, n: int) -> AttentionGraph:
        return self._layout(n).graph(n)

    def _allows(self, q_idx: Tensor, kv_idx: Tensor, n: int) -> Tensor:
        return self._layout(n)._allows(q_idx, kv_idx, n)

    def params(self) -> dict:
        return dataclasses.asdict(self.config)
