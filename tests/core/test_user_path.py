"""The user path: cached graphs and plans, piecewise planning, strided inputs, the bench command.

References are independent of the code under test: boolean masks built from dense tensors
(``to_dense``, explicit OR), the block pairs counted from the dense mask block by block, and
outputs on contiguous copies of the same inputs.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from grad_checks import assert_close_with_grads
from tiny_models import tiny_llama

import sparseattn as sa
from sparseattn import graph as graph_module
from sparseattn.engines import layout as layout_module
from sparseattn.engines.flex import flex_available
from sparseattn.engines.layout import block_pairs, block_plan, choose_block, count_pairs
from sparseattn.graph import AttentionGraph
from sparseattn.patterns.base import GRAPH_CACHE_SIZE

pytestmark = pytest.mark.device


def _qkv(n, b=1, h=2, d=8, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=gen, dtype=dtype) for _ in range(3)]


# ---------------------------------------------------------------------- caching
STATIC = {
    "window": lambda: sa.window(8),
    "longformer": lambda: sa.longformer(8, 2),
    "bigbird": lambda: sa.bigbird(8, 1, 1, 4),
    "union": lambda: sa.union(sa.strided(4), sa.fixed(4)),
    "causal longformer": lambda: sa.longformer(8, 2).causal(),
    "no diagonal": lambda: sa.no_diagonal(sa.window(4)),
}


@pytest.mark.parametrize("name", list(STATIC))
def test_same_pattern_object_same_graph_and_plan(name):
    pattern = STATIC[name]()
    q, k, v = _qkv(40)
    g1, g2 = pattern.build(q, k), pattern.build(q, k)
    assert g1 is g2 and g1 is pattern.graph(40)
    out1 = sa.sparse_attention(q, k, v, pattern, engine="block")
    plans = {key: g1.memo.peek(key) for key in g1.memo}  # block choice, pairs, plans, copies
    out2 = sa.sparse_attention(q, k, v, pattern, engine="block")
    assert set(g1.memo) == plans.keys()
    assert all(g1.memo.peek(key) is plan for key, plan in plans.items())
    assert torch.equal(out1, out2)  # first call (builds) and cached call agree exactly


def test_head_split_and_cycle_members_are_cached():
    split = sa.split_heads(sa.window(4), sa.strided(4))
    q, k, _ = _qkv(24, h=4)
    assert split.build(q, k) is split.build(q, k)
    assert split.graph(24, num_heads=4) is split.build(q, k)
    assert split.graph(24, num_heads=2) is not split.build(q, k)
    layers = sa.cycle(sa.longformer(4, 1), sa.strided(4))
    assert layers[0].build(q, k) is layers[2].build(q, k)


def test_graph_cache_is_bounded_lru():
    pattern = sa.longformer(4, 1)
    first = pattern.graph(16)
    for n in range(17, 17 + GRAPH_CACHE_SIZE - 1):
        pattern.graph(n)
    assert pattern.graph(16) is first  # still held (and now most recently used)
    for n in range(100, 100 + GRAPH_CACHE_SIZE):
        pattern.graph(n)
    assert len(pattern.memo("graphs")) == GRAPH_CACHE_SIZE
    assert pattern.graph(16) is not first  # evicted, rebuilt equal
    assert pattern.graph(16) == first


def test_a_sparsified_gqa_decoder_plans_once_per_length(monkeypatch, device):
    """Through hf.sparsify on a grouped-query decoder the block plan is built once per length,
    not per call and layer: the stacked-query graph and its size-1-squeezed form are cached
    on the pattern's graph (they were rebuilt on every call, with the plan)."""
    from sparseattn import hf

    model = tiny_llama(
        "LlamaModel", vocab_size=50, hidden_size=32, intermediate_size=64,
        max_position_embeddings=256, attn_implementation="sdpa",
    ).to(device)  # fmt: skip
    hf.sparsify(model, sa.sliding_window(16, 2), engine="block")
    built = []
    real = layout_module._build_plan
    monkeypatch.setattr(layout_module, "_build_plan", lambda *a: built.append(1) or real(*a))
    ids = torch.randint(0, 50, (1, 200))
    with torch.no_grad():
        for _ in range(3):
            model(input_ids=ids)
    assert len(built) == 1


def _resolutions(monkeypatch) -> list:
    """Count the calls that check and resolve in full (sparse_attention's slow path)."""
    from sparseattn import attention

    seen = []
    real = attention._check_qkv
    monkeypatch.setattr(attention, "_check_qkv", lambda *a: seen.append(1) or real(*a))
    return seen


@pytest.mark.parametrize("engine", ["auto", "block", "gather", "dense", "rows"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_a_repeated_call_is_checked_and_resolved_once(monkeypatch, engine, kv_heads):
    """A second call with the same signature (shapes, dtypes, devices, pattern, map, engine,
    arguments, whether it is differentiated) skips the checks and decisions and runs what the
    first resolved: the same output and gradients; a call that differs in any of them (here
    the length, the dtype, gradients, the engine) resolves again."""
    seen = _resolutions(monkeypatch)
    pattern = sa.sliding_window(8, 2)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 40, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, kv_heads, 40, 8, generator=gen, dtype=torch.float64) for _ in "kv")
    gqa = kv_heads != 4

    def call(*qkv, **kw):
        return sa.sparse_attention(*qkv, pattern, engine=engine, enable_gqa=gqa, **kw)

    with torch.no_grad():
        first = call(q, k, v)
        again = [call(q, k, v) for _ in range(2)]
    assert len(seen) == 1
    assert all(torch.equal(first, out) for out in again)
    with torch.no_grad():
        call(q[:, :, :20], k[:, :, :20], v[:, :, :20])  # another length
        call(q.float(), k.float(), v.float())  # another dtype
        call(q, k, v, prob_map="sparsemax")  # another map
    assert len(seen) == 4
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    grads = []
    for _ in range(2):  # differentiated: resolved once more, then kept
        out = call(*leaves)
        grads.append(torch.autograd.grad(out.square().sum(), leaves))
    assert len(seen) == 5
    torch.testing.assert_close(out.detach(), first)  # the training path may sum differently
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(flex_available() is not None, reason=str(flex_available()))
def test_a_kept_flex_call_decides_its_kernel_once(monkeypatch):
    """The flex engine's own decisions (the cached BlockMask, the kernel's ``dynamic``, the
    compiled function) are made when a call is resolved: a kept call is the look-up and the
    compiled call, with the same output; on CPU a key holding inf is still refused."""
    from sparseattn.engines import flex

    decided = []
    real = flex._dynamic
    monkeypatch.setattr(flex, "_dynamic", lambda *a: decided.append(1) or real(*a))
    pattern = sa.longformer(8, 2)
    q, k, v = _qkv(40, d=16, dtype=torch.float32)  # d >= 16: FlexAttention's GPU kernels
    with torch.no_grad():
        outs = [sa.sparse_attention(q, k, v, pattern, engine="flex") for _ in range(3)]
        dense = sa.sparse_attention(q, k, v, pattern, engine="dense")
    assert len(decided) == 1
    assert all(torch.equal(outs[0], out) for out in outs[1:])
    torch.testing.assert_close(outs[0], dense)
    if q.device.type == "cpu":
        bad = k.clone()
        bad[0, 1, 5, 2] = float("inf")
        with pytest.raises(ValueError, match="k contains NaN or inf"):
            sa.sparse_attention(q, bad, v, pattern, engine="flex")
        assert len(decided) == 1


def test_a_kept_call_still_refuses_bad_values_and_kinds(monkeypatch):
    """What the kept resolution skips depends on the signature alone: values are checked on
    every CPU call, and an argument of another kind takes the full checks."""
    seen = _resolutions(monkeypatch)
    q, k, v = _qkv(24)
    sa.sparse_attention(q, k, v, sa.window(4))
    bad = q.clone()
    bad[0, 0, 3, 1] = float("nan")
    with pytest.raises(ValueError, match="q contains NaN"):
        sa.sparse_attention(bad, k, v, sa.window(4))  # a new pattern object: resolved again
    pattern = sa.window(4)
    sa.sparse_attention(q, k, v, pattern)
    with pytest.raises(ValueError, match="q contains NaN"):
        sa.sparse_attention(bad, k, v, pattern)  # kept: the value check still runs
    with pytest.raises(ValueError, match="scale"):
        sa.sparse_attention(q, k, v, pattern, scale=float("nan"))
    with pytest.raises(TypeError):
        sa.sparse_attention(q.numpy(), k, v, pattern)
    assert len(seen) == 5


def test_calls_that_are_not_kept(monkeypatch):
    """Key padding, a score_mod, a data-dependent pattern and a learned α are resolved every
    call (their masks, modifiers, graphs and α are per call)."""
    seen = _resolutions(monkeypatch)
    q, k, v = _qkv(24)
    pad = torch.zeros(1, 24, dtype=torch.bool)
    pad[0, -3:] = True
    alpha = sa.maps.entmax(torch.tensor(1.4, dtype=torch.float64, requires_grad=True))
    calls = [
        lambda: sa.sparse_attention(q, k, v, sa.window(4), key_padding_mask=pad),
        lambda: sa.sparse_attention(q, k, v, sa.window(4), score_mod=sa.score_mods.softcap(5.0)),
        lambda: sa.sparse_attention(q, k, v, sa.topk(3)),
        lambda: sa.sparse_attention(q, k, v, sa.window(4), prob_map=alpha),
    ]
    for call in calls:
        call()
        call()
    assert len(seen) == 2 * len(calls)


def test_kept_calls_live_on_the_pattern_bounded(monkeypatch):
    """What a call resolved is kept by its pattern (a ready graph: by the graph), as many
    signatures as the lengths whose graphs the pattern keeps; gone with the pattern."""
    seen = _resolutions(monkeypatch)
    pattern = sa.window(4)
    for n in range(20, 20 + 2 * GRAPH_CACHE_SIZE):
        q, k, v = _qkv(n)
        sa.sparse_attention(q, k, v, pattern)
    assert len(pattern.memo("calls")) == GRAPH_CACHE_SIZE
    graph = sa.window(4).graph(24)
    q, k, v = _qkv(24)
    for _ in range(3):
        sa.sparse_attention(q, k, v, graph)
    assert len(seen) == 2 * GRAPH_CACHE_SIZE + 1
    assert sum(isinstance(key, tuple) and key[:1] == ("call",) for key in graph.memo) == 1


def test_data_dependent_patterns_build_per_call():
    q, k, _ = _qkv(20)
    top = sa.topk(3)
    assert top.build(q, k) is not top.build(q, k)
    mixed = sa.union(sa.window(2), sa.topk(2))
    assert mixed.build(q, k) is not mixed.build(q, k)


# ---------------------------------------------------------------------- O(E) planning
def _random_graph(n_q, n_k, batch_shape, density, seed):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(*batch_shape, n_q, n_k, generator=gen) < density
    mask[..., : n_q // 3, :] |= torch.rand(*batch_shape, n_q // 3, n_k, generator=gen) < 0.9
    return AttentionGraph.from_dense(mask), mask


def _pairs_from_mask(mask, block):
    """(row block, key block) pairs, edge counts and full flags, block by block."""
    *batch, n_q, n_k = mask.shape
    flat = mask.reshape(-1, n_q, n_k)
    nbq, nbk = -(-n_q // block), -(-n_k // block)
    keys, counts, full = [], [], []
    for g in range(flat.shape[0]):
        for i in range(nbq):
            for j in range(nbk):
                tile = flat[g, i * block : (i + 1) * block, j * block : (j + 1) * block]
                if tile.any():
                    keys.append((g * nbq + i) * nbk + j)
                    counts.append(int(tile.sum()))
                    full.append(bool(tile.all()) and tile.shape == (block, block))
    return torch.tensor(keys), torch.tensor(counts), torch.tensor(full)


@pytest.mark.parametrize("block", [4, 6, 16])
@pytest.mark.parametrize("batch_shape", [(), (3,), (2, 2)])
def test_block_pairs_in_small_pieces_equal_the_dense_count(monkeypatch, block, batch_shape):
    monkeypatch.setattr(graph_module, "PIECE_EDGES", 50)  # many pieces
    monkeypatch.setattr(layout_module, "PIECE_EDGES", 50)
    graph, mask = _random_graph(37, 29, batch_shape, 0.2, seed=block)
    pairs = block_pairs(graph, block, partial=True)
    keys, counts, full = _pairs_from_mask(mask, block)
    assert torch.equal(pairs.keys, keys) and torch.equal(pairs.counts, counts)
    assert torch.equal(pairs.full, full)
    # every edge of a partial pair is listed once, at its place inside the block
    nbq, nbk = -(-37 // block), -(-29 // block)
    rebuilt = torch.zeros_like(mask.reshape(-1, 37, 29))
    key = pairs.keys[pairs.e_pair]
    rb, kb = key // nbk, key % nbk
    rebuilt[rb // nbq, (rb % nbq) * block + pairs.e_q, kb * block + pairs.e_k] = True
    part_blocks = torch.zeros_like(rebuilt)
    for kk in pairs.keys[~pairs.full].tolist():
        r, c = divmod(kk, nbk)
        part_blocks[r // nbq, (r % nbq) * block :][:block, c * block : (c + 1) * block] = True
    assert torch.equal(rebuilt, mask.reshape(-1, 37, 29) & part_blocks)
    assert pairs.e_pair.numel() == int(rebuilt.sum())


def test_count_pairs_derived_from_the_smallest_block_equals_a_direct_count():
    graph, mask = _random_graph(300, 300, (), 0.01, seed=5)
    for block in (16, 32, 48, 64, 128, 24):
        assert count_pairs(graph, block) == _pairs_from_mask(mask, block)[0].numel()


def test_plans_equal_with_one_piece_and_many(monkeypatch):
    graph = sa.bigbird(16, 2, 2, 8).graph(200)
    whole = block_plan(graph, 8)
    monkeypatch.setattr(layout_module, "PIECE_EDGES", 64)
    monkeypatch.setattr(graph_module, "PIECE_EDGES", 64)
    again = sa.bigbird(16, 2, 2, 8).graph(200)
    pieces = block_plan(again, 8)
    assert len(whole.groups) == len(pieces.groups)
    for a, b in zip(whole.groups, pieces.groups, strict=True):
        assert torch.equal(a.rows, b.rows) and torch.equal(a.full, b.full)
        assert torch.equal(a.part, b.part)
        assert (a.keep is None) == (b.keep is None)
        assert a.keep is None or torch.equal(a.keep, b.keep)


@pytest.mark.parametrize("shapes", [((), ()), ((3,), ()), ((2, 1), (1, 3))])
def test_union_merge_equals_dense_or(shapes):
    a, ma = _random_graph(23, 31, shapes[0], 0.15, seed=1)
    b, mb = _random_graph(23, 31, shapes[1], 0.05, seed=2)
    for x, y in ((a, b), (b, a)):
        u = x | y
        assert torch.equal(u.to_dense(), (ma | mb) if x is a else (mb | ma))
        assert torch.equal(u.col, AttentionGraph.from_dense(u.to_dense()).col)
    empty = AttentionGraph.from_dense(torch.zeros(23, 31, dtype=torch.bool))
    assert torch.equal((a | empty).to_dense(), ma)


def test_choose_block_is_unchanged_by_the_shared_count():
    assert choose_block(sa.window(512).graph(8192)) in (32, 64, 128)
    assert choose_block(sa.window(2).graph(4096)) == 16


# ---------------------------------------------------------------------- strided inputs
def _layouts(n, b=2, h=3, d=6, dtype=torch.float64):
    """q, k, v as views with the strides users pass: a fused projection's output permuted,
    a (B, n, H, d) tensor transposed (Hugging Face), every other column of a wider tensor."""
    gen = torch.Generator().manual_seed(7)
    fused = torch.randn(b, n, 3, h, d, generator=gen, dtype=dtype)
    heads_last = torch.randn(b, n, h, d, generator=gen, dtype=dtype)
    wide = torch.randn(b, h, n, 2 * d, generator=gen, dtype=dtype)
    q, k, v = fused.permute(2, 0, 3, 1, 4)
    return [(q, k, v), (heads_last.transpose(1, 2), k, wide[..., ::2])]


MAPS = {
    "softmax": "softmax",
    "sparsemax": "sparsemax",
    "entmax15": "entmax15",
    "entmax1.3": sa.entmax(1.3),
}


@pytest.mark.parametrize("engine", ["dense", "gather", "block"])
@pytest.mark.parametrize("map_name", list(MAPS))
def test_strided_and_contiguous_inputs_agree_forward_and_backward(engine, map_name):
    pattern = sa.longformer(6, 2)
    for views in _layouts(37):
        assert not any(t.is_contiguous() for t in views)
        strided = [t.detach().requires_grad_() for t in views]  # same strides, as leaves
        copies = [t.detach().contiguous().requires_grad_() for t in views]
        assert not any(t.is_contiguous() for t in strided)
        out = sa.sparse_attention(*strided, pattern, prob_map=MAPS[map_name], engine=engine)
        ref = sa.sparse_attention(*copies, pattern, prob_map=MAPS[map_name], engine=engine)
        tol = (1e-12, 1e-12)
        assert_close_with_grads(out, ref, strided, tol, (1e-11, 1e-11), ref_inputs=copies)


@pytest.mark.skipif(flex_available() is not None, reason=str(flex_available()))
def test_flex_engine_on_strided_inputs():
    # d = 16: compiled FlexAttention on CUDA needs a head dim of at least 16 (inductor NYI)
    for views in _layouts(64, d=16, dtype=torch.float32):
        with torch.no_grad():
            out = sa.sparse_attention(*views, sa.longformer(16, 2), engine="flex")
            ref = sa.sparse_attention(
                *(t.contiguous() for t in views), sa.longformer(16, 2), engine="dense"
            )
        torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


def test_module_float32_strided_path_matches_contiguous_block_engine(device):
    layer = sa.SparseAttention(32, 4, pattern=sa.longformer(16, 2), engine="block").to(device)
    x = torch.randn(2, 300, 32)
    q, k, v = layer.qkv(x).view(2, 300, 3, 4, 8).permute(2, 0, 3, 1, 4)
    ref = sa.sparse_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), layer.pattern, engine="block"
    )
    out = sa.sparse_attention(q, k, v, layer.pattern, engine="block")
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------- the bench command
def test_bench_help_works_outside_the_checkout(tmp_path):
    exe = os.path.join(os.path.dirname(sys.executable), "sparseattn")
    if not os.path.exists(exe):  # e.g. the GPU machine: the package on PYTHONPATH only
        pytest.skip("the sparseattn console script is not installed beside this Python")
    res = subprocess.run(
        [exe, "bench", "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    assert "user" in res.stdout and "Traceback" not in res.stderr


def test_user_suite_runs_and_reports(tmp_path):
    from sparseattn.lab.bench.userpath import USER_SUITES, run_user_suite

    suite = dataclasses.replace(
        USER_SUITES["user-quick"],
        ns=(96,),
        hf_ns=(),
        minilm=False,
        embed_dim=32,
        heads=2,
        window=16,
        global_tokens=2,
        repeats=1,
    )
    data = run_user_suite(suite, tmp_path, log=lambda m: None)
    sections = {r["section"] for r in data["rows"]}
    assert sections == {
        "module forward",
        "module training step",
        "functional forward",
        "functional forward+backward",
        "first call",
    }
    assert all(r["time_s"] > 0 for r in data["rows"])
    assert data["machine"]["vector_extensions"] is not None
    table = (tmp_path / "results.md").read_text()
    assert all(f"| {section} | 96 |" in table for section in sections)
    assert (tmp_path / "userpath.png").stat().st_size > 1000
