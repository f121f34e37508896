"""Models that modify their attention scores, under hf.sparsify: Gemma 2 (logit soft-capping,
its own sliding layers, grouped-query attention) and T5 (relative position bias, encoder and
decoder, cross-attention left exact), and BART (cross-attention left exact).

Tiny random models built from configs (nothing downloaded). References: the unmodified model,
and a hand-written eager kernel registered with transformers that applies the model's
modifiers (soft-capping, the position bias) and a window written out per (i, j) ∩ the model's
own mask.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

import sparseattn as sa
from sparseattn import hf

TOL = 2e-5
DEVICE = torch.device("cpu")  # the run's device (--device), set for each test below


@pytest.fixture(autouse=True)
def _run_device(device):
    global DEVICE
    DEVICE = device


def _gemma2():
    torch.manual_seed(0)
    config = transformers.Gemma2Config(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=100,
        max_position_embeddings=128,
        sliding_window=12,  # layer 0 slides, layer 1 is global
        attn_logit_softcapping=2.0,  # small: the capping changes the scores here
        final_logit_softcapping=None,
        query_pre_attn_scalar=16,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return transformers.AutoModelForCausalLM.from_config(config).eval().to(DEVICE)


def _t5():
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=100,
        d_model=64,
        d_kv=16,
        d_ff=96,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=20,
        dropout_rate=0.0,  # gradients compared across engines
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return transformers.T5ForConditionalGeneration(config).eval().to(DEVICE)


def _bart():
    torch.manual_seed(0)
    config = transformers.BartConfig(
        vocab_size=100,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=96,
        decoder_ffn_dim=96,
        max_position_embeddings=128,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
    )
    return transformers.BartForConditionalGeneration(config).eval().to(DEVICE)


def _batch():
    """Two sequences of 30 tokens, the second with 6 padding tokens (right padding)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 100, (2, 30), generator=gen)
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[1, -6:] = 0
    return ids, mask


def _run(model, ids, mask, decoder_ids=None):
    with torch.no_grad():
        if decoder_ids is None:
            return model(input_ids=ids, attention_mask=mask).logits
        return model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits


def _register_reference(name: str, w: int, cross: set[int]) -> str:
    """Eager attention with the model's modifiers, over the keys j with |i − j| ≤ w/2
    (self-attention; decoders: and j ≤ i from the model's mask) ∩ the model's mask;
    the modules in ``cross`` (ids) keep every key the model's mask allows."""

    def kernel(
        module,
        q,
        k,
        v,
        attention_mask,
        scaling=None,
        dropout=0.0,
        softcap=None,
        position_bias=None,
        **kwargs,
    ):
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        s = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scaling is None else scaling)
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        if position_bias is not None:
            s = s + position_bias
        n_q, n_k = s.shape[-2:]
        allowed = torch.ones(n_q, n_k, dtype=torch.bool)
        if attention_mask is None and getattr(module, "is_causal", False):
            allowed = allowed.tril(n_k - n_q)  # the model's mask is left to is_causal
        if id(module) not in cross:
            for i in range(n_q):
                for j in range(n_k):
                    pos = n_k - n_q + i
                    allowed[i, j] &= -(-w // 2) >= pos - j >= -(w // 2)
        if attention_mask is not None:
            allowed = allowed & attention_mask
        s = s.masked_fill(~allowed, float("-inf"))
        p = torch.softmax(s, -1).nan_to_num(0.0)
        return (p @ v).transpose(1, 2).contiguous(), None

    AttentionInterface.register(name, kernel)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def _cross_ids(model) -> set[int]:
    names = ("EncDecAttention", "encoder_attn")
    return {id(m) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in names}


def _real(mask: torch.Tensor) -> torch.Tensor:
    return mask.bool()


def test_gemma2_dense_equals_original_and_window_equals_reference():
    model = _gemma2()
    original = model.config._attn_implementation
    ids, mask = _batch()
    expected = _run(model, ids, mask)
    hf.sparsify(model, sa.dense())
    got = _run(model, ids, mask)
    assert float((got - expected)[_real(mask)].abs().max()) < TOL
    hf.restore(model)

    # window(8) in a decoder: its causal part, |i − j| ≤ 4 with j ≤ i (∩ layer 0's slide)
    model.set_attn_implementation(_register_reference("ref_gemma2", 8, set()))
    want = _run(model, ids, mask)
    model.set_attn_implementation(original)
    hf.sparsify(model, sa.window(8))
    got = _run(model, ids, mask)
    assert float((got - want)[_real(mask)].abs().max()) < TOL
    assert float((got - expected)[_real(mask)].abs().max()) > 1e-3  # the window matters


def test_gemma2_softcap_reaches_every_engine():
    """Soft-capping is applied whichever engine runs the layer (the capped scores differ
    from the uncapped ones at this cap)."""
    model = _gemma2()
    original = model.config._attn_implementation
    ids, mask = _batch()
    model.set_attn_implementation(_register_reference("ref_gemma2_w", 8, set()))
    want = _run(model, ids, mask)
    model.set_attn_implementation(original)
    for engine in ("dense", "block", "gather"):
        hf.sparsify(model, sa.window(8), engine=engine)
        got = _run(model, ids, mask)
        assert float((got - want)[_real(mask)].abs().max()) < TOL, engine


def test_t5_dense_equals_original_and_window_equals_reference():
    model = _t5()
    original = model.config._attn_implementation
    ids, mask = _batch()
    dec = ids[:, :12]
    expected = _run(model, ids, mask, dec)
    assert len(hf.layer_names(model)) == 4  # 2 encoder + 2 decoder self-attention layers
    hf.sparsify(model, sa.dense())
    got = _run(model, ids, mask, dec)
    assert float((got - expected).abs().max()) < TOL
    hf.restore(model)

    model.set_attn_implementation(_register_reference("ref_t5", 6, _cross_ids(model)))
    want = _run(model, ids, mask, dec)
    model.set_attn_implementation(original)
    hf.sparsify(model, sa.window(6))
    got = _run(model, ids, mask, dec)
    assert float((got - want).abs().max()) < TOL
    assert float((got - expected).abs().max()) > 1e-3


def test_t5_position_bias_gets_its_gradient():
    """The relative attention embedding (layer 0's) trains through the sparse engines."""
    model = _t5().train()
    ids, mask = _batch()
    emb = model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight
    grads = {}
    for engine in ("dense", "block"):
        hf.sparsify(model, sa.window(6), engine=engine)
        model.zero_grad()
        model(input_ids=ids, attention_mask=mask, labels=ids[:, :12].contiguous()).loss.backward()
        grads[engine] = emb.grad.clone()
    assert grads["dense"].abs().sum() > 0
    torch.testing.assert_close(grads["block"], grads["dense"], atol=1e-6, rtol=1e-4)


def test_layers_are_named_and_cross_attention_stays_exact():
    """BART with a pattern on every layer: the decoder's encoder_attn modules are not layers
    (cross-attention keeps every encoder key); layers= picks by the names listed."""
    model = _bart()
    original = model.config._attn_implementation
    names = hf.layer_names(model)
    assert names == [
        "model.encoder.layers.0.self_attn",
        "model.encoder.layers.1.self_attn",
        "model.decoder.layers.0.self_attn",
        "model.decoder.layers.1.self_attn",
    ]
    ids, mask = _batch()
    dec = ids[:, :12]
    model.set_attn_implementation(_register_reference("ref_bart", 6, _cross_ids(model)))
    want = _run(model, ids, mask, dec)
    model.set_attn_implementation(original)
    hf.sparsify(model, sa.window(6))
    got = _run(model, ids, mask, dec)
    assert float((got - want).abs().max()) < TOL
    hf.restore(model)
    hf.sparsify(model, sa.window(6), layers=[names.index("model.decoder.layers.1.self_attn")])
    assert sorted(hf.layer_specs(model)) == [3]


def test_methods_without_score_mod_are_refused():
    model = _gemma2()
    ids, mask = _batch()

    def method(q, k, v, pattern, **kwargs):  # no score_mod parameter
        return sa.sparse_attention(q, k, v, pattern, **kwargs)

    hf.sparsify(model, sa.window(8), method=method)
    with pytest.raises(ValueError, match="modifies its attention scores"):
        _run(model, ids, mask)
