"""Device and half-precision behaviour: run on CPU by default, on a GPU with ``--device cuda``.

References are independent of the engine under test: a dense masked attention written here in
float64 on the predicate's mask, and, for Hugging Face, the unmodified model.
"""

from __future__ import annotations

import dataclasses
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


@pytest.mark.parametrize("engine", ["flex", "auto"])
def test_the_module_replays_from_cuda_graphs(device, engine):
    """``torch.cuda.make_graphed_callables`` captures SparseAttention's forward and backward
    (after its warm-up calls fill the library's caches): replayed outputs and gradients equal
    the eager ones — no host sync or host→device copy inside the call. Needs a real GPU."""
    if device.type != "cuda" or not torch.backends.cuda.is_built():  # CPU or the guard
        pytest.skip("CUDA graphs need a real GPU")
    torch.manual_seed(0)
    layer = sa.SparseAttention(64, 4, pattern=sa.longformer(32, 2), engine=engine).to(device)
    x = torch.randn(2, 256, 64, device=device, requires_grad=True)
    g = torch.randn(2, 256, 64, device=device)
    eager = layer(x)
    eager_grads = torch.autograd.grad(eager, (x, *layer.parameters()), g)
    graphed = torch.cuda.make_graphed_callables(layer, (x,))
    for _ in range(2):  # the second replay reuses the captured graphs
        out = graphed(x)
        grads = torch.autograd.grad(out, (x, *layer.parameters()), g)
        assert torch.allclose(out, eager, atol=1e-5, rtol=1e-5)
        for a, b in zip(grads, eager_grads, strict=True):
            assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)


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


def test_triton_tuning_sets_the_options_and_restores_them_on_error():
    """``tuning`` replaces the knobs of the current options (validated as ``TritonOptions``
    validates them) for the ``with`` block and puts the previous options back, on an error
    too; nested blocks start from the enclosing block's options."""
    from sparseattn.engines import triton_entmax as te

    default = te.DEFAULT_OPTIONS
    assert te.current_options() is default
    assert (default.block, default.topk, default.split_long) == (64, 8, None)
    assert default.stages == (2, None) and default.skip_tiles and not default.longest_first
    assert [default.num_warps(b) for b in (16, 32, 64, 128)] == [4, 4, 4, 8]
    knobs = {"skip_tiles": False, "warps": 2, "stages": 3, "split_long": 4.0}
    with te.tuning(block=128, topk=32, longest_first=True, **knobs) as tuned:
        assert te.current_options() is tuned
        assert (tuned.block, tuned.topk) == (128, 32)
        assert tuned.num_warps(128) == tuned.num_warps(16) == 2  # one value: every block
        assert tuned.split_long == 4.0 and tuned.longest_first and not tuned.skip_tiles
        assert tuned.stages == (3, 3)
        with te.tuning(stages=None, warps={64: 8}) as inner:
            assert inner.stages == (None, None) and inner.num_warps(64) == 8
            assert (inner.block, inner.topk, inner.split_long) == (128, 32, 4.0)
            assert inner.warps == ((64, 8),) and hash(inner) == hash(dataclasses.replace(inner))
        assert te.current_options() is tuned
    with pytest.raises(RuntimeError), te.tuning(block=32, stages=None):
        raise RuntimeError("a failed measurement")
    assert te.current_options() is default
    with pytest.raises(ValueError, match="block must be one of"), te.tuning(block=48):
        pass
    with pytest.raises(ValueError, match="topk must be a power of two"), te.tuning(topk=12):
        pass
    bad_split = pytest.raises(ValueError, match="split_long must be None or > 1")
    with bad_split, te.tuning(split_long=0.5):
        pass
    with pytest.raises(TypeError, match="unexpected keyword"), te.tuning(warp=8):
        pass
    with pytest.raises(dataclasses.FrozenInstanceError):
        default.topk = 16
    assert te.current_options() is default and default == te.TritonOptions()


def _stub_triton_kernels(monkeypatch, te) -> list:
    """The Triton kernel modules replaced by stubs: ``kern.name[grid](*args, **constexprs)``
    records (thread, kernel, constexprs) and computes nothing (no GPU, no interpreter)."""
    import threading

    launches = []

    class Kernel:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            thread = threading.current_thread().name
            return lambda *args, **constexprs: launches.append((thread, self.name, constexprs))

    class Kernels:
        def __getattr__(self, name):
            return Kernel(name)

    monkeypatch.setattr(te, "_kernels", Kernels)
    monkeypatch.setattr(te, "_split_kernels", Kernels)
    monkeypatch.setattr(te, "_multiprocessors", lambda device: 1)
    return launches


def test_triton_options_are_per_thread_and_kept_for_the_backward(monkeypatch, device):
    """Two threads in different ``tuning`` blocks at once each launch with their own options
    (a context variable, not module state), and asyncio tasks each see their own; an explicit
    ``options=`` wins over the block's; the backward launches with the forward's options,
    whatever the context is by then. The kernels are stubs (no GPU, no interpreter)."""
    import asyncio
    import threading

    from sparseattn.engines import triton_entmax as te

    launches = _stub_triton_kernels(monkeypatch, te)
    q, k, v = (torch.randn(1, 2, 64, 16, device=device) for _ in range(3))
    graph = sa.window(4).graph(64)
    both_inside = threading.Barrier(2, timeout=30)

    def run(knobs: dict) -> None:
        with te.tuning(**knobs):
            both_inside.wait()  # the other thread's block is open too
            te.triton_entmax_attention(q, k, v, graph, sa.entmax(1.5), 0.25, check=False)
            both_inside.wait()

    knobs = {"a": {"topk": 16}, "b": {"topk": 32, "skip_tiles": False, "longest_first": True}}
    threads = [threading.Thread(target=run, args=(kn,), name=name) for name, kn in knobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = {th: (kw["TOPK"], kw["SKIP"], kw["LONGEST_FIRST"]) for th, n, kw in launches}
    assert got == {"a": (16, True, False), "b": (32, False, True)}
    assert te.current_options() is te.DEFAULT_OPTIONS

    async def task(topk: int) -> int:  # asyncio tasks too: each sees its own block
        with te.tuning(topk=topk):
            await asyncio.sleep(0)  # the other task enters its block meanwhile
            return te.current_options().topk

    async def both() -> list[int]:
        return await asyncio.gather(task(16), task(32))

    assert asyncio.run(both()) == [16, 32]

    launches.clear()
    with te.tuning(topk=64):
        mine = te.TritonOptions(topk=4, warps=2)
        te.triton_entmax_attention(q, k, v, graph, sa.entmax(1.5), 0.25, check=False, options=mine)
    assert [(kw["TOPK"], kw["num_warps"]) for _, _, kw in launches] == [(4, 2)]

    # forward in a block, backward after it: the backward's launches keep the block's knobs
    launches.clear()
    layout = te.graph_layout(sa.longformer(16, 2).graph(256), 16)
    q, k, v = (torch.randn(1, 2, 256, 16, device=device, requires_grad=True) for _ in range(3))
    with te.tuning(longest_first=True, stages=3, warps=8, split_long=3.0):
        out = te.entmax_attention(q, k, v, layout, 1.5, 0.25)
    out.sum().backward()
    by_kernel = {name: kw for _, name, kw in launches}
    assert {"_split_pass0", "_split_dq"} <= set(by_kernel)  # split forward and backward
    assert by_kernel["_backward_dq"]["LONGEST_FIRST"] is True
    for name in ("_forward", "_backward_dq", "_backward_dkdv", "_split_dq"):
        assert (by_kernel[name]["num_warps"], by_kernel[name]["num_stages"]) == (8, 3), name
