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
from tiny_models import BART, GEMMA2, T5, tiny_model
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

import sparseattn as sa
from sparseattn import hf

pytestmark = [pytest.mark.device, pytest.mark.guard]

TOL = 2e-5


def _gemma2(device):
    return tiny_model("Gemma2Config", "Gemma2ForCausalLM", **GEMMA2).to(device)


def _t5(device):
    return tiny_model("T5Config", "T5ForConditionalGeneration", **T5).to(device)


def _bart(device):
    return tiny_model("BartConfig", "BartForConditionalGeneration", **BART).to(device)


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


def _window_and_reference(model, w, ids, mask, dec=None, engine="auto"):
    """Logits of ``model`` sparsified with window(w) on ``engine``, and of the reference
    kernel with the same window (``model`` is left sparsified)."""
    original = model.config._attn_implementation
    model.set_attn_implementation(_register_reference(f"ref_{w}", w, _cross_ids(model)))
    want = _run(model, ids, mask, dec)
    model.set_attn_implementation(original)
    hf.sparsify(model, sa.window(w), engine=engine)
    return _run(model, ids, mask, dec), want


def _dense_equals_original(model, ids, mask, dec=None):
    """Logits of the original model; asserts that the dense pattern gives the same."""
    expected = _run(model, ids, mask, dec)
    hf.sparsify(model, sa.dense())
    got = _run(model, ids, mask, dec)
    real = mask.bool() if dec is None else torch.ones_like(got[..., 0], dtype=torch.bool)
    assert float((got - expected)[real].abs().max()) < TOL
    hf.restore(model)
    return expected


def test_gemma2_dense_equals_original_and_window_equals_reference(device):
    model = _gemma2(device)
    ids, mask = _batch()
    expected = _dense_equals_original(model, ids, mask)
    # window(8) in a decoder: its causal part, |i − j| ≤ 4 with j ≤ i (∩ layer 0's slide)
    got, want = _window_and_reference(model, 8, ids, mask)
    real = mask.bool()
    assert float((got - want)[real].abs().max()) < TOL
    assert float((got - expected)[real].abs().max()) > 1e-3  # the window matters


@pytest.mark.parametrize("engine", ["dense", "block", "gather"])
def test_gemma2_softcap_reaches_every_engine(device, engine):
    """Soft-capping is applied whichever engine runs the layer (at this cap the capped
    scores differ from the uncapped ones)."""
    ids, mask = _batch()
    got, want = _window_and_reference(_gemma2(device), 8, ids, mask, engine=engine)
    assert float((got - want)[mask.bool()].abs().max()) < TOL


def test_t5_dense_equals_original_and_window_equals_reference(device):
    model = _t5(device)
    ids, mask = _batch()
    assert len(hf.layer_names(model)) == 4  # 2 encoder + 2 decoder self-attention layers
    expected = _dense_equals_original(model, ids, mask, ids[:, :12])
    got, want = _window_and_reference(model, 6, ids, mask, ids[:, :12])
    assert float((got - want).abs().max()) < TOL
    assert float((got - expected).abs().max()) > 1e-3


def test_t5_position_bias_gets_its_gradient(device):
    """The relative attention embedding (layer 0's) trains through the sparse engines."""
    model = _t5(device).train()
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


def test_layers_are_named_and_cross_attention_stays_exact(device):
    """BART with a pattern on every layer: the decoder's encoder_attn modules are not layers
    (cross-attention keeps every encoder key); layers= picks by the names listed."""
    model = _bart(device)
    names = hf.layer_names(model)
    assert names == [
        "model.encoder.layers.0.self_attn",
        "model.encoder.layers.1.self_attn",
        "model.decoder.layers.0.self_attn",
        "model.decoder.layers.1.self_attn",
    ]
    ids, mask = _batch()
    got, want = _window_and_reference(model, 6, ids, mask, ids[:, :12])
    assert float((got - want).abs().max()) < TOL
    hf.restore(model)
    hf.sparsify(model, sa.window(6), layers=[names.index("model.decoder.layers.1.self_attn")])
    assert sorted(hf.layer_specs(model)) == [3]


def test_methods_without_score_mod_are_refused(device):
    model = _gemma2(device)
    ids, mask = _batch()

    def method(q, k, v, pattern, **kwargs):  # no score_mod parameter
        return sa.sparse_attention(q, k, v, pattern, **kwargs)

    hf.sparsify(model, sa.window(8), method=method)
    with pytest.raises(ValueError, match="modifies its attention scores"):
        _run(model, ids, mask)
