"""The device guard (tests/device_guard.py) and what it checks in CPU CI.

The guard simulates a GPU on the CPU: these tests check that it catches what CUDA rejects
(a host tensor mixed into a device op, a host index, ``.numpy()`` of a device tensor), that
it leaves correct code alone, and then run the library under it: every engine × map on a
pattern with global tokens (predicates with tensors), ``SparseAttention``, the host→device
copies of a second call (none), and ``sparseattn bench gpu`` end to end at tiny sizes.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from device_guard import CUDA, DeviceGuard, on_device

import sparseattn as sa


@pytest.fixture
def guard(device_guard):
    """The active guard (``--device guard``) or a fresh one for this test."""
    with contextlib.nullcontext(device_guard) if device_guard else DeviceGuard() as g:
        yield g


def test_the_guard_raises_where_cuda_would(guard):
    x = torch.randn(4, 3).to(CUDA)
    assert x.device == CUDA and x.is_cuda and on_device(x)
    host = torch.ones(4, 3)
    with pytest.raises(RuntimeError, match="same device"):
        x + host
    with pytest.raises(RuntimeError, match="same device"):
        torch.isin(x, torch.arange(3))
    with pytest.raises(RuntimeError, match="same device"):
        x[torch.arange(2)]
    with pytest.raises(TypeError, match="numpy"):
        x.numpy()
    # what CUDA allows: host 0-dim tensors, copies across devices, results on the device
    y = x * torch.tensor(2.0) + torch.zeros(3, device=x.device) + x.new_ones(3)
    assert on_device(y) and on_device(torch.zeros_like(x)) and on_device(x[:, :1])
    assert on_device(x.sum()) and not on_device(x.cpu()) and on_device(x.cpu().cuda())
    x.copy_(host)
    assert torch.equal(x.cpu(), host)
    assert on_device(torch.nn.Linear(3, 2).to(CUDA).weight)
    # a 0-dim host tensor broadcast against a device tensor is a host view of the full shape
    # (the H200 run found `Pattern.allows(n - 1, kv_idx, n)` making such a view)
    scalar, row = torch.broadcast_tensors(torch.as_tensor(3), x[0])
    assert not on_device(scalar) and on_device(row)
    with pytest.raises(RuntimeError, match="same device"):
        scalar & row.long()


def test_the_guard_counts_host_to_device_copies(guard):
    before = len(guard.copies)
    x = torch.randn(5).to(CUDA)
    x.to(CUDA)  # already there: no copy
    torch.tensor([1, 2], device=CUDA)
    assert [n for _, n in guard.copies[before:]] == [5, 2]
    with pytest.raises(AssertionError, match="copied 1 tensor"), guard.no_copies():
        torch.zeros(3).cuda()


def test_module_to_moves_parameters_however_the_device_is_named(guard):
    """``Module.to`` with the device positional or as ``device=`` (the guard once rewrote the
    keyword inside ``Module.to``'s own argument parsing and left the parameters on the host)."""
    for to in ({"args": ("cuda",)}, {"kw": {"device": "cuda"}},
               {"kw": {"device": CUDA, "dtype": torch.float64}}):  # fmt: skip
        layer = torch.nn.Linear(3, 3).to(*to.get("args", ()), **to.get("kw", {}))
        assert on_device(layer.weight) and on_device(layer.bias), to


ENGINES = ["dense", "block", "gather", "rows", "flex", "auto"]
MAPS = ["softmax", "entmax15", "sparsemax"]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("rho", MAPS)
def test_every_engine_and_map_stays_on_the_device(guard, engine, rho):
    """Forward and backward on 'cuda': outputs and gradients on the device; a second call
    at the same pattern and length copies nothing from the host."""
    if engine == "flex" and rho != "softmax":
        pytest.skip("FlexAttention computes softmax only")
    pattern = sa.bigbird(8, 2, 1, 8)  # window, global tokens (isin), random blocks (a table)
    gen = torch.Generator().manual_seed(0)
    # head dim 16: FlexAttention's GPU kernels refuse smaller ones (declared by the engine)
    q, k, v = (torch.randn(2, 3, 40, 16, generator=gen).to(CUDA).requires_grad_() for _ in "qkv")
    out = sa.sparse_attention(q, k, v, pattern, prob_map=rho, engine=engine)
    assert on_device(out)
    out.sum().backward()
    assert all(on_device(t.grad) for t in (q, k, v))
    with guard.no_copies(f"the second {engine}/{rho} call"):
        sa.sparse_attention(q, k, v, pattern, prob_map=rho, engine=engine).sum().backward()
    ref = sa.sparse_attention(
        *(t.detach().cpu() for t in (q, k, v)), pattern, prob_map=rho, engine="dense"
    )
    torch.testing.assert_close(out.detach().cpu(), ref, atol=1e-5, rtol=1e-5)


def test_key_padding_and_the_module_stay_on_the_device(guard):
    layer = sa.SparseAttention(16, 2, pattern=sa.longformer(8, 2), prob_map="entmax15").to(CUDA)
    x = torch.randn(2, 24, 16).to(CUDA)
    pad = torch.zeros(2, 24, dtype=torch.bool).to(CUDA)  # True = padding, as in PyTorch
    pad[1, 20:] = True
    out = layer(x, key_padding_mask=pad)
    assert on_device(out)
    with guard.no_copies("the module's second call"):
        layer(x, key_padding_mask=pad)
    q, window = torch.randn(2, 2, 24, 16).to(CUDA), sa.window(6)  # one pattern: cached graphs
    for engine, rho in [(e, "sparsemax") for e in ("block", "gather", "dense", "rows")] + [
        ("flex", "softmax")
    ]:
        with torch.no_grad():
            out = sa.sparse_attention(
                q, q, q, window, prob_map=rho, engine=engine, key_padding_mask=pad
            )
            assert on_device(out)
            with guard.no_copies(f"{engine} with key padding, second call"):
                sa.sparse_attention(
                    q, q, q, window, prob_map=rho, engine=engine, key_padding_mask=pad
                )


@pytest.mark.parametrize("prob_map", ["softmax", "entmax15"])
def test_checkpoint_models_weights_and_counts_stay_on_the_device(guard, prob_map):
    """A sparsified Longformer and BigBird on the device, with padding (and global tokens):
    ``output_attentions`` and ``capture_attention``'s records (formed apart from the engine)
    and ``attention_sparsity``'s counts (the layer's graph on the host, the call's masks on
    the device)."""
    pytest.importorskip("transformers")
    from tiny_models import tiny_model

    from sparseattn import hf

    longformer = tiny_model(
        "LongformerConfig", "LongformerModel", vocab_size=50, hidden_size=16,
        num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
        attention_window=[4], max_position_embeddings=64,
    )  # fmt: skip
    bigbird = tiny_model(
        "BigBirdConfig", "BigBirdModel", vocab_size=50, hidden_size=16, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=16, block_size=4, num_random_blocks=1,
        max_position_embeddings=128, attention_type="block_sparse",
    )  # fmt: skip
    mask = torch.ones(2, 40, dtype=torch.long).to(CUDA)
    mask[1, 33:] = 0
    glob = torch.zeros(2, 40, dtype=torch.long).to(CUDA)
    glob[:, 0] = 1
    ids = torch.randint(5, 50, (2, 40)).to(CUDA)
    for model, extra in ((longformer, {"global_attention_mask": glob}), (bigbird, {})):
        model = hf.sparsify(model.eval().to(CUDA), prob_map=prob_map, count_weights=True)
        with torch.no_grad(), hf.capture_attention(model) as records:
            out = model(ids, attention_mask=mask, output_attentions=True, **extra)
        assert on_device(out.last_hidden_state) and all(map(on_device, out.attentions))
        assert list(hf.attention_sparsity(model)) == [0]
        (record,) = records
        assert all(on_device(t) for t in (record.scores, record.probs, record.allowed))


@pytest.mark.parametrize("engine", ["block", "gather", "dense", "flex"])
@pytest.mark.parametrize("n_q", [1, 64])
def test_grouped_query_calls_stay_on_the_device(guard, engine, n_q):
    """Grouped-query attention (8 query heads on 2 key/value heads), a decode step (n_q = 1
    at the end of the keys) and a full call: no host→device copy on the second call (the
    gather engine once rebuilt the grouped graph's index arrays every call)."""
    q = torch.randn(1, 8, n_q, 16).to(CUDA)
    k, v = torch.randn(2, 1, 2, 64, 16).to(CUDA)
    pattern = sa.sliding_window(16, 2)
    with torch.no_grad():
        out = sa.sparse_attention(q, k, v, pattern, engine=engine, enable_gqa=True)
        assert on_device(out)
        with guard.no_copies(f"{engine}, grouped queries, second call"):
            sa.sparse_attention(q, k, v, pattern, engine=engine, enable_gqa=True)


def test_bench_gpu_runs_end_to_end_at_tiny_sizes(guard, tmp_path):
    """``sparseattn bench gpu`` (sparseattn/lab/bench/gpu.py) on the simulated GPU: every row
    measured (none skipped by an error), the report and the figure written."""
    from sparseattn.lab.bench.gpu import GpuSuite, run_gpu_suite

    suite = GpuSuite(
        "smoke",
        ns=(256,),
        fp32_ns=(256,),
        window=32,
        sinks=2,
        package_max_n=256,
        calibrate_ns=(256,),
        entmax_ns=(256,),
        tiles_ns=(256,),
        tile_blocks=(32,),
        tile_warps=(4,),
        tile_stages=(2,),
        module_ns=(256,),
        stream_ns=(128, 256),
        embed_dim=64,
        samples=1,
        min_sample_s=0.0,
    )
    data = run_gpu_suite(suite, tmp_path, log=lambda _: None)
    skipped = [
        (r["who"], r["mode"], r["skipped"])
        for r in data["rows"]
        # an optional baseline; CUDA graphs, which the simulated GPU cannot capture
        if "skipped" in r and r["skipped"] != "adasplash missing" and "CUDA graph" not in r["who"]
    ]
    assert not skipped
    sections = {r["section"] for r in data["rows"]}
    assert sections == {"main", "module", "stream", "tiles", "entmax", "calibrate"}
    assert (tmp_path / "results.md").exists() and (tmp_path / "gpu.png").exists()
    report = (tmp_path / "results.md").read_text()
    assert "Training step" in report and "stream of lengths" in report
