"""Block and flex engines, the auto rule, fast row maps and DeepSpeed layouts.

References are independent of the code under test: a plain masked attention written here
(scores → −inf outside a boolean mask built from the pattern's predicate → ρ → · V), the
`entmax` package for the row maps, and layouts written out by hand.
"""

from __future__ import annotations

import math

import entmax as package
import pytest
import torch

import sparseattn as sa
from sparseattn.attention import choose_engine
from sparseattn.engines import block_attention, flex_attention_engine, unsupported
from sparseattn.engines.flex import flex_available
from sparseattn.engines.layout import block_plan, choose_block
from sparseattn.fastmaps import entmax15_rows, entmax_rows, sparsemax_rows
from sparseattn.maps import entmax, hardmax, softmax, sparselin_gen, sparsemax
from sparseattn.patterns.blocks import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    VariableSparsityConfig,
    from_block_layout,
)

pytestmark = pytest.mark.device

F64 = torch.float64
PATTERNS = {
    "window": sa.window(6),
    "longformer": sa.longformer(8, 3),
    "bigbird": sa.bigbird(6, 2, 2, 4),
    "strided": sa.strided(5),
    "random": sa.random(k=4, seed=2),
    "causal window": sa.window(6).causal(),
    "star": sa.star(2),
    "dense": sa.dense(),
}
MAPS = {
    "softmax": softmax(),
    "sparsemax": sparsemax(),
    "entmax15": entmax(1.5),
    "entmax1.3": entmax(1.3),
    "hardmax": hardmax(),
    "sparselin": sparselin_gen(0.3),
}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, compared on the host (layouts and graphs live there; test tensors may not)."""
    return torch.equal(a.cpu(), b.cpu())


def predicate_mask(pattern: sa.Pattern, n: int) -> torch.Tensor:
    """(n, n) mask from the pattern's predicate on an index grid (not from graph code)."""
    i = torch.arange(n)
    return pattern.allows(i[:, None], i[None, :], n)


def reference(q, k, v, mask, rho, scale):
    """Plain masked attention (Yun eq. 3): ρ over full rows with −inf outside the mask."""
    scores = (q @ k.transpose(-1, -2)) * scale
    mask = mask.to(scores.device).expand_as(scores)  # graphs' dense masks live on the host
    return rho(scores.masked_fill(~mask, -math.inf), mask) @ v


def qkv(b=2, h=3, n=37, d=5, dtype=F64, seed=0, grad=False, d_v=None):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(b, h, n, d), (b, h, n, d), (b, h, n, d_v or d)]
    return [torch.randn(s, generator=gen, dtype=dtype).requires_grad_(grad) for s in shapes]


def check_forward_backward(engine_fn, q, k, v, mask, rho, scale, tol):
    out = engine_fn(q, k, v)
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = reference(qr, kr, vr, mask, rho, scale)
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(ref, (qr, kr, vr), g)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=10 * tol, rtol=10 * tol)


# ----------------------------------------------------------------------------- block engine
@pytest.mark.parametrize("map_name", list(MAPS))
@pytest.mark.parametrize("pattern_name", list(PATTERNS))
def test_block_matches_reference(pattern_name, map_name):
    pattern, rho = PATTERNS[pattern_name], MAPS[map_name]
    n = 37  # not a multiple of any block size used
    mask = predicate_mask(pattern, n)
    q, k, v = qkv(n=n, grad=True)
    graph = pattern.graph(n)
    for block in (8, 16):
        check_forward_backward(
            lambda q, k, v, block=block: block_attention(
                q, k, v, graph, rho, 0.4, block=block, budget=512
            ),
            q,
            k,
            v,
            mask,
            rho,
            0.4,
            1e-9,
        )


@pytest.mark.parametrize("map_name", ["softmax", "entmax15"])
def test_block_key_padding_float32_and_other_value_width(map_name):
    rho = MAPS[map_name]
    n = 45
    pattern = sa.longformer(10, 2)
    keep = torch.arange(n) < torch.tensor([[30], [45]])
    mask = predicate_mask(pattern, n) & keep[:, None, None, :]
    q, k, v = qkv(n=n, grad=True)
    check_forward_backward(
        lambda q, k, v: block_attention(q, k, v, pattern.graph(n), rho, 0.3, keep, block=8),
        q,
        k,
        v,
        mask,
        rho,
        0.3,
        1e-9,
    )
    q, k, v = qkv(n=n, dtype=torch.float32, grad=True, d_v=7)  # d_v != d: general path
    check_forward_backward(
        lambda q, k, v: block_attention(q, k, v, pattern.graph(n), rho, 0.3, block=16),
        q,
        k,
        v,
        predicate_mask(pattern, n),
        rho,
        0.3,
        2e-5,
    )


def test_block_runs_of_full_blocks_are_views_and_exact():
    n, pattern = 90, sa.longformer(40, 3)
    plan = block_plan(pattern.graph(n), 4)
    chunks = plan.chunks(6, 2000)
    assert any(c.run is not None for c in chunks), "window rows should form strided runs"
    assert plan.partial < plan.pairs
    q, k, v = qkv(n=n, grad=True)
    for rho in (softmax(), entmax(1.5)):
        check_forward_backward(
            lambda q, k, v, rho=rho: block_attention(
                q, k, v, pattern.graph(n), rho, 0.3, block=4, budget=2000
            ),
            q,
            k,
            v,
            predicate_mask(pattern, n),
            rho,
            0.3,
            1e-9,
        )


@pytest.mark.parametrize("n", [96, 101])
def test_block_band_edges_and_shared_global_blocks_join_the_flash_call(n):
    # window ±12 at block 4: every row block has full blocks flanked by partial band edges,
    # and the 3 global keys sit in one partial block shared by all row blocks
    pattern = sa.longformer(24, 3)
    plan = block_plan(pattern.graph(n), 4)
    chunks = plan.chunks(6, 4000, split=True)
    band = [c for c in chunks if c.bias is not None]
    assert band, "band edges should join the run of full blocks"
    assert all(c.bias.shape == (4, c.full.shape[1] * 4) for c in band)
    assert any(c.shared for c in chunks), "the global block should be shared by row blocks"
    assert not any(c.bias is not None for c in plan.chunks(6, 4000, split=False))
    q, k, v = qkv(n=n, grad=True)
    check_forward_backward(
        lambda q, k, v: block_attention(
            q, k, v, pattern.graph(n), softmax(), 0.3, block=4, budget=4000
        ),
        q,
        k,
        v,
        predicate_mask(pattern, n),
        softmax(),
        0.3,
        1e-9,
    )


def test_block_full_blocks_off_the_band_are_gathered_beside_the_run():
    # BigBird at block 8: the random blocks are full blocks away from the band, the band
    # itself stays a strided run (with its edges); every part merged by log-sum-exp
    n, pattern = 300, sa.bigbird(40, 3, random_blocks=1, block=8)
    chunks = block_plan(pattern.graph(n), 8).chunks(6, 1 << 18, split=True)
    assert any(c.extra is not None and c.run is not None for c in chunks)
    q, k, v = qkv(n=n, grad=True)
    check_forward_backward(
        lambda q, k, v: block_attention(q, k, v, pattern.graph(n), softmax(), 0.3, block=8),
        q,
        k,
        v,
        predicate_mask(pattern, n),
        softmax(),
        0.3,
        1e-9,
    )


@pytest.mark.parametrize("block", [32, 64])  # closed-form and flash-kernel backward of the band
def test_block_band_backward_on_both_sides_of_the_flash_backward_threshold(block):
    n, pattern = 600, sa.longformer(300, 5)
    chunks = block_plan(pattern.graph(n), block).chunks(4, 1 << 18, split=True)
    assert any(c.bias is not None for c in chunks)
    q, k, v = qkv(b=1, h=4, n=n, d=8, grad=True)
    check_forward_backward(
        lambda q, k, v: block_attention(q, k, v, pattern.graph(n), softmax(), 0.3, block=block),
        q,
        k,
        v,
        predicate_mask(pattern, n),
        softmax(),
        0.3,
        1e-9,
    )


def test_block_chunks_cover_every_row_block_once():
    graph = sa.bigbird(16, 3, 2, 8).graph(200)
    plan = block_plan(graph, 8)
    for budget in (1, 300, 1 << 20):
        rows = torch.cat([c.rows for c in plan.chunks(2, budget)])
        assert sorted(rows.tolist()) == list(range(plan.graphs * plan.nbq))
    dense = graph.to_dense()
    layout = graph.to_block_layout(8)
    assert plan.pairs == int(layout.sum())
    assert plan.edges == int(dense.sum())


def test_block_batched_graphs_topk_split_heads_and_layouts():
    q, k, v = qkv(n=30, grad=True)
    top = sa.topk(5)
    graph = top.graph(30, q.detach(), k.detach())  # batch_shape (B, H)
    for rho in (softmax(), entmax(1.5)):
        check_forward_backward(
            lambda q, k, v, rho=rho: block_attention(q, k, v, graph, rho, 0.5, block=8),
            q,
            k,
            v,
            graph.to_dense(),
            rho,
            0.5,
            1e-9,
        )
    split = sa.split_heads(sa.strided(4, 1), sa.strided(4, 2))
    graph = split.graph(30, num_heads=3)  # batch_shape (H,)
    keep = torch.arange(30) < torch.tensor([[25], [30]])
    check_forward_backward(
        lambda q, k, v: block_attention(q, k, v, graph, softmax(), 0.5, keep, block=4),
        q,
        k,
        v,
        graph.to(keep.device).to_dense() & keep[:, None, None, :],
        softmax(),
        0.5,
        1e-9,
    )


def test_block_gradcheck_and_dropout():
    q, k, v = qkv(b=1, h=1, n=9, d=2, grad=True, seed=3)
    graph = sa.longformer(4, 1).graph(9)
    for rho in (softmax(), entmax(1.5)):
        assert torch.autograd.gradcheck(
            lambda q, k, v, rho=rho: block_attention(q, k, v, graph, rho, 0.5, block=4), (q, k, v)
        )

    def dropped(q, k, v):
        torch.manual_seed(7)
        return block_attention(q, k, v, graph, softmax(), 0.5, dropout_p=0.4, block=4)

    assert torch.autograd.gradcheck(dropped, (q, k, v))  # backward replays the forward's mask
    plain = block_attention(q, k, v, graph, softmax(), 0.5, block=4)
    assert not torch.allclose(dropped(q, k, v), plain)
    torch.testing.assert_close(dropped(q, k, v), dropped(q, k, v))


def test_block_through_the_public_api_and_block_choice():
    q, k, v = qkv(n=64, grad=False)
    pattern = sa.longformer(16, 2)
    out = sa.sparse_attention(q, k, v, pattern, prob_map="entmax15", engine="block")
    ref = reference(q, k, v, predicate_mask(pattern, 64), entmax(1.5), 1 / math.sqrt(5))
    torch.testing.assert_close(out, ref)
    assert choose_block(sa.window(512).graph(8192)) in (32, 64, 128)
    assert choose_block(sa.window(2).graph(4096)) == 16  # a thin band: small blocks
    assert choose_block(sa.dense().graph(512)) == 128


# ----------------------------------------------------------------------------- flex engine
needs_flex = pytest.mark.skipif(flex_available() is not None, reason=str(flex_available()))


@needs_flex
def test_flex_matches_reference_and_block_masks():
    # one compiled kernel serves every case: same (B, H, n, d) and the same table bucket
    n = 200
    q, k, v = qkv(n=n, d=16, dtype=torch.float32)
    keep = torch.arange(n) < torch.tensor([[150], [200]])
    cases = [
        (sa.longformer(20, 3).graph(n), None),
        (sa.bigbird(16, 2, 2, 8).graph(n), keep),
        (sa.window(10).causal().graph(n), None),
        (sa.split_heads(sa.window(8), sa.strided(9)).graph(n, num_heads=3), None),
        (sa.topk(5).graph(n, q, k), keep),
    ]
    for graph, key_valid in cases:
        out = flex_attention_engine(q, k, v, graph, softmax(), 0.25, key_valid)
        mask = graph.to(q.device).to_dense()
        mask = mask if key_valid is None else mask & key_valid[:, None, None, :]
        torch.testing.assert_close(
            out, reference(q, k, v, mask, softmax(), 0.25), atol=2e-5, rtol=2e-5
        )


@needs_flex
def test_flex_key_padding_reuses_the_cached_block_lists(monkeypatch):
    """A call with key padding wraps the cached BlockMask's mask_mod: the block lists are
    built once per graph (no per-call rebuild, which syncs the host on a GPU), and each
    batch item keeps its own padding."""
    from sparseattn.engines import flex

    n = 200
    q, k, v = qkv(n=n, d=16, dtype=torch.float32)
    graph = sa.longformer(20, 3).graph(n)
    flex_attention_engine(q, k, v, graph, softmax(), 0.25, torch.ones(2, n, dtype=torch.bool))
    built = []
    monkeypatch.setattr(flex, "_block_mask", lambda *a: built.append(a))
    for cut in (150, 60):
        keep = torch.arange(n) < torch.tensor([[cut], [200]])
        out = flex_attention_engine(q, k, v, graph, softmax(), 0.25, keep)
        mask = graph.to_dense().to(q.device) & keep[:, None, None, :]
        torch.testing.assert_close(
            out, reference(q, k, v, mask, softmax(), 0.25), atol=2e-5, rtol=2e-5
        )
    assert not built


@needs_flex
def test_pattern_to_block_mask_equals_the_predicate(device):
    from torch.nn.attention.flex_attention import create_mask

    n = 300
    for pattern in (sa.longformer(30, 4), sa.strided(17)):
        bm = pattern.to_block_mask(n, block=64, device=device)
        assert bm.BLOCK_SIZE == (64, 64)
        dense = create_mask(bm.mask_mod, 1, 1, n, n, device=device)[0, 0]
        layout = pattern.graph(n).to(device).to_block_layout(64)
        assert torch.equal(bm.to_dense()[0, 0, : layout.shape[0], : layout.shape[1]].bool(), layout)
        full_or_partial = (
            dense
            & bm.to_dense()[0, 0]
            .bool()
            .repeat_interleave(64, 0)[:n]
            .repeat_interleave(64, 1)[:, :n]
        )
        assert torch.equal(full_or_partial | _full_blocks(bm, n), predicate_mask(pattern, n))


def _full_blocks(bm, n):
    """Element mask of the BlockMask's full blocks (where mask_mod is not called)."""
    b = bm.BLOCK_SIZE[0]
    out = torch.zeros(n, n, dtype=torch.bool)
    nums, idx = bm.full_kv_num_blocks[0, 0], bm.full_kv_indices[0, 0]
    for i in range(nums.numel()):
        for j in idx[i, : nums[i]].tolist():
            out[i * b : (i + 1) * b, j * b : (j + 1) * b] = True
    return out


def test_flex_refuses_what_it_cannot_compute():
    q, k, v = qkv(n=20, d=4, dtype=torch.float32)
    graph = sa.window(4).graph(20)
    with pytest.raises(ValueError, match="softmax only"):
        flex_attention_engine(q, k, v, graph, entmax(1.5), 0.5)
    with pytest.raises(ValueError, match="dropout"):
        flex_attention_engine(q, k, v, graph, softmax(), 0.5, dropout_p=0.1)
    if q.device.type != "cpu":  # the rest are limits of torch's CPU FlexAttention
        return
    with pytest.raises(ValueError, match="float64"):
        flex_attention_engine(*qkv(n=20, d=4), graph, softmax(), 0.5)
    qg = q.clone().requires_grad_()
    with pytest.raises(ValueError, match="no backward on cpu"):
        flex_attention_engine(qg, k, v, graph, softmax(), 0.5)
    with torch.no_grad():  # inputs requiring grad are fine when grad is off
        assert unsupported("flex", qg, k, v, softmax()) == flex_available()


@pytest.mark.skipif(flex_available() is not None, reason="needs torch.compile")
def test_flex_user_path_checks_the_request_once(monkeypatch):
    """Host time on every call: ``sparse_attention(engine="flex")`` asks the engine table
    once whether flex can compute the call; the engine it dispatches to does not ask again
    (the engine function called directly still does)."""
    import sparseattn.engines.capabilities as capabilities

    calls = []
    real = capabilities.request_reasons
    monkeypatch.setattr(capabilities, "request_reasons", lambda *a: calls.append(a[0]) or real(*a))
    q, k, v = qkv(n=64, d=16, dtype=torch.float32)
    out = sa.sparse_attention(q, k, v, sa.window(8), engine="flex")
    assert calls == ["flex"]
    flex_attention_engine(q, k, v, sa.window(8).graph(64), softmax(), 0.25)
    assert calls == ["flex", "flex"]
    ref = sa.sparse_attention(q, k, v, sa.window(8), engine="dense")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_triton_table_entry_does_not_check_the_request_again(monkeypatch):
    """As for flex: the engine table's triton entry runs what the dispatcher has checked; the
    engine function called directly checks (the kernels stubbed: no GPU needed)."""
    from sparseattn.engines import SPECS, triton_entmax

    asked = []
    monkeypatch.setattr(triton_entmax, "triton_entmax_unsupported", lambda *a: asked.append(1))
    monkeypatch.setattr(triton_entmax, "entmax_attention", lambda q, *a: torch.zeros_like(q))
    q, k, v = qkv(n=64, d=16, dtype=torch.float32)
    graph = sa.window(8).graph(64)
    SPECS["triton"].run(q, k, v, graph, entmax(1.5), 0.25)
    assert asked == []
    triton_entmax.triton_entmax_attention(q, k, v, graph, entmax(1.5), 0.25)
    assert asked == [1]


def test_flex_compiles_with_its_own_recompile_limit(monkeypatch):
    """The engine's kernels may recompile RECOMPILE_LIMIT times before torch would fall back
    to an unfused O(n²) FlexAttention: passed to ``torch.compile`` where it takes
    ``recompile_limit`` (no per-call patch of dynamo's config), else dynamo's global limit is
    raised around each call."""
    from sparseattn.engines import flex

    seen, limits = [], []

    def compile_(fn, **kw):
        seen.append(kw)
        return lambda *a: limits.append(torch._dynamo.config.recompile_limit)

    monkeypatch.setattr(torch, "compile", compile_)
    for has_limit in (True, False):
        monkeypatch.setattr(flex, "_COMPILE_HAS_LIMIT", has_limit)
        flex._compiled.__wrapped__(False)()
    options = {"options": {"cpp.simdlen": flex._cpu_vector_bits()}}  # Inductor's cache key
    assert seen == [
        {"dynamic": False, "recompile_limit": flex.RECOMPILE_LIMIT, **options},
        {"dynamic": False, **options},
    ]
    assert limits[0] == torch._dynamo.config.recompile_limit  # no patch
    assert limits[1] == max(flex.RECOMPILE_LIMIT, torch._dynamo.config.recompile_limit)


# ----------------------------------------------------------------------------- auto rule
def _can_compute(engine, q, k, v, rho, dropout_p):
    return unsupported(engine, q, k, v, rho, dropout_p) is None


@pytest.mark.parametrize("n", [16, 300, 2048])
@pytest.mark.parametrize("pattern_name", ["longformer", "random", "strided", "dense"])
def test_auto_never_picks_an_engine_that_cannot_compute(n, pattern_name):
    pattern = {
        "longformer": sa.longformer(64, 4),
        "random": sa.random(k=8),
        "strided": sa.strided(32),
        "dense": sa.dense(),
    }[pattern_name]
    graph = pattern.graph(n)
    for dtype in (torch.float32, F64):
        for grad in (False, True):
            q, k, v = qkv(b=1, h=2, n=n, d=8, dtype=dtype, grad=grad)
            for rho in (softmax(), entmax(1.5), None):
                for dropout_p in (0.0, 0.2):
                    engine = choose_engine(graph, q, k, rho, dropout_p)
                    assert engine in sa.attention.ENGINES
                    assert _can_compute(engine, q, k, v, rho, dropout_p)
                    if grad or rho is None or rho.name != "softmax" or dropout_p:
                        assert engine != "flex"


def test_auto_picks_by_structure():
    q, k, _ = qkv(b=1, h=8, n=4096, d=64, dtype=torch.float32)
    if q.device.type != "cpu":
        pytest.skip("the CPU rule (the GPU rule: tests/core/test_gpu.py)")
    assert choose_engine(sa.window(4).graph(16), q[..., :16, :], k[..., :16, :]) == "dense"
    assert choose_engine(sa.longformer(512, 16).graph(4096), q, k, softmax()) == "block"
    assert choose_engine(sa.random(k=64).graph(4096), q, k, softmax()) == "gather"


# ----------------------------------------------------------------------------- fast maps
def _package_on_valid(fn, x, valid):
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        if valid[i].any():
            out[i, valid[i]] = fn(x[i, valid[i]][None])[0]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("k", [1, 3, 40, 700])
def test_fast_maps_equal_the_entmax_package(dtype, k):
    gen = torch.Generator().manual_seed(k)
    x = (torch.randn(60, k, generator=gen, dtype=F64) * 3).to(dtype)
    x[5] = 0.25  # ties everywhere
    x[6, : k // 2] = x[6, 0].item()  # a value, not a view: CUDA refuses the aliased write
    valid = torch.rand(60, k, generator=gen) < 0.8
    valid[0] = False
    valid[1] = False
    valid[1, 0] = True
    tol = 1e-12 if dtype == F64 else 1e-6
    xd = x.double()
    cases = [
        (sparsemax_rows(x, valid), package.sparsemax),
        (entmax15_rows(x, valid), package.entmax15),
        (entmax_rows(x, valid, 1.3), lambda r: package.entmax_bisect(r, 1.3, n_iter=70)),
        (entmax_rows(x, valid, 1.7), lambda r: package.entmax_bisect(r, 1.7, n_iter=70)),
        (entmax_rows(x, valid, 3.0), lambda r: package.entmax_bisect(r, 3.0, n_iter=70)),
    ]
    for got, fn in cases:
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), _package_on_valid(fn, xd, valid), atol=tol, rtol=0)
        assert torch.all(got[~valid] == 0)


def test_maps_use_the_fast_kernels_on_long_inputs_with_the_same_results():
    x = torch.randn(16, 600, dtype=F64)  # > 8192 entries: the Newton kernels
    for rho, fn in (
        (entmax(1.5), package.entmax15),
        (sparsemax(), package.sparsemax),
        (entmax(1.4), lambda r: package.entmax_bisect(r, 1.4, n_iter=70)),
    ):
        torch.testing.assert_close(rho(x), fn(x), atol=1e-12, rtol=0)
        xs = x.clone().requires_grad_()
        xr = x.clone().requires_grad_()
        g = torch.randn_like(x)
        (ours,) = torch.autograd.grad(rho(xs), xs, g)
        (theirs,) = torch.autograd.grad(fn(xr), xr, g)
        torch.testing.assert_close(ours, theirs, atol=1e-10, rtol=0)


def test_fast_maps_adversarial_rows():
    rows = torch.tensor(
        [
            [1e6, 0.0, -1e6, 5e5],
            [1e-8, 0.0, -1e-8, 2e-8],
            [3.0, 1.0, 1.0, 1.0],
            [2.0, 2.0, 2.0, 2.0],
        ],
        dtype=F64,
    )
    rows = rows.repeat(1, 3000)  # long rows: the Newton path
    for ours, fn in ((sparsemax_rows, package.sparsemax), (entmax15_rows, package.entmax15)):
        torch.testing.assert_close(ours(rows), fn(rows), atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="alpha"):
        entmax_rows(rows, None, 1.0)


# ----------------------------------------------------------------------------- DeepSpeed layouts
def _grid(text: str) -> torch.Tensor:
    """A 0/1 picture as a bool tensor on the host, where the layouts under test are made."""
    rows = [[c == "1" for c in line.split()[0]] for line in text.strip().splitlines()]
    return torch.tensor(rows, device="cpu")


def test_deepspeed_fixed_layout_by_hand():
    # 10 blocks, windows of 4 (the last one short), global column = last block of a window
    want = _grid("""
        1111000101
        1111000101
        1111000101
        1111000101
        0001111101
        0001111101
        0001111101
        0001111101
        0001000111
        0001000111""")
    cfg = FixedSparsityConfig(num_heads=2, block=4, num_local_blocks=4, num_global_blocks=1)
    layout = cfg.make_layout(40)
    assert layout.shape == (2, 10, 10) and layout.dtype == torch.long
    assert same(layout[0].bool(), want) and same(layout[1].bool(), want)
    uni = FixedSparsityConfig(num_heads=1, block=4, attention="unidirectional").make_layout(40)
    assert same(uni[0].bool(), want.tril())
    horiz = FixedSparsityConfig(2, 4, num_local_blocks=4, horizontal_global_attention=True)
    h = horiz.make_layout(32)[0].bool()  # 8 blocks: global blocks 3 and 7
    assert h[3].all() and h[:, 3].all() and not h[0, 5]


def test_deepspeed_other_layouts_by_hand():
    dense = DenseSparsityConfig(num_heads=3, block=2).make_layout(8)
    assert same(dense, torch.ones(3, 4, 4, dtype=torch.long))
    window = LocalSlidingWindowSparsityConfig(1, block=2, num_sliding_window_blocks=3)
    assert same(
        window.make_layout(10)[0].bool(),
        _grid("""
        10000
        11000
        01100
        00110
        00011"""),
    )
    longformer = BSLongformerSparsityConfig(
        1, block=2, num_sliding_window_blocks=3, global_block_indices=[0, 4]
    )
    assert same(
        longformer.make_layout(12)[0].bool(),
        _grid("""
        111111
        111010
        111110
        101110
        111111
        100011"""),
    )
    variable = VariableSparsityConfig(
        1, block=2, local_window_blocks=[1, 2], global_block_indices=[3]
    )
    assert same(
        variable.make_layout(12)[0].bool(),
        _grid("""
        100100
        011100
        011100
        000110
        000110
        000101"""),
    )  # windows {0}, {1, 2}, then 2 repeating: {3, 4}, {5}; global column 3
    bigbird = BigBirdSparsityConfig(
        2,
        block=2,
        num_random_blocks=1,
        num_sliding_window_blocks=3,
        different_layout_per_head=True,
        seed=3,
    ).make_layout(16)
    base = _grid("""
        11111111
        11100000
        11110000
        10111000
        10011100
        10001110
        10000111
        10000011""")  # window ±1 block, block 0 global
    for h in range(2):  # window + global are there; each row adds at most one random block
        extra = bigbird[h].bool() & ~base
        assert torch.all(bigbird[h].bool() >= base) and torch.all(extra.sum(-1) <= 1)
    with pytest.raises(ValueError, match="multiple of block"):
        dense = DenseSparsityConfig(1, block=4).make_layout(10)


def test_block_layout_imports_to_the_expected_graphs():
    layout = torch.zeros(2, 3, 3, dtype=torch.long)
    layout[0] = torch.eye(3, dtype=torch.long)
    layout[1, :, 0] = 1
    pattern = from_block_layout(layout, block=4)
    graph = pattern.graph(11)  # 3 blocks of 4 cover n = 11 (the last block has 3 tokens)
    assert graph.batch_shape == (2,)
    i = torch.arange(11)
    want0 = (i[:, None] // 4) == (i[None, :] // 4)
    want1 = (i[None, :] // 4 == 0).expand(11, 11)
    assert same(graph.to_dense(), torch.stack([want0, want1]))
    shared = from_block_layout(layout[:1].expand(4, 3, 3), block=4, causal=True)
    g = shared.graph(12)
    j = torch.arange(12)
    want = (j[:, None] // 4 == j[None, :] // 4) & (j[None, :] <= j[:, None])
    assert g.batch_shape == () and same(g.to_dense(), want)
    assert same(shared.allows(j[:, None], j[None, :], 12), want)
    cfg = BigBirdSparsityConfig(4, block=8, different_layout_per_head=True, seed=1)
    per_head = cfg.pattern().graph(64)
    assert per_head.batch_shape == (4,)
    expected = cfg.make_layout(64).bool().repeat_interleave(8, 1).repeat_interleave(8, 2)
    assert same(per_head.to_dense(), expected)
    q, k, v = qkv(b=1, h=4, n=64, d=4)
    out = sa.sparse_attention(q, k, v, cfg.pattern(), prob_map="softmax", engine="block")
    torch.testing.assert_close(out, reference(q, k, v, expected, softmax(), 0.5))
    with pytest.raises(ValueError, match="heads, nb, nb"):
        from_block_layout(torch.ones(2, 3, 4), block=2)


def test_dense_engine_hands_sdpa_a_mask_of_the_inputs_rank(monkeypatch):
    """A per-head graph's (H, n, n) mask reaches SDPA as (1, H, n, n): torch's CPU kernel ran
    the 3-D form 3x slower. The result equals the reference either way."""
    from sparseattn.engines import dense as dense_module

    seen = []
    sdpa = dense_module.F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, **kwargs):
        seen.append(attn_mask.shape)
        return sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(dense_module.F, "scaled_dot_product_attention", recording)
    pattern = sa.split_heads(sa.window(3), sa.strided(4))
    q, k, v = torch.randn(3, 2, 2, 16, 8).unbind(0)
    out = sa.sparse_attention(q, k, v, pattern, engine="dense")
    assert seen == [torch.Size([1, 2, 16, 16])]
    mask = pattern.graph(16, num_heads=2).to(q.device).to_dense()
    scores = (q @ k.transpose(-1, -2) / math.sqrt(8)).masked_fill(~mask, -math.inf)
    torch.testing.assert_close(out, scores.softmax(-1) @ v)


def test_dense_engine_with_key_padding_is_sdpa_on_cpu(monkeypatch):
    """Softmax with key padding: on CPU the dense engine hands SDPA's fused kernel the graph
    ∩ the real keys (before, it materialised the scores); a row left without keys (a padding
    query whose window is all padding) gets 0 and zero gradients, as the library defines it,
    which is what torch's CPU kernel gives — this test fails if a torch changes that; off the
    CPU the scores are still materialised (the CUDA kernels are unverified there)."""
    from sparseattn.engines import dense as dense_module

    calls = []
    sdpa = dense_module.F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        calls.append(kwargs["attn_mask"].shape)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(dense_module.F, "scaled_dot_product_attention", recording)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    padding = torch.zeros(2, 16, dtype=torch.bool)
    padding[1, 8:] = True  # item 1's queries 12…15 see keys 10…15 only: all padding
    pattern = sa.window(4)
    out = sa.sparse_attention(q, k, v, pattern, engine="dense", key_padding_mask=padding)
    assert calls == ([torch.Size([2, 1, 16, 16])] if q.device.type == "cpu" else [])
    allowed = pattern.graph(16).to(q.device).to_dense() & ~padding.to(q.device)[:, None, None]
    scores = (q @ k.mT / math.sqrt(8)).masked_fill(~allowed, -math.inf)
    empty = ~allowed.any(-1, keepdim=True)
    ref = scores.masked_fill(empty, 0.0).softmax(-1).masked_fill(empty, 0.0) @ v
    torch.testing.assert_close(out, ref)
    assert bool(empty.any()) and not bool(out[1, :, 12:].any())
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    refs = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for grad, expected in zip(grads, refs, strict=True):
        torch.testing.assert_close(grad, expected)


def test_engine_capabilities_are_declared_and_refusals_name_them():
    """The capability table (engines/capabilities.py) is what explicit engines are checked
    against: a request an engine cannot compute is refused with its declared reason."""
    from sparseattn.engines import SPECS, Request

    for spec in SPECS.values():
        assert spec.why and spec.devices and spec.dtypes
        if spec.name != "triton":
            assert not spec.not_supported_reasons(Request("cpu", torch.float32, softmax()))
    triton = SPECS["triton"].not_supported_reasons(Request("cpu", torch.float32, softmax()))
    assert any("cuda" in r for r in triton) and any("entmax" in r for r in triton)
    on_gpu = Request("cuda", torch.bfloat16, entmax(1.5), train=True)
    missing = SPECS["triton"].available()  # triton not installed (or the device guard)
    assert SPECS["triton"].not_supported_reasons(on_gpu) == ([] if missing is None else [missing])
    wants = Request("tpu", torch.float32, entmax(1.5), train=True, dropout=True, row_alpha=True)
    reasons = SPECS["flex"].not_supported_reasons(wants)
    assert any("tpu" in r for r in reasons) and any("softmax only" in r for r in reasons)
    assert any("dropout" in r for r in reasons) and any("backward" in r for r in reasons)
    q, k, v = qkv(n=64, d=8, dtype=torch.float32)
    per_head = entmax(torch.full((q.shape[1], 1, 1), 1.5))
    with pytest.raises(ValueError, match="engine='gather' cannot run this call: .*tensor α"):
        sa.sparse_attention(q, k, v, sa.window(8), prob_map=per_head, engine="gather")
    out = sa.sparse_attention(q, k, v, sa.window(8), prob_map=per_head)  # auto: one that can
    torch.testing.assert_close(
        out, sa.sparse_attention(q, k, v, sa.window(8), prob_map=per_head, engine="dense")
    )


def test_flex_declares_its_gpu_head_dim_limit():
    """FlexAttention's GPU kernels refuse head dims below 16: declared, so ``auto`` skips
    flex there instead of failing inside the compiler."""
    from sparseattn.engines.flex import flex_refuses

    small = torch.zeros(1, 1, 8, 8, device="cpu")
    assert flex_refuses(small, small, small) is None  # the CPU kernel takes them
    on_gpu = type("T", (), {"device": torch.device("cuda"), "shape": small.shape})()
    assert "head dims >= 16" in flex_refuses(on_gpu, on_gpu, on_gpu)


def test_blocked_inputs_are_one_contiguous_copy_whatever_their_strides():
    """The block engine lays q, k, v out contiguously once per call: a projection's strided
    views (B, H, n, d) of one (B, n, 3, H, d) buffer included. (``x.to(dtype,
    memory_format=torch.contiguous_format)`` returned such a view as it was when the dtype
    matched, and every index_select then copied it again: 4x slower.)"""
    from types import SimpleNamespace

    from sparseattn.engines.block import _blocked

    run = SimpleNamespace(plan=SimpleNamespace(block=16), lead=8, dtype=torch.float32)
    x = torch.randn(1, 100, 3, 8, 64).permute(2, 0, 3, 1, 4)[0]  # (1, 8, 100, 64), strided
    out = _blocked(x, run)
    assert out.is_contiguous() and out.shape == (8, 7, 16, 64)
    torch.testing.assert_close(out.reshape(1, 8, 112, 64)[:, :, :100], x)
    half = _blocked(x.bfloat16(), run)
    assert half.is_contiguous() and half.dtype == torch.float32
