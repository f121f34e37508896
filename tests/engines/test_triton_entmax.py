"""The Triton α-entmax / sparsemax kernels (engines/triton_entmax.py), forward and backward.

Without a GPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1`` while the
kernel module is imported) on CPU tensors, at small sizes: n ≤ 96, d = 16/32, a few heads.
The reference is independent of the kernels: float64 scores on the dense mask of the graph,
the ``entmax`` package's maps (``entmax15``, ``sparsemax``, ``entmax_bisect``), weights · V,
and autograd through the package's backward for the gradients. One test compiles the kernels
for an H100 (sm_90) without running them, so that code the interpreter accepts but the
compiler would not is caught here too.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import subprocess
import sys

import pytest
import torch

import sparseattn as sa
from sparseattn import score_mods as sm
from sparseattn.engines import capabilities, costs
from sparseattn.engines import triton_entmax as te

pytestmark = [pytest.mark.device, pytest.mark.triton]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ENV = os.environ.get("TRITON_INTERPRET")
if DEVICE == "cpu":  # triton builds its library functions at import: interpreted, from here on
    os.environ["TRITON_INTERPRET"] = "1"
try:
    triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
    INTERPRETED = DEVICE == "cpu" and te._interpreted()  # imports the kernels
finally:  # the other test modules see the environment unchanged
    if _ENV is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _ENV
entmax_pkg = pytest.importorskip("entmax", reason="the entmax package is the reference")
tl = triton.language
te._kernels()  # (imported above, interpreted or not)
from sparseattn.engines import _entmax_tiles  # noqa: E402 (after the kernels' first import)


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    """The interpreter checks TRITON_INTERPRET while kernels run, too: set it per test."""
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")


needs_kernels = pytest.mark.skipif(
    DEVICE == "cpu" and not INTERPRETED,
    reason="no GPU, and triton was imported before TRITON_INTERPRET=1 was set (run this "
    "module on its own, or with TRITON_INTERPRET=1 in the environment)",
)

MAPS = {
    "entmax15": (1.5, sa.entmax(1.5)),
    "sparsemax": (2.0, sa.sparsemax()),
    "entmax1.25": (1.25, sa.entmax(1.25)),
}


def _package_map(alpha: float):
    if alpha == 1.5:
        return entmax_pkg.entmax15
    if alpha == 2.0:
        return entmax_pkg.sparsemax
    return lambda x, dim: entmax_pkg.entmax_bisect(x, alpha, dim=dim, n_iter=60)


def reference(q, k, v, allowed, alpha, scale):
    """float64 α-entmax attention on a dense mask ``allowed`` (…, n_q, n_k), by the entmax
    package; GQA by repeating k, v; rows without an allowed key give 0 (and 0 gradient)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ kk.transpose(-1, -2)) * scale
    s = s.masked_fill(~allowed, -1e6)  # far below any threshold: weight exactly 0
    p = _package_map(alpha)(s, dim=-1) * allowed
    return p @ vv, (q, k, v)


def inputs(bsz, heads, n_q, n_k, d, dtype=torch.float32, kv_heads=None, d_v=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv_heads = heads if kv_heads is None else kv_heads
    q = torch.randn(bsz, heads, n_q, d, generator=g)
    k = torch.randn(bsz, kv_heads, n_k, d, generator=g)
    v = torch.randn(bsz, kv_heads, n_k, d_v or d, generator=g)
    return [t.to(DEVICE, dtype).requires_grad_() for t in (q, k, v)]


def check(out, q, k, v, allowed, alpha, scale, atol=2e-5, gtol=5e-5):
    """Output and q, k, v gradients against the float64 reference (same upstream grad)."""
    ref, (q64, k64, v64) = reference(q, k, v, allowed.to(DEVICE), alpha, scale)
    g = torch.Generator().manual_seed(7)
    up = torch.randn(out.shape, generator=g).to(DEVICE)
    assert out.dtype == q.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref.detach(), atol=atol, rtol=0)
    grads = torch.autograd.grad(out, (q, k, v), up.to(out.dtype))
    refs = torch.autograd.grad(ref, (q64, k64, v64), up.double())
    for name, got, want in zip("qkv", grads, refs, strict=True):
        assert got.dtype == q.dtype, name
        torch.testing.assert_close(got.double(), want, atol=gtol, rtol=0, msg=f"d{name}")


def _dense_mask(graph, bsz, heads):
    m = graph.to_dense().to(DEVICE)
    return m.reshape((1,) * (4 - m.dim()) + m.shape).expand(bsz, heads, -1, -1)


@pytest.mark.parametrize("name", list(MAPS))
@needs_kernels
def test_dense_pattern(name):
    alpha, prob_map = MAPS[name]
    q, k, v = inputs(1, 2, 64, 64, 16)
    graph = sa.dense().graph(64)
    out = te.triton_entmax_attention(q, k, v, graph, prob_map, 0.5, block=32)
    check(out, q, k, v, torch.ones(64, 64, dtype=torch.bool), alpha, 0.5)


@pytest.mark.parametrize("name", ["entmax15", "sparsemax"])
@needs_kernels
def test_causal_layout_and_graph(name):
    """causal_layout (no graph) and the causal pattern's graph give the causal reference."""
    alpha, prob_map = MAPS[name]
    n = 56  # not a multiple of the block: the last blocks are cut
    q, k, v = inputs(1, 2, n, n, 16, seed=1)
    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    out = te.entmax_attention(q, k, v, te.causal_layout(n, n, 16), alpha, 0.25)
    check(out, q, k, v, allowed, alpha, 0.25)
    graph = sa.dense().causal().graph(n)
    out2 = te.triton_entmax_attention(q, k, v, graph, prob_map, 0.25, block=32)
    torch.testing.assert_close(out2, out, atol=1e-5, rtol=0)


@needs_kernels
def test_causal_offset_decoding():
    """n_q < n_k: queries at the end of the keys (prefill in pieces, decoding)."""
    n_q, n_k = 20, 56
    q, k, v = inputs(2, 1, n_q, n_k, 16, seed=2)
    allowed = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)
    out = te.entmax_attention(q, k, v, te.causal_layout(n_q, n_k, 16), 1.5, 0.3)
    check(out, q, k, v, allowed, 1.5, 0.3)
    graph = sa.dense().causal().graph(n_k, n_q)
    out2 = te.triton_entmax_attention(q, k, v, graph, sa.entmax(1.5), 0.3, block=16)
    torch.testing.assert_close(out2, out, atol=1e-5, rtol=0)
    one = [t[:, :, -1:].detach().requires_grad_() for t in (q,)] + [k, v]  # decoding
    out1 = te.entmax_attention(*one, te.causal_layout(1, n_k, 16), 1.5, 0.3)
    check(out1, *one, torch.ones(1, n_k, dtype=torch.bool), 1.5, 0.3)


@pytest.mark.parametrize("name", ["entmax15", "entmax1.25"])
@needs_kernels
def test_longformer_partial_blocks(name):
    """A window with global tokens at a block that does not divide it: partial blocks with
    element masks, a row block visiting every key block (the globals), key blocks visited by
    every row block."""
    alpha, prob_map = MAPS[name]
    n = 72
    graph = sa.longformer(20, 3).graph(n)
    layout = te.graph_layout(graph, 16)
    assert int((layout.pair_mask >= 0).sum()) > 0 and layout.pairs < layout.nbq * layout.nbk
    q, k, v = inputs(1, 1, n, n, 32, seed=3)
    out = te.triton_entmax_attention(q, k, v, graph, prob_map, 0.3, block=16)
    check(out, q, k, v, _dense_mask(graph, 1, 1), alpha, 0.3)


def test_mask_tiles_are_packed_row_bits():
    """``pack_rows``: bit c % 64 of word c // 64 of a row is its column c (bit 63, the sign
    bit, and the second word of 128-wide tiles included)."""
    gen = torch.Generator().manual_seed(0)
    for block in te.BLOCKS:
        masks = torch.rand(3, block, block, generator=gen) < 0.5
        words = te.pack_rows(masks)
        assert words.shape == (3, block, -(-block // 64)) and words.dtype == torch.int64
        c = torch.arange(block)
        bits = (words[..., c // 64] >> (c % 64)) & 1
        assert torch.equal(bits.bool(), masks)


@pytest.mark.parametrize("block", [64, 128])
@needs_kernels
def test_partial_blocks_of_wide_tiles(block):
    """Partial pairs at the widest tiles: mask words whose top bit is set (64) and the second
    word of a row (128)."""
    n = 200
    graph = sa.longformer(90, 2).graph(n)
    layout = te.graph_layout(graph, block)
    assert int((layout.pair_mask >= 0).sum()) > 0
    q, k, v = inputs(1, 1, n, n, 16, seed=4)
    out = te.triton_entmax_attention(q, k, v, graph, sa.entmax(1.5), 0.4, block=block)
    check(out, q, k, v, _dense_mask(graph, 1, 1), 1.5, 0.4)


@needs_kernels
def test_key_padding_and_empty_rows():
    """Padded keys get no weight; a batch whose keys are all padding gives zeros (and zero
    gradients), as on the other engines."""
    n = 48
    graph = sa.window(16).graph(n)
    q, k, v = inputs(3, 1, n, n, 16, seed=4)
    kpm = torch.ones(3, n, dtype=torch.bool, device=DEVICE)
    kpm[0, 40:] = False
    kpm[1, ::3] = False
    kpm[2] = False
    allowed = _dense_mask(graph, 3, 1) & kpm[:, None, None, :]
    out = te.triton_entmax_attention(q, k, v, graph, sa.entmax(1.5), 0.25, kpm, block=16)
    check(out, q, k, v, allowed, 1.5, 0.25)
    assert not out[2].any()


@needs_kernels
def test_gqa_and_value_dim():
    """Fewer key/value heads than query heads, and d_v ≠ d."""
    q, k, v = inputs(1, 4, 48, 48, 16, kv_heads=2, d_v=32, seed=5)
    graph = sa.dense().graph(48)
    out = te.triton_entmax_attention(q, k, v, graph, sa.sparsemax(), 0.25, block=16)
    check(out, q, k, v, torch.ones(48, 48, dtype=torch.bool), 2.0, 0.25)


@needs_kernels
def test_per_head_graphs():
    """A batched graph (batch_shape (H,), MULTIHEAD): each head on its own layout graph."""
    n = 48
    graph = sa.split_heads(sa.window(8), sa.strided(16)).graph(n, num_heads=2)
    assert graph.batch_shape == (2,)
    q, k, v = inputs(1, 2, n, n, 16, seed=6)
    out = te.triton_entmax_attention(q, k, v, graph, sa.sparsemax(), 0.25, block=16)
    check(out, q, k, v, _dense_mask(graph, 1, 2), 2.0, 0.25)


def test_split_plan_cuts_long_query_blocks_into_chunks():
    """The query block of Longformer's global tokens visits every key block: it alone is
    split, into chunks that cover its pairs once, in order; the main kernel's range of it is
    left empty."""
    n, block = 384, 16
    layout = te.graph_layout(sa.longformer(16, 2).graph(n), block)
    plan = te.split_plan(layout, 3.0, torch.device("cpu"))
    assert plan is te.split_plan(layout, 3.0, torch.device("cpu"))  # cached
    row_ptr = layout.row_ptr.long()
    assert plan.long_rb.tolist() == [0] and plan.long_c0.tolist() == [0]
    assert plan.long_c1.tolist() == [plan.ch_rb.numel()] == [3]
    assert plan.ch_start[0] == row_ptr[0] and plan.ch_end[-1] == row_ptr[1] == 24
    assert (plan.ch_start[1:] == plan.ch_end[:-1]).all()
    assert plan.row_end[0] == row_ptr[0] and (plan.row_end[1:] == row_ptr[2:].int()).all()
    assert te.split_plan(te.graph_layout(sa.window(16).graph(n), block), 3.0, "cpu") is None


def _counting_splits(monkeypatch) -> list:
    """The split plans the forward and the backward (dq) use, as they ask for them."""
    calls: list = []
    real = te.split_plan

    def counted(*args):
        plan = real(*args)
        if plan is not None:
            calls.append(plan)
        return plan

    monkeypatch.setattr(te, "split_plan", counted)
    return calls


@needs_kernels
@pytest.mark.parametrize("name", ["entmax15", "sparsemax"])
def test_split_query_blocks(name, monkeypatch):
    """The global tokens' query block split into chunks (``tuning(split_long=…)``: one
    program per chunk, each pass one launch, the chunks' sums merged between passes) gives
    the reference's outputs and gradients, and the unsplit kernel's passes and outputs."""
    alpha, prob_map = MAPS[name]
    n = 256
    graph = sa.longformer(16, 2).graph(n)
    q, k, v = inputs(1, 2, n, n, 16, seed=12)
    splits = _counting_splits(monkeypatch)
    with te.tuning(split_long=3.0):
        out = te.triton_entmax_attention(q, k, v, graph, prob_map, 0.25, block=16)
    assert [plan.ch_rb.numel() for plan in splits] == [2]  # the forward's
    tol = 2e-5
    check(out, q, k, v, _dense_mask(graph, 1, 2), alpha, 0.25, atol=tol, gtol=10 * tol)
    assert len(splits) == 2  # and the backward's dq
    # the same start as the main kernel's, so the same threshold passes (and outputs)
    call = (*(t.detach() for t in (q, k, v)), te.graph_layout(graph, 16))
    call += (torch.zeros(2, dtype=torch.int32, device=DEVICE), None, alpha, 0.25, False)
    with te.tuning(split_long=3.0):
        split = te._launch_forward(*call)
    whole = te._launch_forward(*call)
    assert torch.equal(split[-1], whole[-1])
    torch.testing.assert_close(split[0], whole[0], atol=tol, rtol=0)


@needs_kernels
@pytest.mark.parametrize("n_q", [1, 20])
def test_split_decoding_against_a_long_cache(n_q, monkeypatch):
    """Decoding: one query block (or two) against many key blocks makes fewer programs than
    the device has multiprocessors (8 here); with the split on, every query block is cut
    into chunks (flash-decoding's split of the keys), and the result is the reference's."""
    monkeypatch.setattr(te, "_multiprocessors", lambda device: 8)
    splits = _counting_splits(monkeypatch)
    n = 512
    q, k, v = inputs(1, 1, n_q, n, 16, seed=15)
    with te.tuning(split_long=4.0):
        out = te.full_rows_entmax(q, k, v, sa.entmax(1.5), 0.25, None, causal=True, block=16)
    allowed = torch.arange(n)[None, :] <= torch.arange(n - n_q, n)[:, None]
    check(out, q, k, v, allowed, 1.5, 0.25)
    assert len(splits) == 2 and splits[0].long_rb.numel() == -(-n_q // 16)
    assert splits[0].ch_rb.numel() >= 4 * splits[0].long_rb.numel()


@needs_kernels
def test_longest_first_launch_order():
    """``tuning(longest_first=True)``: the main kernels take their query blocks longest first
    (grid (B·H, nbq), the order per layout graph); the outputs, gradients and passes are
    those of the query-block order, on a causal layout and on per-head graphs with a split
    block (emptied in the main kernels, so ordered last)."""
    graph = sa.split_heads(sa.longformer(16, 2), sa.window(16)).graph(256, num_heads=2)
    cases = [
        (128, None, te.causal_layout(128, 128, 16), torch.zeros(2, dtype=torch.int32)),
        (256, 3.0, te.graph_layout(graph, 16), torch.arange(2, dtype=torch.int32)),
    ]
    for n, split_long, layout, gidx in cases:
        q, k, v = inputs(1, 2, n, n, 16, seed=16)
        runs = []
        for longest_first in (False, True):
            with te.tuning(split_long=split_long, longest_first=longest_first):
                out = te.entmax_attention(q, k, v, layout, 1.5, 0.25, graph_index=gidx.to(DEVICE))
                grads = torch.autograd.grad(out.sum(), (q, k, v))
                call = (*(t.detach() for t in (q, k, v)), layout.to(q.device), gidx.to(DEVICE))
                passes = te._launch_forward(*call, None, 1.5, 0.25, False)[-1]
            runs.append((out, *grads, passes))
        for a, b in zip(*runs, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@needs_kernels
def test_no_split_for_other_alphas(monkeypatch):
    """α ∉ {1.5, 2}: the search may take up to MAX_IT passes (bisection for α > 2), so the
    long query block stays in the main kernel whatever ``split_long`` says."""
    splits = _counting_splits(monkeypatch)
    q, k, v = (t.detach() for t in inputs(1, 1, 256, 256, 16, seed=14))
    with te.tuning(split_long=3.0):
        te.triton_entmax_attention(q, k, v, sa.longformer(16, 2).graph(256), sa.entmax(3.0), 0.25)
    assert splits == []


@needs_kernels
def test_split_query_blocks_per_head_graphs_key_padding(monkeypatch):
    """A batched graph where one head's layout has a long query block and the other's has
    none (the split kernels' programs of the other head do nothing), with key padding and
    one key/value head for both query heads (GQA)."""
    n = 256
    splits = _counting_splits(monkeypatch)
    graph = sa.split_heads(sa.longformer(16, 2), sa.window(16)).graph(n, num_heads=2)
    q, k, v = inputs(2, 2, n, n, 16, kv_heads=1, seed=13)
    kpm = torch.ones(2, n, dtype=torch.bool, device=DEVICE)
    kpm[1, 200:] = False
    kpm[0, 1] = False  # a global token's key
    allowed = _dense_mask(graph, 2, 2) & kpm[:, None, None, :]
    with te.tuning(split_long=3.0):
        out = te.triton_entmax_attention(q, k, v, graph, sa.entmax(1.5), 0.25, kpm, block=16)
    check(out, q, k, v, allowed, 1.5, 0.25)
    assert len(splits) == 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@needs_kernels
def test_half_precision(dtype):
    """bf16/fp16 inputs, float32 accumulation: outputs and gradients in the input dtype,
    close to the float64 reference on the same (rounded) inputs."""
    n = 64
    graph = sa.dense().causal().graph(n)
    q, k, v = inputs(1, 2, n, n, 32, dtype=dtype, seed=8)
    out = te.triton_entmax_attention(q, k, v, graph, sa.entmax(1.5), 1 / math.sqrt(32), block=32)
    tol = 3e-2 if dtype == torch.bfloat16 else 5e-3
    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    check(out, q, k, v, allowed, 1.5, 1 / math.sqrt(32), atol=tol, gtol=4 * tol)


@needs_kernels
def test_alpha_above_two():
    """α > 2: the concave case, safeguarded Newton with bisection."""
    q, k, v = inputs(1, 1, 32, 32, 16, seed=9)
    out = te.entmax_attention(q, k, v, te.dense_layout(32, 32, 16), 3.0, 0.5)
    check(out, q, k, v, torch.ones(32, 32, dtype=torch.bool), 3.0, 0.5, atol=1e-4, gtol=1e-3)


@needs_kernels
@pytest.mark.parametrize("skip", [True, False], ids=["skip", "visit-all"])
@pytest.mark.parametrize("name", ["sparsemax", "entmax15"])
def test_skipped_tiles_and_hard_rows(name, skip):
    """Peaked rows: most (row block, key block) tiles hold no weight, are skipped (flags in
    the backward's buffer) and the result stays exact; tied keys and near-uniform rows (a
    tiny scale: every key in the support) too; with the threshold passes skipping tiles below
    the rows' thresholds or visiting every tile (``skip_tiles``, passed per call)."""
    options = te.TritonOptions(skip_tiles=skip)
    alpha, prob_map = MAPS[name]
    n = 64
    q, k, v = inputs(1, 1, n, n, 16, seed=11)
    q, k = q.detach(), k.detach()
    with torch.no_grad():
        u = torch.ones(16, device=DEVICE) / 4
        q += 3 * u  # all queries share a direction; keys 16..31 point away from it
        k[:, :, 16:32] = 0.3 * k[:, :, 16:32] - 3 * u
        k[:, :, 40:48] = k[:, :, 8:16]  # ties across tiles
    q, k = q.requires_grad_(), k.requires_grad_()
    graph = sa.dense().graph(n)
    out = te.triton_entmax_attention(q, k, v, graph, prob_map, 3.0, block=16, options=options)
    nonzero = out.grad_fn.saved_tensors[5]  # int8 (B·H, pairs): does the pair hold a weight
    assert 0 < int(nonzero.sum()) < nonzero.numel()
    check(out, q, k, v, torch.ones(n, n, dtype=torch.bool), alpha, 3.0, atol=5e-5, gtol=2e-4)
    out = te.triton_entmax_attention(q, k, v, graph, prob_map, 1e-3, block=32, options=options)
    assert bool((out.grad_fn.saved_tensors[5] == 1).all())
    check(out, q, k, v, torch.ones(n, n, dtype=torch.bool), alpha, 1e-3)


@pytest.mark.parametrize("name", list(MAPS))
@needs_kernels
def test_few_threshold_passes_with_large_scores(name):
    """A score offset common to a row changes no weight, but makes the row max m large: the
    float spacing of the absolute threshold m + τ then exceeds the step tolerance, and the
    passes must still stop (they ran to MAX_IT once, exact all the same)."""
    alpha, _ = MAPS[name]
    n, d = 128, 16
    q, k, v = (t.detach() for t in inputs(1, 2, n, n, d, seed=5))
    offset = torch.full((1, 2, n, 1), 30.0, device=DEVICE)
    q, k = torch.cat([q, offset], -1), torch.cat([k, offset], -1)  # +900 · scale per score
    scale = 4 / d**0.5
    layout = te.causal_layout(n, n, 32).to(q.device)
    gidx = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    out, *_, passes = te._launch_forward(q, k, v, layout, gidx, None, alpha, scale, False)
    assert int(passes.max()) <= 6, passes
    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    ref, _ = reference(q, k, v, allowed.to(DEVICE), alpha, scale)
    # float32 scores near 450 hold ~3e-5 of rounding each: the weights follow
    torch.testing.assert_close(out.double(), ref, atol=1e-3, rtol=0)


@needs_kernels
def test_matches_dense_engine_float64():
    """The library's own dense engine in float64 agrees too (same map, engine-level call)."""
    n = 64
    graph = sa.longformer(16, 2).graph(n)
    q, k, v = inputs(1, 2, n, n, 16, seed=10)
    out = te.triton_entmax_attention(q, k, v, graph, sa.sparsemax(), 0.25, block=16)
    ref = sa.engines.dense_attention(
        *(t.detach().double().cpu() for t in (q, k, v)), graph, sa.sparsemax(), 0.25
    )
    torch.testing.assert_close(out.detach().double().cpu(), ref, atol=2e-5, rtol=0)


# ---------------------------------------------------------------------------- score modifiers
def _modifier(name: str, bias=None, slopes=None):
    """The modifiers the kernels take, by name, on a bias tensor and ALiBi slopes (None: the
    paper's, computed from the head count 2)."""
    heads = 2 if slopes is None else slopes
    return {
        "bias": lambda: sm.bias(bias),
        "alibi": lambda: sm.alibi(heads),
        "softcap": lambda: sm.softcap(1.5),
        "softcap-bias": lambda: sm.chain(sm.softcap(2.0), sm.bias(bias)),  # Gemma 2 + a bias
        "bias-alibi-softcap": lambda: sm.chain(sm.bias(bias), sm.alibi(heads), sm.softcap(1.2)),
    }[name]()


def check_modded(run, q, k, v, tensors, make, graph, prob_map, scale, key_valid=None, tol=2e-5):
    """``run(q, k, v, score_mod)`` (the kernels) against the float64 dense engine with the same
    modifier, ``make(*tensors)`` (bias, slopes: float64 copies there): the output and the
    gradients of q, k, v and of the modifier's tensors, for one upstream gradient."""
    out = run(q, k, v, make(*tensors))
    rep = q.shape[1] // k.shape[1]
    q64, k64, v64, *t64 = (t.detach().cpu().double().requires_grad_() for t in (q, k, v, *tensors))
    kk, vv = k64.repeat_interleave(rep, 1), v64.repeat_interleave(rep, 1)
    valid = None if key_valid is None else key_valid.cpu()
    ref = sa.engines.dense_attention(q64, kk, vv, graph, prob_map, scale, valid, 0.0, make(*t64))
    torch.testing.assert_close(out.detach().cpu().double(), ref.detach(), atol=tol, rtol=0)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v, *tensors), up.to(out))
    refs = torch.autograd.grad(ref, (q64, k64, v64, *t64), up)
    names = ["q", "k", "v", *(f"tensor {i}" for i in range(len(tensors)))]
    for name, got, want in zip(names, grads, refs, strict=True):
        # rtol: ALiBi's slope gradients sum B·n² float32 terms
        torch.testing.assert_close(got.cpu().double(), want, atol=5 * tol, rtol=1e-5, msg=name)


@triton.jit
def _tanh_of(X, Y, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, _entmax_tiles._tanh(tl.load(X + offs)))


@needs_kernels
def test_softcap_tanh_is_float32_accurate():
    """The kernels' tanh (the softcap's): a series near 0, where 1 − e^{−2|x|} would cancel,
    the exponential form beyond; within a few float32 ulps of tanh across both."""
    x = torch.cat([torch.linspace(-30, 30, 900), torch.logspace(-8, 0.5, 124)]).to(DEVICE)
    y = torch.empty_like(x)
    _tanh_of[(1,)](x, y, x.numel())
    want = torch.tanh(x.double())
    assert ((y.double() - want).abs() <= 4e-7 * want.abs() + 1e-12).all()


@pytest.mark.parametrize("pattern", ["window", "random"])
@pytest.mark.parametrize("map_name", ["entmax15", "sparsemax"])
@pytest.mark.parametrize("mod", ["bias", "alibi", "softcap", "softcap-bias", "bias-alibi-softcap"])
@needs_kernels
def test_score_mods_forward_and_backward(mod, map_name, pattern):
    """Each modifier the kernels take × map × pattern (a window; random keys: every pair
    partial) against the float64 dense engine with the same modifier: outputs, ∂q, ∂k, ∂v
    and ∂bias — the bias shared by the heads (its gradient added atomically) on the window,
    one per head (stored) on the random graph."""
    alpha, prob_map = MAPS[map_name]
    n = 48
    graph = (sa.window(8) if pattern == "window" else sa.random(5, seed=1)).graph(n)
    q, k, v = inputs(1, 2, n, n, 16, seed=20)
    heads = 1 if pattern == "window" else 2
    gen = torch.Generator().manual_seed(21)
    bias = torch.randn(1, heads, n, n, generator=gen).to(DEVICE).requires_grad_()
    tensors = (bias,) if "bias" in mod else ()

    def run(q, k, v, score_mod):
        return te.triton_entmax_attention(
            q, k, v, graph, prob_map, 0.5, block=16, score_mod=score_mod
        )

    check_modded(run, q, k, v, tensors, lambda *t: _modifier(mod, *t), graph, prob_map, 0.5)


@needs_kernels
def test_score_mod_key_bias_learned_slopes_gqa_padding():
    """A bias per (batch, key) — broadcast over heads and queries: its gradient summed over
    each tile's rows, then added — learned ALiBi slopes (their gradient −Σ ds·|i − j| per
    head), the softcap between them, with key padding and two query heads per key/value
    head (h is the query head)."""
    n, bsz = 40, 2
    graph = sa.longformer(6, 2).graph(n)
    q, k, v = inputs(bsz, 2, n, n, 16, kv_heads=1, seed=22)
    gen = torch.Generator().manual_seed(23)
    bias = torch.randn(bsz, 1, 1, n, generator=gen).to(DEVICE).requires_grad_()
    slopes = torch.tensor([0.3, 0.1], device=DEVICE, requires_grad=True)
    kpm = torch.ones(bsz, n, dtype=torch.bool, device=DEVICE)
    kpm[1, 30:] = False

    def make(bias, slopes):
        return sm.chain(sm.alibi(slopes), sm.softcap(2.5), sm.bias(bias))

    def run(q, k, v, score_mod):
        return te.triton_entmax_attention(
            q, k, v, graph, sa.entmax(1.5), 0.5, kpm, block=16, score_mod=score_mod
        )

    check_modded(run, q, k, v, (bias, slopes), make, graph, sa.entmax(1.5), 0.5, kpm)


@needs_kernels
def test_score_mod_in_split_blocks_and_full_rows(monkeypatch):
    """Decoding against a long cache with the split on (every query block cut into chunks:
    the chunk kernels apply the modifier and the split dq writes the bias's gradient), on
    the causal layout without a graph (``full_rows_entmax``)."""
    monkeypatch.setattr(te, "_multiprocessors", lambda device: 8)
    splits = _counting_splits(monkeypatch)
    n_q, n_k = 16, 256
    q, k, v = inputs(1, 1, n_q, n_k, 16, seed=24)
    bias = torch.randn(1, 1, n_q, n_k, generator=torch.Generator().manual_seed(25))
    bias = bias.to(DEVICE).requires_grad_()
    graph = sa.dense().causal().graph(n_k, n_q)

    def make(bias):
        return sm.chain(sm.softcap(2.0), sm.bias(bias))

    def run(q, k, v, score_mod):
        with te.tuning(split_long=4.0):
            return te.full_rows_entmax(
                q, k, v, sa.sparsemax(), 0.5, None, causal=True, block=16, score_mod=score_mod
            )

    check_modded(run, q, k, v, (bias,), make, graph, sa.sparsemax(), 0.5)
    assert len(splits) == 2 and splits[0].ch_rb.numel() >= 2


@needs_kernels
def test_score_mods_the_kernels_refuse_go_elsewhere(monkeypatch):
    """Another callable (a plain function, an nn.Module, a chain holding one), two of a kind
    in a chain, a bias that does not broadcast and too few slopes are refused with their
    reasons; ``auto`` on a CUDA request keeps ``triton`` for the library's modifiers and
    routes the others to another engine (decisions kept apart per modifier kind)."""
    q, k, v = inputs(1, 2, 32, 32, 16)
    bias = torch.zeros(1, 2, 32, 32, device=DEVICE)

    def plain(score, b, h, q_idx, kv_idx):
        return score * 2

    rho = sa.entmax(1.5)
    assert te.triton_entmax_unsupported(q, k, v, rho, 0.0, None, sm.bias(bias)) is None
    cases = {
        "function": (plain, "score modifiers only"),
        "module": (torch.nn.Identity(), "score modifiers only"),
        "chain with a function": (sm.chain(sm.softcap(2.0), plain), "score modifiers only"),
        "two biases": (sm.chain(sm.bias(bias), sm.bias(bias)), "2 × bias"),
        "bias shape": (sm.bias(torch.zeros(3, 32, device=DEVICE)), "does not broadcast"),
        "slopes": (sm.alibi(torch.ones(1, device=DEVICE)), "1 slopes for 2 query heads"),
    }
    for case, (mod, words) in cases.items():
        why = te.triton_entmax_unsupported(q, k, v, rho, 0.0, None, mod)
        assert why is not None and words in why, (case, why)
    graph = sa.window(8).graph(32)
    with pytest.raises(ValueError, match="score modifiers only"):
        te.triton_entmax_attention(q, k, v, graph, rho, 0.25, score_mod=plain)
    with pytest.raises(ValueError, match="score modifiers only"):
        te.entmax_attention(q, k, v, te.dense_layout(32, 32, 16), 1.5, score_mod=plain)

    monkeypatch.setattr(costs, "GPU_DENSE_LIMIT", 0)  # no dense engine for this small call
    chosen = {}
    for name, mod in [("bias", sm.bias(bias)), ("plain", plain), ("alibi", sm.alibi(2))]:
        req = capabilities.Request.of(q, k, v, rho, 0.0, mod)
        req = dataclasses.replace(req, device="cuda")
        call = (q, k, v, rho, 0.0, mod)
        chosen[name] = capabilities.choose(req, graph, call)
        if name == "plain":
            why = " ".join(capabilities.request_reasons("triton", req, call))
            assert "score modifiers only" in why
    assert chosen["bias"] == chosen["alibi"] == "triton"
    assert chosen["plain"] in ("block", "gather")


def test_layout_cached_on_graph():
    graph = sa.window(8).graph(64)
    assert te.graph_layout(graph, 16) is te.graph_layout(graph, 16)
    assert te.graph_layout(graph, 32) is not te.graph_layout(graph, 16)


@needs_kernels
def test_unsupported_reasons(monkeypatch):
    q, k, v = inputs(1, 2, 32, 32, 16)
    assert te.triton_entmax_unsupported(q, k, v, sa.entmax(1.5)) is None
    assert te.triton_entmax_unsupported(q, k, v, sa.sparsemax()) is None
    cases = {
        "softmax only": (sa.softmax(), 0.0, "entmax and sparsemax only"),
        "dropout": (sa.entmax(1.5), 0.1, "dropout"),
        "alpha 1": (sa.entmax(1.0), 0.0, "softmax"),
        "tensor alpha": (sa.entmax(torch.tensor([1.5, 1.7]).view(2, 1, 1)), 0.0, "tensor"),
        "no map": (None, 0.0, "unknown"),
    }
    for case, (prob_map, p, words) in cases.items():
        why = te.triton_entmax_unsupported(q, k, v, prob_map, p)
        assert why is not None and words in why, case
    why = te.triton_entmax_unsupported(q.double(), k.double(), v.double(), sa.entmax(1.5))
    assert "float32/bfloat16/float16" in why
    assert "do not fit" in te.triton_entmax_unsupported(q, k[:, :, :16], v, sa.entmax(1.5))
    q3, k3, v3 = inputs(1, 3, 32, 32, 16, kv_heads=2)
    assert "multiple" in te.triton_entmax_unsupported(q3, k3, v3, sa.entmax(1.5))
    if DEVICE == "cpu":  # outside the interpreter, CPU tensors are refused
        monkeypatch.delenv("TRITON_INTERPRET")
        assert "CUDA" in te.triton_entmax_unsupported(q, k, v, sa.entmax(1.5))
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="dropout"):
        te.triton_entmax_attention(q, k, v, sa.dense().graph(32), sa.entmax(1.5), 0.25, None, 0.1)


_COMPILE = """
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sparseattn.engines import _entmax_kernels as kern
from sparseattn.engines import _entmax_split as split
from sparseattn.engines.triton_entmax import DEFAULT_OPTIONS, MAX_IT

TOPK = DEFAULT_OPTIONS.topk

types = {
    **dict.fromkeys(("n_q", "n_k", "H", "HKV", "nbq", "nbk", "n_pairs", "n_chunks", "BH"), "i32"),
    **dict.fromkeys(("mul", "scale", "AM1", "R", "m_cap", "m_scale", "m_am1"), "fp32"),
    **dict.fromkeys(("mb_b", "mb_h", "mb_i", "mb_j"), "i32"),
    **dict.fromkeys(("Q", "K", "V", "O", "DO", "DQ", "DK", "DV_"), "*bf16"),
    **dict.fromkeys(("TAU", "GV", "DELTA", "TMAX", "PART", "TOP", "STATE", "ACC", "GACC", "DQP",
                     "MSL", "MDB", "MDSL"), "*fp32"),
    "MB": "*bf16",
    **dict.fromkeys(("NZ", "KPM"), "*i8"),
    "MASKS": "*i64",
}
consts = {"D": 64, "DV": 64, "BD": 64, "BDV": 64, "BLOCK": 64, "HAS_KPM": True, "UPCAST": False,
          "PARTIAL": True, "LONGEST_FIRST": True, "MOD": 0, "MOD_GRAD": 0}
# score modifiers (MOD): 22 = ALiBi, softcap, then the bias; 17 = the bias, then the softcap
specs = [
    (kern._forward, {"MODE": 1, "NEED_GRAD": True, "MAX_IT": MAX_IT, "TOPK": TOPK, "PREC": "tf32",
                     "SKIP": True}),
    (kern._backward_dkdv, {"MODE": 0, "GROUP": 2, "PREC": "tf32"}),
    (split._split_sums, {"MODE": 1, "PREC": "tf32", "SKIP": True}),
    (kern._backward_dq, {"MODE": 1, "PREC": "tf32", "MOD": 22, "MOD_GRAD": 6}),
]
if sys.argv[1] == "all":
    specs += [
        (split._split_pass0, {"MODE": 1, "TOPK": TOPK, "PREC": "tf32"}),
        (split._split_init, {"MODE": 1, "TOPK": TOPK}),
        (split._split_update, {"MODE": 1}),
        (split._split_last, {"MODE": 1, "NEED_GRAD": True, "PREC": "tf32"}),
        (split._split_finish, {"MODE": 1, "NEED_GRAD": True}),
        (split._split_dq, {"MODE": 1, "PREC": "tf32"}),
        (split._split_dq_finish, {}),
    ]
    specs += [
        (kern._forward, {"MODE": m, "NEED_GRAD": g, "MAX_IT": MAX_IT, "TOPK": TOPK, "PREC": p,
                         "SKIP": skip})
        for m, g, p, skip in [(0, False, "ieee", True), (2, True, "tf32", False),
                              (1, False, "ieee", False)]
    ]
    specs += [(kern._backward_dq, {"MODE": m, "PREC": "tf32"}) for m in (0, 1, 2)]
    specs += [(kern._backward_dkdv, {"MODE": m, "GROUP": 1, "PREC": "tf32"}) for m in (1, 2)]
    specs += [
        (kern._forward, {"MODE": 1, "NEED_GRAD": True, "MAX_IT": MAX_IT, "TOPK": TOPK,
                         "PREC": "tf32", "SKIP": True, "MOD": 17}),
        (kern._backward_dkdv, {"MODE": 2, "GROUP": 2, "PREC": "tf32", "MOD": 22}),
        (kern._backward_dq, {"MODE": 2, "PREC": "tf32", "MOD": 17, "MOD_GRAD": 1}),
        (kern._backward_dq, {"MODE": 1, "PREC": "tf32", "MOD": 5, "MOD_GRAD": 7}),
        (split._split_last, {"MODE": 1, "NEED_GRAD": True, "PREC": "tf32", "MOD": 22}),
        (split._split_dq, {"MODE": 1, "PREC": "tf32", "MOD": 17, "MOD_GRAD": 3}),
    ]
for fn, extra in specs:
    constexprs = {k: v for k, v in {**consts, **extra}.items() if k in fn.arg_names}
    signature = {a: "constexpr" if a in constexprs else types.get(a, "*i32") for a in fn.arg_names}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    assert "cubin" in triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm
print("compiled", len(specs), "with triton", triton.__version__)
"""


def test_without_triton(monkeypatch):
    """Without triton the engine module imports and names the reason (the kernels' module is
    what imports triton, on first use)."""
    monkeypatch.setattr(te, "_KERNELS", None)
    monkeypatch.setitem(sys.modules, "sparseattn.engines._entmax_kernels", None)
    q, k, v = inputs(1, 2, 32, 32, 16)
    assert "triton is not installed" in te.triton_entmax_unsupported(q, k, v, sa.entmax(1.5))


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU the other tests compile the kernels")
@pytest.mark.parametrize("which", ["main", pytest.param("all", marks=pytest.mark.slow)])
def test_compiles_for_h100(which):
    """The kernels compile (to a cubin for sm_90, by triton's own ptxas; no GPU needed) with
    constexprs the engine uses: what the interpreter accepts, the compiler must accept too.
    In a fresh process, since this one's triton may be the interpreter's. ``main``: the
    1.5-entmax forward with gradients, the general-α dK/dV kernel and the split blocks' pass
    (~15 s of CPU); ``all`` (slow): every map × kernel. ``SPARSEATTN_TEST_TRITON=DIR``
    compiles with the triton installed in DIR instead (``pip install --target DIR
    triton==3.6.0``: the GPU image's)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(te.__file__)))
    other = env.get("SPARSEATTN_TEST_TRITON", "")
    env["PYTHONPATH"] = os.pathsep.join([p for p in (other, root, env.get("PYTHONPATH")) if p])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE, which],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"compiled {4 if which == 'main' else 25}" in done.stdout


@pytest.mark.slow
@pytest.mark.skipif(DEVICE != "cpu" or not INTERPRETED, reason="a dry run without a GPU")
def test_bench_gpu_entmax_dry_run_reaches_the_kernels(tmp_path, monkeypatch):
    """The GPU bench's sparse-map and tiles sections, run on a GPU simulated on the CPU (the
    device guard) with the kernels under the interpreter, at n = 256: every row reaches the
    Triton engine through ``sparse_attention`` — with the knobs the next GPU run measures
    (``topk``, ``split_long``, ``longest_first``) — and none is skipped by an error, so a
    device call is not spent on a broken row (~4 minutes on 2 cores)."""
    import dataclasses

    from device_guard import DeviceGuard

    from sparseattn.engines import SPECS
    from sparseattn.lab.bench.gpu import GpuSuite, run_gpu_suite

    suite = GpuSuite(
        "dry-run",
        ns=(),
        fp32_ns=(),
        window=32,
        sinks=2,
        package_max_n=256,
        calibrate_ns=(),
        entmax_ns=(256,),
        tiles_ns=(256,),
        tile_blocks=(),
        tile_warps=(),
        tile_stages=(),
        tile_topks=(16,),
        module_ns=(),
        stream_ns=(),
        embed_dim=64,
        samples=1,
        min_sample_s=0.0,
    )
    seen = []
    real = te.entmax_attention

    def recorded(*args, **kwargs):
        options = inspect.signature(real).bind(*args, **kwargs).arguments["options"]
        seen.append((options.topk, options.split_long, options.longest_first))
        return real(*args, **kwargs)

    monkeypatch.setattr(te, "entmax_attention", recorded)
    monkeypatch.setattr(costs, "GPU_DENSE_LIMIT", 0)  # n = 256 would go to masked SDPA
    with DeviceGuard():
        # the guard turns the kernels off (they would launch on CUDA); here they interpret
        # (the guard puts the real entry back when it exits)
        SPECS["triton"] = dataclasses.replace(SPECS["triton"], available=lambda: None)
        data = run_gpu_suite(suite, tmp_path, log=lambda _: None)
    skipped = [
        r for r in data["rows"] if r.get("skipped", "adasplash missing") != "adasplash missing"
    ]
    assert not skipped
    assert {r["section"] for r in data["rows"]} == {"entmax", "tiles"}
    topk = te.DEFAULT_OPTIONS.topk
    wanted = {(topk, None, False), (16, None, False), (topk, 4.0, False), (topk, None, True)}
    assert wanted <= set(seen)
