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
from sparseattn.patterns.fixed import DRAWS_PER_PATTERN

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
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


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
    for n in range(1, 3 * DRAWS_PER_PATTERN):
        pattern.allows(i[:, None], i[None, :], n)
    parts = getattr(pattern, "parts", (pattern,))  # bigbird is a union
    for part in parts:
        assert len(part.__dict__.get("_drawn", {})) <= DRAWS_PER_PATTERN


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
        out = compiled(q, k, v, block_mask=pattern.to_block_mask(n, **kwargs))
        torch.testing.assert_close(
            out, sdpa(q, k, v, pattern.graph(n, **kwargs).to_dense()), atol=2e-6, rtol=2e-6
        )
