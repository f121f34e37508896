"""Hugging Face decoders and other AttentionInterface models under hf.sparsify (issue 15, 3).

Tiny random models built from configs (nothing downloaded). References are independent of
sparseattn's kernel: the unmodified model (its own SDPA kernel), and a hand-written kernel
registered with transformers that applies a brute-force mask (written out per (i, j) from the
pattern's definition) with torch SDPA, run on the whole prefix without a cache.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
import torch.nn.functional as F
import transformers
from tiny_models import LLAMA
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

from sparseattn import (
    causal_strided,
    dense,
    hf,
    sliding_window,
    sparse_attention,
    split_heads,
    window,
)

pytestmark = pytest.mark.device

TOL = 1e-5
IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
LLAMA_LIKE = {**LLAMA, **IDS}  # grouped-query attention: 2 query heads per key/value head
DECODERS = ["llama", "qwen2", "qwen3", "mistral", "gpt2", "gpt_neox"]


def _config(kind: str, **overrides):
    if kind == "gpt2":
        kw = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=100, n_positions=128, **IDS)
        return transformers.GPT2Config(**{**kw, **overrides})
    if kind == "gpt_neox":
        kw = {k: v for k, v in LLAMA_LIKE.items() if k != "num_key_value_heads"}
        return transformers.GPTNeoXConfig(**{**kw, **overrides})
    configs = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mistral": transformers.MistralConfig,
    }
    extra = {"head_dim": 16} if kind == "qwen3" else {}
    return configs[kind](**{**LLAMA_LIKE, **extra, **overrides})


DEVICE = torch.device("cpu")  # the run's device (--device), set for each test below


@pytest.fixture(autouse=True)
def _run_device(device):
    global DEVICE
    DEVICE = device


def _decoder(kind: str, **overrides):
    torch.manual_seed(0)
    config = _config(kind, **overrides)
    return transformers.AutoModelForCausalLM.from_config(config).eval().to(DEVICE)


def _prompt(lengths=(10, 6), seed: int = 1):
    """Left-padded prompts (generation's padding side): input_ids, attention_mask."""
    gen = torch.Generator().manual_seed(seed)
    n = max(lengths)
    ids = torch.randint(3, 100, (len(lengths), n), generator=gen)
    mask = (torch.arange(n) >= n - torch.tensor(lengths)[:, None]).long()
    return ids.masked_fill(mask == 0, 0), mask


def _positions(mask):
    """Position ids as generate() makes them for left padding (first real token at 0)."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def _logits(model, ids, mask):
    return model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)).logits


@torch.no_grad()
def _generate(model, ids, mask, steps: int):
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=steps,
        min_new_tokens=steps,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences, torch.stack(out.logits, 1)  # (B, n + steps), (B, steps, vocab)


def _register_reference(name: str, allowed_fn, per_head: bool = False) -> str:
    """A kernel applying ``allowed_fn(i, j, first_real) -> bool`` (``per_head``:
    ``allowed_fn(h, i, j, first_real)``) over positions (brute force, one (i, j) at a time) ∩
    the model's own mask, with torch SDPA (GQA by ``enable_gqa``). Padding queries (no allowed
    key) attend to themselves; their outputs are never compared."""

    def kernel(module, q, k, v, attention_mask, scaling=None, dropout=0.0, **kwargs):
        bsz, _, n_q, _ = q.shape
        n_k = k.shape[-2]
        own = torch.ones(bsz, 1, n_q, n_k, dtype=torch.bool)
        if attention_mask is not None:
            own = attention_mask.expand(bsz, 1, n_q, n_k).clone()
        elif getattr(module, "is_causal", False):
            own = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q).expand(bsz, 1, -1, -1)
        heads = q.shape[1] if per_head else 1
        allowed = torch.zeros(bsz, heads, n_q, n_k, dtype=torch.bool)
        for b, h in itertools.product(range(bsz), range(heads)):
            real = own[b, 0].any(0)
            first = int(real.nonzero()[0]) if real.any() else n_k
            rule = functools.partial(allowed_fn, h) if per_head else allowed_fn
            for i in range(n_q):
                pos = n_k - n_q + i
                for j in range(n_k):
                    allowed[b, h, i, j] = bool(own[b, 0, i, j]) and rule(pos, j, first)
                if not allowed[b, h, i].any():
                    allowed[b, h, i, pos] = True
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(name, kernel)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def _sliding_rule(w: int, sinks: int):
    """sliding_window(w, sinks) written out: j ≤ i and (i − j < w, or j a sink), with positions
    counted from the first real token."""
    return lambda i, j, first: j <= i and (i - j < w or j - first < sinks or i - first < sinks)


# --------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("kind", DECODERS)
def test_dense_softmax_equals_original_logits_and_generation(kind):
    model = _decoder(kind)
    ids, mask = _prompt()
    real = mask.bool()
    expected_logits = _logits(model, ids, mask)
    expected_tokens, _ = _generate(model, ids, mask, 5)
    hf.sparsify(model, dense(), "softmax")
    got_logits = _logits(model, ids, mask)
    causal_dense = hf.layer_specs(model)[0].causal_pattern
    assert not len(causal_dense.memo("graphs"))  # the prefill built no n × n graph
    got_tokens, _ = _generate(model, ids, mask, 5)
    assert float((got_logits - expected_logits)[real].abs().max()) < TOL
    assert torch.equal(got_tokens, expected_tokens)
    assert hf.attention_sparsity(model) == {0: 0.0, 1: 0.0}
    hf.restore(model)
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(_logits(model, ids, mask), expected_logits)


def test_dense_softmax_equals_original_modernbert_with_local_layers():
    config = transformers.ModernBertConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        vocab_size=100,
        global_attn_every_n_layers=2,  # layer 1 is local: |i − j| <= 4
        local_attention=8,
        cls_token_id=1,
        sep_token_id=2,
        **IDS,
    )
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config).eval().to(DEVICE)
    ids, _ = _prompt((20, 13))
    mask = (torch.arange(20) < torch.tensor([20, 13])[:, None]).long()  # right padding
    real = mask.bool()
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).last_hidden_state
        hf.sparsify(model)
        got = model(input_ids=ids, attention_mask=mask).last_hidden_state
        assert float((got - expected)[real].abs().max()) < TOL
        # window(4) ∩ the local layer's band, against the brute-force kernel
        name = _register_reference("test_modernbert_window4", lambda i, j, _: abs(i - j) <= 2)
        hf.restore(model)
        model.set_attn_implementation(name)
        reference = model(input_ids=ids, attention_mask=mask).last_hidden_state
        model.set_attn_implementation("sdpa")
        hf.sparsify(model, window(4))
        got = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert float((got - reference)[real].abs().max()) < TOL
    assert float((got - expected)[real].abs().max()) > 1e-2  # the window changed the model


@pytest.mark.guard
# --------------------------------------------------------------------------- generation
@pytest.mark.parametrize(
    ("kind", "pattern", "rule"),
    [
        ("llama", sliding_window(3, sinks=2), _sliding_rule(3, 2)),
        ("qwen3", sliding_window(4, sinks=1), _sliding_rule(4, 1)),
        ("gpt2", sliding_window(3, sinks=1), _sliding_rule(3, 1)),
        # a non-causal pattern on a decoder is intersected with causality: Yun's window(4) keeps
        # keys i − 2 … i + 2, of which a decoder sees i − 2 … i
        ("gpt_neox", window(4), lambda i, j, _: i - 2 <= j <= i),
    ],
)
def test_sparse_generation_equals_full_recompute_at_every_step(kind, pattern, rule):
    model = _decoder(kind)
    ids, mask = _prompt()
    steps = 4
    hf.sparsify(model, pattern)
    tokens, step_logits = _generate(model, ids, mask, steps)
    model.set_attn_implementation(_register_reference(f"test_ref_{kind}", rule))
    for t in range(steps):
        n = ids.shape[1] + t
        prefix_mask = torch.cat([mask, torch.ones(len(ids), t, dtype=mask.dtype)], 1)
        full = _logits(model, tokens[:, :n], prefix_mask)[:, -1]  # no cache: the whole prefix
        assert float((step_logits[:, t] - full).abs().max()) < TOL, f"step {t}"


@pytest.mark.guard
def test_head_split_with_grouped_query_heads_equals_full_recompute():
    model = _decoder("llama")  # 4 query heads, 2 key/value heads: heads 0, 1 share one
    ids, mask = _prompt()
    steps = 3
    hf.sparsify(model, split_heads(sliding_window(2), sliding_window(4, sinks=1), sizes=(1, 3)))
    tokens, step_logits = _generate(model, ids, mask, steps)
    narrow, wide = _sliding_rule(2, 0), _sliding_rule(4, 1)
    rule = lambda h, i, j, first: (narrow if h == 0 else wide)(i, j, first)  # noqa: E731
    model.set_attn_implementation(_register_reference("test_ref_split", rule, per_head=True))
    for t in range(steps):
        n = ids.shape[1] + t
        prefix_mask = torch.cat([mask, torch.ones(len(ids), t, dtype=mask.dtype)], 1)
        full = _logits(model, tokens[:, :n], prefix_mask)[:, -1]
        assert float((step_logits[:, t] - full).abs().max()) < TOL, f"step {t}"


def test_left_padded_batch_generates_what_each_prompt_generates_alone():
    model = _decoder("llama")
    ids, mask = _prompt((10, 6, 3))
    hf.sparsify(model, sliding_window(3, sinks=2))
    tokens, _ = _generate(model, ids, mask, 6)
    for b, length in enumerate(mask.sum(-1).tolist()):
        alone = ids[b : b + 1, ids.shape[1] - length :]
        expected, _ = _generate(model, alone, torch.ones_like(alone), 6)
        assert torch.equal(tokens[b, ids.shape[1] - length :], expected[0])


def test_window_changes_a_decoder_and_its_sparsity_counts_causal_pairs():
    model = _decoder("qwen2")
    ids = torch.randint(3, 100, (1, 8))
    with torch.no_grad():
        original = model(input_ids=ids).logits
        hf.sparsify(model, sliding_window(2))
        got = model(input_ids=ids).logits
    assert float((got - original).abs().max()) > 1e-3
    # query i sees min(i + 1, 2) of its i + 1 causal keys: 15 edges of 36 pairs
    assert hf.attention_sparsity(model) == pytest.approx({0: 1 - 15 / 36, 1: 1 - 15 / 36})


def test_capture_on_a_decoder_sees_causal_rows_and_expanded_heads():
    model = _decoder("llama")
    ids, mask = _prompt()
    hf.sparsify(model, sliding_window(3))
    with hf.capture_attention(model, layers=[0]) as records, torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask))
    (record,) = records
    assert record.q.shape == record.k.shape == (2, 4, 10, 16)  # k expanded to 4 heads
    i, j = torch.arange(10)[:, None], torch.arange(10)[None, :]
    expected = (j <= i) & (i - j < 3) & mask.bool()[:, None, None, :]
    assert torch.equal(record.allowed.expand(2, 4, 10, 10), expected.expand(2, 4, 10, 10))


# --------------------------------------------------------------------------- errors
def test_model_sliding_window_and_static_cache_are_refused_with_a_reason():
    model = _decoder("mistral", sliding_window=6)
    ids = torch.randint(3, 100, (1, 5))
    hf.sparsify(model, sliding_window(3))
    with pytest.raises(ValueError, match="own sliding window.*config.sliding_window = None"):
        _generate(model, ids, torch.ones_like(ids), 4)  # the cache starts dropping keys
    model = _decoder("llama")
    hf.sparsify(model, sliding_window(3))
    with pytest.raises(ValueError, match="static cache"), torch.no_grad():
        model.generate(input_ids=ids, max_new_tokens=2, cache_implementation="static")


def test_context_methods_need_a_separate_value_projection_and_equal_heads():
    def method(q, k, v, pattern, context=None, **options):
        return sparse_attention(q, k, v, pattern, **options)

    with pytest.raises(ValueError, match="fused projection"):
        hf.sparsify(_decoder("gpt2"), method=method)
    model = hf.sparsify(_decoder("llama"), method=method)
    ids = torch.randint(3, 100, (1, 5))
    with pytest.raises(ValueError, match="2 key/value heads for 4 query heads"), torch.no_grad():
        model(input_ids=ids)


# --------------------------------------------------------------------------- evicting cache
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_window_cache_generates_the_full_cache_tokens_and_keeps_a_bounded_cache(kind):
    model = _decoder(kind)
    ids, mask = _prompt((10, 6, 8))  # left padding 4 and 2: kept in front with the sinks
    hf.sparsify(model, sliding_window(4, sinks=2))
    steps = 30
    full_tokens, full_logits = _generate(model, ids, mask, steps)
    cache = hf.window_cache(model, mask)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            cache=cache,
            do_sample=False,
            max_new_tokens=steps,
            min_new_tokens=steps,
            output_logits=True,
            return_dict_in_generate=True,
        )
    assert torch.equal(out.sequences, full_tokens)
    assert float((torch.stack(out.logits, 1) - full_logits).abs().max()) < TOL
    assert cache.get_seq_length() == ids.shape[1] + steps - 1  # positions count every token
    kept = 2 + 4 + (4 - 1)  # sinks + left padding in front, the last window − 1
    assert [layer.keys.shape[-2] for layer in cache.layers] == [kept, kept]


def test_evictable_extent_and_window_cache_errors():
    assert hf.evictable_extent(sliding_window(8, sinks=4)) == (4, 8)
    assert hf.evictable_extent(sliding_window(8, sinks=[0, 5])) == (6, 8)
    assert hf.evictable_extent(sliding_window(8)) == (0, 8)
    assert hf.evictable_extent(split_heads(sliding_window(8, 2), sliding_window(4))) == (2, 8)
    for pattern in (
        causal_strided(4),
        window(4).causal(),
        dense().causal(),
        sliding_window(8) | causal_strided(4),
    ):
        assert hf.evictable_extent(pattern) is None
    model = _decoder("llama")
    with pytest.raises(ValueError, match="layer 0 uses exact attention"):
        hf.window_cache(model)
    hf.sparsify(model, causal_strided(4), layers=[1])
    hf.sparsify(model, sliding_window(4), layers=[0])
    with pytest.raises(ValueError, match=r"layer 1 uses causal_strided"):
        hf.window_cache(model)
    hf.sparsify(model, sliding_window(8), layers=[1])
    with pytest.raises(ValueError, match="one \\(front, window\\)"):
        hf.window_cache(model)
    hf.sparsify(model, sliding_window(4))
    with pytest.raises(ValueError, match="cannot be cropped"):
        hf.window_cache(model).layers[0].crop(-1)
