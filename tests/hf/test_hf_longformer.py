"""Longformer on sparseattn (issue 40, item 2): ``hf.sparsify`` of a model holding transformers'
``LongformerSelfAttention`` modules.

References: the unmodified transformers model (its own banded code: outputs, logits and
gradients), and, for patterns other than the model's window, a dense masked re-implementation
of Longformer's self-attention written here (n × n scores, softmax or the map on the masked
rows), itself checked against transformers for the window. Tiny random-weight models built from
``LongformerConfig`` (nothing is downloaded), dropout probabilities 0.
"""

from __future__ import annotations

import copy
import functools
import io
import math

import pytest
import torch
import transformers
from tiny_models import tiny_model

from sparseattn import block_local, hf, split_heads, window
from sparseattn.hf import longformer as lf
from sparseattn.maps import resolve_prob_map


@pytest.fixture(autouse=True, scope="module")
def _quiet_padding_warning():
    """transformers warns "Input ids are automatically padded …" at lengths off the window."""
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(level)


#: A 2-layer Longformer of width 32, 4 heads, windows of 4 and 8 tokens (±2, ±4), 160 positions
#: (ids start after the padding id 1; inputs are padded to a multiple of 8).
LONGFORMER = dict(
    vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    intermediate_size=48, attention_window=[4, 8], max_position_embeddings=160,
    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=1,
)  # fmt: skip
MODELS = ["LongformerModel", "LongformerForMaskedLM", "LongformerForSequenceClassification"]
BSZ = 3


def tiny_longformer(model: str = "LongformerModel", **overrides):
    return tiny_model("LongformerConfig", model, **{**LONGFORMER, **overrides})


def assert_close(out: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-5) -> None:
    """Equal to ``rtol`` relative to the reference's scale."""
    torch.testing.assert_close(out, ref, rtol=rtol, atol=rtol * float(ref.detach().abs().max()))


def batch(n: int, padding: bool = True, globals_: str = "mixed", seed: int = 1) -> dict:
    """Token ids of BSZ items of length n: item 1 padded at its end (5 tokens) with
    ``padding``; global tokens ``none``, ``mixed`` (item 0: position 0, item 1: 3 and 5,
    item 2: none) or ``all`` (item 2 too: n − 1 and n // 2)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, LONGFORMER["vocab_size"], (BSZ, n), generator=gen)
    mask = torch.ones(BSZ, n, dtype=torch.long)
    if padding:
        mask[1, n - 5 :] = 0
        ids[1, n - 5 :] = LONGFORMER["pad_token_id"]
    out = {"input_ids": ids, "attention_mask": mask}
    if globals_ != "none":
        glob = torch.zeros(BSZ, n, dtype=torch.long)
        glob[0, 0] = 1
        glob[1, [3, 5]] = 1
        if globals_ == "all":
            glob[2, [n - 1, n // 2]] = 1
        out["global_attention_mask"] = glob
    return out


def main_output(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def self_attentions(model) -> list:
    return lf.attention_modules(model)


# ----------------------------------------------------------- the dense reference (n × n)
def dense_longformer_forward(
    module,
    allowed,
    prob_map,
    hidden_states,
    attention_mask=None,
    is_index_masked=None,
    is_index_global_attn=None,
    is_global_attn=None,
    output_attentions=False,
):
    """Longformer self-attention with n × n masks: local rows (regular projections) over
    ``allowed(n)`` ((n, n) or (H, n, n) bool) ∪ global keys minus padding keys, global rows
    (global projections) over every real key, padding rows 0."""
    bsz, n, embed = hidden_states.shape
    heads, d = module.num_heads, module.head_dim

    def split(x):
        return x.view(bsz, n, heads, d).transpose(1, 2)

    pad, glob = is_index_masked, is_index_global_attn
    q, k, v = (split(p(hidden_states)) for p in (module.query, module.key, module.value))
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    local = (allowed(n) | glob[:, None, None, :]) & ~pad[:, None, None, :]
    local = local | pad[:, None, :, None]  # padding rows: any keys (their output is zeroed)
    out = prob_map(scores, local.expand_as(scores)) @ v
    qg, kg, vg = (
        split(p(hidden_states))
        for p in (module.query_global, module.key_global, module.value_global)
    )
    scores_g = qg @ kg.transpose(-1, -2) / math.sqrt(d)
    real = (~pad)[:, None, None, :].expand_as(scores_g)
    out_g = prob_map(scores_g, real) @ vg
    out = torch.where(glob[:, None, :, None], out_g, out)
    out = out.masked_fill(pad[:, None, :, None], 0.0)
    return (out.transpose(1, 2).reshape(bsz, n, embed),)


def band(w: int):
    """Longformer's window of ``w`` tokens: |i − j| ≤ w / 2."""
    return lambda n: (torch.arange(n)[:, None] - torch.arange(n)).abs() <= w // 2


def blocks(b: int):
    """Blocks of ``b`` tokens: i // b = j // b."""
    return lambda n: (torch.arange(n)[:, None] // b) == (torch.arange(n) // b)


def dense_reference(model, allowed_per_layer, prob_map="softmax"):
    """A copy of ``model`` whose self-attention is :func:`dense_longformer_forward`."""
    ref = copy.deepcopy(model)
    rho = resolve_prob_map(prob_map)
    for layer, module in enumerate(self_attentions(ref)):
        module.forward = functools.partial(
            dense_longformer_forward, module, allowed_per_layer[layer], rho
        )
    return ref


# ------------------------------------------------------------------------- the window
@pytest.mark.parametrize("model_class", MODELS)
@pytest.mark.parametrize("n", [16, 13, 37])
@pytest.mark.parametrize("globals_", ["none", "mixed", "all"])
def test_equals_transformers_in_eval_mode(model_class, n, globals_):
    """Without a pattern each layer uses its own window (4, then 8 tokens): outputs equal the
    model's own, lengths that are and are not multiples of the window (transformers pads),
    padding in one item, global tokens at different positions per item or none.
    (LongformerForSequenceClassification puts a global token on position 0 itself.)"""
    model = tiny_longformer(model_class)
    inputs = batch(n, globals_=globals_)
    with torch.no_grad():
        ref = main_output(model(**inputs))
        hf.sparsify(model)
        out = main_output(model(**inputs))
    assert_close(out, ref)


def test_the_layers_windows_are_the_configs():
    """layer_specs: window(attention_window[l]) per layer, softmax, engine auto; layer_names
    lists the LongformerSelfAttention modules; an int attention_window serves every layer."""
    model = hf.sparsify(tiny_longformer())
    specs = hf.layer_specs(model)
    assert [specs[0].pattern, specs[1].pattern] == [window(4), window(8)]
    assert specs[0].prob_map.is_softmax and specs[0].engine == "auto"
    assert hf.layer_names(model) == [f"encoder.layer.{i}.attention.self" for i in range(2)]
    model = hf.sparsify(tiny_longformer(attention_window=6))
    assert [s.pattern for s in hf.layer_specs(model).values()] == [window(6), window(6)]


@pytest.mark.parametrize("n", [18, 7])
def test_an_int_window_and_a_length_shorter_than_it(n):
    """attention_window=6 for both layers (padded to 18 from 7: more padding than tokens)."""
    model = tiny_longformer(attention_window=6)
    inputs = batch(n)
    with torch.no_grad():
        ref = model(**inputs).last_hidden_state
        out = hf.sparsify(model)(**inputs).last_hidden_state
    assert_close(out, ref)


def test_a_long_input():
    """n = 130 (padded to 136): windows far shorter than the sequence, globals in each item."""
    model = tiny_longformer()
    inputs = batch(130, globals_="all")
    with torch.no_grad():
        ref = model(**inputs).last_hidden_state
        out = hf.sparsify(model)(**inputs).last_hidden_state
    assert_close(out, ref)


@pytest.mark.parametrize("how", ["hook", "many globals"])
def test_the_global_rows_unfolded_equal_transformers(how):
    """The global rows go through key_global / value_global unfolded when the projections are
    not plain (a forward hook here: it must run) or when the globals are too many for the fold
    to pay (lf._fold_globals); both equal transformers, and the fold is not used."""
    model = tiny_longformer()
    inputs = batch(37, globals_="all")
    if how == "many globals":
        inputs["global_attention_mask"][:, :30] = 1
    with torch.no_grad():
        ref = model(**inputs).last_hidden_state
        calls = []
        if how == "hook":
            for layer in model.encoder.layer:
                layer.attention.self.key_global.register_forward_hook(lambda *args: calls.append(1))
        folded = []
        real = lf._folded_global_rows
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(lf, "_folded_global_rows", lambda *a, **k: folded.append(1) or real(*a, **k))
            out = hf.sparsify(model)(**inputs).last_hidden_state
    assert_close(out, ref)
    assert not folded and (how != "hook" or len(calls) == 2)


@pytest.mark.parametrize("engine", ["dense", "rows", "block", "gather"])
def test_every_engine_equals_transformers(engine):
    model = tiny_longformer()
    inputs = batch(37)
    with torch.no_grad():
        ref = model(**inputs).last_hidden_state
        out = hf.sparsify(model, engine=engine)(**inputs).last_hidden_state
    assert_close(out, ref)


def test_float64_to_rounding():
    """In float64 the result equals the dense reference to rounding; transformers' own model
    only to ~1e-7, since it computes its softmax in float32 whatever the dtype."""
    model = tiny_longformer().double()
    inputs = batch(37, globals_="all")
    with torch.no_grad():
        ref = model(**inputs).last_hidden_state
        dense = dense_reference(model, [band(4), band(8)])(**inputs).last_hidden_state
        out = hf.sparsify(model)(**inputs).last_hidden_state
    assert_close(out, dense, rtol=1e-12)
    assert_close(out, ref, rtol=1e-6)


def test_an_item_of_padding_only():
    """An item whose every token is padding, beside items with global tokens: its rows give
    what transformers gives (no NaN)."""
    model = tiny_longformer()
    inputs = batch(13)
    inputs["attention_mask"][2] = 0
    with torch.no_grad():
        ref = model(**inputs).last_hidden_state
        out = hf.sparsify(model)(**inputs).last_hidden_state
    assert torch.isfinite(ref).all()
    assert_close(out, ref)


# ------------------------------------------------------------------- training, gradients
@pytest.mark.parametrize("model_class", ["LongformerModel", "LongformerForMaskedLM"])
@pytest.mark.parametrize("globals_", ["none", "mixed"])
def test_gradients_equal_transformers_in_train_mode(model_class, globals_):
    """Train mode (dropout probabilities 0): the output and the gradients of the input
    embeddings and of every parameter (the global projections included) equal the model's."""
    ref_model = tiny_longformer(model_class).train()
    model = hf.sparsify(copy.deepcopy(ref_model))
    inputs = batch(21, globals_=globals_)
    ids = inputs.pop("input_ids")
    results = []
    for m in (model, ref_model):
        embeds = m.get_input_embeddings()(ids).detach().requires_grad_()
        out = main_output(m(inputs_embeds=embeds, **inputs))
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
        params = [p for _, p in m.named_parameters()]
        grads = torch.autograd.grad((out * g).sum(), [embeds, *params], allow_unused=True)
        results.append((out, grads))
    (out, grads), (ref, ref_grads) = results
    assert_close(out, ref)
    names = ["inputs_embeds"] + [name for name, _ in ref_model.named_parameters()]
    scale = max(float(g.abs().max()) for g in ref_grads if g is not None)
    checked = 0
    for name, got, want in zip(names, grads, ref_grads, strict=True):
        assert (got is None) == (want is None), name
        if want is None:
            continue
        if name.endswith(("key.bias", "key_global.bias")):
            # zero in exact arithmetic (a key bias shifts a query's scores alike): both are
            # rounding noise (~1e-9), checked against the largest gradient's scale
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * scale)
        else:
            assert_close(got, want)
        checked += 1
    assert checked > 10
    if globals_ == "mixed":  # the global projections were trained
        attn = self_attentions(ref_model)[0]
        index = [p is attn.query_global.weight for _, p in ref_model.named_parameters()]
        assert ref_grads[1 + index.index(True)].abs().max() > 0


# ------------------------------------------------------------------- restore, layers
def test_restore_gives_the_original_model_back():
    original = tiny_longformer("LongformerForMaskedLM")
    model = copy.deepcopy(original)
    inputs = batch(13)
    with torch.no_grad():
        ref = model(**inputs).logits
        hf.sparsify(model)
        assert all("forward" in m.__dict__ for m in self_attentions(model))
        assert hf.restore(model) is model
        out = model(**inputs).logits
    assert torch.equal(out, ref)
    assert not any("forward" in m.__dict__ for m in self_attentions(model))
    assert hf.layer_specs(model) == {}
    assert hf.restore(model) is model  # a no-op now
    assert model.state_dict().keys() == original.state_dict().keys()


def test_layers_and_sparsifying_again():
    """``layers=[1]`` patches layer 1 only (layer 0 keeps transformers' code); a second call
    adds layer 0 with another engine; restore undoes both."""
    model = tiny_longformer()
    inputs = batch(37)
    with torch.no_grad():
        ref = model(**inputs).last_hidden_state
        hf.sparsify(model, layers=[1])
        modules = self_attentions(model)
        assert "forward" not in modules[0].__dict__ and "forward" in modules[1].__dict__
        assert set(hf.layer_specs(model)) == {1}
        assert_close(model(**inputs).last_hidden_state, ref)
        hf.sparsify(model, engine="gather", layers=[0])
        specs = hf.layer_specs(model)
        assert set(specs) == {0, 1} and (specs[0].engine, specs[1].engine) == ("gather", "auto")
        assert_close(model(**inputs).last_hidden_state, ref)
        hf.restore(model)
        assert torch.equal(model(**inputs).last_hidden_state, ref)


def test_copies_and_pickles_stay_bound_to_their_own_modules():
    model = hf.sparsify(tiny_longformer())
    inputs = batch(13)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        ref = model(**inputs).last_hidden_state
        for other in (loaded, twin):
            for mine, theirs in zip(self_attentions(other), self_attentions(model), strict=True):
                assert mine.forward.args[0] is mine and theirs.forward.args[0] is theirs
            assert torch.equal(other(**inputs).last_hidden_state, ref)
        hf.restore(twin)
    assert "forward" in self_attentions(model)[0].__dict__  # the original is still sparsified


# ------------------------------------------------------------ patterns, maps, methods
def test_the_dense_reference_is_transformers_for_the_window():
    model = tiny_longformer()
    inputs = batch(37, globals_="all")
    with torch.no_grad():
        ref = model(**inputs).last_hidden_state
        out = dense_reference(model, [band(4), band(8)])(**inputs).last_hidden_state
    assert_close(out, ref)


def _heads_split(n: int) -> torch.Tensor:
    """split_heads(window(2), block_local(4)) over 4 heads: heads 0–1 |i − j| ≤ 1, heads
    2–3 the same block of 4."""
    near, same = band(2)(n), blocks(4)(n)
    return torch.stack([near, near, same, same])


@pytest.mark.parametrize(
    "pattern, masks",
    [
        (window(2), [band(2), band(2)]),
        (
            [window(2), block_local(4)],
            [band(2), lambda n: (torch.arange(n)[:, None] // 4) == (torch.arange(n) // 4)],
        ),  # fmt: skip
        (split_heads(window(2), block_local(4)), [_heads_split, _heads_split]),
    ],
    ids=["window", "per-layer", "per-head"],
)
def test_a_pattern_replaces_the_window(pattern, masks):
    """``pattern=`` replaces the window (a Pattern, a sequence per layer, a head split); the
    call's global tokens are still added and the padding taken out."""
    model = tiny_longformer()
    inputs = batch(37)
    with torch.no_grad():
        ref = dense_reference(model, masks)(**inputs).last_hidden_state
        out = hf.sparsify(model, pattern)(**inputs).last_hidden_state
    assert_close(out, ref)


@pytest.mark.parametrize("prob_map", ["sparsemax", "entmax15"])
def test_another_map_applies_to_local_and_global_rows(prob_map):
    model = tiny_longformer()
    inputs = batch(37, globals_="all")
    with torch.no_grad():
        ref = dense_reference(model, [band(4), band(8)], prob_map)(**inputs).last_hidden_state
        out = hf.sparsify(model, prob_map=prob_map)(**inputs).last_hidden_state
    assert_close(out, ref)


def test_a_method_hook_gets_the_per_item_graph():
    """A method in sparse_attention's signature receives the local rows' graph, of batch shape
    (batch, 1); with a context parameter, the layer's input and ``value`` projection."""
    from sparseattn import sparse_attention

    seen = []

    def method(q, k, v, pattern, *, context=None, **options):
        seen.append((pattern.batch_shape, context.layer, context.value_proj))
        return sparse_attention(q, k, v, pattern, **options)

    model = tiny_longformer()
    inputs = batch(13)
    with torch.no_grad():
        ref = model(**inputs).last_hidden_state
        out = hf.sparsify(model, method=method)(**inputs).last_hidden_state
    assert_close(out, ref)
    modules = self_attentions(model)
    assert seen == [((BSZ, 1), 0, modules[0].value), ((BSZ, 1), 1, modules[1].value)]


def test_the_local_graph_is_window_and_globals_without_padding():
    """local_graph against the same graph made from n × n masks: row i of item b holds the
    window and b's global columns minus b's padding keys (a padding row keeps its keys)."""
    n, w = 24, 6
    gen = torch.Generator().manual_seed(3)
    is_global = torch.rand(BSZ, n, generator=gen) < 0.15
    is_padding = torch.zeros(BSZ, n, dtype=torch.bool)
    is_padding[1, 17:] = True
    is_padding[2, 9:] = True
    is_global &= ~is_padding
    q = torch.randn(BSZ, 4, n, 8)
    graph = lf.local_graph(window(w), q, q, is_global, is_padding)
    assert graph.batch_shape == (BSZ, 1)
    want = band(w)(n) | is_global[:, None, :]
    want = want & ~(is_padding[:, None, :] & ~is_padding[:, :, None])
    assert torch.equal(graph.to_dense(), want[:, None])
    assert graph.col.numel() <= BSZ * n * (w + 1 + int(is_global.sum(-1).max()))


# ----------------------------------------------------------------------- refusals
# ------------------------------------------------------------------ output_attentions
def _attentions(out) -> list:
    """Every layer's ``attentions`` and ``global_attentions`` (None where an item has none)."""
    return [*out.attentions, *(out.global_attentions or ())]


@pytest.mark.parametrize("n", [13, 37])
@pytest.mark.parametrize("globals_", ["none", "mixed", "all"])
def test_output_attentions_equal_transformers(n, globals_):
    """transformers' layout: per layer ``attentions`` (B, H, n, g + 2w + 1: the item's global
    keys, then the band) and, where an item has global tokens, ``global_attentions``
    (B, H, n, g), with padding, per-layer windows and lengths transformers pads."""
    model = tiny_longformer()
    inputs = batch(n, globals_=globals_)
    with torch.no_grad():
        ref = model(**inputs, output_attentions=True)
        out = hf.sparsify(copy.deepcopy(model))(**inputs, output_attentions=True)
    assert_close(main_output(out), main_output(ref))
    for ours, theirs in zip(_attentions(out), _attentions(ref), strict=True):
        if theirs is None:
            assert ours is None
            continue
        assert ours.shape == theirs.shape
        assert_close(ours, theirs)


def test_output_attentions_gradients_equal_transformers():
    """In train mode (dropout 0) the weights are differentiable as transformers' are."""
    model = tiny_longformer().train()
    ours = hf.sparsify(copy.deepcopy(model))
    inputs = batch(13)
    grads = []
    for m in (model, ours):
        gen = torch.Generator().manual_seed(3)
        out = m(**inputs, output_attentions=True)
        loss = sum((a * torch.randn(a.shape, generator=gen)).sum() for a in _attentions(out))
        loss.backward()
        grads.append({name: p.grad for name, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    # relative to the largest gradient: key.bias's is float noise (softmax ignores a shift)
    scale = max(float(g.abs().max()) for g in grads[0].values())
    for name, ref in grads[0].items():
        torch.testing.assert_close(grads[1][name], ref, rtol=1e-5, atol=1e-5 * scale)


def sharpened(model, factor: float = 8.0):
    """``model`` with its query and key projections scaled by ``factor``: peaked scores, so
    that a sparse map zeroes some of the keys a row may read (a random tiny model has none)."""
    with torch.no_grad():
        for module in self_attentions(model):
            for name in ("query", "key", "query_global", "key_global"):
                getattr(module, name).weight.mul_(factor)
    return model


def dense_weights(model, layer: int, hidden, inputs: dict, allowed, prob_map: str):
    """Layer ``layer``'s weights n × n from its input ``hidden`` (B, n, E) (no padding inside
    transformers): local rows (regular projections) on ``allowed(n)`` ∪ the item's global keys
    minus padding, global rows (global projections) on every real key, padding rows 0; and the
    mask of the keys each row may read (B, H, n, n)."""
    module = self_attentions(model)[layer]
    bsz, n, _ = hidden.shape
    heads, d = module.num_heads, module.head_dim
    pad = inputs["attention_mask"] == 0
    glob = inputs.get("global_attention_mask", torch.zeros(bsz, n)).bool()

    def scores(query, key):
        split = lambda x: x.view(bsz, n, heads, d).transpose(1, 2)  # noqa: E731
        with torch.no_grad():
            return split(query(hidden)) @ split(key(hidden)).mT / math.sqrt(d)

    local_keys = ((allowed(n) | glob[:, None, None, :]) & ~pad[:, None, None, :]).expand(
        bsz, heads, n, n
    )
    real_keys = (~pad)[:, None, None, :].expand(bsz, heads, n, n)
    local_rows, global_rows = (~glob & ~pad)[:, None, :, None], glob[:, None, :, None]
    rho = resolve_prob_map(prob_map)
    local = rho(scores(module.query, module.key), local_keys).masked_fill(~local_rows, 0.0)
    glob_w = rho(scores(module.query_global, module.key_global), real_keys)
    weights = local + glob_w.masked_fill(~global_rows, 0.0)
    return weights, (local_keys & local_rows) | (real_keys & global_rows)


def test_output_attentions_of_another_map_are_its_weights_on_the_layers_rows():
    """With 1.5-entmax the layout holds ρ's weights: laid back out as n × n they equal ρ on
    the dense reference's local rows (window ∪ global keys, no padding), and
    some of the keys a row may read get 0."""
    model = hf.sparsify(sharpened(tiny_longformer()), prob_map="entmax15")
    inputs = batch(16)  # a multiple of the windows: no padding inside transformers
    with torch.no_grad():
        out = model(**inputs, output_attentions=True, output_hidden_states=True)
    weights = out.attentions[0]  # layer 0: window ±2
    glob = inputs["global_attention_mask"].bool()
    probs, reads = dense_weights(model, 0, out.hidden_states[0], inputs, band(4), "entmax15")
    probs = probs.masked_fill(glob[:, None, :, None], 0.0)  # global rows: 0 in this layout
    n, g = 16, int(glob.sum(-1).max())
    dense = torch.zeros_like(probs)
    for b in range(BSZ):
        for s, j in enumerate(glob[b].nonzero().flatten().tolist()):
            dense[b, :, :, j] += weights[b, :, :, s]
        for t in range(5):  # the band: key i − 2 + t
            for i in range(max(0, 2 - t), min(n, n + 2 - t)):
                dense[b, :, i, i - 2 + t] += weights[b, :, i, g + t]
    assert_close(dense, probs)
    assert bool(((dense == 0) & reads & ~glob[:, None, :, None]).any())


@pytest.mark.parametrize("prob_map", ["softmax", "entmax15"])
def test_attention_sparsity_counts_as_the_dense_reference(prob_map):
    """``hf.attention_sparsity``: per layer, 1 − (the keys the rows may read, or ρ's non-zero
    weights) / (pairs of real tokens), over the calls since sparsify; ``reset`` starts again."""
    model = hf.sparsify(sharpened(tiny_longformer()), prob_map=prob_map, count_weights=True)
    inputs = batch(16, globals_="all")
    for _ in range(2):  # counts add up over calls: the ratios stay
        with torch.no_grad():
            out = model(**inputs, output_hidden_states=True)
    graph = hf.attention_sparsity(model, of="graph")
    weights = hf.attention_sparsity(model, reset=True)
    real = inputs["attention_mask"].sum(-1).double()
    pairs = float((real**2).sum()) * LONGFORMER["num_attention_heads"]
    for layer, w in enumerate([4, 8]):
        probs, reads = dense_weights(
            model, layer, out.hidden_states[layer], inputs, band(w), prob_map
        )
        assert graph[layer] == pytest.approx(1 - float(reads.sum()) / pairs)
        assert weights[layer] == pytest.approx(1 - float((probs > 0).sum()) / pairs)
    assert (weights == graph) == (prob_map == "softmax")
    assert hf.attention_sparsity(model) == {}  # reset


@pytest.mark.parametrize("prob_map", ["softmax", "entmax15"])
def test_capture_attention_records_each_row_as_the_layer_computes_it(prob_map):
    """``hf.capture_attention``: per layer and call, q and k (the regular projections,
    unscaled), the scores and the keys each real row may read — local rows the regular
    projections on their window ∪ global keys, global rows the global projections on every
    real key — and ρ's weights there, equal to the dense reference's."""
    model = hf.sparsify(sharpened(tiny_longformer()), prob_map=prob_map)
    inputs = batch(16)
    with torch.no_grad(), hf.capture_attention(model) as records:
        out = model(**inputs, output_hidden_states=True)
    assert [r.layer for r in records] == [0, 1]
    real = inputs["attention_mask"].bool()
    rows = real[:, None, :, None]
    heads, d = LONGFORMER["num_attention_heads"], LONGFORMER["hidden_size"] // 4
    for record, w in zip(records, [4, 8], strict=True):
        hidden, module = out.hidden_states[record.layer], self_attentions(model)[record.layer]
        probs, reads = dense_weights(model, record.layer, hidden, inputs, band(w), prob_map)
        assert_close(record.probs * rows, probs)
        assert torch.equal(record.allowed.expand_as(reads) & rows, reads)
        assert torch.equal(record.key_padding_mask, ~real)
        split = lambda x: x.view(BSZ, 16, heads, d).transpose(1, 2)  # noqa: E731
        assert_close(record.q, split(module.query(hidden)))
        assert_close(record.k, split(module.key(hidden)))
        glob = inputs["global_attention_mask"].bool()[:, None, :, None]
        projected = split(module.query_global(hidden)) @ split(module.key_global(hidden)).mT
        scores = torch.where(glob, projected, record.q @ record.k.mT) / math.sqrt(d)
        assert_close(record.scores, scores)
    assert hf.attention_sparsity(model, of="graph")  # the forward still counts


def test_capture_attention_sparsifies_an_unmodified_model_for_the_block_only():
    """An unmodified Longformer runs its own configuration for the block and is restored after;
    a sparsified one records only the layers sparseattn runs (others: a ValueError)."""
    model, inputs = tiny_longformer(), batch(16)
    with torch.no_grad():
        ref = model(**inputs).last_hidden_state
        with hf.capture_attention(model, layers=[1]) as records:
            out = model(**inputs).last_hidden_state
    assert [r.layer for r in records] == [1]
    assert lf.model_state(model) is None
    assert_close(out, ref)
    partial = hf.sparsify(tiny_longformer(), layers=[0])
    unrecorded = pytest.raises(ValueError, match=r"layers \[1\] .* run transformers' own")
    with unrecorded, hf.capture_attention(partial):
        pass
    with torch.no_grad(), hf.capture_attention(partial, layers=[0]) as records:
        partial(**inputs)
    assert [r.layer for r in records] == [0]


def test_refusals():
    inputs = batch(13)
    for why, refused in {
        "pattern": hf.sparsify(tiny_longformer(), pattern=window(6)),
        "method hook": hf.sparsify(tiny_longformer(), method=lambda q, *a, **kw: q),
        "dropout": hf.sparsify(tiny_longformer(attention_probs_dropout_prob=0.1).train()),
    }.items():
        with pytest.raises(ValueError, match=f"output_attentions needs.*{why}"):
            refused(**inputs, output_attentions=True)
    with pytest.raises(ValueError, match="engine"):
        hf.sparsify(tiny_longformer(), engine="nope")
    with pytest.raises(ValueError, match="layers"):
        hf.sparsify(tiny_longformer(), layers=[2])
    with pytest.raises(TypeError, match="pattern"):
        hf.sparsify(tiny_longformer(), pattern="window")
    with pytest.raises(ValueError, match="heads"):
        hf.sparsify(tiny_longformer(), split_heads(*(window(2 * i) for i in range(1, 6))))
