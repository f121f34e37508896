"""Tests for sparseattn.maps against the `entmax` package, torch.softmax and closed forms."""

from __future__ import annotations

import math
from collections.abc import Callable

import entmax as ref
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseattn.maps import (
    ProbabilityMap,
    entmax,
    hardmax,
    resolve_prob_map,
    softmax,
    sparselin_gen,
    sparsemax,
)

pytestmark = pytest.mark.device

F64 = torch.float64
INF = math.inf
Ref = Callable[[torch.Tensor], torch.Tensor]


def hardmax_ref(x: torch.Tensor) -> torch.Tensor:
    """One-hot argmax, the weight split uniformly over tied maxima (the documented tie rule)."""
    top = (x == x.amax(-1, keepdim=True)).to(x.dtype)
    return top / top.sum(-1, keepdim=True)


def bisect_ref(alpha: float) -> Ref:
    return lambda x: ref.entmax_bisect(x, alpha=alpha, n_iter=100)


def sparselin_ref(lam: float) -> Ref:
    return lambda x: ref.sparsemax(x / (1 - lam))


# (map, independent reference acting on unpadded rows along the last dim)
CASES: dict[str, tuple[ProbabilityMap, Ref]] = {
    "softmax": (softmax(), lambda x: torch.softmax(x, -1)),
    "hardmax": (hardmax(), hardmax_ref),
    "sparsemax": (sparsemax(), ref.sparsemax),
    "entmax15": (entmax(1.5), ref.entmax15),
    "entmax1.2": (entmax(1.2), bisect_ref(1.2)),
    "entmax1.7": (entmax(1.7), bisect_ref(1.7)),
    "entmax3": (entmax(3.0), bisect_ref(3.0)),
    "sparselin0": (sparselin_gen(0.0), sparselin_ref(0.0)),
    "sparselin0.3": (sparselin_gen(0.3), sparselin_ref(0.3)),
    "sparselin0.9": (sparselin_gen(0.9), sparselin_ref(0.9)),
}
SMOOTH = [name for name in CASES if name != "hardmax"]
PACKAGE = {"sparsemax": "sparsemax", "entmax15": "entmax15", "entmax1.2": 1.2, "entmax3": 3.0}


def ref_on_valid(fn: Ref, scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Reference applied row by row to the valid entries only; empty rows stay zero."""
    k = scores.shape[-1]
    rows, masks = scores.reshape(-1, k), valid.expand(scores.shape).reshape(-1, k)
    out = torch.zeros_like(rows)
    for i in range(rows.shape[0]):
        if masks[i].any():
            out[i, masks[i]] = fn(rows[i, masks[i]].unsqueeze(0)).squeeze(0)
    return out.reshape(scores.shape)


def random_batch(seed: int, shape: tuple[int, ...] = (2, 3, 5, 7)) -> tuple:
    """Distinct random scores, a random mask with an empty and a one-entry row, garbage padding."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(shape, generator=gen, dtype=F64) * 2
    valid = torch.rand(shape, generator=gen) < 0.7
    valid.view(-1, shape[-1])[0] = False
    valid.view(-1, shape[-1])[1] = torch.arange(shape[-1]) == 2
    garbage = torch.tensor([-INF, INF, 1e30, -1e30, 1e3], dtype=F64)
    fill = garbage[torch.randint(0, 5, shape, generator=gen)]
    return torch.where(valid, scores, fill), valid


ADVERSARIAL = {
    "all_tied": ([1.0, 1.0, 1.0, 1.0], None),
    "tied_top": ([2.0, 2.0, 0.0, -1.0], None),
    "tied_below": ([3.0, 1.0, 1.0, 1.0, -2.0], None),
    "spread_1e6": ([1e6, 0.0, -1e6, 5e5], None),
    "spread_1e4_close_top": ([1e4, 1e4 - 0.25, -1e4, 3.0], None),
    "spread_1e5_tied": ([1e5, 1e5, -1e5], None),
    "huge_negative": ([-1e6, -1e6 - 0.5, -1e6 - 3.0], None),
    "tiny": ([1e-8, 0.0, -1e-8, 2e-8], None),
    "tiny_tied": ([1e-8, 1e-8, 0.0], None),
    "one_valid_garbage": ([0.3, -INF, 1e30, 7.0], [True, False, False, False]),
    "pad_neg_inf": ([0.5, -INF, 0.2, -INF], [True, False, True, False]),
    "pad_large": ([1e30, -0.4, 1.0, -1e30, 0.9], [False, True, True, False, True]),
    "pad_nan": ([math.nan, 0.1, math.nan, -0.7], [False, True, False, True]),
    "length_1": ([4.2], None),
}


@pytest.mark.parametrize("row", ADVERSARIAL.values(), ids=ADVERSARIAL.keys())
@pytest.mark.parametrize("name", CASES)
def test_adversarial_rows_match_reference(name: str, row: tuple) -> None:
    prob_map, fn = CASES[name]
    scores = torch.tensor(row[0], dtype=F64)
    valid = torch.ones_like(scores, dtype=torch.bool) if row[1] is None else torch.tensor(row[1])
    got = prob_map(scores, None if row[1] is None else valid)
    torch.testing.assert_close(got, ref_on_valid(fn, scores, valid), atol=1e-6, rtol=0)
    assert torch.all(got[~valid] == 0)


@pytest.mark.parametrize("name", CASES)
def test_random_padded_batches_match_reference(name: str) -> None:
    prob_map, fn = CASES[name]
    for seed in range(3):
        scores, valid = random_batch(seed)
        got = prob_map(scores, valid)
        assert got.shape == scores.shape and got.dtype == F64
        torch.testing.assert_close(got, ref_on_valid(fn, scores, valid), atol=1e-6, rtol=0)
    unpadded = torch.randn(2, 3, 5, 7, dtype=F64)
    torch.testing.assert_close(prob_map(unpadded), fn(unpadded), atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", CASES)
def test_broadcast_mask_and_float32(name: str) -> None:
    prob_map, fn = CASES[name]
    scores = torch.randn(2, 3, 6, dtype=F64)
    valid = torch.tensor([True, True, False, True, False, True])  # broadcast over (2, 3)
    expected = ref_on_valid(fn, scores, valid)
    torch.testing.assert_close(prob_map(scores, valid), expected, atol=1e-6, rtol=0)
    got32 = prob_map(scores.float(), valid)
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32, expected.float(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", CASES)
def test_float32_rows_with_a_large_offset(name: str) -> None:
    # entmax_bisect (1.3) does not subtract the row max: in float32 it is off by 1e-2 on the
    # first row and NaN on the second; the reference is therefore taken in float64.
    prob_map, fn = CASES[name]
    scores = torch.tensor([[-1e6, -1e6 - 0.5, -1e6 - 3.0], [1e8, 1e8 - 16.0, 1e8 - 8.0]])
    torch.testing.assert_close(prob_map(scores), fn(scores.double()).float(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", SMOOTH)
def test_gradcheck_with_padding(name: str) -> None:
    prob_map = CASES[name][0]
    scores, valid = random_batch(7, (2, 3, 6))
    scores = scores.masked_fill(
        ~valid, 1e3
    ).requires_grad_()  # finite garbage: gradcheck perturbs it
    assert torch.autograd.gradcheck(lambda s: prob_map(s, valid), (scores,))


@pytest.mark.parametrize("name", SMOOTH)
def test_gradient_matches_reference_on_padded_rows(name: str) -> None:
    prob_map, fn = CASES[name]
    scores, valid = random_batch(11)
    upstream = torch.randn(scores.shape, dtype=F64)
    ours = scores.clone().requires_grad_()
    (prob_map(ours, valid) * upstream).sum().backward()
    theirs = scores.masked_fill(~valid, 0.0).requires_grad_()
    (ref_on_valid(fn, theirs, valid) * upstream).sum().backward()
    torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-6, rtol=0)
    assert torch.all(ours.grad[~valid] == 0)


@pytest.mark.parametrize("name", PACKAGE)
def test_gradient_matches_package_autograd(name: str) -> None:
    prob_map = CASES[name][0]
    kind = PACKAGE[name]
    package_fn = getattr(ref, kind) if isinstance(kind, str) else bisect_ref(kind)
    scores = torch.randn(2, 3, 5, 8, dtype=F64, requires_grad=True)
    upstream = torch.randn(2, 3, 5, 8, dtype=F64)
    (ours,) = torch.autograd.grad((prob_map(scores) * upstream).sum(), scores)
    (theirs,) = torch.autograd.grad((package_fn(scores) * upstream).sum(), scores)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)


def test_hardmax_gradient_is_zero() -> None:
    scores, valid = random_batch(3)
    scores = scores.masked_fill(~valid, 0.0).requires_grad_()
    out = hardmax()(scores, valid)
    out.backward(torch.randn_like(out))
    assert torch.equal(scores.grad, torch.zeros_like(scores))


def test_hardmax_splits_ties_uniformly() -> None:
    got = hardmax()(torch.tensor([1.0, 3.0, 3.0, 0.0]))
    assert torch.equal(got, torch.tensor([0.0, 0.5, 0.5, 0.0]))
    got = hardmax()(torch.tensor([5.0, 2.0, 2.0, 9.0]), torch.tensor([False, True, True, False]))
    assert torch.equal(got, torch.tensor([0.0, 0.5, 0.5, 0.0]))


@pytest.mark.parametrize("name", CASES)
def test_padding_gets_exact_zero_weight_and_gradient(name: str) -> None:
    prob_map = CASES[name][0]
    valid = torch.tensor([[True, False, True, False], [False, False, False, False]])
    outputs = []
    for fill in (-INF, INF, math.nan, 1e30, -1e30):
        scores = torch.tensor([[0.4, fill, -0.3, fill], [fill, fill, fill, fill]], dtype=F64)
        scores.requires_grad_()
        out = prob_map(scores, valid)
        out.backward(torch.ones_like(out) + torch.arange(4.0, dtype=F64))
        assert torch.all(out[~valid] == 0) and torch.all(out[1] == 0)
        assert torch.all(scores.grad[~valid] == 0) and torch.all(scores.grad.isfinite())
        outputs.append(out.detach())
    assert all(torch.equal(out, outputs[0]) for out in outputs)  # garbage has no influence


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_all_invalid_rows_give_zeros_without_nan(name: str, dtype: torch.dtype) -> None:
    prob_map = CASES[name][0]
    scores = torch.full((2, 3, 4), math.nan, dtype=dtype, requires_grad=True)
    out = prob_map(scores, torch.zeros(4, dtype=torch.bool))
    out.sum().backward()
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(scores.grad, torch.zeros_like(scores))


def test_empty_last_dim_gives_empty_output() -> None:
    assert entmax(1.7)(torch.zeros(3, 0)).shape == (3, 0)


def test_sparse_maps_give_exact_zeros_and_closed_form() -> None:
    row = torch.tensor([0.0, -5.0, -0.1], dtype=F64)
    # sparsemax: support {0, 2}, τ = (0 − 0.1 − 1)/2 = −0.55
    got = sparsemax()(row)
    torch.testing.assert_close(got, torch.tensor([0.55, 0.0, 0.45], dtype=F64))
    for prob_map in (entmax(1.5), entmax(1.2), entmax(3.0), sparselin_gen(0.5), hardmax()):
        assert prob_map.sparse and prob_map(row)[1] == 0.0
    assert not softmax().sparse and torch.all(softmax()(row) > 0)


def test_entmax_special_alphas_agree_with_neighbouring_bisection() -> None:
    scores = torch.randn(4, 9, dtype=F64)
    torch.testing.assert_close(entmax(1.0)(scores), torch.softmax(scores, -1))
    torch.testing.assert_close(entmax(2.0)(scores), ref.sparsemax(scores))
    # the exact sort-based paths (α = 1.5, 2) against the bisection path right next to them
    for alpha in (1.5, 2.0):
        near = entmax(alpha + 1e-7)(scores)
        torch.testing.assert_close(entmax(alpha)(scores), near, atol=1e-6, rtol=0)


@st.composite
def grid_rows(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of length K on a 1/8 grid (exact shifts, frequent ties) with a mask."""
    k = draw(st.integers(1, 8))
    ints = draw(st.lists(st.integers(-160, 160), min_size=2 * k, max_size=2 * k))
    mask = draw(st.lists(st.booleans(), min_size=2 * k, max_size=2 * k))
    return torch.tensor(ints, dtype=F64).view(2, k) / 8, torch.tensor(mask).view(2, k)


PROPERTY_MAPS = ["softmax", "hardmax", "sparsemax", "entmax15", "entmax1.7", "sparselin0.3"]


@pytest.mark.parametrize("name", PROPERTY_MAPS)
@settings(max_examples=50, deadline=None)
@given(rows=grid_rows())
def test_outputs_are_distributions_on_valid_entries(name: str, rows: tuple) -> None:
    scores, valid = rows
    out = CASES[name][0](scores, valid)
    assert torch.all(out >= 0) and torch.all(out[~valid] == 0)
    sums = out.sum(-1)
    torch.testing.assert_close(sums, valid.any(-1).to(F64), atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", PROPERTY_MAPS)
@settings(max_examples=50, deadline=None)
@given(rows=grid_rows(), shift=st.integers(-800, 800))
def test_invariant_to_adding_a_constant(name: str, rows: tuple, shift: int) -> None:
    scores, valid = rows
    prob_map = CASES[name][0]
    moved = prob_map(scores + shift / 8, valid)
    torch.testing.assert_close(moved, prob_map(scores, valid), atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", PROPERTY_MAPS)
@settings(max_examples=50, deadline=None)
@given(rows=grid_rows(), data=st.data())
def test_permutation_equivariant(name: str, rows: tuple, data: st.DataObject) -> None:
    scores, valid = rows
    perm = torch.tensor(data.draw(st.permutations(range(scores.shape[-1]))))
    prob_map = CASES[name][0]
    permuted = prob_map(scores[:, perm], valid[:, perm])
    torch.testing.assert_close(permuted, prob_map(scores, valid)[:, perm], atol=1e-12, rtol=0)


@pytest.mark.parametrize(
    ("make", "arg"),
    [
        (entmax, 0.5),
        (entmax, math.nan),
        (entmax, INF),
        (sparselin_gen, 1.0),
        (sparselin_gen, -0.1),
        (sparselin_gen, math.nan),
    ],
)
def test_bad_hyper_parameters(make: Callable[[float], ProbabilityMap], arg: float) -> None:
    name = "alpha" if make is entmax else "lam"
    with pytest.raises(ValueError, match=name):
        make(arg)
    with pytest.raises(TypeError, match=name):
        make("1.5")


def test_bad_inputs() -> None:
    with pytest.raises(TypeError, match="scores"):
        softmax()(torch.tensor([1, 2, 3]))
    with pytest.raises(TypeError, match="valid"):
        sparsemax()(torch.zeros(3), torch.ones(3))
    with pytest.raises(ValueError, match="valid"):
        sparsemax()(torch.zeros(2, 3), torch.ones(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="scores"):
        sparsemax()(torch.tensor(1.0))


def test_resolve_prob_map() -> None:
    assert repr(resolve_prob_map("entmax15")) == "entmax(alpha=1.5)"
    assert repr(resolve_prob_map("entmax")) == "entmax(alpha=1.5)"
    for name in ("softmax", "hardmax", "sparsemax"):
        assert repr(resolve_prob_map(name)) == f"{name}()"
    custom = sparselin_gen(0.25)
    assert resolve_prob_map(custom) is custom and repr(custom) == "sparselin_gen(lam=0.25)"
    with pytest.raises(ValueError, match="spec.*'entmax15'.*'softmax'.*'relu'"):
        resolve_prob_map("relu")
    with pytest.raises(TypeError, match="spec"):
        resolve_prob_map(1.5)  # type: ignore[arg-type]
