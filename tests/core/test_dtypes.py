"""Every dtype on every path (issue 28, item 1).

float32, bfloat16 and float16 through each engine × map at sizes and budgets that reach each
code path — the dense engine (SDPA and masked), the rows engine in several chunks (on a graph
and on the dense pattern), the block engine's split-softmax path (block 16: closed-form
backward; block 64: torch's flash backward) and its general path, both in several chunks, the
gather engine in several chunks, FlexAttention's CPU forward — forward and ∂q, ∂k, ∂v against
a float64 dense attention written here from the pattern's predicate. Which path ran is checked
by counting calls of the path's own function. Then the user-level cases of the issue: the
default path at (1, 8, 1024, 64), ``torch.autocast`` around ``SparseAttention``, a
``.bfloat16()`` module, and a tiny bf16 Llama sparsified with a sliding window.
"""

from __future__ import annotations

import collections
import copy
import math

import pytest
import torch
from tiny_models import tiny_llama

import sparseattn as sa
from sparseattn import hf
from sparseattn.engines import block as block_engine
from sparseattn.engines import gather as gather_engine
from sparseattn.engines import rows as rows_engine
from sparseattn.engines.block import block_attention
from sparseattn.engines.gather import gather_attention
from sparseattn.maps import resolve_prob_map

HALF = [torch.bfloat16, torch.float16]
DTYPES = [torch.float32, *HALF]
#: Bound on ‖x − ref‖ / ‖ref‖ for outputs and gradients stored in each dtype: a few roundings
#: of the dtype (2⁻⁹ for bf16, 2⁻¹² for fp16). Measured: bf16 ≤ 2.5e-3, fp16 ≤ 3.2e-4.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
MAPS = ["softmax", "entmax15", "sparsemax"]


def reference(q, k, v, pattern, rho, scale=None):
    """Dense masked attention in float64 on ``pattern.allows`` (Yun eq. 3)."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    mask = pattern.allows(torch.arange(n_q)[:, None], torch.arange(n_k)[None, :], n_k)
    q, k, v = (t.double() for t in (q, k, v))
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    return rho(s.masked_fill(~mask, -math.inf), mask.expand_as(s)) @ v


def rel_err(x, ref):
    return float((x.detach().double() - ref.detach()).norm() / ref.detach().norm())


def _qkv(n, dtype, heads=2, d=16, batch=1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(batch, heads, n, d, generator=gen).to(dtype).requires_grad_() for _ in range(3)
    ]


def _check(out, q, k, v, pattern, rho, dtype, tol=None):
    """Output and ∂q, ∂k, ∂v in ``dtype``, within ``tol`` of the float64 reference."""
    tol = TOL[dtype] if tol is None else tol
    assert out.dtype == dtype
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference(*leaves, pattern, resolve_prob_map(rho))
    assert rel_err(out, ref) < tol
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), g)
    refs = torch.autograd.grad(ref, leaves, g.double())
    for name, a, b in zip("qkv", grads, refs, strict=True):
        assert a.dtype == dtype, name
        assert rel_err(a, b) < tol, f"∂{name}: {rel_err(a, b):.2e}"


@pytest.fixture
def calls(monkeypatch):
    """``spy(owner, name)`` counts the calls of ``owner.name`` in the returned Counter."""
    seen: collections.Counter = collections.Counter()

    def spy(owner, name):
        fn = getattr(owner, name)

        def counted(*args, **kwargs):
            seen[name] += 1
            return fn(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)

    return seen, spy


WINDOW = sa.longformer(64, 2)  # block 16: full blocks inside the band, partial band edges
WIDE = sa.longformer(256, 2)  # block 64: full 64-blocks on and beside the diagonal
N = 300  # not a multiple of the block sizes: a short last row block


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rho", MAPS)
@pytest.mark.parametrize("block", [16, 64])
def test_block_engine_split_and_general_paths_in_chunks(dtype, rho, block, calls):
    """Softmax takes the split path (flash kernel on the band + partial blocks merged by
    log-sum-exp; backward by the closed form at b = 16, torch's flash backward at b = 64),
    other maps the general path; both in several chunks. The split path's fp32 log-sum-exp
    met bf16 buffers here before (``index_copy_`` dtype error)."""
    seen, spy = calls
    spy(block_engine, "_split_forward")
    spy(block_engine._Runner, "weights")
    pattern = WINDOW if block == 16 else WIDE
    q, k, v = _qkv(N, dtype)
    out = block_attention(
        q, k, v, pattern.graph(N), resolve_prob_map(rho), 0.25, block=block, budget=1 << 12
    )
    _check(out, q, k, v, pattern, rho, dtype)
    path = "_split_forward" if rho == "softmax" else "weights"
    assert seen[path] >= 3  # forward chunks (the general path recomputes them in backward)
    assert seen["_split_forward" if path == "weights" else "weights"] == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rho", MAPS)
def test_gather_engine_in_chunks(dtype, rho, calls):
    seen, spy = calls
    spy(gather_engine._Run, "weights")
    q, k, v = _qkv(N, dtype)
    out = gather_attention(q, k, v, WINDOW.graph(N), resolve_prob_map(rho), 0.25, budget=1 << 11)
    _check(out, q, k, v, WINDOW, rho, dtype)
    assert seen["weights"] >= 6  # forward and backward, several chunks each


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rho", MAPS)
@pytest.mark.parametrize("pattern", [WINDOW, sa.dense()], ids=["graph", "dense-pattern"])
def test_rows_engine_in_chunks(dtype, rho, pattern, calls, monkeypatch):
    """The rows engine on a graph, and on the dense pattern (sparse maps: full rows without a
    graph); softmax on the dense pattern goes to torch's SDPA."""
    seen, spy = calls
    spy(rows_engine._Run, "map")
    monkeypatch.setattr(rows_engine, "BUDGET", {"cpu": 2 * 64 * N, "cuda": 2 * 64 * N})
    q, k, v = _qkv(N, dtype)
    engine = "rows" if pattern is WINDOW else "auto"
    out = sa.sparse_attention(q, k, v, pattern, prob_map=rho, engine=engine)
    _check(out, q, k, v, pattern, rho, dtype)
    sdpa = pattern is not WINDOW and rho == "softmax"
    assert seen["map"] == (0 if sdpa else 5)  # ceil(300 / 64) forward chunks


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rho", MAPS)
def test_dense_engine(dtype, rho):
    """Softmax through SDPA with the graph's mask, other maps through the masked scores."""
    q, k, v = _qkv(N, dtype)
    out = sa.sparse_attention(q, k, v, WINDOW, prob_map=rho, engine="dense")
    _check(out, q, k, v, WINDOW, rho, dtype)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("engine", ["dense", "block", "rows"])
def test_entmax_with_a_tensor_alpha(dtype, engine):
    """One α per head (1.2 … 3): α > 2 is the steep case where half-precision scores moved the
    weights most; ∂q, ∂k, ∂v within the dtype's rounding."""
    q, k, v = _qkv(N, dtype, heads=4)
    rho = sa.entmax(torch.tensor([1.2, 1.5, 2.0, 3.0]).view(4, 1, 1))
    out = sa.sparse_attention(q, k, v, WINDOW, prob_map=rho, engine=engine)
    _check(out, q, k, v, WINDOW, rho, dtype)


@pytest.mark.slow  # one FlexAttention compile per dtype, 7-17 s each on CPU
@pytest.mark.parametrize("dtype", DTYPES)
def test_flex_forward(dtype):
    q, k, v = (t.detach() for t in _qkv(256, dtype))
    with torch.no_grad():
        out = sa.sparse_attention(q, k, v, WINDOW, engine="flex")
    assert out.dtype == dtype
    assert rel_err(out, reference(q, k, v, WINDOW, sa.maps.softmax())) < TOL[dtype]


@pytest.mark.parametrize(
    ("pattern", "dtype"),
    [
        pytest.param(sa.longformer(128, 4), torch.bfloat16, id="longformer-bf16"),
        pytest.param(sa.bigbird(64, 2, 2, 32), torch.bfloat16, id="bigbird-bf16"),
        pytest.param(sa.window(64), torch.bfloat16, id="window-bf16", marks=pytest.mark.slow),
        pytest.param(sa.longformer(128, 4), torch.float16, id="fp16", marks=pytest.mark.slow),
    ],
)
def test_the_default_path_at_the_issues_size(pattern, dtype, calls):
    """The issue's call, ``sparse_attention(q, k, v, pattern)`` with (1, 8, 1024, 64) half
    inputs: ``auto`` takes the block engine's split path, which crashed."""
    seen, spy = calls
    spy(block_engine, "_split_forward")
    q, k, v = _qkv(1024, dtype, heads=8, d=64)
    out = sa.sparse_attention(q, k, v, pattern)
    assert seen["_split_forward"] > 0
    _check(out, q, k, v, pattern, "softmax", dtype)


def module_reference(layer, x, pattern):
    """SparseAttention's math in float64 from its weights: projections, reference attention
    per head, output projection. x (B, n, E) → (B, n, E)."""
    bsz, n, e = x.shape
    h = layer.num_heads
    w_in, b_in = layer.qkv.weight.double(), layer.qkv.bias.double()
    qkv = (x.double() @ w_in.T + b_in).view(bsz, n, 3, h, e // h).permute(2, 0, 3, 1, 4)
    out = reference(qkv[0], qkv[1], qkv[2], pattern, sa.maps.softmax())
    out = out.transpose(1, 2).reshape(bsz, n, e)
    return out @ layer.out.weight.double().T + layer.out.bias.double()


def _layer(pattern, monkeypatch):
    """A SparseAttention whose ``auto`` picks the block engine at these small sizes."""
    monkeypatch.setattr(sa.engines.costs, "DENSE_LIMIT", 0)
    torch.manual_seed(0)
    return sa.SparseAttention(64, 4, pattern=pattern)


def _param_grads_against_reference(layer, loss, x, pattern, tol):
    params = list(layer.parameters())
    grads = torch.autograd.grad(loss, params)
    wide = copy.deepcopy(layer).double()
    ref_loss = module_reference(wide, x.double(), pattern).square().mean()
    refs = torch.autograd.grad(ref_loss, list(wide.parameters()))
    for p, a, b in zip(params, grads, refs, strict=True):
        assert a.dtype == p.dtype
        assert rel_err(a, b) < tol


def test_autocast_around_the_module(monkeypatch, calls):
    """Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` a float32 layer takes float32 x
    (as nn.MultiheadAttention does): bf16 projections and attention, a bf16 output, float32
    parameter gradients; outside autocast a dtype mismatch is still a TypeError."""
    seen, spy = calls
    spy(block_engine, "_split_forward")
    pattern = sa.longformer(32, 2)
    layer = _layer(pattern, monkeypatch)
    x = torch.randn(2, 200, 64, generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
        loss = out.float().square().mean()
    assert out.dtype == torch.bfloat16 and seen["_split_forward"] > 0
    assert rel_err(out, module_reference(layer, x, pattern)) < 3e-2
    _param_grads_against_reference(layer, loss, x, pattern, 5e-2)
    with pytest.raises(TypeError, match="dtype"):
        layer(x.bfloat16())


def test_sparse_attention_under_autocast_casts_like_sdpa():
    """float32 q, k, v under bf16 autocast: computed from bf16 inputs, returned in bf16 — as
    ``scaled_dot_product_attention`` does."""
    q, k, v = (t.detach() for t in _qkv(N, torch.float32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = sa.sparse_attention(q, k, v, WINDOW, prob_map="entmax15", engine="block")
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert out.dtype == sdpa.dtype == torch.bfloat16
    ref = reference(*(t.bfloat16() for t in (q, k, v)), WINDOW, sa.entmax(1.5))
    assert rel_err(out, ref) < TOL[torch.bfloat16]


def test_a_bfloat16_module_trains(monkeypatch, calls):
    """``SparseAttention(...).bfloat16()``: bf16 output and bf16 parameter gradients within
    bf16 rounding of the float64 math on the same (bf16) weights."""
    seen, spy = calls
    spy(block_engine, "_split_forward")
    pattern = sa.longformer(32, 2)
    layer = _layer(pattern, monkeypatch).bfloat16()
    x = torch.randn(2, 200, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    out = layer(x)
    assert out.dtype == torch.bfloat16 and seen["_split_forward"] > 0
    assert rel_err(out, module_reference(layer, x, pattern)) < 2e-2
    _param_grads_against_reference(layer, out.float().square().mean(), x, pattern, 5e-2)


def test_tiny_llama_in_bfloat16_with_a_sliding_window(calls):
    """A bf16 Llama (grouped-query attention) sparsified with ``sliding_window(256, 4)`` at
    2048 tokens runs the block engine's split path; its logits lie within bf16 rounding of
    the same weights in float64 on the dense reference engine."""
    seen, spy = calls
    spy(block_engine, "_split_forward")
    model = tiny_llama(max_position_embeddings=2048).bfloat16()
    wide = copy.deepcopy(model).double()
    ids = torch.randint(0, 100, (1, 2048), generator=torch.Generator().manual_seed(0))
    pattern = sa.sliding_window(256, 4)
    hf.sparsify(model, pattern)
    hf.sparsify(wide, pattern, engine="dense")
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        ref = wide(input_ids=ids).logits
    assert logits.dtype == torch.bfloat16 and seen["_split_forward"] > 0
    assert rel_err(logits, ref) < 2e-2
