"""FlexAttention interop: ``Pattern.to_block_mask`` and ``Pattern.allows`` as a ``mask_mod``.

The reference is SDPA with the boolean mask ``pattern.graph(n).to_dense()`` (of a fresh
pattern object, so a random pattern's table is drawn independently of the one under test).
Eager ``flex_attention`` calls the ``mask_mod`` with the real batch and head indices, as the
compiled kernel does (the compiled path is in ``test_compiled_flex_broadcasts``, marked slow).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention

import sparseattn as sa
from sparseattn.patterns import NAMED
from sparseattn.patterns.base import MEMO_SIZES

pytestmark = [pytest.mark.device, pytest.mark.avx2]

N = 200
STATIC = {name: (f, kw) for name, (f, kw) in NAMED.items() if name != "topk"}


def fresh(name: str) -> sa.Pattern:
    factory, kwargs = STATIC[name]
    return factory(**kwargs)


def qkv(b: int, h: int, n: int = N, d: int = 16):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(3, b, h, n, d, generator=gen).unbind(0)


def eager_flex(q, k, v, block_mask):
    with warnings.catch_warnings():  # "flex_attention called without torch.compile()"
        warnings.simplefilter("ignore")
        return flex_attention(q, k, v, block_mask=block_mask)


def sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.device))


CASES = [
    ("window", lambda: sa.window(16), {}, 3),
    ("causal bigbird", lambda: fresh("bigbird").causal(), {}, 2),
    ("random", lambda: fresh("random"), {}, 3),
    (
        "head split",
        lambda: sa.split_heads(sa.window(8), sa.strided(9), fresh("random")),
        {"num_heads": 4},
        4,
    ),
]


@pytest.mark.parametrize("name,make,graph_kwargs,heads", CASES, ids=[c[0] for c in CASES])
def test_to_block_mask_broadcasts_over_batch_and_heads(name, make, graph_kwargs, heads):
    q, k, v = qkv(2, heads)
    block_mask = make().to_block_mask(N, block=64, device=q.device, **graph_kwargs)
    mask = make().graph(N, **graph_kwargs).to(q.device).to_dense()
    torch.testing.assert_close(
        eager_flex(q, k, v, block_mask), sdpa(q, k, v, mask), atol=2e-6, rtol=2e-6
    )


@pytest.mark.parametrize("name", sorted(STATIC))
@pytest.mark.parametrize("causal", [False, True], ids=["", "causal"])
def test_allows_is_a_mask_mod_for_every_named_pattern(name, causal, device):
    pattern = fresh(name).causal() if causal else fresh(name)

    def mask_mod(b, h, q_idx, kv_idx):
        return pattern.allows(q_idx, kv_idx, N)

    # the first use of a random pattern is inside create_block_mask's vmap: it must draw
    # the same seeded table as an independent instance drawing outside
    block_mask = create_block_mask(mask_mod, None, None, N, N, device=device, BLOCK_SIZE=64)
    reference = fresh(name).causal() if causal else fresh(name)
    want = reference.graph(N).to(device).to_dense()
    assert torch.equal(create_mask(mask_mod, 1, 1, N, N, device=device)[0, 0], want)
    q, k, v = qkv(2, 2)
    torch.testing.assert_close(
        eager_flex(q, k, v, block_mask), sdpa(q, k, v, want), atol=2e-6, rtol=2e-6
    )


@pytest.mark.parametrize("name", ["random", "random_blocks", "bigbird"])
def test_random_allows_is_deterministic_and_its_cache_bounded(name):
    pattern = fresh(name)
    i = torch.arange(N)
    first = pattern.allows(i[:, None], i[None, :], N)
    torch.manual_seed(123)  # the global RNG plays no part
    assert torch.equal(pattern.allows(i[:, None], i[None, :], N), first)
    assert torch.equal(first, fresh(name).graph(N).to(i.device).to_dense())
    draws = MEMO_SIZES["draws"]
    for n in range(1, 3 * draws):
        pattern.allows(i[:, None], i[None, :], n)
    parts = getattr(pattern, "parts", (pattern,))  # bigbird is a union
    for part in parts:
        assert len(part.memo("draws")) <= draws


@pytest.mark.slow
def test_compiled_flex_broadcasts():
    """The issue's case: compiled flex_attention with heads > 1 and batch > 1."""
    compiled = torch.compile(flex_attention)
    n = 256
    for pattern, kwargs, heads in [
        (sa.window(16), {}, 2),
        (sa.bigbird(16, 2, 1, 16).causal(), {}, 3),
        (sa.split_heads(sa.window(8), sa.strided(9)), {"num_heads": 3}, 3),
    ]:
        q, k, v = qkv(2, heads, n, 64)
        out = compiled(q, k, v, block_mask=pattern.to_block_mask(n, device=q.device, **kwargs))
        torch.testing.assert_close(
            out, sdpa(q, k, v, pattern.graph(n, **kwargs).to_dense()), atol=2e-6, rtol=2e-6
        )


@pytest.mark.parametrize("name", sorted(STATIC))
@pytest.mark.parametrize("causal", [False, True], ids=["", "causal"])
def test_element_wise_mask_mod_equals_the_graph(name, causal):
    """``Pattern.mask_mod`` (what the flex engine compiles instead of a table look-up) is the
    graph's edge set, at lengths that cut blocks unevenly and for queries at an offset."""
    pattern = fresh(name).causal() if causal else fresh(name)
    lengths = [(37, None), (64, None)] + ([(50, 7), (50, 1)] if pattern.is_causal else [])
    for n, n_q in lengths:
        graph = fresh(name).causal().graph(n, n_q) if causal else fresh(name).graph(n, n_q)
        mask_mod = pattern.mask_mod(n, n_q)
        if mask_mod is None:  # random tables: the engine looks the block layout up instead
            assert "random" in name or "bigbird" in name, name
            return
        q_idx = torch.arange(n_q or n, dtype=torch.int32)[:, None]
        kv_idx = torch.arange(n, dtype=torch.int32)[None, :]
        assert torch.equal(mask_mod(0, 0, q_idx, kv_idx), graph.to_dense().to(q_idx.device)), (
            n,
            n_q,
        )


def test_flex_engine_compiles_a_bounded_number_of_kernels_over_a_stream_of_lengths(monkeypatch):
    """A model sees one length after another: the flex engine compiles a length-generic
    kernel (at most twice: torch specialises a block count of 2), whatever lengths and window
    sizes follow — every constant of the mask_mod is a tensor, not an int compiled in. Off the
    CPU the first STATIC_SHAPES shapes get a kernel each first (one here)."""
    from sparseattn.engines import flex

    if flex.flex_available() is not None:
        pytest.skip(flex.flex_available())
    from torch._dynamo.utils import counters

    monkeypatch.setattr(flex, "STATIC_SHAPES", 1)
    torch._dynamo.reset()
    flex.forget_shapes()
    before = counters["stats"]["unique_graphs"]
    for n, w in [(130, 16), (300, 8), (420, 16), (515, 4), (700, 32)]:
        q, k, v = qkv(1, 2, n)
        with torch.no_grad():
            out = sa.sparse_attention(q, k, v, sa.window(w), engine="flex")
        want = sdpa(q, k, v, sa.window(w).graph(n).to_dense())
        torch.testing.assert_close(out, want, atol=2e-6, rtol=2e-6)
    static = 0 if q.device.type == "cpu" else flex.STATIC_SHAPES
    assert counters["stats"]["unique_graphs"] - before <= 2 + static


def test_flex_engine_specialises_a_bounded_number_of_shapes_on_a_gpu():
    """Off the CPU, element-wise masks get a kernel per shape for the first STATIC_SHAPES
    shapes (the fastest kernel), then the length-generic one for every new shape, while the
    shapes already seen keep theirs; table look-ups always compile per shape; the CPU keeps
    torch's default. (Meta tensors stand in for a GPU's: only device, shape and strides are
    read.)"""
    from sparseattn.engines import flex

    def shapes(n, device="meta"):
        return [torch.empty(1, 2, n, 8, device=device) for _ in range(3)]

    flex.forget_shapes()
    try:
        first = [flex._dynamic(*shapes(n), True) for n in range(1, flex.STATIC_SHAPES + 1)]
        assert first == [False] * flex.STATIC_SHAPES
        assert flex._dynamic(*shapes(flex.STATIC_SHAPES + 1), True) is True
        assert flex._dynamic(*shapes(1), True) is False  # seen: keeps its kernel
        q, k, v = shapes(3)  # seen, but other strides: a new shape
        assert flex._dynamic(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, True) is True
        assert flex._dynamic(*shapes(999), False) is False  # a table: per shape
        assert flex._dynamic(*shapes(999, "cpu"), True) is None
    finally:
        flex.forget_shapes()


def test_flex_engine_shape_budget_holds_under_threads():
    """Threads that call the engine at once share the STATIC_SHAPES budget: no more than that
    many shapes get a specialised kernel however the calls interleave."""
    from concurrent.futures import ThreadPoolExecutor

    from sparseattn.engines import flex

    def ask(n):
        qkv = [torch.empty(1, 2, n, 8, device="meta") for _ in range(3)]
        return flex._dynamic(*qkv, True)

    flex.forget_shapes()
    try:
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, range(1, 4 * flex.STATIC_SHAPES + 1)))
        assert answers.count(False) == flex.STATIC_SHAPES
    finally:
        flex.forget_shapes()


def test_flex_engine_reads_grouped_key_value_heads_itself():
    """Grouped-query attention on the flex engine: k, v with fewer heads go to FlexAttention
    as they are (its enable_gqa), against the dense reference on repeated k and v."""
    from sparseattn.engines.flex import flex_available

    if flex_available() is not None:
        pytest.skip(flex_available())
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, N, 16, generator=gen)
    k, v = torch.randn(2, 2, 2, N, 16, generator=gen).unbind(0)
    pattern = sa.longformer(16, 2)
    with torch.no_grad():
        out = sa.sparse_attention(q, k, v, pattern, engine="flex", enable_gqa=True)
    want = sdpa(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), pattern.graph(N).to_dense()
    )
    torch.testing.assert_close(out, want, atol=2e-6, rtol=2e-6)
