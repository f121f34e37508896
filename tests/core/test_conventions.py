"""PyTorch's names keep PyTorch's meanings (issue 27): ``key_padding_mask`` is True for keys to
ignore, as in ``nn.MultiheadAttention``; ``enable_gqa`` is SDPA's grouped-query flag; options
after ``pattern`` are keyword-only. And the bad inputs that used to get a raw error or a silent
answer get an error naming the argument.

References: ``nn.MultiheadAttention`` with shared weights, ``F.scaled_dot_product_attention``
(with its own ``enable_gqa``), the dense engine on k and v repeated per query head, and the
same layer on each item's unpadded prefix.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from grad_checks import assert_close_with_grads
from torch import nn

import sparseattn as sa
from sparseattn import AttentionGraph
from sparseattn.methods.mca import mca_attention


def raises_naming(name: str, fn, *args, **kwargs) -> str:
    with pytest.raises((TypeError, ValueError)) as info:
        fn(*args, **kwargs)
    assert name in str(info.value), f"{name!r} not named in: {info.value}"
    return str(info.value)


# ------------------------------------------------------------------ key_padding_mask
def _mha_pair(embed_dim=16, heads=4, pattern=None, engine="auto", seed=0):
    """nn.MultiheadAttention and a SparseAttention sharing its weights (float64)."""
    torch.manual_seed(seed)
    mha = nn.MultiheadAttention(embed_dim, heads, batch_first=True).double().eval()
    layer = sa.SparseAttention(embed_dim, heads, pattern=pattern, engine=engine).double().eval()
    with torch.no_grad():
        layer.qkv.weight.copy_(mha.in_proj_weight)  # rows: W_q; W_k; W_v, as SparseAttention
        layer.qkv.bias.copy_(mha.in_proj_bias)
        layer.out.weight.copy_(mha.out_proj.weight)
        layer.out.bias.copy_(mha.out_proj.bias)
    return mha, layer


LENGTHS = [10, 7, 3]


def _padded_batch(embed_dim=16):
    x = torch.randn(len(LENGTHS), max(LENGTHS), embed_dim, dtype=torch.float64)
    pad = torch.arange(max(LENGTHS)) >= torch.tensor(LENGTHS)[:, None]  # True = padding
    return x, pad


@pytest.mark.parametrize("engine", ["auto", "dense", "block", "gather", "rows"])
def test_swaps_in_for_multihead_attention_with_its_padding_mask(engine):
    """The user's nn.MultiheadAttention call, mask and all, gives the same output with
    SparseAttention(pattern=dense()) in its place: padded keys get no weight."""
    mha, layer = _mha_pair(engine=engine)
    x, pad = _padded_batch()
    with torch.no_grad():
        want, _ = mha(x, x, x, key_padding_mask=pad, need_weights=False)
        got = layer(x, key_padding_mask=pad)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("engine", ["dense", "block", "gather"])
def test_padded_keys_get_no_weight_under_a_sparse_pattern(engine):
    """With a window, each item's real tokens get what the item alone (its unpadded prefix)
    gets, and attention_weights puts exactly zero on every padded key."""
    _, layer = _mha_pair(pattern=sa.window(4), engine=engine)
    x, pad = _padded_batch()
    with torch.no_grad():
        out = layer(x, key_padding_mask=pad)
        for b, n in enumerate(LENGTHS):
            alone = layer(x[b : b + 1, :n])
            torch.testing.assert_close(out[b : b + 1, :n], alone, atol=1e-12, rtol=1e-10)
    q = torch.randn(len(LENGTHS), 2, max(LENGTHS), 4, dtype=torch.float64)
    weights = sa.attention_weights(q, q, sa.window(4), key_padding_mask=pad)
    assert torch.equal(weights * pad[:, None, None, :], torch.zeros_like(weights))
    sums = weights.sum(-1)[~pad[:, None, :].expand(-1, 2, -1)]  # rows of real queries
    torch.testing.assert_close(sums, torch.ones_like(sums))


def test_a_true_for_real_tokens_mask_is_refused_with_the_convention():
    """The old meaning (True = real token, a tokenizer's attention_mask) marks every key of an
    unpadded item as ignored: refused, with a message that says what True means."""
    _, layer = _mha_pair()
    x, pad = _padded_batch()
    message = raises_naming("key_padding_mask", layer, x, key_padding_mask=~pad)
    assert "True marks a key to ignore" in message and "batch item(s) [0]" in message
    q = torch.randn(3, 2, 10, 4)
    raises_naming(
        "key_padding_mask", sa.sparse_attention, q, q, q, sa.dense(), key_padding_mask=~pad
    )
    raises_naming("key_padding_mask", sa.attention_weights, q, q, sa.dense(), key_padding_mask=~pad)
    raises_naming(
        "key_padding_mask", sa.sparse_attention, q, q, q, sa.dense(), key_padding_mask=pad.long()
    )


def test_hf_hands_methods_the_pytorch_convention():
    """A method hook under hf.sparsify receives key_padding_mask True for padding tokens."""
    pytest.importorskip("transformers")
    from transformers import BertConfig, BertModel

    from sparseattn import hf

    config = BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16,
    )  # fmt: skip
    torch.manual_seed(0)
    model = BertModel(config).eval()
    ids = torch.randint(1, 50, (2, 9))
    attention_mask = (torch.arange(9) < torch.tensor([[9], [5]])).long()
    seen = []

    def method(q, k, v, pattern, **options):
        seen.append(options["key_padding_mask"])
        return sa.sparse_attention(q, k, v, pattern, **options)

    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=attention_mask).last_hidden_state
        hf.sparsify(model, sa.dense(), method=method)
        got = model(input_ids=ids, attention_mask=attention_mask).last_hidden_state
    assert torch.equal(seen[0], attention_mask == 0)
    real = attention_mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ enable_gqa
def _gqa_inputs(heads=6, kv_heads=2, n=12, d=4, d_v=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, n, d, generator=gen, dtype=torch.float64)
    k = torch.randn(2, kv_heads, n, d, generator=gen, dtype=torch.float64)
    v = torch.randn(2, kv_heads, n, d_v, generator=gen, dtype=torch.float64)
    return q, k, v


def _repeated(q, k, v):
    groups = q.shape[1] // k.shape[1]
    return k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)


PATTERNS = {
    "window": sa.window(4),
    "longformer": sa.longformer(4, 1),
    "split_heads": sa.split_heads(sa.strided(4, 1), sa.strided(4, 2), sa.window(2)),
    "causal_strided": sa.causal_strided(4),
    "topk": sa.topk(3),
    "dense": sa.dense(),
    "causal_dense": sa.dense().causal(),
}


@pytest.mark.parametrize("pattern_name", list(PATTERNS))
@pytest.mark.parametrize("prob_map", ["softmax", "entmax15"])
def test_gqa_equals_the_dense_engine_on_repeated_keys(pattern_name, prob_map):
    """Head h reads key/value head h // (heads / kv_heads), forward and backward, against the
    dense engine on k and v repeated per query head (as SDPA's enable_gqa defines it)."""
    pattern = PATTERNS[pattern_name]
    q, k, v = (t.requires_grad_() for t in _gqa_inputs())
    pad = torch.arange(12) >= torch.tensor([[12], [9]])
    out = sa.sparse_attention(
        q, k, v, pattern, prob_map=prob_map, key_padding_mask=pad, enable_gqa=True
    )
    kr, vr = _repeated(q, k, v)
    ref = sa.sparse_attention(
        q, kr, vr, pattern, prob_map=prob_map, engine="dense", key_padding_mask=pad
    )
    assert_close_with_grads(out, ref, (q, k, v), (1e-12, 1e-10), (1e-11, 1e-9))


@pytest.mark.parametrize("engine", ["dense", "block", "gather"])
def test_gqa_matches_sdpa_enable_gqa(engine):
    """The dense pattern as a graph, on each engine, against torch's own enable_gqa."""
    q, k, v = _gqa_inputs(heads=8, kv_heads=2)
    graph = sa.dense().graph(12)
    out = sa.sparse_attention(q, k, v, graph, engine=engine, enable_gqa=True)
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-10)
    out = sa.sparse_attention(q, k, v, sa.dense(), enable_gqa=True)  # graph-free path
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-10)


def test_gqa_stacks_query_heads_for_static_patterns(monkeypatch):
    """A static pattern (or a ready graph) does not repeat k and v: the query heads sharing a
    key/value head are stacked along the query axis; a data-dependent one repeats them."""
    from sparseattn import attention

    calls = []
    real = attention.group_queries
    monkeypatch.setattr(attention, "group_queries", lambda *a: calls.append(1) or real(*a))
    q, k, v = _gqa_inputs()
    for pattern in (sa.window(4), sa.window(4).graph(12), PATTERNS["split_heads"]):
        sa.sparse_attention(q, k, v, pattern, enable_gqa=True)
    assert len(calls) == 3
    sa.sparse_attention(q, k, v, sa.topk(3), enable_gqa=True)
    assert len(calls) == 3


def test_gqa_with_a_learned_alpha_per_query_head():
    q, k, v = _gqa_inputs()
    alpha = torch.linspace(1.2, 2.5, 6, dtype=torch.float64).view(6, 1, 1)
    out = sa.sparse_attention(q, k, v, sa.window(4), prob_map=sa.entmax(alpha), enable_gqa=True)
    kr, vr = _repeated(q, k, v)
    ref = sa.sparse_attention(q, kr, vr, sa.window(4), prob_map=sa.entmax(alpha), engine="dense")
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-8)


def test_gqa_shapes_are_checked():
    q, k, v = _gqa_inputs(heads=6, kv_heads=4)
    raises_naming("enable_gqa", sa.sparse_attention, q, k, v, sa.window(2), enable_gqa=True)
    q, k, v = _gqa_inputs(heads=6, kv_heads=2)
    message = raises_naming("heads", sa.sparse_attention, q, k, v, sa.window(2))
    assert "enable_gqa=True" in message
    raises_naming("enable_gqa", sa.sparse_attention, q, k, v, sa.window(2), enable_gqa=1)


# ------------------------------------------------------------------ keyword-only options
def test_options_after_pattern_are_keyword_only():
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(TypeError, match="positional"):
        sa.sparse_attention(q, q, q, sa.window(2), "softmax")
    with pytest.raises(TypeError, match="positional"):
        sa.attention_weights(q, q, sa.window(2), "softmax")


# ------------------------------------------------------------------ bad inputs (item 6)
def test_meta_tensors_are_refused_naming_the_argument():
    cpu = torch.randn(1, 2, 8, 4)
    meta = torch.empty(1, 2, 8, 4, device="meta")
    for name, args in (("q", (meta, cpu, cpu)), ("k", (cpu, meta, cpu)), ("v", (cpu, cpu, meta))):
        raises_naming(name, sa.sparse_attention, *args, sa.window(2))
    layer = sa.SparseAttention(8, 2, pattern=sa.window(2))
    raises_naming("x", layer, torch.empty(1, 8, 8, device="meta"))
    raises_naming("x", layer.to("meta"), torch.randn(1, 8, 8))  # parameters on meta
    x, w = torch.randn(1, 8, 5), torch.randn(2, 5, 3)
    raises_naming("x", mca_attention, x.to("meta"), cpu, cpu, w, None, 0.3, sa.dense())
    raises_naming("weight", mca_attention, x, cpu, cpu, w.to("meta"), None, 0.3, sa.dense())


def test_graph_and_pattern_arguments_of_the_wrong_kind():
    raises_naming("mask", AttentionGraph.from_dense, [[True, False], [True, True]])
    graph = sa.window(4).graph(16)
    raises_naming("block", graph.to_block_layout, 4.0)
    raises_naming("block", graph.to_block_layout, 0)
    assert graph.to_block_layout(4).shape == (4, 4)
    raises_naming("pattern", sa.SparseAttention, 8, 2, pattern=3)
    raises_naming("pattern", sa.SparseAttention, 8, 2, pattern="window")


@pytest.mark.parametrize("factory", [
    lambda seed: sa.random(2, seed=seed),
    lambda seed: sa.random_blocks(1, 4, seed=seed),
    lambda seed: sa.bigbird(4, 1, 1, 4, seed=seed),
    lambda seed: sa.causal_bigbird(4, 1, 1, 4, seed=seed),
])  # fmt: skip
def test_seeds_beyond_64_bits_are_refused(factory):
    message = raises_naming("seed", factory, 2**64)
    assert "2**64 - 1" in message
    raises_naming("seed", factory, -(2**63) - 1)
    for seed in (2**64 - 1, -(2**63), 2**63):  # every seed torch.Generator takes still works
        assert factory(seed).graph(32).num_edges > 0
    # a negative seed is the generator's seed modulo 2⁶⁴
    assert torch.equal(factory(-1).graph(32).to_dense(), factory(2**64 - 1).graph(32).to_dense())


def test_mca_with_every_key_padded_is_an_error():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 5, generator=gen)
    q = torch.randn(2, 2, 6, 4, generator=gen)
    w = torch.randn(2, 5, 3, generator=gen)
    pad = torch.ones(2, 6, dtype=torch.bool)
    raises_naming(
        "key_padding_mask", mca_attention, x, q, q, w, None, 0.3, sa.dense(), key_padding_mask=pad
    )
