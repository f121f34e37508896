"""Device and half-precision behaviour: run on CPU by default, on a GPU with ``--device cuda``.

References are independent of the engine under test: a dense masked attention written here in
float64 on the predicate's mask, and, for Hugging Face, the unmodified model.
"""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import WIDE_BERT, tiny_bert

import sparseattn as sa
from sparseattn import hf
from sparseattn.attention import choose_engine

pytestmark = [pytest.mark.device, pytest.mark.guard]

HALF = [torch.bfloat16, torch.float16]


def reference(q, k, v, pattern, rho):
    """Dense masked attention in float64 from the pattern's predicate (Yun eq. 3)."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    i = torch.arange(n_q, device=q.device)[:, None]
    j = torch.arange(n_k, device=q.device)[None, :]
    mask = pattern.allows(i, j, n_k)
    q, k, v = (t.double() for t in (q, k, v))
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return rho(s.masked_fill(~mask, -math.inf), mask.expand_as(s)) @ v


def rel_err(out, ref):
    return float((out.detach().double() - ref).norm() / ref.norm())


def _qkv(n, dtype, device, grad=False, heads=4, d=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(2, heads, n, d, generator=gen).to(device, dtype).requires_grad_(grad)
        for _ in range(3)
    ]


def test_the_device_option_moves_the_tests_tensors_only():
    """``--device``'s mode (tests/conftest.py) takes tensors made here, with or without
    ``requires_grad`` (which stays a leaf), and leaves the library's own allocations alone."""
    from conftest import _TestTensorsOn

    with _TestTensorsOn(torch.device("cpu")) as mode:
        x = torch.randn(3, requires_grad=True)
        torch.zeros(2, device="cpu")  # an explicit device is kept
        assert (mode.moved, x.is_leaf, x.requires_grad) == (1, True, True)
        sa.window(4).graph(64)  # builds with torch.arange & co inside sparseattn
        sa.sparse_attention(
            x.view(1, 1, 3, 1),
            x.view(1, 1, 3, 1),
            x.view(1, 1, 3, 1),
            sa.dense(),
            prob_map="entmax15",
        )
        assert mode.moved == 1


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("rho", ["softmax", "entmax15", "sparsemax"])
@pytest.mark.parametrize("engine", ["dense", "block", "gather", "rows"])
def test_half_precision_engines_match_a_float64_reference(device, dtype, rho, engine):
    """bf16/fp16 inputs: the output has the inputs' dtype, lies within half-precision rounding
    of the float64 reference (‖out − ref‖/‖ref‖ < 2e-2), and gradients are finite."""
    pattern = sa.longformer(24, 2)
    q, k, v = _qkv(200, dtype, device, grad=True)
    out = sa.sparse_attention(q, k, v, pattern, prob_map=rho, engine=engine)
    assert out.dtype == dtype and out.device == q.device
    ref = reference(q.detach(), k.detach(), v.detach(), pattern, sa.maps.resolve_prob_map(rho))
    assert rel_err(out, ref) < 2e-2
    out.float().square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_flex_forward_and_backward_on_the_device(device):
    """FlexAttention computes forward and backward on a GPU; on CPU, forward only."""
    if device.type == "cpu":
        pytest.skip("FlexAttention has no backward on CPU")
    pattern = sa.longformer(64, 4)
    q, k, v = _qkv(384, torch.float32, device, grad=True)
    out = sa.sparse_attention(q, k, v, pattern, engine="flex")
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference(qr, kr, vr, pattern, sa.maps.softmax())
    assert rel_err(out, ref) < 1e-3  # TF32 matrix units where torch allows them
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    refs = torch.autograd.grad(ref, (qr, kr, vr), g.double())
    for a, b in zip(grads, refs, strict=True):
        assert rel_err(a, b) < 1e-3
    graph = pattern.graph(384)

    def masks():
        return {key: graph.memo.peek(key) for key in graph.memo if key[0] == "flex_mask"}

    before = masks()
    sa.sparse_attention(q, k, v, pattern, engine="flex")
    assert masks() == before and len(before) == 1  # one BlockMask per (graph, block, device)


def test_auto_on_a_gpu_picks_flex_for_softmax_and_triton_for_entmax(device):
    if device.type == "cpu":
        pytest.skip("the GPU rule")
    from sparseattn.engines import SPECS

    pattern = sa.longformer(512, 16)
    q, k, _ = _qkv(8192, torch.bfloat16, device, heads=8, d=64)
    graph = pattern.graph(8192)
    assert choose_engine(graph, q, k, sa.maps.softmax()) == "flex"
    fused = "triton" if SPECS["triton"].available() is None else "block"
    assert choose_engine(graph, q, k, sa.maps.entmax(1.5)) == fused
    assert choose_engine(graph, q, k, sa.maps.softmax(), dropout_p=0.1) == "block"


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
def test_sparse_attention_module_trains_on_the_device(device, dtype):
    """SparseAttention in each dtype: output equal to the float64 reference of its own
    projections, and an optimiser step changes every parameter."""
    torch.manual_seed(0)
    layer = sa.SparseAttention(64, 4, pattern=sa.window(16), prob_map="entmax15").to(device, dtype)
    x = torch.randn(2, 96, 64).to(device, dtype)
    out = layer(x)
    assert out.dtype == dtype and out.device == x.device
    wide = sa.SparseAttention(64, 4, pattern=sa.window(16), prob_map="entmax15").double()
    wide.load_state_dict({k: t.double().cpu() for k, t in layer.state_dict().items()})
    ref = wide(x.double().cpu())
    assert rel_err(out.cpu(), ref) < (1e-5 if dtype == torch.float32 else 3e-2)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    before = [p.detach().clone() for p in layer.parameters()]
    out.float().square().mean().backward()
    opt.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, layer.parameters(), strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_sparsify_on_the_device_equals_the_original_model(device, dtype):
    """Dense softmax sparsify equals the original model's sdpa implementation in the same dtype
    and device, padding included."""
    model = tiny_bert(**WIDE_BERT).to(device, dtype)
    ids = torch.randint(1, 100, (2, 40))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, 25:] = 0
    with torch.no_grad():
        original = model(input_ids=ids, attention_mask=mask).last_hidden_state
        hf.sparsify(model, sa.dense())
        ours = model(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert rel_err(ours[real], original[real].double()) < tol


def test_triton_tuning_sets_the_knobs_and_restores_them_on_error():
    from sparseattn.engines import triton_entmax as te

    before = (dict(te.DEFAULT_BLOCK), te.SKIP_TILES, dict(te.WARPS), dict(te.STAGES), te.TOPK)
    split = (te.SPLIT_LONG, te.LONGEST_FIRST)
    knobs = {"skip_tiles": not te.SKIP_TILES, "warps": 2, "stages": 3, "split_long": 4.0}
    with te.tuning(block=128, topk=32, longest_first=not te.LONGEST_FIRST, **knobs):
        assert (te.DEFAULT_BLOCK["cuda"], te.WARPS[128], te.TOPK) == (128, 2, 32)
        assert te.SPLIT_LONG == 4.0 and te.LONGEST_FIRST is not split[1]
        assert te.STAGES == {"forward": 3, "backward": 3}
        assert te.SKIP_TILES is not before[1]
    with pytest.raises(RuntimeError), te.tuning(block=32, stages=None):
        raise RuntimeError("a failed measurement")
    assert (
        dict(te.DEFAULT_BLOCK),
        te.SKIP_TILES,
        dict(te.WARPS),
        dict(te.STAGES),
        te.TOPK,
    ) == before
    with pytest.raises(ValueError, match="block must be one of"), te.tuning(block=48):
        pass
    with pytest.raises(ValueError, match="topk must be a power of two"), te.tuning(topk=12):
        pass
    bad_split = pytest.raises(ValueError, match="split_long must be None or > 1")
    with bad_split, te.tuning(split_long=0.5):
        pass
    assert before[4] == te.TOPK and split == (te.SPLIT_LONG, te.LONGEST_FIRST)
