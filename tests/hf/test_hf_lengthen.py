"""The Longformer paper's recipe (``sparseattn.hf.lengthen.lengthen``): a RoBERTa or BERT model
made into a Longformer of the same weights, with more positions, on sparseattn's attention.

References: the original transformers model (its outputs on the real tokens, at lengths within
its limit, with a window covering the input) and transformers' own Longformer code
(``sparsify=False``). Tiny random-weight models built from configs (nothing is downloaded),
dropout probabilities 0.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import tiny_model

from sparseattn import hf, window
from sparseattn.hf.lengthen import lengthen


@pytest.fixture(autouse=True, scope="module")
def _quiet_transformers():
    """transformers warns "Input ids are automatically padded …" at lengths off the window."""
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(level)


#: 2 layers of width 32, 4 heads; 64 learned positions (RoBERTa: rows 2 … 65, pad id 1; BERT:
#: rows 0 … 63, pad id 0), no dropout.
COMMON = dict(
    vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    intermediate_size=37, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
)  # fmt: skip
CONFIGS = {
    "Roberta": ("RobertaConfig", dict(COMMON, max_position_embeddings=66)),
    "Bert": ("BertConfig", dict(COMMON, max_position_embeddings=64)),
}
LEARNED = 64
BSZ, N = 3, 20


def source(model_class: str, **overrides):
    family = "Bert" if model_class.startswith("Bert") else "Roberta"
    config, options = CONFIGS[family]
    return tiny_model(config, model_class, **{**options, **overrides})


def assert_close(out: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-5) -> None:
    """Equal to ``rtol`` relative to the reference's scale."""
    torch.testing.assert_close(out, ref, rtol=rtol, atol=rtol * float(ref.detach().abs().max()))


def batch(model, n: int = N, padding: bool = True, seed: int = 1) -> dict:
    """BSZ items of length n, item 1 padded at its end (5 tokens) with ``padding``; token types
    0 then 1 (from n // 2) where the model has two."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, COMMON["vocab_size"], (BSZ, n), generator=gen)
    mask = torch.ones(BSZ, n, dtype=torch.long)
    if padding:
        mask[1, n - 5 :] = 0
        ids[1, n - 5 :] = model.config.pad_token_id
    types = torch.zeros(BSZ, n, dtype=torch.long)
    if model.config.type_vocab_size > 1:
        types[:, n // 2 :] = 1
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


def real_rows(out, mask: torch.Tensor) -> torch.Tensor:
    """The logits or last hidden state at the real tokens (padding rows mean nothing)."""
    main = out.logits if hasattr(out, "logits") else out.last_hidden_state
    return main[mask.bool()] if main.dim() == 3 else main


# ------------------------------------------------------------------ equal to the original
MODELS = ["RobertaModel", "RobertaForMaskedLM", "BertModel", "BertForMaskedLM"]


@pytest.mark.parametrize("model_class", MODELS)
@pytest.mark.parametrize("padding", [False, True])
def test_equals_the_original_within_its_length(model_class, padding):
    """A window covering the input (64 ≥ 2 · 20): the Longformer, 4× longer, on sparseattn, gives
    the original's outputs on the real tokens (MLM logits for the MaskedLM classes; the pooler's
    output for the base models), with and without padding."""
    model = source(model_class)
    long = lengthen(model, 4 * LEARNED, attention_window=64)
    expected = model_class.replace("Roberta", "Longformer").replace("Bert", "Longformer")
    assert type(long).__name__ == expected
    assert hf.layer_specs(long)[0].pattern == window(64)
    inputs = batch(model, padding=padding)
    with torch.no_grad():
        ref, out = model(**inputs), long(**inputs)
    assert_close(real_rows(out, inputs["attention_mask"]), real_rows(ref, inputs["attention_mask"]))
    if model_class.endswith("Model"):
        assert_close(out.pooler_output, ref.pooler_output)


def test_global_tokens_attend_as_the_original():
    """The global projections are copies of the regular ones: global tokens (differing per item)
    change nothing while the window covers the input."""
    model = source("RobertaForMaskedLM")
    long = lengthen(model, 4 * LEARNED, attention_window=64)
    inputs = batch(model)
    glob = torch.zeros(BSZ, N, dtype=torch.long)
    glob[0, 0], glob[1, [3, 5]] = 1, 1
    with torch.no_grad():
        ref = model(**inputs)
        out = long(**inputs, global_attention_mask=glob)
    assert_close(real_rows(out, inputs["attention_mask"]), real_rows(ref, inputs["attention_mask"]))


@pytest.mark.parametrize(
    "model_class",
    [
        "RobertaForSequenceClassification",
        "RobertaForTokenClassification",
        "BertForTokenClassification",
    ],
)
def test_classification_heads(model_class):
    """The heads are copied (LongformerForSequenceClassification makes token 0 global itself:
    the same result with the copied projections)."""
    model = source(model_class, num_labels=3)
    long = lengthen(model, 2 * LEARNED, attention_window=[64, 48])
    assert long.config.num_labels == 3 and long.config.attention_window == [64, 48]
    inputs = batch(model)
    with torch.no_grad():
        ref, out = model(**inputs), long(**inputs)
    assert_close(real_rows(out, inputs["attention_mask"]), real_rows(ref, inputs["attention_mask"]))


# ----------------------------------------------------------------------------- the weights
@pytest.mark.parametrize("model_class", ["RobertaForMaskedLM", "BertModel"])
def test_the_weights_are_the_originals(model_class):
    """Position row first + p is the original's row p mod 64 (RoBERTa and the Longformer count
    from 2, its two leading rows copied; BERT from 0, the Longformer's padding row 0 zero);
    global projections start as copies, parameters of their own; the original is untouched."""
    model = source(model_class)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    long = lengthen(model, 200, attention_window=8)
    first = 2 if model_class.startswith("Roberta") else 0
    old = model.base_model.embeddings.position_embeddings.weight
    new = long.base_model.embeddings.position_embeddings.weight
    new_first = model.config.pad_token_id + 1
    assert (
        new.shape == (200 + new_first, 32)
        and long.config.max_position_embeddings == 200 + new_first
    )
    p = torch.arange(200)
    assert torch.equal(new[new_first + p], old[first + p % LEARNED])
    if first:
        assert torch.equal(new[:first], old[:first])
    else:
        assert not new[0].any()
    for layer in long.base_model.encoder.layer:
        attn = layer.attention.self
        for name in ("query", "key", "value"):
            regular, glob = getattr(attn, name), getattr(attn, f"{name}_global")
            assert torch.equal(glob.weight, regular.weight) and torch.equal(glob.bias, regular.bias)
            assert glob.weight is not regular.weight
    old_params = {p.data_ptr() for p in model.parameters()}
    assert not any(p.data_ptr() in old_params for p in long.parameters())
    with torch.no_grad():
        for param in long.parameters():
            param.add_(1.0)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert long.config.hidden_act == model.config.hidden_act
    assert long.config.layer_norm_eps == model.config.layer_norm_eps


def test_mode_dtype_and_the_untouched_option():
    model = source("RobertaModel").double().train()
    long = lengthen(model, LEARNED, attention_window=16, sparsify=False)
    assert long.training and long.embeddings.word_embeddings.weight.dtype == torch.float64
    assert hf.layer_specs(long) == {}  # transformers' Longformer code
    long = lengthen(model, LEARNED, attention_window=16, pattern=window(6), engine="gather")
    specs = hf.layer_specs(long)
    assert [s.pattern for s in specs.values()] == [window(6)] * 2 and specs[0].engine == "gather"
    no_pooler = transformers.RobertaModel(model.config, add_pooling_layer=False)
    assert lengthen(no_pooler, LEARNED, attention_window=16).pooler is None


def test_runs_at_four_times_the_original_length():
    """4 × 64 tokens with windows of 16: positions beyond the original's limit exist, and
    sparseattn's attention equals transformers' Longformer code there (padding, global tokens)."""
    model = source("RobertaForMaskedLM")
    long = lengthen(model, 4 * LEARNED, attention_window=16)
    reference = lengthen(model, 4 * LEARNED, attention_window=16, sparsify=False)
    inputs = batch(model, n=4 * LEARNED)
    glob = torch.zeros(BSZ, 4 * LEARNED, dtype=torch.long)
    glob[:, 0] = 1
    glob[2, 200] = 1
    with torch.no_grad():
        out = long(**inputs, global_attention_mask=glob).logits
        ref = reference(**inputs, global_attention_mask=glob).logits
    assert out.shape == (BSZ, 4 * LEARNED, COMMON["vocab_size"]) and torch.isfinite(out).all()
    assert_close(out, ref)
    with pytest.raises(IndexError):  # the original stops at 64
        model(**batch(model, n=4 * LEARNED))


# ------------------------------------------------------------------------------- refusals
def test_refusals():
    roberta = source("RobertaModel")
    with pytest.raises(ValueError, match="smaller than the 64 positions"):
        lengthen(roberta, 63)
    with pytest.raises(TypeError, match="max_positions"):
        lengthen(roberta, 4096.0)
    with pytest.raises(ValueError, match="even"):
        lengthen(roberta, 128, attention_window=7)
    with pytest.raises(ValueError, match="one per layer"):
        lengthen(roberta, 128, attention_window=[8, 8, 8])
    with pytest.raises(TypeError, match="torch.nn.Module"):
        lengthen("roberta-base", 4096)
    with pytest.raises(ValueError, match="RoBERTa or BERT"):
        lengthen(tiny_model("DistilBertConfig", "DistilBertModel", dim=32, n_heads=4), 4096)
    with pytest.raises(ValueError, match="pooler"):
        lengthen(source("BertForSequenceClassification"), 4096)
    with pytest.raises(ValueError, match="RoBERTa or BERT"):
        lengthen(source("RobertaForCausalLM", is_decoder=True), 4096)
    with pytest.raises(ValueError, match="encoder"):
        lengthen(source("RobertaModel", is_decoder=True), 4096)
    with pytest.raises(ValueError, match="gelu"):
        lengthen(source("BertForMaskedLM", hidden_act="relu"), 4096)
