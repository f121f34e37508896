"""sa.bigbird_blocks: BigBird's block layout against Hugging Face transformers' own code.

References, independent of the pattern: (1) HF's ``BigBirdBlockSparseAttention`` run forward
(and a tiny ``BigBirdModel``), the keys that get weight; (2) HF's draw routines called as its
forward calls them, turned into a dense mask by a loop over blocks written here.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import sparseattn as sa
from sparseattn.patterns.bigbird_blocks import BigBirdBlocks, bigbird_rand_attn

transformers = pytest.importorskip("transformers")
from transformers.models.big_bird import modeling_big_bird as hf  # noqa: E402


@pytest.fixture(autouse=True)
def _keep_numpy_state():
    """HF seeds the global np.random state; leave it as the test found it."""
    state = np.random.get_state()
    yield
    np.random.set_state(state)


def hf_module(b, r, heads, seed, training=True, max_seqlen=4096):
    config = transformers.BigBirdConfig(
        hidden_size=4 * heads,
        num_attention_heads=heads,
        block_size=b,
        num_random_blocks=r,
        max_position_embeddings=max_seqlen,
        attention_type="block_sparse",
    )
    return hf.BigBirdBlockSparseAttention(config, seed).train(training)


def hf_forward(n, b, r, heads, seed, training=True, max_seqlen=4096, d=4):
    """(q, k, v, HF's output (1, H, n, d), HF's attention probabilities (H, n, n))."""
    module = hf_module(b, r, heads, seed, training, max_seqlen)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, heads, n, d, generator=gen) for _ in range(3))
    blocked, band, from_mask, to_mask = hf.BigBirdModel.create_masks_for_block_sparse_attn(
        torch.ones(1, n), b
    )
    out, probs = module.bigbird_block_sparse_attention(
        q, k, v, band, from_mask, to_mask, blocked, blocked, heads, r, d, b, b, 1, n, n,
        seed=seed, plan_from_length=None, plan_num_rand_blocks=None,
    )  # fmt: skip
    return q, k, v, out.transpose(1, 2), probs[0]


def hf_rand_attn(n, b, r, heads, seed, training=True, max_seqlen=4096):
    """HF's rand_attn (H, n/b - 2, r), by HF's methods, dispatched as its forward does."""
    module = hf_module(b, r, heads, seed, training, max_seqlen)
    nb = n // b
    np.random.seed(seed)
    if n in (1024, 3072, 4096):
        draws = [
            module._bigbird_block_rand_mask(max_seqlen, max_seqlen, b, b, r, last_idx=1024)[
                : nb - 2
            ]
            for _ in range(heads)
        ]
    else:
        plan, plan_r = module._get_rand_attn_plan(n, b, r)
        draws = module._bigbird_block_rand_mask_with_head(n, n, b, b, heads, plan, plan_r)
    return np.stack(draws)


def reference_mask(rand_attn, b):
    """Dense (H, n, n) bool mask of HF's block layout for a rand_attn (H, nb - 2, r)."""
    heads, rows, _ = rand_attn.shape
    nb = rows + 2
    layout = torch.zeros(heads, nb, nb, dtype=torch.bool)
    for h in range(heads):
        layout[h, 0, :] = layout[h, nb - 1, :] = True
        for i in range(1, nb - 1):
            for j in [i - 1, i, i + 1, 0, nb - 1, *rand_attn[h, i - 1].tolist()]:
                layout[h, i, j] = True
    return layout.repeat_interleave(b, 1).repeat_interleave(b, 2)


def dense(pattern, n):
    mask = pattern.graph(n).to_dense()
    return mask if mask.dim() == 3 else mask[None]


# ---------------------------------------------------------------- against HF's forward
CASES = [  # n, block, r, heads, seed, training, max_seqlen
    (256, 16, 3, 2, 0, True, 4096),
    (256, 16, 3, 2, 3, False, 4096),
    (512, 32, 2, 3, 7, True, 4096),
    (448, 16, 1, 2, 4, True, 4096),
    (1024, 16, 3, 2, 1, True, 4096),  # HF's older draw (n in 1024, 3072, 4096)
    (1024, 16, 3, 2, 1, True, 1024),
    (1024, 16, 3, 2, 1, False, 4096),
    (3072, 64, 3, 2, 2, True, 4096),
    (96, 16, 3, 2, 0, True, 4096),  # short: BigBirdModel would use full attention here
    (128, 16, 3, 3, 5, True, 4096),
]


@pytest.mark.parametrize(("n", "b", "r", "heads", "seed", "training", "max_seqlen"), CASES)
def test_graph_is_the_set_of_keys_hf_weights(n, b, r, heads, seed, training, max_seqlen):
    *_, probs = hf_forward(n, b, r, heads, seed, training, max_seqlen)
    pattern = sa.bigbird_blocks(b, r, heads, seed, training=training, max_seqlen=max_seqlen)
    graph = pattern.graph(n)
    assert graph.batch_shape == (heads,)
    assert torch.equal(graph.to_dense(), probs > 0)


def test_a_tiny_bigbird_model_layer_by_layer():
    """Layer l of BigBirdModel draws with seed l: heads=H, seed=l is that layer's layout."""
    n, b, r, heads, layers = 256, 16, 2, 2, 3
    config = transformers.BigBirdConfig(
        vocab_size=32, hidden_size=8, num_attention_heads=heads, num_hidden_layers=layers,
        intermediate_size=16, block_size=b, num_random_blocks=r, max_position_embeddings=512,
        attention_type="block_sparse", pad_token_id=0, bos_token_id=1, eos_token_id=2,
        sep_token_id=3,
    )  # fmt: skip
    torch.manual_seed(0)
    model = hf.BigBirdModel(config)
    ids = torch.randint(4, 32, (1, n))
    for training in (True, False):
        model.train(training)
        attentions = model(ids, output_attentions=True).attentions
        for layer, probs in enumerate(attentions):
            pattern = sa.bigbird_blocks(b, r, heads=heads, seed=layer, training=training)
            assert torch.equal(pattern.graph(n).to_dense(), probs[0] > 0), (training, layer)


def test_edge_counts_at_256_block_16_three_random_blocks():
    n, b, r = 256, 16, 3
    nb = n // b
    per_head = (2 * nb + 2 * (4 + r) + (nb - 4) * (5 + r)) * b * b  # no draw repeats a block
    assert per_head == 36_352
    for heads in (None, 4):
        graph = sa.bigbird_blocks(b, r, heads).graph(n)
        assert (torch.as_tensor(graph.num_edges) == per_head).all()
    evaluated = sa.bigbird_blocks(b, r, training=False).graph(n)  # band ∪ globals
    assert evaluated.num_edges == (2 * nb + 2 * 4 + (nb - 4) * 5) * b * b == 25_600
    *_, probs = hf_forward(n, b, r, 2, 0, training=False)
    assert int((probs > 0).sum()) == 2 * 25_600
    rows = probs.sum(-1)  # HF's eval probabilities keep one of block 0's r + 1 copies
    assert (rows[:, b : n - b] < 0.999).all() and torch.allclose(rows[:, :b], torch.ones(1))


def test_training_outputs_equal_hf_and_eval_outputs_need_the_multiplicity():
    n, b, r, heads = 256, 16, 3, 2
    q, k, v, out, _ = hf_forward(n, b, r, heads, seed=0)
    ours = sa.sparse_attention(q, k, v, sa.bigbird_blocks(b, r, heads, seed=0))
    torch.testing.assert_close(ours, out, rtol=1e-4, atol=1e-5)

    q, k, v, out, _ = hf_forward(n, b, r, heads, seed=0, training=False)
    pattern = sa.bigbird_blocks(b, r, heads, training=False)
    plain = sa.sparse_attention(q, k, v, pattern)
    assert not torch.allclose(plain, out, atol=1e-3)  # HF counts block 0 r + 1 times

    def repeat_block_0(score, batch, head, q_idx, kv_idx):  # multiplicity r + 1 in rows 1..nb-2
        middle = (q_idx >= b) & (q_idx < n - b) & (kv_idx < b)
        return score + middle * math.log(r + 1)

    weighted = sa.sparse_attention(q, k, v, pattern, score_mod=repeat_block_0)
    torch.testing.assert_close(weighted, out, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- against HF's draw routines
@pytest.mark.parametrize(
    ("n", "b", "r", "heads", "max_seqlen"),
    [(256, 16, 3, 1, 4096), (256, 16, 3, 4, 4096), (640, 32, 4, 2, 4096), (96, 16, 3, 2, 4096),
     (1024, 16, 3, 2, 4096), (1024, 64, 3, 3, 1024), (4096, 64, 3, 2, 4096)],
)  # fmt: skip
def test_the_draw_is_hfs_own_and_leaves_numpy_alone(n, b, r, heads, max_seqlen):
    for seed in (0, 11):
        expected = hf_rand_attn(n, b, r, heads, seed, max_seqlen=max_seqlen)
        state = np.random.get_state()
        drawn = bigbird_rand_attn(n, b, r, heads, seed, max_seqlen=max_seqlen)
        after = np.random.get_state()
        assert after[0] == state[0] and np.array_equal(after[1], state[1]) and after[2] == state[2]
        assert drawn.dtype == torch.long and drawn.shape == (heads, n // b - 2, r)
        assert np.array_equal(drawn.numpy(), expected)
    evaluated = bigbird_rand_attn(n, b, r, heads, training=False, max_seqlen=max_seqlen)
    assert np.array_equal(evaluated.numpy(), hf_rand_attn(n, b, r, heads, 0, False, max_seqlen))


def test_rand_attn_takes_hfs_draw_as_it_is():
    n, b, r, heads = 512, 32, 2, 3
    table = hf_rand_attn(n, b, r, heads, seed=9)
    for given in (table, torch.from_numpy(table), list(table)):
        pattern = sa.bigbird_blocks(b, r, rand_attn=given)
        assert pattern.heads == heads
        assert torch.equal(dense(pattern, n), reference_mask(torch.as_tensor(table), b))
    shared = sa.bigbird_blocks(b, r, rand_attn=table[1])  # (nb - 2, r): one draw, every head
    assert shared.graph(n).batch_shape == ()
    assert torch.equal(dense(shared, n)[0], reference_mask(torch.as_tensor(table[1:2]), b)[0])
    with pytest.raises(ValueError, match="covers n = 512"):
        sa.bigbird_blocks(b, r, rand_attn=table).graph(2 * n)


def test_at_1024_hfs_draw_can_hit_the_band_and_the_last_global_block():
    n, b, r, nb = 1024, 16, 3, 64
    hits = 0
    for seed in range(6):
        table = torch.from_numpy(hf_rand_attn(n, b, r, 2, seed).astype(np.int64))
        rows = torch.arange(1, nb - 1)[None, :, None]
        hits += int(((table - rows).abs() <= 1).sum() + (table == nb - 1).sum())
        pattern = sa.bigbird_blocks(b, r, 2, seed)  # the set union of HF's slots
        assert torch.equal(dense(pattern, n), reference_mask(table, b))
        assert torch.equal(pattern.block_table(n), table)
    assert hits > 0  # HF then counts those keys twice; the graph holds each edge once


# ---------------------------------------------------------------- the pattern's own contract
def test_shared_and_per_head_draws():
    n, b, r = 320, 16, 3
    shared = sa.bigbird_blocks(b, r, seed=4)
    assert shared.graph(n).batch_shape == () and shared.shared
    expected = torch.from_numpy(hf_rand_attn(n, b, r, 1, 4).astype(np.int64))
    assert torch.equal(shared.graph(n).to_dense(), reference_mask(expected, b)[0])
    per_head = sa.bigbird_blocks(b, r, heads=4, seed=4)
    masks = per_head.graph(n).to_dense()
    assert masks.shape == (4, n, n) and not per_head.shared
    assert any(not torch.equal(masks[0], masks[h]) for h in range(1, 4))


def test_same_seed_same_graph_and_other_seeds_differ():
    n, b, r = 384, 16, 3
    a, again = sa.bigbird_blocks(b, r, 2, seed=7), sa.bigbird_blocks(b, r, 2, seed=7)
    assert a == again and hash(a) == hash(again) and a is not again
    assert torch.equal(a.graph(n).to_dense(), again.graph(n).to_dense())
    assert a.graph(n) is a.graph(n)  # cached per n
    other = sa.bigbird_blocks(b, r, 2, seed=8)
    assert other != a and not torch.equal(other.graph(n).to_dense(), a.graph(n).to_dense())
    evaluated = [
        sa.bigbird_blocks(b, r, seed=s, training=False).graph(n).to_dense() for s in (0, 5)
    ]
    assert torch.equal(*evaluated)  # eval: no randomness


def test_allows_agrees_with_the_graph():
    n, b, r = 256, 16, 3
    i = torch.arange(n)
    shared = sa.bigbird_blocks(b, r, seed=2)
    assert torch.equal(shared.allows(i[:, None], i[None, :], n), shared.graph(n).to_dense())
    per_head = sa.bigbird_blocks(b, r, heads=3, seed=2)
    heads = torch.arange(3)[:, None, None]
    assert torch.equal(
        per_head.allows_head(heads, i[:, None], i[None, :], n), per_head.graph(n).to_dense()
    )
    with pytest.raises(TypeError, match="allows_head"):
        per_head.allows(i[:, None], i[None, :], n)


def test_long_sequences_build_from_the_block_table():
    n, b, r, heads = 16384, 64, 3, 2
    nb = n // b
    graph = sa.bigbird_blocks(b, r, heads).graph(n)
    expected = (2 * nb + 2 * (4 + r) + (nb - 4) * (5 + r)) * b * b
    assert (graph.num_edges == expected).all()
    assert (graph.degrees[:, b : n - b] <= (5 + r) * b).all()


def test_per_head_graphs_run_through_sparse_attention_and_check_heads():
    n, b, r = 128, 16, 1
    pattern = sa.bigbird_blocks(b, r, heads=2, seed=1)
    q, k, v = (torch.randn(1, 2, n, 8) for _ in range(3))
    mask = pattern.graph(n).to_dense()
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(sa.sparse_attention(q, k, v, pattern), expected)
    with pytest.raises(ValueError, match="heads=2"):
        x = torch.randn(1, 3, n, 8)
        sa.sparse_attention(x, x, x, pattern)


def test_short_lengths_follow_hf_which_raises_where_its_draw_fails():
    b, r = 16, 3
    for nb in range(2, 14):
        n = nb * b
        try:
            hf_forward(n, b, r, 2, 0)
            hf_ok = True
        except (ValueError, RuntimeError):
            hf_ok = False
        pattern = sa.bigbird_blocks(b, r, 2, 0)
        if hf_ok:
            *_, probs = hf_forward(n, b, r, 2, 0)
            assert torch.equal(pattern.graph(n).to_dense(), probs > 0), nb
        else:
            with pytest.raises(ValueError, match="too few legal key blocks|at least 4 blocks"):
                pattern.graph(n)
        evaluated = sa.bigbird_blocks(b, r, 2, training=False)
        if nb >= 4:
            *_, probs = hf_forward(n, b, r, 2, 0, training=False)
            assert torch.equal(evaluated.graph(n).to_dense(), probs > 0), nb
        else:
            with pytest.raises(ValueError, match="at least 4 blocks"):
                evaluated.graph(n)


def test_the_block_band_is_no_token_window():
    """The motivation: sa.window(32) (±16) is not BigBird's band of three blocks of 16."""
    n, b = 256, 16
    band = sa.bigbird_blocks(b, 1, training=False).graph(n).to_dense()[2 * b : n - 2 * b]
    band = band[:, b : n - b]  # middle query rows, non-global keys: the band alone
    window = sa.window(32).graph(n).to_dense()[2 * b : n - 2 * b, b : n - b]
    assert not torch.equal(window, band)
    assert (band | window).equal(band) and band.sum() > window.sum()  # band ⊋ window(32)
    assert band.sum(-1).unique().tolist() == [3 * b]  # 48 keys per query, window(32) has 33
    for w in range(1, 6 * b):
        assert not torch.equal(sa.window(w).graph(n).to_dense()[2 * b : n - 2 * b, b : n - b], band)


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="block"):
        sa.bigbird_blocks(0, 3)
    with pytest.raises(ValueError, match="random_blocks"):
        sa.bigbird_blocks(16, 0)
    with pytest.raises(TypeError, match="random_blocks"):
        sa.bigbird_blocks(16, 2.5)
    with pytest.raises(ValueError, match="heads"):
        sa.bigbird_blocks(16, 3, heads=0)
    for seed in (-1, 2**32):
        with pytest.raises(ValueError, match="seed"):
            sa.bigbird_blocks(16, 3, seed=seed)
    with pytest.raises(TypeError, match="training"):
        sa.bigbird_blocks(16, 3, training=1)
    with pytest.raises(ValueError, match="multiple of block=16"):
        sa.bigbird_blocks(16, 3).graph(250)
    with pytest.raises(ValueError, match="max_seqlen"):
        sa.bigbird_blocks(16, 3, max_seqlen=512).graph(1024)
    table = torch.zeros(2, 14, 3, dtype=torch.long)
    with pytest.raises(TypeError, match="rand_attn"):
        sa.bigbird_blocks(16, 3, rand_attn=table.float())
    with pytest.raises(ValueError, match="rand_attn"):
        sa.bigbird_blocks(16, 2, rand_attn=table)
    with pytest.raises(ValueError, match="rand_attn"):
        sa.bigbird_blocks(16, 3, rand_attn=table + 16)
    with pytest.raises(ValueError, match="rand_attn"):
        sa.bigbird_blocks(16, 3, rand_attn=table[0, 0])
    with pytest.raises(ValueError, match="heads=3"):
        sa.bigbird_blocks(16, 3, heads=3, rand_attn=table)
    with pytest.raises(ValueError, match="seed"):
        sa.bigbird_blocks(16, 3, seed=1, rand_attn=table)


def test_repr_and_export():
    assert repr(sa.bigbird_blocks(16, 3)) == (
        "bigbird_blocks(block=16, random_blocks=3, heads=None, seed=0)"
    )
    table = torch.zeros(2, 14, 3, dtype=torch.long)
    assert "rand_attn=(2, 14, 3)" in repr(sa.bigbird_blocks(16, 3, rand_attn=table))
    assert "training=False" in repr(sa.bigbird_blocks(16, 3, training=False))
    assert isinstance(sa.bigbird_blocks(16, 3), BigBirdBlocks) and "bigbird_blocks" in sa.__all__
    assert sa.bigbird(4, 1, 1, 4).graph(32).num_edges > 0  # the token-level one stays
