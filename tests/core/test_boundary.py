"""Issue 17: bad and edge inputs at every public entry point, drawn by hypothesis.

Each draw ends in a ValueError/TypeError whose message names the argument, or in a finite
result checked against an independent reference (closed-form masks, torch SDPA with a
brute-force mask, float64 softmax, a sort-based float64 sparsemax transcription).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from bad_inputs import BAD_REAL, BAD_SIZE
from hypothesis import given, settings
from hypothesis import strategies as st

import sparseattn as sa
from sparseattn import AttentionGraph, hf
from sparseattn.methods.mca import MCAMethod, mc_value_projection, mca_attention, sample_sizes
from sparseattn.methods.sparsebert import DifferentiableAttentionMask, keep_row_max
from sparseattn.validate import (
    check_finite_float,
    check_int,
    check_positive,
    check_probability,
    check_tensor,
)

pytestmark = pytest.mark.device

FAST = settings(max_examples=15, deadline=None)


def raises_naming(name: str, fn, *args, **kwargs) -> None:
    with pytest.raises((TypeError, ValueError)) as info:
        fn(*args, **kwargs)
    assert name in str(info.value), f"{name!r} not named in: {info.value}"


# ----------------------------------------------------------------------------- validate.py
@FAST
@given(BAD_SIZE)
def test_validate_helpers_name_the_argument(value):
    raises_naming("size_arg", check_positive, "size_arg", value)


@FAST
@given(BAD_REAL)
def test_check_finite_float_refuses_non_reals(value):
    raises_naming("real_arg", check_finite_float, "real_arg", value)


@FAST
@given(st.floats(allow_nan=False, allow_infinity=False))
def test_check_probability_bounds(p):
    if 0 <= p < 1:
        assert check_probability("p", p, allow_one=False) == p
    else:
        raises_naming("p", check_probability, "p", p, allow_one=False)


def test_check_int_and_tensor():
    assert check_int("i", torch.tensor(3)) == 3
    raises_naming("t", check_tensor, "t", [1.0])
    raises_naming("t", check_tensor, "t", torch.zeros(2), dim=2)
    raises_naming("t", check_tensor, "t", torch.zeros(2, dtype=torch.long), floating=True)


# ----------------------------------------------------------------------------- patterns
SIZE_FACTORIES = {
    "w": [sa.window, sa.strided, sa.fixed, sa.star, lambda w: sa.longformer(w, 1)],
    "block": [sa.block_local, lambda b: sa.random_blocks(1, b)],
    "random_blocks": [lambda r: sa.random_blocks(r, 4)],
    "k": [sa.topk, lambda k: sa.random(k=k)],
    "global_tokens": [sa.global_tokens],
}


@FAST
@given(BAD_SIZE)
def test_pattern_size_parameters_are_validated(value):
    for name, factories in SIZE_FACTORIES.items():
        for make in factories:
            if name == "global_tokens" and isinstance(value, list):
                continue  # a list of ints is a valid global_tokens spec (checked below)
            raises_naming(name, make, value)


@FAST
@given(st.one_of(BAD_REAL, st.floats(max_value=0), st.floats(min_value=1.0001, max_value=1e9)))
def test_random_density_is_validated(density):
    raises_naming("density", sa.random, density=density)


@FAST
@given(st.lists(st.one_of(st.floats(0.1, 5.9), st.integers(max_value=-1), st.text()), min_size=1))
def test_global_token_positions_must_be_non_negative_ints(tokens):
    raises_naming("global_tokens", sa.global_tokens, tokens)
    raises_naming("global_tokens", sa.longformer, 4, tokens)


def test_split_heads_sizes_and_topk_chunk_are_validated():
    raises_naming("sizes", sa.split_heads, sa.window(2), sa.dense(), sizes=["a", 2])
    raises_naming("sizes", sa.split_heads, sa.window(2), sa.dense(), sizes=[2])
    raises_naming("sizes", sa.split_heads, sa.window(2), sizes=4)
    raises_naming("chunk", sa.patterns.TopK, 4, False, "x")
    raises_naming("chunk", sa.patterns.TopK, 4, False, 0)


def _brute(n: int, rule) -> torch.Tensor:
    return torch.tensor([[bool(rule(i, j)) for j in range(n)] for i in range(n)])


@FAST
@given(st.integers(1, 24), st.integers(0, 10**15))
def test_huge_window_and_block_parameters_are_exact_and_cheap(n, extra):
    """Parameters far beyond n (10¹⁵ at n ≤ 24) give the closed-form mask without allocating."""
    big = n + extra
    ceil_half, floor_half = -(-big // 2), big // 2
    cases = {
        sa.window(big): lambda i, j: -ceil_half <= j - i <= floor_half,
        sa.block_local(big): lambda i, j: i // big == j // big,
        sa.strided(big, part=2): lambda i, j: (j - i) % big == 0,
        sa.fixed(big, part=2): lambda i, j: j == i or j % big == big - 1,
        sa.random_blocks(10**12, big): lambda i, j: True,  # one block holds every key
        sa.star(big): lambda i, j: True,  # the ring wraps over every ordinary token
    }
    for pattern, rule in cases.items():
        want = _brute(n, rule)
        torch.testing.assert_close(
            pattern.graph(n).to(want.device).to_dense(), want, msg=repr(pattern)
        )


# ----------------------------------------------------------------------------- graph
@FAST
@given(st.integers(1, 6), st.integers(1, 6), st.integers(0, 20))
def test_from_edges_refuses_out_of_range_and_fractional_indices(n_q, n_k, past):
    rows = torch.tensor([0, n_q + past])
    cols = torch.tensor([0, 0])
    raises_naming("row", AttentionGraph.from_edges, rows, cols, n_q, n_k)
    raises_naming("rows", AttentionGraph.from_edges, rows.float() + 0.5, cols, n_q, n_k)
    raises_naming("cols", AttentionGraph.from_edges, rows * 0, cols + 0.5, n_q, n_k)
    raises_naming("key", AttentionGraph.from_edges, rows * 0, cols + n_k + past, n_q, n_k)
    raises_naming("index", AttentionGraph.from_neighbours, torch.zeros(n_q, 2) + 0.5, None, n_k)
    raises_naming("n_k", AttentionGraph.from_edges, rows * 0, cols, n_q, "x")


# ----------------------------------------------------------------------------- attention
def _reference(q, k, v, mask, scale):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@FAST
@given(
    st.integers(1, 2),
    st.integers(1, 3),
    st.integers(1, 20),
    st.integers(1, 5),
    st.integers(1, 10**12),
    st.sampled_from(["dense", "gather", "block"]),
    st.one_of(st.none(), st.floats(-3, 3)),
)
def test_sparse_attention_matches_sdpa_with_a_brute_force_mask(bsz, heads, n, d, w, engine, scale):
    gen = torch.Generator().manual_seed(n * 31 + d)
    q, k, v = (torch.randn(bsz, heads, n, d, generator=gen, dtype=torch.float64) for _ in "qkv")
    mask = _brute(n, lambda i, j: -((w + 1) // 2) <= j - i <= w // 2)
    out = sa.sparse_attention(q, k, v, sa.window(w), engine=engine, scale=scale)
    expected = _reference(q, k, v, mask, 1 / math.sqrt(d) if scale is None else scale)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected)


@FAST
@given(BAD_REAL)
def test_scale_must_be_a_finite_real(scale):
    q = torch.randn(1, 1, 4, 2)
    raises_naming("scale", sa.sparse_attention, q, q, q, sa.dense(), scale=scale)
    raises_naming("scale", sa.attention_weights, q, q, sa.dense(), scale=scale)


@FAST
@given(st.floats(1e36, 1e300))
def test_a_scale_that_overflows_the_scores_is_an_error_not_nan(scale):
    q = torch.full((1, 1, 4, 8), 10.0)
    _host_checks_only(q)
    raises_naming("scale", sa.sparse_attention, q, q, q, sa.window(2), scale=scale)
    raises_naming("scale", sa.attention_weights, q, q, sa.window(2), scale=scale)


@FAST
@given(st.one_of(BAD_REAL, st.floats(1, 10), st.floats(max_value=-1e-9)))
def test_dropout_is_validated(p):
    q = torch.randn(1, 1, 4, 2)
    raises_naming("dropout_p", sa.sparse_attention, q, q, q, sa.dense(), dropout_p=p)
    raises_naming("dropout", sa.SparseAttention, 4, 2, dropout=p)


def test_other_sparse_attention_arguments_are_named():
    q = torch.randn(1, 1, 4, 2)
    raises_naming("engine", sa.sparse_attention, q, q, q, sa.dense(), engine=["dense"])
    raises_naming("engine", sa.sparse_attention, q, q, q, sa.dense(), engine="nope")
    raises_naming(
        "key_padding_mask", sa.sparse_attention, q, q, q, sa.dense(), key_padding_mask=[[True] * 4]
    )
    raises_naming("q", sa.sparse_attention, [[1.0]], q, q, sa.dense())
    raises_naming("q", sa.sparse_attention, q.to("meta"), q.to("meta"), q.to("meta"), sa.dense())
    raises_naming("pattern", sa.sparse_attention, q, q, q, "window")
    _host_checks_only(q)
    bad = q.clone()
    bad[0, 0, 1, 1] = math.nan
    raises_naming("k", sa.sparse_attention, q, bad, q, sa.dense())


@pytest.mark.parametrize("pattern", [sa.window(2), sa.dense(), sa.dense().causal()], ids=str)
@pytest.mark.parametrize("prob_map", ["softmax", "entmax15", "sparsemax", "hardmax"])
def test_nan_or_inf_the_call_reads_is_named(pattern, prob_map):
    """On CPU a result that is not finite names the input holding NaN or inf, on every engine
    and map; q is checked before the call (some kernels turn a NaN row into a finite one), and
    the flex engine reads k before its call (torch's CPU kernel gives the rows that read a
    NaN key zeros, on AVX2 and AVX-512: tests/engines/test_flex_cpu.py). An inf in k is left
    out: where it makes a score −inf, that key gets weight 0 and the result stays finite
    (docs/engines.md, "Checks that read values")."""
    _host_checks_only(torch.zeros(1))
    gen = torch.Generator().manual_seed(0)
    for engine, name, bad in itertools.product(
        ["auto", "dense", "rows", "block", "gather", "flex"], "qkv", [math.nan, math.inf]
    ):
        if (engine == "flex" and prob_map != "softmax") or (name, bad) == ("k", math.inf):
            continue  # the flex engine runs softmax only
        q, k, v = (torch.randn(1, 2, 8, 4, generator=gen) for _ in range(3))
        {"q": q, "k": k, "v": v}[name][0, 0, 0, 0] = bad  # key 0: seen by every pattern
        with pytest.raises(ValueError, match=f"^{name} contains NaN or inf"):
            sa.sparse_attention(q, k, v, pattern, prob_map=prob_map, engine=engine)


def test_nan_in_keys_the_call_never_reads_is_not_an_error():
    """The check reads the result, not every input: decoding one token with a window against a
    long cache reads the window's keys only, and a NaN before the window changes nothing."""
    _host_checks_only(torch.zeros(1))
    q, k, v = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 256, 4), torch.randn(1, 2, 256, 4)
    pattern = sa.window(8).causal()
    for engine in ("block", "gather"):  # the engines that read the graph's keys only
        k0, v0 = k.clone(), v.clone()
        clean = sa.sparse_attention(q, k0, v0, pattern, engine=engine)
        k0[0, 0, 3], v0[0, 1, 5] = math.nan, math.inf
        torch.testing.assert_close(sa.sparse_attention(q, k0, v0, pattern, engine=engine), clean)
        k0[0, 0, 253] = math.nan  # inside the window (keys 251…255)
        raises_naming("k", sa.sparse_attention, q, k0, v0, pattern, engine=engine)


def test_a_call_with_gradients_reads_every_input():
    """An inf key scored −inf gets weight 0 (a finite output) but a NaN gradient in q: a call
    that will be differentiated checks q, k and v whole first."""
    _host_checks_only(torch.zeros(1))
    q, k, v = torch.rand(1, 1, 4, 3) + 0.1, torch.randn(1, 1, 4, 3), torch.randn(1, 1, 4, 3)
    k[0, 0, 0, 0] = -math.inf  # q > 0: the scores of key 0 are −inf
    assert sa.sparse_attention(q, k, v, sa.window(4)).isfinite().all()
    raises_naming("k", sa.sparse_attention, q.requires_grad_(), k, v, sa.window(4))


def _host_checks_only(t: torch.Tensor) -> None:
    """NaN inputs and overflowing scores are refused on CPU only (no host sync on a GPU)."""
    if t.device.type != "cpu":
        pytest.skip("value checks that read back to the host run on CPU only")


@pytest.mark.parametrize("engine", ["auto", "dense", "gather", "block"])
@pytest.mark.parametrize(
    "shape", [(0, 2, 5, 3, 3), (2, 0, 5, 3, 3), (2, 2, 0, 3, 3), (2, 2, 5, 3, 0)]
)
def test_empty_dimensions_give_a_defined_empty_result(engine, shape):
    """batch 0, heads 0, n 0 or d_v 0: an empty output of the right shape, with gradients."""
    bsz, heads, n, d, d_v = shape
    q = torch.randn(bsz, heads, n, d, requires_grad=True)
    k = torch.randn(bsz, heads, n, d)
    v = torch.randn(bsz, heads, n, d_v)
    out = sa.sparse_attention(q, k, v, sa.window(2), engine=engine)
    assert out.shape == (bsz, heads, n, d_v)
    out.sum().backward()
    assert q.grad.shape == q.shape
    assert sa.attention_weights(q, k, sa.window(2)).shape == (bsz, heads, n, n)


def test_zero_head_dim_and_no_keys_are_errors():
    q = torch.randn(1, 1, 3, 0)
    raises_naming("d", sa.sparse_attention, q, q, torch.randn(1, 1, 3, 2), sa.dense())
    q = torch.randn(1, 1, 3, 2)
    empty = torch.randn(1, 1, 0, 2)
    raises_naming("key", sa.sparse_attention, q, empty, empty, sa.dense())


@FAST
@given(BAD_SIZE)
def test_sparse_attention_module_arguments_are_named(value):
    raises_naming("embed_dim", sa.SparseAttention, value, 1)
    raises_naming("num_heads", sa.SparseAttention, 4, value)


def test_sparse_attention_module_edges(device):
    raises_naming("engine", sa.SparseAttention, 4, 2, engine="nope")
    raises_naming("layer_index", sa.SparseAttention, 4, 2, layer_index=-1)
    raises_naming("bias", sa.SparseAttention, 4, 2, bias="yes")
    layer = sa.SparseAttention(8, 2, sa.window(2)).to(device)
    raises_naming("x", layer, [[0.0] * 8])
    raises_naming("x", layer, torch.zeros(1, 3, 8, dtype=torch.float64))
    raises_naming("x", layer, torch.zeros(1, 3, 8, dtype=torch.long))
    out = layer(torch.zeros(2, 0, 8))  # n = 0: a defined empty sequence
    assert out.shape == (2, 0, 8)
    x = torch.randn(2, 5, 8)
    wide = sa.SparseAttention(8, 2, sa.window(10**12)).to(device)  # clamped: every key
    dense = sa.SparseAttention(8, 2, sa.dense()).to(device)
    dense.load_state_dict(wide.state_dict())
    torch.testing.assert_close(wide(x), dense(x))


# ----------------------------------------------------------------------------- maps
MAPS = [sa.softmax(), sa.sparsemax(), sa.entmax(1.5), sa.entmax(1.3), sa.hardmax()]


@FAST
@given(st.integers(1, 12), st.integers(0, 11), st.sampled_from([math.nan, math.inf, -math.inf]))
def test_maps_refuse_non_finite_valid_scores_but_ignore_padding(k, where, bad):
    where = where % k
    scores = torch.randn(2, k)
    scores[1, where] = bad
    for rho in MAPS:
        raises_naming("scores", rho, scores)
        valid = torch.ones(2, k, dtype=torch.bool)
        valid[1, where] = False
        out = rho(scores, valid)
        assert torch.isfinite(out).all() and out[1, where] == 0


@FAST
@given(st.floats(1e-9, 1e-3), st.floats(0.1, 5.0))
def test_entmax_near_one_in_float32_is_close_to_softmax(eps, spread):
    """|entmax_α − softmax| = O(α − 1): float32 must not add more (it used to add up to 0.3)."""
    gen = torch.Generator().manual_seed(int(eps * 1e9) % 1000)
    x = torch.randn(8, 200, generator=gen) * spread
    got = sa.entmax(1 + eps)(x)
    reference = torch.softmax(x.double(), -1)
    assert (got.double() - reference).abs().max() <= 10 * eps * spread + 1e-5


def _sparsemax_reference(z: torch.Tensor) -> torch.Tensor:
    """Martins & Astudillo (2016), by sorting, in float64."""
    z = z.double()
    zs = z.sort(-1, descending=True).values
    k = torch.arange(1, z.shape[-1] + 1, dtype=z.dtype)
    cums = zs.cumsum(-1)
    support = (1 + k * zs > cums).sum(-1, keepdim=True)
    tau = (cums.gather(-1, support - 1) - 1) / support
    return (z - tau).clamp_min(0)


@settings(max_examples=5, deadline=None)
@given(st.sampled_from([1e-6, 1e-3, 1.0]), st.sampled_from([8192, 12000]))
def test_float32_sparsemax_on_long_nearly_tied_rows_sums_to_one(spread, k):
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(k)) * spread
    got = sa.sparsemax()(x)
    assert (got.double().sum(-1) - 1).abs().max() < 1e-5
    assert (got.double() - _sparsemax_reference(x)).abs().max() < 1e-5


@FAST
@given(BAD_REAL)
def test_map_parameters_are_named(value):
    raises_naming("alpha", sa.entmax, value)
    raises_naming("lam", sa.sparselin_gen, value)


# ----------------------------------------------------------------------------- MCA
def _mca_data(n=6, d_in=5, heads=2, d_head=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, n, d_in, generator=gen, dtype=torch.float64)
    w = torch.randn(heads, d_in, d_head, generator=gen, dtype=torch.float64)
    q = torch.randn(2, heads, n, 4, generator=gen, dtype=torch.float64)
    return x, w, q


@FAST
@given(st.one_of(BAD_REAL, st.floats(max_value=-1e-9)))
def test_mca_alpha_is_validated(alpha):
    x, w, q = _mca_data()
    weights = sa.attention_weights(q, q, sa.dense())
    raises_naming("alpha", sample_sizes, weights, alpha, 5)
    raises_naming("alpha", mca_attention, x, q, q, w, None, alpha, sa.dense())
    raises_naming("alpha", MCAMethod, alpha)


@FAST
@given(BAD_SIZE)
def test_mca_sizes_are_validated(d_in):
    x, w, q = _mca_data()
    raises_naming("d_in", sample_sizes, sa.attention_weights(q, q, sa.dense()), 0.1, d_in)


def test_mca_refuses_nan_and_bad_sample_counts():
    x, w, q = _mca_data()
    r = torch.full((2, 2, 6), 2)
    weights = sa.attention_weights(q, q, sa.dense())
    raises_naming("weights", sample_sizes, weights * math.nan, 0.1, 5)
    raises_naming("r", mc_value_projection, x, w, -r)
    raises_naming("r", mc_value_projection, x, w, r * 10)
    raises_naming("r", mc_value_projection, x, w, r.float())
    raises_naming("x", mc_value_projection, x * math.nan, w, r)
    raises_naming("weight", mc_value_projection, x, w * math.inf, r)
    raises_naming("bias", mc_value_projection, x, w, r, torch.zeros(3))
    raises_naming("generator", mc_value_projection, x, w, r, None, 0)
    raises_naming("seed", MCAMethod, 0.1, seed="a")


def test_mca_with_every_key_padded_is_refused():
    x, w, q = _mca_data()
    pad = torch.ones(2, 6, dtype=torch.bool)  # True = padding: every key ignored
    with pytest.raises(ValueError, match="key_padding_mask ignores every key"):
        mca_attention(x, q, q, w, None, 0.3, sa.dense(), key_padding_mask=pad)
    pad[1] = False  # one item unpadded: still refused, naming the other
    with pytest.raises(ValueError, match=r"batch item\(s\) \[0\]"):
        mca_attention(x, q, q, w, None, 0.3, sa.dense(), key_padding_mask=pad)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[1, 4:] = True  # item 1: two padding tokens at the end
    res = mca_attention(x, q, q, w, None, 0.3, sa.dense(), key_padding_mask=pad)
    assert (res.r[1, :, 4:] == 0).all() and (res.r[0] > 0).all()  # padding gets no samples


@FAST
@given(st.floats(0.0, 2.0), st.integers(0, 1000))
def test_mca_is_exact_at_full_samples_and_finite_otherwise(alpha, seed):
    x, w, q = _mca_data(seed=seed)
    res = mca_attention(x, q, q, w, None, alpha, sa.window(2))
    exact = sa.attention_weights(q, q, sa.window(2)) @ torch.einsum("bnd,hde->bhne", x, w)
    assert torch.isfinite(res.out).all()
    if alpha == 0:
        torch.testing.assert_close(res.out, exact)


def test_mca_creates_every_tensor_on_the_input_device():
    """Under ``torch.device('meta')`` any factory call without a device lands on meta and then
    fails against the CPU inputs: the sampled projection must create nothing device-fixed."""
    x, w, _ = _mca_data()
    r = torch.tensor([[[1, 2, 5, 0, 3, 4]] * 2] * 2)
    expected = mc_value_projection(x, w, r, generator=torch.Generator().manual_seed(1))
    with torch.device("meta"):
        got = mc_value_projection(x, w, r, generator=torch.Generator().manual_seed(1))
        sizes = sample_sizes(torch.rand(2, 2, 6, 6, device="cpu"), 0.5, 5)
    assert got.device == x.device and sizes.device.type == "cpu"
    torch.testing.assert_close(got, expected)


# ----------------------------------------------------------------------------- DAM
@FAST
@given(st.floats(1e31, 1e300))
def test_dam_refuses_values_that_overflow_float32(big):
    raises_naming("init_std", DifferentiableAttentionMask, 4, 1, init_std=big)
    raises_naming("bias_value", DifferentiableAttentionMask, 4, 1, bias_value=-big)
    raises_naming("tau", DifferentiableAttentionMask, 4, 1, tau=math.nan)
    raises_naming("max_len", DifferentiableAttentionMask, "4", 1)


@FAST
@given(st.integers(2, 9), st.floats(-4.5, 5), st.integers(0, 100))
def test_dam_empty_rows_keep_one_entry_and_symmetry(n, tie, seed):
    """A row of equal logits keeps exactly one entry (not all); a symmetric mask stays so.
    (tie > −5: at tie = −5 every logit is equal, the logits are symmetric, and the rule
    mirrors the added entries — the symmetric case checked below.)"""
    rows = torch.linspace(-5, tie, n)[:, None].expand(n, n)[None]  # row i: n copies of one value
    hard = keep_row_max(rows > 0, rows)
    empty = ~(rows > 0).any(-1)
    assert torch.equal(hard.sum(-1)[empty], torch.ones_like(hard.sum(-1)[empty]))
    assert hard[empty][:, 0].all()  # the first of the tied maxima
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(1, n, n, generator=gen) - 1.5
    sym = a + a.transpose(-1, -2)
    kept = keep_row_max(sym > 0, sym)
    assert torch.equal(kept, kept.transpose(-1, -2))
    assert kept.any(-1).all()


# ----------------------------------------------------------------------------- hf
@pytest.mark.parametrize("fn", [hf.restore, hf.sparsify, hf.layer_specs, hf.attention_sparsity])
def test_hf_helpers_refuse_a_non_model(fn):
    raises_naming("model", fn, 5)


def test_hf_capture_and_encode_refuse_bad_arguments():
    with pytest.raises(TypeError, match="model"), hf.capture_attention("model"):
        pass
    raises_naming("layers", hf.state.check_layers, 5)
    raises_naming("layers", hf.state.check_layers, [0, 9], 6)
    raises_naming("layers", hf.state.check_layers, ["a"])


# ----------------------------------------------------------------------------- dmin theory
def test_dmin_causal_theory_uses_k_plus_one():
    from sparseattn.lab.experiments.dmin import DminConfig, summarise
    from sparseattn.methods.likhosherstov.expressivity import theorem_d, theorem_slope

    cells = {"c": {"q": 1.0, "n": 16, "d_min": 8}}
    for causal, k_eff in ((False, 2), (True, 3)):
        config = DminConfig(k=2, ns=(16,), causal=causal)
        s = summarise(config, cells)["1"]
        assert s["table"][0]["theorem_d"] == theorem_d(16, k_eff, 2.0, 0.25, 2.0)
        assert s["theory_slope"] == theorem_slope(k_eff, 2.0, 0.25, 2.0)
    raises_naming("k", DminConfig(k="a").validate)
    raises_naming("ns", DminConfig(ns=(1,)).validate)
