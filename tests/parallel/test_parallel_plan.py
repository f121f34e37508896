"""The context-parallel planner (sparseattn.parallel.plan, issue 42 item 1), without processes.

Reference: the pattern's exact graph at small n (``pattern.graph(n)``), from which the keys a
shard's rows read outside the shard are read off edge by edge; and the closed forms of the
analytic need (a window of w needs w keys per interior rank, Longformer w + g).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import sparseattn as sa
from sparseattn.graph import AttentionGraph
from sparseattn.parallel import intervals as iv
from sparseattn.parallel.plan import balanced_boundaries, even_boundaries, plan
from sparseattn.parallel.rules import FALLBACK_MAX_N, key_intervals, row_graph
from sparseattn.patterns.base import Pattern
from sparseattn.patterns.blocks import (
    BSLongformerSparsityConfig,
    FixedSparsityConfig,
    from_block_layout,
)


@dataclasses.dataclass(frozen=True, repr=False)
class EveryThird(Pattern):
    """A pattern without a rule: query i reads i and the keys j ≡ 0 (mod 3)."""

    def _graph(self, n: int) -> AttentionGraph:
        return AttentionGraph.from_dense(self.allows(*torch.meshgrid(
            torch.arange(n), torch.arange(n), indexing="ij"), n))  # fmt: skip

    def _allows(self, q_idx, kv_idx, n):
        return (kv_idx == q_idx) | (kv_idx % 3 == 0)


def _layout(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    layout = torch.rand(2, 8, 8, generator=gen) < 0.3
    layout |= torch.eye(8, dtype=torch.bool)
    return layout


PATTERNS = {
    "dense": sa.dense(),
    "dense_causal": sa.dense().causal(),
    "dense_no_diagonal": sa.dense_no_diagonal(),
    "window3": sa.window(3),
    "window8": sa.window(8),
    "window32": sa.window(32),
    "window_wide": sa.window(300),
    "window_causal": sa.window(9).causal(),
    "strided": sa.strided(5),
    "strided_wide": sa.strided(40),
    "stride_only": sa.strided(7, part=2),
    "fixed": sa.fixed(6),
    "fixed_summary": sa.fixed(6, part=2),
    "star": sa.star(2),
    "global_tokens": sa.global_tokens(2),
    "global_positions": sa.global_tokens([5, 40]),
    "longformer": sa.longformer(8, 2),
    "longformer_positions": sa.longformer(6, [3, 50]),
    "longformer_causal": sa.longformer(8, 2).causal(),
    "bigbird": sa.bigbird(6, 2, 2, 8, seed=1),
    "random": sa.random(k=3, seed=2),
    "random_blocks": sa.random_blocks(2, 8, seed=3),
    "block_local": sa.block_local(8),
    "causal_strided": sa.causal_strided(6),
    "causal_fixed": sa.causal_fixed(6, c=2),
    "sliding_window": sa.sliding_window(7, 2),
    "sliding_window_late_sink": sa.sliding_window(5, [30]),
    "causal_bigbird": sa.causal_bigbird(5, 1, 1, 8, seed=4),
    "split_heads": sa.split_heads(sa.window(4), sa.strided(8)),
    "no_diagonal": sa.no_diagonal(sa.window(4)),
    "block_layout": from_block_layout(_layout(), 8),
    "block_layout_causal": from_block_layout(_layout(1), 8, causal=True),
    "bslongformer": BSLongformerSparsityConfig(num_heads=2, block=8).pattern(),
    "ds_fixed": FixedSparsityConfig(num_heads=2, block=8, num_local_blocks=2).pattern(),
    "union_random": sa.union(sa.window(2), sa.random(k=2, seed=5)),
    "no_rule": EveryThird(),
}

#: bigbird_blocks needs n a multiple of its block with room for HF's random draw
BLOCK_PATTERNS = {
    "bigbird_blocks": sa.bigbird_blocks(8, 1, seed=3),
    "bigbird_blocks_heads": sa.bigbird_blocks(8, 1, heads=2, seed=4),
}


def _exact_graph(pattern, n: int) -> AttentionGraph:
    if isinstance(pattern, AttentionGraph):
        return pattern
    if isinstance(pattern, sa.patterns.HeadSplit):
        return pattern.graph(n, num_heads=2)
    return pattern.graph(n)


def _keys(graph: AttentionGraph, rows: np.ndarray) -> set[int]:
    """Every key the given rows read, in any leading entry, from the CSR arrays."""
    out: set[int] = set()
    crow, col = graph.crow.tolist(), graph.col.tolist()
    for entry in range(graph.num_rows // graph.n_q):
        for i in rows.tolist():
            r = entry * graph.n_q + i
            out.update(col[crow[r] : crow[r + 1]])
    return out


def _points(intervals: np.ndarray) -> set[int]:
    return set(iv.as_index(intervals).tolist())


def _check_plan(pattern, n: int, parts: int) -> None:
    graph = _exact_graph(pattern, n)
    p = plan(pattern, n, parts)
    assert p.boundaries == even_boundaries(n, parts)
    for rp in p.ranks:
        rows = np.arange(rp.start, rp.stop)
        local = rows[~np.isin(rows, p.global_rows)]
        assert _points(rp.local_rows) == set(local.tolist())
        need = {j for j in _keys(graph, local) if not rp.start <= j < rp.stop}
        assert _points(rp.need) == need, f"rank {rp.rank}"
        # block = 1: what arrives from each rank is exactly the need on its shard
        for s, got in enumerate(p.ranks[rp.rank].recv):
            lo, hi = p.boundaries[s], p.boundaries[s + 1]
            want = set() if s == rp.rank else {j for j in need if lo <= j < hi}
            assert _points(got) == want
            assert _points(p.ranks[s].send[rp.rank]) == want
    for i in p.global_rows.tolist():  # a global row reads a key outside its owner's shard
        o = int(p.owner(np.array([i]))[0])
        assert any(not p.boundaries[o] <= j < p.boundaries[o + 1] for j in _keys(graph, np.r_[i]))


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_plan_equals_the_exact_need_of_every_family(name):
    """The rule's intervals equal the keys read off the exact graph, per rank and per source,
    for several n and P (n not divisible by P; windows narrower, equal to, wider than a shard
    and wider than n)."""
    for n, parts in [(64, 1), (64, 2), (64, 4), (37, 3), (100, 7), (64, 5)]:
        if name.startswith(("block_layout", "bslongformer", "ds_fixed")) and n % 8:
            n = 64  # a layout of 8 blocks of 8 covers 57 … 64 positions
        _check_plan(PATTERNS[name], n, parts)


@pytest.mark.parametrize("name", sorted(BLOCK_PATTERNS))
def test_plan_of_bigbird_blocks(name):
    for n, parts in [(64, 2), (64, 3), (128, 5), (128, 8)]:
        _check_plan(BLOCK_PATTERNS[name], n, parts)


def test_plan_of_an_attention_graph():
    gen = torch.Generator().manual_seed(0)
    mask = torch.rand(2, 50, 50, generator=gen) < 0.1
    mask |= torch.eye(50, dtype=torch.bool)
    mask[:, 7, :] = True  # a full row: global
    graph = AttentionGraph.from_dense(mask)
    _check_plan(graph, 50, 3)
    assert plan(graph, 50, 3).global_rows.tolist() == [7]


def test_key_intervals_of_any_row_range():
    """The rule's contract on arbitrary row ranges: exact outside [lo, hi), a superset
    inside."""
    gen = np.random.default_rng(0)
    for name, pattern in {**PATTERNS, **BLOCK_PATTERNS}.items():
        n = 64
        graph = _exact_graph(pattern, n)
        for _ in range(6):
            lo = int(gen.integers(0, n))
            hi = int(gen.integers(lo + 1, n + 1))
            got = _points(key_intervals(pattern, n, lo, hi))
            want = _keys(graph, np.arange(lo, hi))
            outside = {j for j in range(n) if not lo <= j < hi}
            assert got & outside == want & outside, (name, lo, hi)
            assert want <= got, (name, lo, hi)


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_row_graph_is_the_slice_of_the_full_graph(name):
    pattern, n = PATTERNS[name], 64
    full = _exact_graph(pattern, n)
    for lo, hi in [(0, 64), (5, 30), (40, 41), (63, 64)]:
        got = row_graph(pattern, n, lo, hi, heads=2)
        assert (got.n_q, got.n_k) == (hi - lo, n)
        dense = full.to_dense()[..., lo:hi, :]
        assert torch.equal(got.to_dense().expand_as(dense), dense), (name, lo, hi)


def test_global_rows_are_the_global_tokens_that_reach_out():
    """Longformer's global tokens are global rows (for P > 1); at P = 1 nothing is; causal
    sinks on the first shard read only keys there and stay local rows."""
    assert plan(sa.longformer(8, 3), 64, 4).global_rows.tolist() == [0, 1, 2]
    assert plan(sa.longformer(8, 3), 64, 1).global_rows.tolist() == []
    assert plan(sa.longformer(8, [10, 40]), 64, 4).global_rows.tolist() == [10, 40]
    assert plan(sa.sliding_window(8, 2), 64, 4).global_rows.tolist() == []
    assert plan(sa.sliding_window(8, [5, 40]), 64, 4).global_rows.tolist() == [40]
    assert plan(sa.star(2), 64, 4).global_rows.tolist() == [63]
    bb = plan(sa.bigbird_blocks(8, 1, seed=0), 128, 4)
    assert bb.global_rows.tolist() == [*range(8), *range(120, 128)]
    # a dense layout (every row full): nothing merged, every key fetched
    dense = plan(from_block_layout(torch.ones(8, 8, dtype=torch.bool), 8), 64, 4)
    assert dense.global_rows.tolist() == []
    assert all(rp.recv_keys == 48 for rp in dense.ranks)


def test_analytic_need_of_windows_and_longformer():
    """Interior ranks receive exactly w keys for window(w) (⌈w/2⌉ left, ⌊w/2⌋ right), w + g
    with g global tokens; the causal sliding window w − 1; dense causal everything before."""
    n, parts = 1000, 8
    for w in [1, 7, 64, 125, 250, 400]:
        p = plan(sa.window(w), n, parts)
        for rp in p.ranks[1:-1]:
            left = min(-(-w // 2), rp.start)
            right = min(w // 2, n - rp.stop)
            assert rp.recv_keys == left + right
    p = plan(sa.longformer(64, 16), n, parts)
    assert all(rp.recv_keys == 64 + 16 for rp in p.ranks[1:-1])
    assert p.ranks[0].recv_keys == 32  # rows 16 … 124: ±32 and the globals are local
    p = plan(sa.sliding_window(64), n, parts)
    assert [rp.recv_keys for rp in p.ranks] == [0] + [63] * (parts - 1)
    p = plan(sa.dense().causal(), n, parts)
    assert [rp.recv_keys for rp in p.ranks] == [rp.start for rp in p.ranks]


def test_block_rounding():
    """block > 1: received intervals widen to multiples of the block in global positions, cut
    to the sender's shard; they contain the exact need and no block without a needed key."""
    p1, p16 = plan(sa.window(10), 200, 3), plan(sa.window(10), 200, 3, block=16)
    for a, b in zip(p1.ranks, p16.ranks, strict=True):
        for s in range(3):
            lo, hi = p1.boundaries[s], p1.boundaries[s + 1]
            need, got = _points(a.recv[s]), _points(b.recv[s])
            assert need <= got and all(lo <= j < hi for j in got)
            blocks = {j // 16 for j in need}
            assert {j // 16 for j in got} == blocks
            assert got == {j for j in range(lo, hi) if j // 16 in blocks}
    assert p16.ranks[1].recv_keys > p1.ranks[1].recv_keys


def test_bytes_and_peak_memory():
    """Bytes follow the key counts; the peak K/V memory is O(N/P + w + g)."""
    p = plan(sa.longformer(512, 16), 1 << 20, 64)
    t = p.traffic(3, batch=1, heads=8, kv_heads=8, d=128, dtype=torch.bfloat16)
    per_key = 8 * 256 * 2
    rp = p.ranks[3]
    assert rp.recv_keys == 512 + 16
    assert t["halo_recv"] == rp.recv_keys * per_key
    assert t["halo_grad_send"] == t["halo_recv"]
    assert t["kv"] == (rp.size + 512 + 16) * per_key
    assert max(r["kv"] for r in p.table(batch=1, heads=8, d=128)) <= (
        ((1 << 20) // 64 + 512 + 16) * 8 * 256 * 4
    )
    masked = p.traffic(3, batch=2, heads=8, d=64, key_padding=True)
    assert masked["halo_recv"] == rp.recv_keys * (2 * 8 * 128 + 2) * 4
    assert t["global_forward"] == 16 * 8 * (128 + 1 + 128 + 1) * 8


@pytest.mark.parametrize(
    "pattern",
    [
        sa.longformer(4096, 16),
        sa.window(128),
        sa.sliding_window(4096, 4),
        sa.dense().causal(),
        sa.strided(65536),
        sa.causal_strided(128),
        sa.bigbird(64, 2, 3, 64),
        sa.block_local(4096),
    ],
    ids=repr,
)
def test_plans_at_a_million_tokens(pattern):
    """N = 2²⁰ over 64 ranks plans without building a graph (the rules are O(intervals))."""
    p = plan(pattern, 1 << 20, 64)
    assert len(p.ranks) == 64 and p.ranks[-1].stop == 1 << 20
    for rp in p.ranks:
        assert iv.total(iv.intersect_sets(rp.keys, iv.span(rp.start, rp.stop))) == rp.size


def test_errors():
    with pytest.raises(ValueError, match="data-dependent"):
        plan(sa.topk(4), 64, 2)
    with pytest.raises(ValueError, match="no key-interval rule for EveryThird"):
        plan(EveryThird(), FALLBACK_MAX_N + 1, 2)
    with pytest.raises(ValueError, match="boundaries must end at n=64"):
        plan(sa.window(4), 64, boundaries=[0, 30, 60])
    with pytest.raises(ValueError, match="never decrease"):
        plan(sa.window(4), 64, boundaries=[0, 40, 30, 64])
    with pytest.raises(ValueError, match="world_size"):
        plan(sa.window(4), 64)


def test_intervals_algebra():
    a = iv.merge([[5, 9], [0, 2], [8, 12], [12, 13], [20, 20]])
    assert a.tolist() == [[0, 2], [5, 13]]
    b = iv.merge([[1, 6], [10, 30]])
    assert _points(iv.intersect_sets(a, b)) == _points(a) & _points(b)
    assert _points(iv.difference(a, b)) == _points(a) - _points(b)
    assert _points(iv.subtract(a, 6, 11)) == _points(a) - set(range(6, 11))
    assert iv.from_points([4, 2, 3, 9, 3]).tolist() == [[2, 5], [9, 10]]
    assert iv.locate(a, np.array([0, 1, 5, 12])).tolist() == [0, 1, 2, 9]
    with pytest.raises(ValueError, match="outside"):
        iv.locate(a, np.array([3]))


def _work_ratio(pattern, n: int, bounds: tuple[int, ...]) -> float:
    """max / mean over ranks of the score entries each computes, from the exact graph: the
    edges of its non-global rows, and of every global row the edges into its shard."""
    graph = pattern.graph(n)
    degree = graph.degrees.reshape(-1, n).sum(0).numpy()
    glob = plan(pattern, n, boundaries=bounds).global_rows
    crow, col = graph.crow.numpy(), graph.col.numpy()
    work = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        rows = np.arange(lo, hi)
        total = degree[rows[~np.isin(rows, glob)]].sum()
        for j in glob.tolist():
            keys = col[crow[j] : crow[j + 1]]
            total += ((keys >= lo) & (keys < hi)).sum()
        work.append(total)
    return max(work) / np.mean(work)


@pytest.mark.parametrize(
    "pattern",
    [
        sa.window(512),
        sa.longformer(256, 16),
        sa.bigbird(96, 2, 3, 32),
        sa.sliding_window(512, 4),
        sa.window(300).causal(),
        sa.dense().causal(),
    ],
    ids=repr,
)
def test_balanced_boundaries(pattern):
    """Balanced contiguous cuts: max / mean work <= 1.05 over 8 ranks (issue 42 item 3),
    counted edge by edge on the exact graph; the shards stay contiguous, so a window's halo
    stays a halo (no rank receives more than the window and the global tokens)."""
    n, parts = 4096, 8
    bounds = balanced_boundaries(pattern, n, parts)
    assert bounds[0] == 0 and bounds[-1] == n and list(bounds) == sorted(bounds)
    assert _work_ratio(pattern, n, bounds) <= 1.05
    if isinstance(pattern, sa.patterns.Union) and pattern.name == "longformer":
        assert max(rp.recv_keys for rp in plan(pattern, n, boundaries=bounds).ranks) <= 256 + 16


def test_contiguous_cuts_of_dense_causal_are_unbalanced():
    """What balancing fixes: near-equal contiguous cuts give the last of 8 ranks 15/8 of the
    mean work on dense causal attention."""
    n, parts = 4096, 8
    assert _work_ratio(sa.dense().causal(), n, even_boundaries(n, parts)) > 1.85
    cuts = balanced_boundaries(sa.dense().causal(), n, parts)
    assert cuts[1] == pytest.approx(n * (1 / parts) ** 0.5, abs=2)  # n·√(r/P)


def test_without_a_process_group_it_is_the_plain_call():
    """No process group (or one rank): cp.sparse_attention is sparseattn.sparse_attention,
    bit for bit, and shard / gather are the identity; nothing is communicated."""
    from sparseattn import parallel as cp

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 30, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    pattern = sa.longformer(6, 2)
    with cp.count_traffic() as moved:
        got = cp.sparse_attention(cp.shard(q), k, v, pattern, prob_map="entmax15")
        assert cp.gather(got) is got
    assert torch.equal(got, sa.sparse_attention(q, k, v, pattern, prob_map="entmax15"))
    assert not moved
    with pytest.raises(ValueError, match="max_kv_bytes"):
        cp.sparse_attention(q, k, v, pattern, max_kv_bytes=1000)
    with pytest.raises(ValueError, match="boundaries must end at n=30"):
        cp.sparse_attention(q, k, v, pattern, boundaries=[0, 20])
