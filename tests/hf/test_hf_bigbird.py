"""BigBird and BigBirdPegasus on sparseattn: ``sparseattn.hf.bigbird.sparsify`` of models holding
transformers' ``BigBirdBlockSparseAttention`` / ``BigBirdPegasusBlockSparseAttention`` modules.

References: the unmodified transformers models (their own block-gathering code: outputs,
logits, gradients, numpy's global state after a training call), and, for patterns and maps
other than the model's own, a dense masked re-implementation of the block-sparse layer written
here (n × n scores), itself checked against transformers for the model's layouts, with the
multiplicities of transformers' repeated blocks as a log bias. Tiny random-weight models built
from configs (nothing is downloaded), float32, dropout probabilities 0.
"""

from __future__ import annotations

import copy
import functools
import io
import math

import numpy as np
import pytest
import torch
import transformers
from tiny_models import tiny_model

import sparseattn as sa
from sparseattn import hf, sparse_attention, split_heads, window
from sparseattn.hf import bigbird as bb
from sparseattn.maps import resolve_prob_map


@pytest.fixture(autouse=True, scope="module")
def _quiet_warnings():
    """transformers warns when it pads to the block size and when it switches to full."""
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(level)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The models are tiny: one thread (on a loaded machine, more only contend)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _keep_numpy_state():
    """A training call seeds numpy's global generator (transformers, and the sparsified model
    alike): leave it as the test found it."""
    state = np.random.get_state()
    yield
    np.random.set_state(state)


#: A 3-layer BigBird of width 32, 4 heads, blocks of 4 tokens, 2 random blocks: block-sparse
#: for inputs longer than (5 + 2·2)·4 = 36 tokens (padded to a multiple of 4).
BIGBIRD = dict(
    vocab_size=100, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
    intermediate_size=48, block_size=4, num_random_blocks=2, max_position_embeddings=256,
    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attention_type="block_sparse",
)  # fmt: skip
#: A BigBirdPegasus of width 32 (2 encoder and 2 decoder layers, 4 heads), blocks of 4 tokens,
#: 2 random blocks; dropouts 0.
PEGASUS = dict(
    vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
    decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, block_size=4,
    num_random_blocks=2, max_position_embeddings=128, dropout=0.0, attention_dropout=0.0,
    activation_dropout=0.0, attention_type="block_sparse",
)  # fmt: skip
BSZ = 3
SHORT = 36  # (5 + 2r)·b: at this length and below, transformers switches to full attention


def tiny_bigbird(model: str = "BigBirdModel", train: bool = False, **overrides):
    return tiny_model("BigBirdConfig", model, **{**BIGBIRD, **overrides}).train(train)


def tiny_pegasus(model: str = "BigBirdPegasusForConditionalGeneration", train: bool = False):
    return tiny_model("BigBirdPegasusConfig", model, **PEGASUS).train(train)


def assert_close(out: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-5) -> None:
    """Equal to ``rtol`` relative to the reference's scale."""
    torch.testing.assert_close(out, ref, rtol=rtol, atol=rtol * float(ref.detach().abs().max()))


def batch(n: int, padding: bool = True, seed: int = 1, bsz: int = BSZ) -> dict:
    """Token ids of ``bsz`` items of length n; with ``padding`` item 1 is padded at its end
    (7 tokens: more than a block)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, BIGBIRD["vocab_size"], (bsz, n), generator=gen)
    mask = torch.ones(bsz, n, dtype=torch.long)
    if padding and bsz > 1:
        mask[1, n - 7 :] = 0
        ids[1, n - 7 :] = 0  # the pad token
    return {"input_ids": ids, "attention_mask": mask}


def main_output(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def run_both(model, inputs, sparse=None, **options):
    """(sparsified output, original output) of a copy of ``model`` and of ``model``."""
    sparse = bb.sparsify(copy.deepcopy(model), **options) if sparse is None else sparse
    with torch.no_grad():
        return main_output(sparse(**inputs)), main_output(model(**inputs))


# ----------------------------------------------------------- the dense reference (n × n)
def dense_bigbird_forward(
    module, allowed, prob_map, hidden_states, band_mask=None, from_mask=None, to_mask=None,
    from_blocked_mask=None, to_blocked_mask=None, **kwargs,
):  # fmt: skip
    """The block-sparse layer with n × n masks: real rows over ``allowed(module, n)`` ((n, n)
    or (H, n, n) bool; with a float (H, n, n) tensor of log multiplicities added to the
    scores) minus padding keys; padding rows output 0."""
    bsz, n, embed = hidden_states.shape
    heads, d = module.num_attention_heads, module.attention_head_size

    def split(x):
        return x.view(bsz, n, heads, d).transpose(1, 2)

    q, k, v = (split(p(hidden_states)) for p in (module.query, module.key, module.value))
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    mask = allowed(module, n)
    if mask.is_floating_point():  # log multiplicities, -inf off the layout
        scores = scores + mask.clamp(min=-1e4)
        mask = mask > -math.inf
    real = to_mask.reshape(bsz, n) != 0
    keep = mask & real[:, None, None, :]
    keep = keep | ~real[:, None, :, None]  # padding rows: any keys (their output is zeroed)
    out = prob_map(scores, keep.expand_as(scores)) @ v
    out = out * from_mask
    return out.transpose(1, 2).reshape(bsz, n, embed), None


def own_layout(module, n):
    """transformers' layout of ``module`` at length n in its current mode, as log
    multiplicities (H, n, n): log(how often its row lists the key's block), -inf if never."""
    b, r = module.block_size, module.num_random_blocks
    if module.training:
        layout = sa.bigbird_blocks(b, r, module.num_attention_heads, module.seed,
                                   max_seqlen=module.max_seqlen)  # fmt: skip
    else:
        layout = sa.bigbird_blocks(b, r, training=False)
    counts = bb.block_repeats(layout, n).double()
    counts = counts.repeat_interleave(b, 1).repeat_interleave(b, 2)
    return counts.log().float().expand(module.num_attention_heads, -1, -1)


def as_set(layout_of):
    """The layout as a set (what maps other than softmax see)."""
    return lambda module, n: layout_of(module, n) > -math.inf


def dense_reference(model, allowed, prob_map="softmax"):
    """A copy of ``model`` whose block-sparse layers are :func:`dense_bigbird_forward`."""
    ref = copy.deepcopy(model)
    rho = resolve_prob_map(prob_map)
    for module in bb.attention_modules(ref):
        module.forward = functools.partial(dense_bigbird_forward, module, allowed, rho)
    return ref


# ------------------------------------------------------------- the model's own layouts
MODELS = ["BigBirdModel", "BigBirdForMaskedLM", "BigBirdForSequenceClassification"]


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("model_class", MODELS)
@pytest.mark.parametrize("n", [48, 70])
def test_equals_transformers(model_class, n, train):
    """Without a pattern each layer runs the model's own layout: in eval mode band and global
    blocks with block 0 counted r + 1 times, in training mode layer l's random draw (seed l).
    Lengths a multiple of the block size and not (transformers pads 70 to 72), one item padded
    over more than a block."""
    model = tiny_bigbird(model_class, train)
    out, ref = run_both(model, batch(n))
    assert_close(out, ref)


def test_the_layer_specs_are_the_models_draws():
    model = bb.sparsify(tiny_bigbird())
    specs = bb.layer_specs(model)
    assert [s.pattern for s in specs.values()] == [
        sa.bigbird_blocks(4, 2, heads=4, seed=layer, max_seqlen=256) for layer in range(3)
    ]
    assert specs[0].prob_map.is_softmax and specs[0].engine == "auto"
    names = [f"encoder.layer.{i}.attention.self" for i in range(3)]
    assert bb.layer_names(model) == names and bb.is_bigbird(model)
    assert not bb.is_bigbird(tiny_model("BertConfig", "BertModel", vocab_size=50, hidden_size=8,
                                        num_hidden_layers=1, num_attention_heads=2,
                                        intermediate_size=8))  # fmt: skip


def test_the_dense_reference_is_transformers():
    """The reference (log multiplicities on n × n scores) against transformers in both modes:
    what the other tests compare patterns and maps with."""
    for train in (False, True):
        model = tiny_bigbird(train=train)
        inputs = batch(70)
        with torch.no_grad():
            ref = model(**inputs).last_hidden_state
            out = dense_reference(model, own_layout)(**inputs).last_hidden_state
        assert_close(out, ref)


def test_a_training_draw_that_repeats_blocks():
    """At n = 1024 transformers uses its older draw, which may name a band or global block
    again; those keys then count twice (a score modifier adds log 2). Layers 1 and 2 of this
    model repeat blocks, layer 0 does not."""
    model = tiny_bigbird(train=True, block_size=16, num_random_blocks=3,
                         max_position_embeddings=1024)  # fmt: skip
    layouts = bb.layer_specs(bb.sparsify(copy.deepcopy(model)))
    repeats = [int((bb.block_repeats(layouts[i].pattern, 1024) > 1).sum()) for i in range(3)]
    assert repeats[0] == 0 and repeats[1] > 0 and repeats[2] > 0
    out, ref = run_both(model, batch(1024, bsz=2))
    assert_close(out, ref)


def test_an_item_of_padding_only():
    model = tiny_bigbird()
    inputs = batch(48)
    inputs["attention_mask"][2] = 0
    out, ref = run_both(model, inputs)
    assert torch.isfinite(ref).all()
    assert_close(out, ref)


def test_float64_to_rounding():
    """In float64 the result equals transformers' to ~1e-11 (both compute in the model's
    dtype), in both modes."""
    for train in (False, True):
        out, ref = run_both(tiny_bigbird(train=train).double(), batch(70))
        assert_close(out, ref, rtol=1e-10)


def test_a_bare_module_is_the_model():
    """A lone BigBirdBlockSparseAttention (seed 5) called with transformers' masks."""
    from transformers.models.big_bird import modeling_big_bird as hf_bigbird

    config = transformers.BigBirdConfig(**BIGBIRD)
    torch.manual_seed(0)
    module = hf_bigbird.BigBirdBlockSparseAttention(config, seed=5)
    mask = torch.ones(2, 64)
    mask[0, 50:] = 0
    masks = hf_bigbird.BigBirdModel.create_masks_for_block_sparse_attn(mask, 4)
    blocked, band, from_mask, to_mask = masks
    args = (torch.randn(2, 64, 32), band, from_mask, to_mask, blocked, blocked)
    sparse = bb.sparsify(copy.deepcopy(module))
    assert bb.layer_names(sparse) == [""] and bb.layer_specs(sparse)[0].pattern.seed == 5
    for train in (False, True):
        with torch.no_grad():
            out, ref = sparse.train(train)(*args)[0], module.train(train)(*args)[0]
        assert_close(out, ref)
    assert "forward" not in vars(bb.restore(sparse))


def test_numpy_is_left_as_transformers_leaves_it():
    """A training call of transformers' module seeds numpy's global generator with the layer
    index and draws: the sparsified model leaves the same state (eval mode: untouched)."""
    model = tiny_bigbird(train=True)
    sparse = bb.sparsify(copy.deepcopy(model))
    inputs = batch(70)
    states = []
    for m in (model, sparse):
        np.random.seed(123)
        with torch.no_grad():
            m(**inputs)
        states.append(np.random.get_state())
    assert np.array_equal(states[0][1], states[1][1]) and states[0][2] == states[1][2]
    np.random.seed(123)
    with torch.no_grad():
        sparse.eval()(**inputs)
    assert np.random.randint(1 << 30) == np.random.RandomState(123).randint(1 << 30)


# ------------------------------------------------------------------- training, gradients
def check_gradients(ref_model, model, inputs, embeds_of=None):
    """Output and the gradients of the input embeddings and of every parameter."""
    inputs = dict(inputs)
    ids = inputs.pop("input_ids")
    results = []
    for m in (model, ref_model):
        embeds = (embeds_of or m.get_input_embeddings())(ids).detach().requires_grad_()
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
        if name.endswith("key.bias"):
            # zero in exact arithmetic (a key bias shifts a query's scores alike): both are
            # rounding noise, checked against the largest gradient's scale
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * scale)
        else:
            assert_close(got, want)
        checked += 1
    assert checked > 10


@pytest.mark.parametrize("model_class", ["BigBirdModel", "BigBirdForMaskedLM"])
def test_gradients_equal_transformers_in_train_mode(model_class):
    ref_model = tiny_bigbird(model_class, train=True)
    check_gradients(ref_model, bb.sparsify(copy.deepcopy(ref_model)), batch(70))


def test_gradients_in_eval_mode():
    """Eval mode (the extra eval columns carry the block-0 weight) differentiates too."""
    ref_model = tiny_bigbird()
    check_gradients(ref_model, bb.sparsify(copy.deepcopy(ref_model)), batch(48))


# --------------------------------------------------------------------- BigBirdPegasus
def pegasus_batch(n: int) -> dict:
    inputs = batch(n)
    inputs["decoder_input_ids"] = torch.randint(5, 100, (BSZ, 9), generator=torch.Generator())
    return inputs


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_pegasus_encoder_and_whole_model(train):
    """The encoder's block-sparse layers only (the decoder's attention stays transformers'):
    the encoder's output and the logits of BigBirdPegasusForConditionalGeneration."""
    model = tiny_pegasus(train=train)
    sparse = bb.sparsify(copy.deepcopy(model))
    assert bb.layer_names(sparse) == [f"model.encoder.layers.{i}.self_attn.self" for i in (0, 1)]
    inputs = pegasus_batch(61)
    with torch.no_grad():
        out, ref = sparse(**inputs), model(**inputs)
    assert_close(out.encoder_last_hidden_state, ref.encoder_last_hidden_state)
    assert_close(out.logits, ref.logits)
    encoder = tiny_pegasus("BigBirdPegasusModel", train=train).get_encoder()
    out, ref = run_both(encoder, batch(70))
    assert_close(out, ref)


def test_pegasus_gradients():
    ref_model = tiny_pegasus(train=True)
    model = bb.sparsify(copy.deepcopy(ref_model))
    inputs = pegasus_batch(61)
    check_gradients(ref_model, model, inputs, embeds_of=lambda ids: model.model.shared(ids))


# ---------------------------------------------------------------------- short inputs
def test_short_inputs_switch_to_full_attention_as_in_transformers():
    """At n <= 36 transformers replaces each layer's block-sparse module by a full-attention
    one, for good. The sparsified model does the same: its short and later long calls equal
    the original's; restore reaches the dropped modules; sparsify finds none left."""
    model = tiny_bigbird()
    sparse = bb.sparsify(copy.deepcopy(model))
    patched = bb.attention_modules(sparse)
    for n in (SHORT, 20, 70):  # full attention from the first short call on
        out, ref = run_both(model, batch(n), sparse=sparse)
        assert_close(out, ref)
    assert sparse.attention_type == model.attention_type == "original_full"
    assert bb.is_bigbird(sparse) and not bb.is_bigbird(model)
    with pytest.raises(ValueError, match="full attention"):
        bb.attention_modules(sparse)
    assert all("forward" in vars(m) for m in patched)
    bb.restore(sparse)
    assert not any("forward" in vars(m) or bb._LAYER_KEY in vars(m) for m in patched)
    assert not bb.is_bigbird(sparse) and bb.layer_specs(sparse) == {}


def test_switched_back_and_sparsified_again():
    """After ``set_attention_type('block_sparse')`` (new modules, transformers' code) a second
    sparsify patches the new modules and lets the old ones go."""
    model = tiny_bigbird()
    sparse = bb.sparsify(copy.deepcopy(model))
    old = bb.attention_modules(sparse)
    run_both(model, batch(20), sparse=sparse)
    for m in (model, sparse):
        m.set_attention_type("block_sparse")
    new = bb.attention_modules(sparse)
    assert not any("forward" in vars(m) for m in new)
    bb.sparsify(sparse, engine="gather")
    assert all("forward" in vars(m) for m in new)
    assert not any("forward" in vars(m) for m in old)
    out, ref = run_both(model, batch(70), sparse=sparse)
    assert_close(out, ref)
    bb.restore(sparse)
    assert not any("forward" in vars(m) for m in new)


def test_pegasus_short_inputs():
    model = tiny_pegasus()
    sparse = bb.sparsify(copy.deepcopy(model))
    for n in (30, 61):
        with torch.no_grad():
            out, ref = sparse(**pegasus_batch(n)).logits, model(**pegasus_batch(n)).logits
        assert_close(out, ref)
    bb.restore(sparse)


# --------------------------------------------------------------- engines, maps, patterns
@pytest.mark.parametrize("engine", ["block", "gather", "rows", "dense"])
def test_other_engines_equal_transformers(engine):
    for train in (False, True):
        out, ref = run_both(tiny_bigbird(train=train), batch(70), engine=engine)
        assert_close(out, ref)


@pytest.mark.parametrize("prob_map", ["sparsemax", "entmax15"])
def test_another_map_sees_the_layout_as_a_set(prob_map):
    for train in (False, True):
        model = tiny_bigbird(train=train)
        inputs = batch(70)
        with torch.no_grad():
            ref = dense_reference(model, as_set(own_layout), prob_map)(**inputs)
            out = bb.sparsify(model, prob_map=prob_map)(**inputs)
        assert torch.isfinite(out.last_hidden_state).all()
        assert_close(out.last_hidden_state, ref.last_hidden_state)


def _band(w):
    def allowed(module, n):
        return (torch.arange(n)[:, None] - torch.arange(n)).abs() <= w // 2

    return allowed


def _heads(module, n):
    near, far = _band(2)(module, n), _band(8)(module, n)
    return torch.stack([near, near, far, far])


@pytest.mark.parametrize(
    "pattern, allowed",
    [(window(4), _band(4)), (split_heads(window(2), window(8)), _heads)],
    ids=["window", "per-head"],
)
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_a_pattern_replaces_the_layout(pattern, allowed, train):
    """``pattern=`` serves both modes, as a set; padding keys still leave the real rows."""
    model = tiny_bigbird(train=train)
    inputs = batch(70)
    with torch.no_grad():
        ref = dense_reference(model, allowed)(**inputs).last_hidden_state
        out = bb.sparsify(model, pattern)(**inputs).last_hidden_state
    assert_close(out, ref)


# ------------------------------------------------------------------------ method hooks
def test_a_method_hook_gets_the_layer_and_eval_columns():
    """A hook in sparse_attention's signature runs every layer (with ``context``: the layer
    and its ``value``); in eval mode q and k carry the extra column, v does not."""
    seen = []

    def method(q, k, v, pattern, *, context=None, **options):
        seen.append((context.layer, context.value_proj, q.shape[-1], v.shape[-1]))
        return sparse_attention(q, k, v, pattern, **options)

    model = tiny_bigbird()
    sparse = bb.sparsify(copy.deepcopy(model), method=method)
    out, ref = run_both(model, batch(48), sparse=sparse)
    assert_close(out, ref)
    values = [m.value for m in bb.attention_modules(sparse)]
    assert seen == [(i, values[i], 9, 8) for i in range(3)]


def test_a_hook_weighs_repeated_training_blocks_through_the_columns():
    """Layer 1's draw at n = 1024 repeats blocks: a hook without a score_mod gets q and k
    wider by one column per repeated key block (v as it is) and equals transformers."""
    widths = []

    def method(q, k, v, pattern, **options):
        widths.append((q.shape[-1], k.shape[-1], v.shape[-1]))
        return sparse_attention(q, k, v, pattern, **options)

    model = tiny_bigbird(train=True, block_size=16, num_random_blocks=3,
                         max_position_embeddings=1024)  # fmt: skip
    sparse = bb.sparsify(copy.deepcopy(model), method=method, layers=[0, 1])
    out, ref = run_both(model, batch(1024, bsz=1), sparse=sparse)
    assert_close(out, ref)
    layout = bb.layer_specs(sparse)[1].pattern
    e = bb.repeat_columns(layout, 1024)[0].shape[-1]
    assert widths == [(8, 8, 8), (8 + e, 8 + e, 8)] and e >= 1


def test_the_columns_add_the_log_repeats():
    """A_i·C_j is log(repeats) of (i's block, j's block) where the block repeats, else 0."""
    n, b = 1024, 16
    for layout in (sa.bigbird_blocks(b, 3, heads=4, seed=2, max_seqlen=1024),
                   sa.bigbird_blocks(b, 3, training=False)):  # fmt: skip
        a, c = bb.repeat_columns(layout, n)
        counts = bb.block_repeats(layout, n).double()
        want = torch.where(counts > 1, counts.log(), torch.zeros(()))
        want = want.repeat_interleave(b, 1).repeat_interleave(b, 2)
        torch.testing.assert_close(a @ c.transpose(-1, -2), want, rtol=0, atol=1e-15)
    assert bb.repeat_columns(sa.bigbird_blocks(b, 3, heads=4, seed=0, max_seqlen=1024), n) is None


# ------------------------------------------------------------- restore, layers, copies
def test_restore_gives_the_original_model_back():
    original = tiny_bigbird("BigBirdForMaskedLM")
    model = copy.deepcopy(original)
    inputs = batch(70)
    with torch.no_grad():
        ref = model(**inputs).logits
        bb.sparsify(model)
        modules = bb.attention_modules(model)
        assert all("forward" in vars(m) for m in modules)
        assert bb.restore(model) is model
        out = model(**inputs).logits
    assert torch.equal(out, ref)
    assert not any("forward" in vars(m) for m in modules)
    assert bb.layer_specs(model) == {} and not hasattr(model, bb._KEY)
    assert bb.restore(model) is model  # a no-op now
    assert model.state_dict().keys() == original.state_dict().keys()


def test_layers_and_sparsifying_again():
    model = tiny_bigbird()
    inputs = batch(70)
    with torch.no_grad():
        ref = model(**inputs).last_hidden_state
        bb.sparsify(model, layers=[1])
        modules = bb.attention_modules(model)
        assert ["forward" in vars(m) for m in modules] == [False, True, False]
        assert_close(model(**inputs).last_hidden_state, ref)
        bb.sparsify(model, engine="block", layers=[0, 2])
        specs = bb.layer_specs(model)
        assert [specs[i].engine for i in range(3)] == ["block", "auto", "block"]
        assert_close(model(**inputs).last_hidden_state, ref)
        bb.restore(model)
        assert torch.equal(model(**inputs).last_hidden_state, ref)


def test_copies_and_pickles_stay_bound_to_their_own_modules():
    model = bb.sparsify(tiny_bigbird())
    inputs = batch(70)
    with torch.no_grad():
        ref = model(**inputs).last_hidden_state  # fills the caches, which copies leave out
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    twin = copy.deepcopy(model)
    assert len(getattr(twin, bb._KEY).cache) == 0
    with torch.no_grad():
        for other in (loaded, twin):
            for mine, theirs in zip(
                bb.attention_modules(other), bb.attention_modules(model), strict=True
            ):
                assert mine.forward.args[0] is mine and theirs.forward.args[0] is theirs
            assert torch.equal(other(**inputs).last_hidden_state, ref)
        bb.restore(twin)
    assert "forward" in vars(bb.attention_modules(model)[0])


# ------------------------------------------------------------------ attention_sparsity
@pytest.mark.parametrize("prob_map", ["softmax", "entmax15"])
def test_attention_sparsity_counts_the_layout_as_a_set(prob_map):
    """Per layer, 1 − (the keys of the eval layout each real row may read, a block listed
    again counted once; or ρ's non-zero weights there) / (pairs of real tokens), against n × n
    counts from the layout's dense mask and the layer's inputs."""
    model = bb.sparsify(tiny_bigbird(), prob_map=prob_map, count_weights=True)
    with torch.no_grad():
        for module in bb.attention_modules(model):  # peaked scores: entmax leaves some keys 0
            module.query.weight.mul_(8.0)
    inputs = batch(64)
    with torch.no_grad():
        out = model(**inputs, output_hidden_states=True)
    graph, weights = hf.attention_sparsity(model, of="graph"), hf.attention_sparsity(model)
    real = inputs["attention_mask"].bool()
    heads, d = BIGBIRD["num_attention_heads"], BIGBIRD["hidden_size"] // 4
    pairs = float((real.sum(-1).double() ** 2).sum()) * heads
    layout = sa.bigbird_blocks(4, 2, training=False).graph(64).to_dense().bool()
    reads = (layout & real[:, None, None, :] & real[:, None, :, None]).expand(-1, heads, -1, -1)
    for layer, module in enumerate(bb.attention_modules(model)):
        hidden = out.hidden_states[layer]
        split = lambda x: x.view(BSZ, 64, heads, d).transpose(1, 2)  # noqa: E731
        with torch.no_grad():
            scores = split(module.query(hidden)) @ split(module.key(hidden)).mT / math.sqrt(d)
        keys = (layout & real[:, None, None, :]).expand_as(scores)
        probs = resolve_prob_map(prob_map)(scores, keys) * real[:, None, :, None]
        assert graph[layer] == pytest.approx(1 - float(reads.sum()) / pairs)
        assert weights[layer] == pytest.approx(1 - float((probs > 0).sum()) / pairs)
    assert (weights == graph) == (prob_map == "softmax")


# ------------------------------------------------------------------ output_attentions
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("model_class", ["BigBirdModel", "pegasus"])
def test_output_attentions_equal_transformers_on_real_rows(model_class, train):
    """transformers' n × n matrix per layer — a block listed twice holds one copy's weight
    (eval mode: block 0) — on the rows of real tokens, to float rounding; the rows of padding
    tokens 0 (transformers' hold weights its output then discards)."""
    model = tiny_pegasus(train=train) if model_class == "pegasus" else tiny_bigbird(train=train)
    inputs = batch(64)
    if model_class == "pegasus":
        inputs["decoder_input_ids"] = inputs["input_ids"][:, :5]
    with torch.no_grad():
        ref = model(**inputs, output_attentions=True)
        out = bb.sparsify(copy.deepcopy(model))(**inputs, output_attentions=True)
    name = "encoder_attentions" if model_class == "pegasus" else "attentions"
    real = inputs["attention_mask"].bool()[:, None, :, None]
    for ours, theirs in zip(getattr(out, name), getattr(ref, name), strict=True):
        assert ours.shape == theirs.shape == (BSZ, 4, 64, 64)
        assert_close(ours * real, theirs * real)
        assert not bool((ours * ~real).any())
    if model_class == "pegasus":  # the decoder's are transformers' own
        for ours, theirs in zip(out.decoder_attentions, ref.decoder_attentions, strict=True):
            assert_close(ours, theirs)


def test_output_attentions_of_another_map_are_its_weights_on_the_layout():
    """With 1.5-entmax the matrix is ρ's weights on each real row's layout keys (a set)."""
    model = bb.sparsify(tiny_bigbird(), prob_map="entmax15")
    inputs = batch(64)
    with torch.no_grad():
        out = model(**inputs, output_attentions=True, output_hidden_states=True)
    module, hidden = bb.attention_modules(model)[0], out.hidden_states[0]
    heads, d = BIGBIRD["num_attention_heads"], BIGBIRD["hidden_size"] // 4
    split = lambda x: x.view(BSZ, 64, heads, d).transpose(1, 2)  # noqa: E731
    with torch.no_grad():
        scores = split(module.query(hidden)) @ split(module.key(hidden)).mT / math.sqrt(d)
    real = inputs["attention_mask"].bool()
    layout = sa.bigbird_blocks(4, 2, training=False).graph(64).to_dense().bool()
    keys = (layout & real[:, None, None, :] & real[:, None, :, None]).expand_as(scores)
    assert_close(out.attentions[0], resolve_prob_map("entmax15")(scores, keys))


@pytest.mark.parametrize("train", [False, True])
def test_capture_attention_records_each_keys_total_weight(train):
    """``hf.capture_attention`` on BigBird: scores scale·q kᵀ, the layout's keys as a set, and
    each key's total weight — transformers' weight of one copy (``output_attentions``, equal
    on real rows) times the times its block is listed (eval mode: block 0, r + 1 times), so
    that each real row sums to 1. An unmodified model is sparsified for the block only."""
    model, inputs = tiny_bigbird(train=train), batch(64)
    with torch.no_grad():
        ref = model(**inputs, output_attentions=True, output_hidden_states=True)
        with hf.capture_attention(model) as records:
            model(**inputs)
    assert bb.model_state(model) is None
    assert [r.layer for r in records] == [0, 1, 2]
    real = inputs["attention_mask"].bool()
    rows = real[:, None, :, None]
    heads, d = BIGBIRD["num_attention_heads"], BIGBIRD["hidden_size"] // 4
    split = lambda x: x.view(BSZ, 64, heads, d).transpose(1, 2)  # noqa: E731
    for record in records:
        module, hidden = bb.attention_modules(model)[record.layer], ref.hidden_states[record.layer]
        with torch.no_grad():
            q, k = split(module.query(hidden)), split(module.key(hidden))
        assert_close(record.scores, q @ k.mT / math.sqrt(d))
        layout = sa.bigbird_blocks(4, 2, heads, seed=record.layer, training=train)
        repeats = bb.block_repeats(layout, 64).repeat_interleave(4, 1).repeat_interleave(4, 2)
        keys = (repeats > 0) & real[:, None, None, :]
        assert torch.equal(record.allowed.expand(BSZ, heads, 64, 64) & rows, keys & rows)
        theirs = ref.attentions[record.layer] * repeats
        assert_close(record.probs * rows, theirs * rows)
        sums = record.probs.sum(-1)[real[:, None, :].expand(BSZ, heads, 64)]
        torch.testing.assert_close(sums, torch.ones_like(sums))
        assert bool((repeats > 1).any()) != train


def test_capture_attention_of_another_map_is_its_weights_on_the_layout():
    model = bb.sparsify(tiny_bigbird(), prob_map="entmax15")
    inputs = batch(64)
    with torch.no_grad(), hf.capture_attention(model, layers=[1]) as records:
        out = model(**inputs, output_attentions=True)
    (record,) = records
    real = inputs["attention_mask"].bool()[:, None, :, None]
    assert_close(record.probs * real, out.attentions[1])


# ----------------------------------------------------------------------- refusals
def test_refusals():
    hooked = bb.sparsify(tiny_bigbird(), method=lambda q, *a, **kw: q)
    with pytest.raises(ValueError, match="output_attentions needs"), torch.no_grad():
        hooked(**batch(48), output_attentions=True)
    with pytest.raises(ValueError, match="engine"):
        bb.sparsify(tiny_bigbird(), engine="nope")
    with pytest.raises(ValueError, match="layers"):
        bb.sparsify(tiny_bigbird(), layers=[3])
    with pytest.raises(TypeError, match="pattern"):
        bb.sparsify(tiny_bigbird(), pattern="window")
    with pytest.raises(ValueError, match="heads"):
        bb.sparsify(tiny_bigbird(), split_heads(*(window(2 * i) for i in range(1, 6))))
    with pytest.raises(ValueError, match="holds no BigBirdBlockSparseAttention"):
        bb.sparsify(tiny_bigbird(attention_type="original_full"))
