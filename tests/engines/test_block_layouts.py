"""The block engine on banded graphs: inputs in a projection's layout, one flash call per band,
the shared global columns scored once per band.

References are a plain masked attention written here (scores → −inf outside the pattern's
predicate → softmax → · V) on contiguous copies of the inputs.
"""

from __future__ import annotations

import math

import pytest
import torch
from grad_checks import assert_close_with_grads

import sparseattn as sa
from sparseattn.engines import block as block_module
from sparseattn.engines import block_attention
from sparseattn.engines.layout import block_plan
from sparseattn.maps import entmax, softmax

pytestmark = pytest.mark.device

F64 = torch.float64


def reference(q, k, v, pattern, n, scale, rho=None):
    i = torch.arange(n)
    mask = pattern.allows(i[:, None], i[None, :], n).to(q.device)
    scores = (q @ k.transpose(-1, -2)) * scale
    rho = softmax() if rho is None else rho
    return rho(scores.masked_fill(~mask, -math.inf), mask.expand_as(scores)) @ v


def projected(b, h, n, d, seed=0):
    """q, k, v (B, H, n, d) as views of one fused (B, n, 3·H·d) projection, requiring grad."""
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(b, n, 3 * h * d, generator=gen, dtype=F64).requires_grad_()
    q, k, v = fused.view(b, n, 3, h, d).permute(2, 0, 3, 1, 4)
    return fused, (q, k, v)


def contiguous(*xs):
    return [x.detach().contiguous().requires_grad_() for x in xs]


class FlashCalls:
    """Counts the block engine's calls to torch's flash kernel."""

    def __init__(self, monkeypatch):
        self.count = 0
        real = block_module._flash

        def counted(*args, **kwargs):
            self.count += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(block_module, "_flash", counted)


@pytest.mark.parametrize("b, n", [(1, 96), (2, 96), (1, 101)])
def test_projection_layout_inputs_exact_with_gradients(b, n):
    # a window ±12 and 3 global tokens at block 4: band runs with edges, a shared global block
    pattern, h, d = sa.longformer(24, 3), 3, 8
    fused, (q, k, v) = projected(b, h, n, d)
    out = block_attention(q, k, v, pattern.graph(n), softmax(), 0.3, block=4, budget=600)
    refs = contiguous(q, k, v)
    ref = reference(*refs, pattern, n, 0.3)
    assert_close_with_grads(out, ref, (q, k, v), (1e-10, 1e-10), (1e-9, 1e-9), ref_inputs=refs)
    if b == 1 and n % 4 == 0:  # the output in the queries' layout: (B, n, H, d) underneath
        assert out.transpose(1, 2).is_contiguous()


def test_queries_are_read_in_place_keys_and_values_copied_once():
    n, pattern = 64, sa.window(16)
    _, (q, k, v) = projected(1, 2, n, 4)
    run = block_module._Runner(
        block_plan(pattern.graph(n), 8), softmax(), 0.5, None, 0.0, 1 << 10, 2, True, F64, 4
    )
    qp = block_module._blocked(q, run, view=True)
    assert qp.data_ptr() == q.data_ptr() and qp.shape == (2, 8, 8, 4)
    kp = block_module._blocked(k, run)
    assert kp.is_contiguous() and kp.data_ptr() != k.data_ptr()
    expanded = q.detach()[:, :1].expand(1, 2, n, 4)  # stride 0: copied
    assert block_module._blocked(expanded, run, view=True).data_ptr() != expanded.data_ptr()


def test_one_flash_call_per_band_and_global_columns_once(monkeypatch):
    n, pattern = 200, sa.longformer(24, 3)
    plan = block_plan(pattern.graph(n), 4)
    runs = plan.runs(6, 600, 8)
    band = [r for r in runs if r.whole is not None]
    assert band and all(r.complete and len(r.pieces) > 1 for r in band)
    whole = band[0].whole
    assert whole.shared and whole.cols.tolist() == [0, 1, 2] and whole.keep is None
    calls = FlashCalls(monkeypatch)
    q, k, v = (torch.randn(2, 3, n, 8, dtype=F64) for _ in range(3))
    out = block_attention(q, k, v, pattern.graph(n), softmax(), 0.3, block=4, budget=600)
    chunks = plan.chunks(6, 600, split=True)
    alone = sum(len(r.pieces) for r in runs if r.whole is None)
    if q.device.type == "cpu":  # the split path (torch's CPU flash kernel)
        assert calls.count == len(band) + alone < len(chunks)
    torch.testing.assert_close(out, reference(q, k, v, pattern, n, 0.3), atol=1e-10, rtol=1e-10)


def test_wide_global_columns_and_gathered_blocks_stay_with_the_chunks():
    # 6 global keys in a partial block of 8 against d = 4: the shared columns' scores would
    # outgrow the output, so only the run is one call; BigBird's random blocks are gathered
    # chunk by chunk
    n = 160
    for pattern, d, block in ((sa.longformer(24, 6), 4, 8), (sa.bigbird(24, 2, 1, 8), 4, 8)):
        plan = block_plan(pattern.graph(n), block)
        runs = plan.runs(2, 300, d)
        assert any(r.whole is not None and not r.complete for r in runs)
        assert all(r.complete or r.whole is None or not r.whole.part.shape[1] for r in runs)
        fused, (q, k, v) = projected(1, 2, n, d, seed=1)
        for rho in (softmax(), entmax(1.5)):
            out = block_attention(q, k, v, pattern.graph(n), rho, 0.4, block=block, budget=300)
            refs = contiguous(q, k, v)
            ref = reference(*refs, pattern, n, 0.4, rho)
            assert_close_with_grads(
                out, ref, (q, k, v), (1e-10, 1e-10), (1e-9, 1e-9), ref_inputs=refs
            )


@pytest.mark.parametrize("block", [4, 8])
def test_rows_without_keys_give_zero_on_the_split_path(block):
    # strided rows cut into partial blocks only, two rows emptied: their output is 0 and the
    # others equal the reference (the merge's weights of an empty row are 0, not ∞ · 0)
    n = 40
    mask = sa.strided(5).graph(n).to_dense().reshape(n, n).clone()
    mask[[3, 17]] = False
    crow = torch.zeros(n + 1, dtype=torch.long)
    crow[1:] = torch.cumsum(mask.sum(1), 0)
    graph = sa.AttentionGraph(crow, mask.nonzero()[:, 1].contiguous(), n, n, ())
    q, k, v = (torch.randn(1, 2, n, 4, dtype=F64) for _ in range(3))
    out = block_attention(q, k, v, graph, softmax(), 0.5, block=block, budget=64)
    assert not out[:, :, [3, 17]].any()
    keep = mask.clone()
    keep[[3, 17]] = True  # the reference needs a key per row; those rows are compared as 0
    scores = (q @ k.transpose(-1, -2) * 0.5).masked_fill(~keep, -math.inf)
    ref = torch.softmax(scores, -1) @ v
    ref[:, :, [3, 17]] = 0
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize(
    "pattern, block, n, empty_rows",
    [
        (sa.longformer(24, 3), 4, 192, True),  # band with edges, shared global columns
        (sa.longformer(200, 5), 64, 384, True),  # the band under a bias in the flash backward
        (sa.bigbird_blocks(8, 2, heads=2, seed=1), 8, 192, False),  # random blocks beside it
    ],
)
def test_key_padding_rides_the_split_path(monkeypatch, pattern, block, n, empty_rows):
    # item 0: its first 8 keys (the global ones) and its last 3/8 (longer than a window)
    # are padding: rows without a real key, output and gradients 0; item 1: a padded stretch
    # inside the band and the first global key; exact with gradients, through torch's flash
    # kernel (the split path)
    h = 2
    keep = torch.ones(2, n, dtype=torch.bool)
    keep[0, n - n * 3 // 8 :] = False
    keep[0, :8] = False
    keep[1, 40:60] = False
    keep[1, 0] = False
    calls = FlashCalls(monkeypatch)
    fused, (q, k, v) = projected(2, h, n, 8, seed=4)
    graph = pattern.graph(n)
    out = block_attention(q, k, v, graph, softmax(), 0.3, keep, block=block, budget=1 << 12)
    refs = contiguous(q, k, v)
    mask = graph.to_dense().view(1, -1, n, n) & keep[:, None, None, :]
    scores = (refs[0] @ refs[1].transpose(-1, -2) * 0.3).masked_fill(~mask, -math.inf)
    ref = softmax()(scores, mask.expand_as(scores)) @ refs[2]
    empty = (~mask.any(-1)).expand(2, h, n)
    assert bool(empty.any()) == empty_rows and not out.detach()[empty].any()
    assert_close_with_grads(out, ref, (q, k, v), (1e-10, 1e-10), (1e-9, 1e-9), ref_inputs=refs)
    if q.device.type == "cpu":
        assert calls.count > 0


def test_per_head_random_blocks_keep_each_heads_band_in_one_segment(monkeypatch):
    # BigBird's training layout: random blocks drawn per head, some next to the band or to
    # one another. The band about each row's own block stays one run (a segment per head and
    # per jump between heads), the random blocks are gathered beside it; exact with gradients
    n, heads, b = 256, 3, 8
    pattern = sa.bigbird_blocks(b, 3, heads=heads, seed=0)
    graph = pattern.graph(n)
    plan = block_plan(graph, b)
    band = max(plan.groups, key=lambda g: g.rows.numel())
    runs = plan.runs(1, 1 << 20, 8)
    assert len(runs) <= 4 * heads * len(plan.groups)
    assert all(r.pieces[0].run is not None for r in runs if r.pieces[0].full.shape[1] < n // b)
    assert band.rows.numel() > n // b  # most row blocks of every head share one group
    calls = FlashCalls(monkeypatch)
    fused, (q, k, v) = projected(1, heads, n, 8, seed=2)
    out = block_attention(q, k, v, graph, softmax(), 0.35, block=b, budget=1 << 20)
    refs = contiguous(q, k, v)
    mask = graph.to_dense().view(1, heads, n, n)
    scores = (refs[0] @ refs[1].transpose(-1, -2) * 0.35).masked_fill(~mask, -math.inf)
    ref = torch.softmax(scores, -1) @ refs[2]
    assert_close_with_grads(out, ref, (q, k, v), (1e-10, 1e-10), (1e-9, 1e-9), ref_inputs=refs)
    if q.device.type == "cpu":  # the split path: a band call and a gathered call per segment
        assert calls.count <= 2 * len(runs)


def test_full_blocks_every_row_holds_are_gathered_once_for_the_segment(monkeypatch):
    # 8 global tokens at block 4: two full key blocks that every row holds beside its band.
    # They are gathered once and expanded over the segment's row blocks (no copy per row),
    # and the whole band with them is one call; exact with gradients
    n, pattern, b = 160, sa.longformer(24, 8), 4
    plan = block_plan(pattern.graph(n), b)
    runs = plan.runs(2, 300, 8)
    whole = [r.whole for r in runs if r.whole is not None and r.complete]
    assert whole and all(w.extra_shared and w.extra[0].tolist() == [0, 1] for w in whole)
    gathered = []
    real = block_module.select_blocks
    monkeypatch.setattr(
        block_module, "select_blocks", lambda x, i: gathered.append(i.numel()) or real(x, i)
    )
    fused, (q, k, v) = projected(1, 2, n, 8, seed=3)
    out = block_attention(q, k, v, pattern.graph(n), softmax(), 0.3, block=b, budget=300)
    assert 2 in gathered  # the two global blocks, once for a whole segment
    refs = contiguous(q, k, v)
    ref = reference(*refs, pattern, n, 0.3)
    assert_close_with_grads(out, ref, (q, k, v), (1e-10, 1e-10), (1e-9, 1e-9), ref_inputs=refs)
