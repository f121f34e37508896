"""LED (Longformer encoder–decoder) on sparseattn: ``hf.sparsify`` of a model holding
transformers' ``LEDEncoderSelfAttention`` modules (a copy of ``LongformerSelfAttention``, served by
``sparseattn.hf.longformer``); the decoder keeps transformers' attention.

Reference: the unmodified transformers model (its own banded code): encoder outputs, decoder
outputs and logits, gradients of every parameter, generated tokens. Tiny random-weight models
built from ``LEDConfig`` (nothing is downloaded), dropout probabilities 0.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from tiny_models import tiny_model

from sparseattn import hf, window
from sparseattn.hf import longformer as lf


@pytest.fixture(autouse=True, scope="module")
def _quiet_padding_warning():
    """transformers warns "Input ids are automatically padded …" at lengths off the window."""
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(level)


#: A LED of width 32, 4 heads, 2 encoder layers with windows of 4 and 8 tokens (±2, ±4), one
#: decoder layer, 128 encoder positions (inputs are padded to a multiple of 8), no dropout.
LED = dict(
    vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=1, encoder_attention_heads=4,
    decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, attention_window=[4, 8],
    max_encoder_position_embeddings=128, max_decoder_position_embeddings=64, dropout=0.0,
    attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0,
    eos_token_id=2, decoder_start_token_id=2,
)  # fmt: skip
MODELS = ["LEDModel", "LEDForConditionalGeneration"]
BSZ = 3


def tiny_led(model: str = "LEDForConditionalGeneration", **overrides):
    return tiny_model("LEDConfig", model, **{**LED, **overrides})


def assert_close(out: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-5) -> None:
    """Equal to ``rtol`` relative to the reference's scale."""
    torch.testing.assert_close(out, ref, rtol=rtol, atol=rtol * float(ref.detach().abs().max()))


def batch(n: int, globals_: str = "mixed", decoder_len: int = 6, seed: int = 1) -> dict:
    """Encoder ids of BSZ items of length n, item 1 padded at its end (5 tokens); global tokens
    ``none`` or ``mixed`` (item 0: position 0, item 1: 3 and 5, item 2: none); decoder ids of
    ``decoder_len`` tokens (0: none)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, LED["vocab_size"], (BSZ, n), generator=gen)
    mask = torch.ones(BSZ, n, dtype=torch.long)
    mask[1, n - 5 :] = 0
    ids[1, n - 5 :] = LED["pad_token_id"]
    out = {"input_ids": ids, "attention_mask": mask}
    if globals_ == "mixed":
        glob = torch.zeros(BSZ, n, dtype=torch.long)
        glob[0, 0] = 1
        glob[1, [3, 5]] = 1
        out["global_attention_mask"] = glob
    if decoder_len:
        out["decoder_input_ids"] = torch.randint(
            3, LED["vocab_size"], (BSZ, decoder_len), generator=gen
        )
    return out


def outputs(out) -> tuple[torch.Tensor, torch.Tensor]:
    """(the decoder's output: logits or last hidden state, the encoder's last hidden state)."""
    main = out.logits if hasattr(out, "logits") else out.last_hidden_state
    return main, out.encoder_last_hidden_state


def encoder_attentions(model) -> list:
    return lf.attention_modules(model)


# ------------------------------------------------------------------------- the window
@pytest.mark.parametrize("model_class", MODELS)
@pytest.mark.parametrize("n", [16, 13, 37])
@pytest.mark.parametrize("globals_", ["none", "mixed"])
def test_equals_transformers_in_eval_mode(model_class, n, globals_):
    """Each encoder layer its own window (4, then 8 tokens): the encoder's output and the
    decoder's (logits for LEDForConditionalGeneration) equal the model's own, at lengths that
    are and are not multiples of the window, one item padded, global tokens differing per item
    or none."""
    model = tiny_led(model_class)
    inputs = batch(n, globals_)
    with torch.no_grad():
        ref, ref_enc = outputs(model(**inputs))
        hf.sparsify(model)
        out, enc = outputs(model(**inputs))
    assert_close(enc, ref_enc)
    assert_close(out, ref)


def test_only_the_encoder_self_attention_is_patched():
    """layer_names: the encoder's LEDEncoderSelfAttention modules; their windows are the
    config's; the decoder's self- and cross-attention keep transformers' forward."""
    model = hf.sparsify(tiny_led(decoder_layers=2))
    names = [f"led.encoder.layers.{i}.self_attn.longformer_self_attn" for i in range(2)]
    assert lf.is_longformer(model) and hf.layer_names(model) == names
    specs = hf.layer_specs(model)
    assert [specs[0].pattern, specs[1].pattern] == [window(4), window(8)]
    assert all("forward" in m.__dict__ for m in encoder_attentions(model))
    decoder = [m for name, m in model.named_modules() if ".decoder." in name]
    assert decoder and not any("forward" in m.__dict__ for m in decoder)
    assert not lf.is_longformer(tiny_model("BartConfig", "BartModel", d_model=32))


def test_a_pattern_replaces_the_window():
    """``pattern=window(4)`` on both layers of an LED whose windows are [4, 8] equals transformers'
    LED with the same weights and windows [4, 4]."""
    model = tiny_led()
    narrow = tiny_led(attention_window=[4, 4])
    narrow.load_state_dict(model.state_dict())
    inputs = batch(37)
    with torch.no_grad():
        ref, ref_enc = outputs(narrow(**inputs))
        out, enc = outputs(hf.sparsify(model, window(4), engine="gather")(**inputs))
    assert_close(enc, ref_enc)
    assert_close(out, ref)


# ------------------------------------------------------------------- training, gradients
@pytest.mark.parametrize("model_class", MODELS)
def test_gradients_equal_transformers_in_train_mode(model_class):
    """Train mode (dropout probabilities 0), global tokens per item, padding, a length off the
    window: the outputs and the gradients of every parameter (the global projections included)
    equal the model's."""
    ref_model = tiny_led(model_class).train()
    model = hf.sparsify(copy.deepcopy(ref_model))
    inputs = batch(21)
    results = []
    for m in (model, ref_model):
        out, enc = outputs(m(**inputs))
        gen = torch.Generator().manual_seed(2)
        loss = (out * torch.randn(out.shape, generator=gen)).sum()
        loss = loss + (enc * torch.randn(enc.shape, generator=gen)).sum()
        params = [p for _, p in m.named_parameters()]
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        results.append((out, enc, grads))
    (out, enc, grads), (ref, ref_enc, ref_grads) = results
    assert_close(out, ref)
    assert_close(enc, ref_enc)
    names = [name for name, _ in ref_model.named_parameters()]
    scale = max(float(g.abs().max()) for g in ref_grads if g is not None)
    checked = 0
    for name, got, want in zip(names, grads, ref_grads, strict=True):
        assert (got is None) == (want is None), name
        if want is None:
            continue
        if name.endswith(("self_attn.key.bias", "key_global.bias")) or "k_proj.bias" in name:
            # zero in exact arithmetic (a key bias shifts a query's scores alike): rounding
            # noise on both sides, checked against the largest gradient's scale
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * scale)
        else:
            assert_close(got, want)
        checked += 1
    assert checked > 40
    attn = encoder_attentions(ref_model)[0]
    index = [p is attn.query_global.weight for _, p in ref_model.named_parameters()]
    assert ref_grads[index.index(True)].abs().max() > 0  # the global projections were trained


# ------------------------------------------------------------------- restore, generate
def test_restore_gives_the_original_model_back():
    original = tiny_led()
    model = copy.deepcopy(original)
    inputs = batch(13)
    with torch.no_grad():
        ref = model(**inputs).logits
        hf.sparsify(model)
        assert hf.restore(model) is model
        out = model(**inputs).logits
    assert torch.equal(out, ref)
    assert not any("forward" in m.__dict__ for m in encoder_attentions(model))
    assert hf.layer_specs(model) == {}
    assert model.state_dict().keys() == original.state_dict().keys()


@pytest.mark.parametrize("num_beams", [1, 2])
def test_generate_gives_the_same_tokens(num_beams):
    """``generate`` (greedy and beam search) of LEDForConditionalGeneration: the same tokens as
    transformers' model, global tokens per item, one item padded."""
    model = tiny_led()
    inputs = batch(29, decoder_len=0)
    options = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, num_beams=num_beams)
    with torch.no_grad():
        ref = model.generate(**inputs, **options)
        out = hf.sparsify(model).generate(**inputs, **options)
    assert ref.shape == (BSZ, 11)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("globals_", ["none", "mixed"])
def test_output_attentions_equal_transformers(globals_):
    """The encoder's ``encoder_attentions`` and ``encoder_global_attentions`` in transformers'
    layout; the decoder's and the cross-attention's are transformers' own."""
    model = tiny_led()
    with torch.no_grad():
        ref = model(**batch(13, globals_), output_attentions=True)
        out = hf.sparsify(copy.deepcopy(model))(**batch(13, globals_), output_attentions=True)
    names = ["encoder_attentions", "encoder_global_attentions", "decoder_attentions"]
    for name in [*names, "cross_attentions"]:
        for ours, theirs in zip(getattr(out, name) or (), getattr(ref, name) or (), strict=True):
            if theirs is None:
                assert ours is None
                continue
            assert ours.shape == theirs.shape
            assert_close(ours, theirs)
    assert_close(out.logits, ref.logits)


def test_attention_sparsity_counts_the_encoder_layers():
    """The encoder's layers are counted as Longformer's (tests/hf/test_hf_longformer.py checks
    the counts); the decoder keeps transformers' attention, uncounted."""
    model = hf.sparsify(tiny_led())
    with torch.no_grad():
        model(**batch(16))
    sparsity = hf.attention_sparsity(model)
    assert sorted(sparsity) == [0, 1]
    assert 1.0 > sparsity[0] > sparsity[1] > 0.0  # layer 0's window (±2) is the narrower
    assert sparsity == hf.attention_sparsity(model, of="graph")  # softmax zeroes none


def test_capture_attention_records_the_encoder_layers():
    """``hf.capture_attention`` on an unmodified LED: the encoder's layers, as Longformer's
    (tests/hf/test_hf_longformer.py checks the records); the model's output unchanged, and its
    own attention back afterwards."""
    model, inputs = tiny_led(), batch(16)
    with torch.no_grad():
        ref = model(**inputs).logits
        with hf.capture_attention(model) as records:
            out = model(**inputs).logits
    assert lf.model_state(model) is None
    assert_close(out, ref)
    assert [r.layer for r in records] == [0, 1]
    real = inputs["attention_mask"].bool()
    for record in records:
        assert record.probs.shape == (BSZ, 4, 16, 16)
        sums = record.probs.sum(-1).transpose(1, 2)[real]
        torch.testing.assert_close(sums, torch.ones_like(sums))
