"""BigBird's *block* layout as Hugging Face transformers lays it out (BigBirdBlockSparseAttention;
docs/checkpoints.md, "BigBird's block layout").

Transformers' block-sparse BigBird (``models/big_bird/modeling_big_bird.py``) cuts the n tokens
into nb = n / b blocks: query blocks 0 and nb − 1 attend to every key; every other query block
i to the key blocks i − 1, i, i + 1 (the band), 0 and nb − 1, and the r random key blocks
``rand_attn[h, i − 1, :]`` (not the token-level ``bigbird(w, …)`` of :mod:`.fixed`). The random
blocks come from HF's own routines, ported here (:func:`bigbird_rand_attn`) with a private
``numpy.random.RandomState`` in place of the global state HF seeds with the layer's index. At
n ∈ {1024, 3072, 4096} HF uses its older ``_bigbird_block_rand_mask`` on
``config.max_position_embeddings`` (``max_seqlen`` here). In eval mode every random slot is
block 0: the graph is band ∪ globals, and HF's eval outputs need a bias of log(r + 1) on block
0's scores (its softmax counts them r + 1 times). Where HF's draw finds too few legal blocks
(short sequences), HF raises, and so does this pattern.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import Tensor

from ..graph import AttentionGraph
from ..validate import check_bool, check_int
from .base import Pattern, check_positive

__all__ = [
    "HF_LEGACY_LENGTHS",
    "BigBirdBlocks",
    "bigbird_blocks",
    "bigbird_rand_attn",
]

#: Lengths at which HF draws with ``_bigbird_block_rand_mask`` ("old plans used in paper").
HF_LEGACY_LENGTHS = (1024, 3072, 4096)

#: HF's ``BigBirdConfig.max_position_embeddings`` default.
DEFAULT_MAX_SEQLEN = 4096

#: ``np.random.seed`` takes seeds in [0, 2³² − 1].
_SEED_MAX = 2**32 - 1


def _check_seed(seed: object) -> int:
    seed = check_int("seed", seed)
    if not 0 <= seed <= _SEED_MAX:
        raise ValueError(
            f"seed must lie in [0, 2**32 - 1] (what np.random.seed takes; HF seeds the draw "
            f"with the layer index), got {seed}"
        )
    return seed


def _check_length(n: int, block: int, r: int) -> int:
    """nb = n / block, for n a multiple of block with at least 4 blocks."""
    check_positive("n", n)
    if n % block:
        raise ValueError(
            f"n must be a multiple of block={block} (BigBirdModel pads its input to one), got n={n}"
        )
    nb = n // block
    if nb < 4:
        raise ValueError(
            f"n must be at least 4 blocks (4 * block = {4 * block}): HF's block-sparse attention "
            f"computes blocks 0, 1, nb - 2 and nb - 1 apart; got n={n}. BigBirdModel uses full "
            f"attention for n <= (5 + 2 * random_blocks) * block = {(5 + 2 * r) * block}"
        )
    return nb


# ------------------------------------------------------------------ HF's draw, ported
def _rand_attn_plan(n: int, b: int, r: int) -> tuple[list[int], list[int]]:
    """HF's ``_get_rand_attn_plan``: where (which key-block ranges) the random blocks go."""
    nb = n // b
    if 2 * r + 5 < nb:
        return [(2 * r + 5) * b, n], [r, 0]
    if r + 5 < nb:
        return [(r + 5) * b, n], [r // 2, r - r // 2]
    return [n], [r]


def _legacy_rand_mask(rng: np.random.RandomState, m: int, b: int, r: int, last_idx: int):
    """HF's ``_bigbird_block_rand_mask(m, m, b, b, r, last_idx)`` in training mode."""
    nb = m // b
    rand_attn = np.zeros((nb - 2, r), dtype=np.int32)
    middle_seq = np.arange(1, nb - 1, dtype=np.int32)
    last = nb - 1
    if last_idx > 2 * b:
        last = last_idx // b - 1
    for i in range(1, nb - 1):
        start, end = i - 2, i
        if i == 1:
            rand_attn[i - 1, :] = rng.permutation(middle_seq[2:last])[:r]
        elif i == 2:
            rand_attn[i - 1, :] = rng.permutation(middle_seq[3:last])[:r]
        elif i in (nb - 3, nb - 2) or start > last:  # HF: rows nb - 3, nb - 2 keep the band
            rand_attn[i - 1, :] = rng.permutation(middle_seq[:last])[:r]
        elif end + 1 == last:
            rand_attn[i - 1, :] = rng.permutation(middle_seq[:start])[:r]
        else:
            rand_attn[i - 1, :] = rng.permutation(
                np.concatenate((middle_seq[:start], middle_seq[end + 1 : last]))
            )[:r]
    return rand_attn


def _single_row(rng: np.random.RandomState, block_id: int, start: int, end: int, r: int):
    """HF's ``_get_single_block_row_attention`` (window and global sizes 1)."""
    perm = rng.permutation(np.arange(start, end, dtype=np.int32))
    illegal = [*range(block_id - 1, block_id + 2), 0, end - 1]
    if block_id == 1:
        illegal.append(end - 2)
    if block_id == end - 2:
        illegal.append(1)
    selected = []
    for i in range(end - start):
        if perm[i] not in illegal:
            selected.append(perm[i])
        if len(selected) == r:
            break
    return np.array(selected, dtype=np.int32)


def _rand_mask_with_head(rng, n: int, b: int, heads: int, plan: list[int], plan_r: list[int]):
    """HF's ``_bigbird_block_rand_mask_with_head`` in training mode, rows 1 … nb − 2."""
    nb = n // b
    plan_blocks = np.array(plan) // b
    max_plan_idx = plan.index(n)
    out = [
        np.zeros((nb, int(np.sum(plan_r[: max_plan_idx + 1]))), dtype=np.int32)
        for _ in range(heads)
    ]
    for plan_idx in range(max_plan_idx + 1):
        rnd_r_cnt = 0
        if plan_idx > 0:
            if plan_r[plan_idx] > 0:
                rnd_r_cnt = int(np.sum(plan_r[:plan_idx]))
                curr_r_cnt = int(np.sum(plan_r[: plan_idx + 1]))
                for row in range(1, plan_blocks[plan_idx - 1]):
                    for h in range(heads):
                        out[h][row, rnd_r_cnt:curr_r_cnt] = _single_row(
                            rng, row, plan_blocks[plan_idx - 1], plan_blocks[plan_idx],
                            plan_r[plan_idx],
                        )  # fmt: skip
            for pl_id in range(plan_idx):
                if plan_r[pl_id] == 0:
                    continue
                for row in range(plan_blocks[plan_idx - 1], plan_blocks[plan_idx]):
                    rnd_r_cnt, to_start = 0, 0
                    if pl_id > 0:
                        rnd_r_cnt = int(np.sum(plan_r[:pl_id]))
                        to_start = plan_blocks[pl_id - 1]
                    curr_r_cnt = int(np.sum(plan_r[: pl_id + 1]))
                    for h in range(heads):
                        out[h][row, rnd_r_cnt:curr_r_cnt] = _single_row(
                            rng, row, to_start, plan_blocks[pl_id], plan_r[pl_id]
                        )
        if plan_r[plan_idx] == 0:
            continue
        curr_r_cnt = int(np.sum(plan_r[: plan_idx + 1]))
        from_start, to_start = 1, 0
        if plan_idx > 0:
            rnd_r_cnt = int(np.sum(plan_r[:plan_idx]))
            from_start = to_start = plan_blocks[plan_idx - 1]
        for row in range(from_start, plan_blocks[plan_idx]):
            for h in range(heads):
                out[h][row, rnd_r_cnt:curr_r_cnt] = _single_row(
                    rng, row, to_start, plan_blocks[plan_idx], plan_r[plan_idx]
                )
    return [a[1 : nb - 1] for a in out]


def bigbird_rand_attn(
    n: int,
    block: int,
    random_blocks: int,
    heads: int = 1,
    seed: int = 0,
    *,
    training: bool = True,
    max_seqlen: int = DEFAULT_MAX_SEQLEN,
) -> Tensor:
    """HF's ``rand_attn`` for one layer: LongTensor[heads, n/block − 2, random_blocks].

    Entry (h, i − 1, :) holds the key blocks query block i draws in head h: what HF computes
    after ``np.random.seed(seed)`` (the layer index) with ``max_position_embeddings =
    max_seqlen`` (read at n ∈ ``HF_LEGACY_LENGTHS`` only), here from a private
    ``np.random.RandomState(seed)``. ``training=False``: HF's eval draw, all zeros. A
    ValueError where HF's draw fails (short sequences) or n is not a multiple of ``block`` of
    at least 4 blocks.
    """
    check_positive("block", block)
    r = check_positive("random_blocks", random_blocks)
    check_positive("heads", heads)
    seed = _check_seed(seed)
    check_bool("training", training)
    check_positive("max_seqlen", max_seqlen)
    nb = _check_length(n, block, r)
    legacy = n in HF_LEGACY_LENGTHS
    if legacy and max_seqlen // block < nb:
        raise ValueError(
            f"max_seqlen must be at least n={n}: at n in {HF_LEGACY_LENGTHS} HF draws for "
            f"max_position_embeddings and keeps the first n/block - 2 rows, got {max_seqlen}"
        )
    if not training:
        return torch.zeros(heads, nb - 2, r, dtype=torch.long)
    rng = np.random.RandomState(seed)
    try:
        if legacy:
            draws = [
                _legacy_rand_mask(rng, max_seqlen, block, r, 1024)[: nb - 2] for _ in range(heads)
            ]
        else:
            plan, plan_r = _rand_attn_plan(n, block, r)
            draws = _rand_mask_with_head(rng, n, block, heads, plan, plan_r)
    except ValueError as err:  # numpy: a slot of r got neither r blocks nor one
        raise ValueError(
            f"HF's random draw finds too few legal key blocks at n={n} (block={block}, "
            f"random_blocks={r}); BigBirdBlockSparseAttention fails there too ({err}). "
            f"BigBirdModel uses full attention for n <= (5 + 2 * random_blocks) * block = "
            f"{(5 + 2 * r) * block}: use sa.dense() there"
        ) from None
    return torch.from_numpy(np.stack(draws).astype(np.int64))


# ------------------------------------------------------------------ the pattern
def _expand_blocks(blocks: AttentionGraph, block: int) -> AttentionGraph:
    """Token graph of a block graph: query i attends to key j iff block pair (i/b, j/b) is
    an edge. Every token row of a block row shares its keys; written piece by piece in O(E)."""
    nb, b = blocks.n_q, block
    bdeg = blocks.crow[1:] - blocks.crow[:-1]  # blocks per block row
    degrees = (bdeg * b).repeat_interleave(b)  # keys per token row
    crow = torch.zeros(degrees.numel() + 1, dtype=torch.long)
    torch.cumsum(degrees, 0, out=crow[1:])
    tokens = (blocks.col[:, None] * b + torch.arange(b)).reshape(-1)  # block rows' keys, in order
    col = torch.empty(int(crow[-1]), dtype=torch.long)
    graph = AttentionGraph(crow, col, nb * b, nb * b, blocks.batch_shape)
    # edge e of token row t is tokens[e + shift[t]]: the row's offset into its block row's keys
    shift = (blocks.crow[:-1] * b).repeat_interleave(b) - crow[:-1]
    for lo, hi in graph.row_pieces():
        e0, e1 = int(crow[lo]), int(crow[hi])
        src = torch.arange(e0, e1)
        src += torch.repeat_interleave(shift[lo:hi], degrees[lo:hi], output_size=e1 - e0)
        torch.index_select(tokens, 0, src, out=graph.col[e0:e1])
    return graph


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class BigBirdBlocks(Pattern):
    """BigBird's block layout (Zaheer et al. 2020, §2) exactly as Hugging Face transformers'
    ``BigBirdBlockSparseAttention`` lays it out (the module docstring).

    Args:
        block: b, tokens per block (HF's ``config.block_size``).
        random_blocks: r, random key blocks per query block (``config.num_random_blocks``).
        heads: None — one draw shared by every head, graph ``batch_shape`` (); H — one draw
            per head, graph ``batch_shape`` (H,) (``config.num_attention_heads``).
        seed: the draw's seed in [0, 2³² − 1] (HF: the layer index).
        training: False gives HF's eval layout (band ∪ globals).
        max_seqlen: HF's ``config.max_position_embeddings``; only read at n ∈ {1024, 3072,
            4096}.
        rand_attn: HF's own draw instead, integer (heads, n/b − 2, r) or (n/b − 2, r)
            (shared), for n = (rows + 2)·b only (then without seed, training, max_seqlen).

    ``graph(n)`` needs n a multiple of b of at least 4 blocks, and raises a ValueError where
    HF's own draw fails (short n; HF's *model* attends fully for n ≤ (5 + 2r)·b). Built in
    O(E) from the block table.
    """

    block: int
    random_blocks: int
    heads: int | None = None
    seed: int = 0
    training: bool = True
    max_seqlen: int = DEFAULT_MAX_SEQLEN
    rand_attn: Tensor | None = None

    def __post_init__(self) -> None:
        check_positive("block", self.block)
        check_positive("random_blocks", self.random_blocks)
        if self.heads is not None:
            check_positive("heads", self.heads)
        _check_seed(self.seed)
        check_bool("training", self.training)
        check_positive("max_seqlen", self.max_seqlen)
        if self.rand_attn is not None:
            self._set_rand_attn(self.rand_attn)

    def _set_rand_attn(self, rand_attn: object) -> None:
        if (self.seed, self.training, self.max_seqlen) != (0, True, DEFAULT_MAX_SEQLEN):
            raise ValueError(
                "rand_attn fixes the random blocks: leave seed, training and max_seqlen unset"
            )
        table = (
            rand_attn if isinstance(rand_attn, Tensor) else torch.as_tensor(np.asarray(rand_attn))
        )
        if table.is_floating_point() or table.is_complex() or table.dtype == torch.bool:
            raise TypeError(f"rand_attn must hold integer block indices, got {table.dtype}")
        if table.dim() not in (2, 3):
            raise ValueError(
                "rand_attn must have shape (heads, n/block - 2, random_blocks) or "
                f"(n/block - 2, random_blocks), got {tuple(table.shape)}"
            )
        if table.shape[-1] != self.random_blocks:
            raise ValueError(
                f"rand_attn must hold random_blocks={self.random_blocks} blocks per row, "
                f"got {table.shape[-1]}"
            )
        nb = table.shape[-2] + 2
        if nb < 4:
            raise ValueError(f"rand_attn must have at least 2 rows (4 blocks), got {nb - 2}")
        if table.numel() and (int(table.min()) < 0 or int(table.max()) >= nb):
            raise ValueError(
                f"rand_attn entries must be key blocks in [0, {nb}), "
                f"got [{int(table.min())}, {int(table.max())}]"
            )
        if table.dim() == 2:
            if self.heads is not None:
                raise ValueError(
                    "a 2-D rand_attn is one draw shared by every head: leave heads=None"
                )
            table = table[None]
        elif self.heads is None:
            object.__setattr__(self, "heads", table.shape[0])
        elif self.heads != table.shape[0]:
            raise ValueError(f"rand_attn has {table.shape[0]} heads, heads={self.heads}")
        object.__setattr__(self, "rand_attn", table.detach().to("cpu", torch.long).clone())

    # -- facts ------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return "bigbird_blocks"

    @property
    def shared(self) -> bool:
        """Whether one draw serves every head (graph ``batch_shape`` ())."""
        return self.heads is None

    def num_blocks(self, n: int) -> int:
        """nb = n / block, after checking that the pattern applies to length n."""
        nb = _check_length(n, self.block, self.random_blocks)
        if self.rand_attn is not None and nb != self.rand_attn.shape[1] + 2:
            raise ValueError(
                f"this rand_attn covers n = {(self.rand_attn.shape[1] + 2) * self.block} "
                f"({self.rand_attn.shape[1] + 2} blocks of {self.block}), got n={n}"
            )
        return nb

    def block_table(self, n: int) -> Tensor:
        """LongTensor[G, n/b − 2, r] (G = heads, or 1 when shared): HF's ``rand_attn``, the
        random key blocks of query blocks 1 … nb − 2 (drawn once per n, cached)."""
        self.num_blocks(n)
        if self.rand_attn is not None:
            return self.rand_attn

        def draw(n: int) -> Tensor:
            return bigbird_rand_attn(
                n, self.block, self.random_blocks, 1 if self.heads is None else self.heads,
                self.seed, training=self.training, max_seqlen=self.max_seqlen,
            )  # fmt: skip

        return self._draw(n, draw)

    def block_graph(self, n: int) -> AttentionGraph:
        """The block layout as a graph over nb = n/b blocks (``batch_shape`` as the token
        graph): block i → j iff query block i attends to key block j (duplicates merged)."""
        nb = self.num_blocks(n)
        table = self.block_table(n)
        g = table.shape[0]
        mid = torch.arange(1, nb - 1)
        fixed = torch.stack(
            [mid - 1, mid, mid + 1, torch.zeros_like(mid), torch.full_like(mid, nb - 1)], 1
        )
        cols_mid = torch.cat([fixed.expand(g, -1, -1), table], -1)  # (G, nb - 2, 5 + r)
        rows_mid = (torch.arange(g)[:, None] * nb + mid)[..., None].expand_as(cols_mid)
        ends = (torch.arange(g)[:, None] * nb + torch.tensor([0, nb - 1])).reshape(-1)
        rows = torch.cat([rows_mid.reshape(-1), ends.repeat_interleave(nb)])
        cols = torch.cat([cols_mid.reshape(-1), torch.arange(nb).repeat(ends.numel())])
        batch_shape = () if self.heads is None else (self.heads,)
        return AttentionGraph.from_edges(rows, cols, nb, nb, batch_shape)

    # -- Pattern ----------------------------------------------------------------------------
    def _graph(self, n: int) -> AttentionGraph:
        return _expand_blocks(self.block_graph(n), self.block)

    def _allows(self, q_idx: Tensor, kv_idx: Tensor, n: int) -> Tensor:
        if self.heads is not None:
            raise TypeError(
                "this layout has one draw per head: use allows_head(head, q_idx, kv_idx, n)"
            )
        return self.allows_head(torch.zeros_like(q_idx), q_idx, kv_idx, n)

    def allows_head(self, head: Tensor, q_idx: Tensor, kv_idx: Tensor, n: int) -> Tensor:
        """FlexAttention-shaped predicate (h, q_idx, kv_idx) at length n (head ignored when
        the draw is shared)."""
        nb = self.num_blocks(n)
        head, q_idx, kv_idx = torch.broadcast_tensors(
            torch.as_tensor(head), torch.as_tensor(q_idx), torch.as_tensor(kv_idx)
        )
        inside = (q_idx >= 0) & (q_idx < n) & (kv_idx >= 0) & (kv_idx < n)
        qb = (q_idx.long() // self.block).clamp(0, nb - 1)
        kb = (kv_idx.long() // self.block).clamp(0, nb - 1)
        table = self._on(("block_table", n), q_idx.device, lambda: self.block_table(n))
        h = torch.zeros_like(qb) if self.heads is None else head.long()
        drawn = table[h, (qb - 1).clamp(0, nb - 3)]  # (..., r)
        rand = (drawn == kb[..., None]).any(-1)
        glob = (qb == 0) | (qb == nb - 1) | (kb == 0) | (kb == nb - 1)
        return inside & (glob | ((kb - qb).abs() <= 1) | rand)

    def build(self, q: Tensor, k: Tensor) -> AttentionGraph:
        if self.heads is not None and q.shape[1] != self.heads:
            raise ValueError(
                f"this layout was drawn for heads={self.heads}, got q with {q.shape[1]} heads"
            )
        return super().build(q, k)

    def params(self) -> dict:
        out = {
            "block": self.block,
            "random_blocks": self.random_blocks,
            "heads": self.heads,
            "seed": self.seed,
        }
        if not self.training:
            out["training"] = False
        if self.max_seqlen != DEFAULT_MAX_SEQLEN:
            out["max_seqlen"] = self.max_seqlen
        if self.rand_attn is not None:
            del out["seed"]
            out["rand_attn"] = tuple(self.rand_attn.shape)
        return out

    def _key(self) -> tuple:
        return (self.block, self.random_blocks, self.heads, self.seed, self.training,
                self.max_seqlen)  # fmt: skip

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BigBirdBlocks):
            return NotImplemented
        a, b = self.rand_attn, other.rand_attn
        same = (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        return self._key() == other._key() and same

    def __hash__(self) -> int:
        return hash(self._key())


def bigbird_blocks(
    block: int,
    random_blocks: int,
    heads: int | None = None,
    seed: int = 0,
    rand_attn: Tensor | None = None,
    *,
    training: bool = True,
    max_seqlen: int = DEFAULT_MAX_SEQLEN,
) -> BigBirdBlocks:
    """BigBird's block layout as HF transformers' ``BigBirdBlockSparseAttention`` builds it
    (:class:`BigBirdBlocks`): with ``heads=config.num_attention_heads`` and ``seed=layer_idx``
    layer ``layer_idx`` of a ``BigBirdModel`` in training mode; ``training=False`` its eval
    layout; ``rand_attn`` a draw of HF's as it is."""
    return BigBirdBlocks(block, random_blocks, heads, seed, training, max_seqlen, rand_attn)
