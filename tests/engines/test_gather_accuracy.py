"""Float32 accuracy of the gather engine on long rows (blocked summation of P·V and dS·K).

References: v = 1 (every output is exactly 1) and the dense engine in float64.
"""

from __future__ import annotations

import pytest
import torch

import sparseattn as sa
from sparseattn.engines import dense_attention, gather_attention
from sparseattn.engines.gather import PIECE
from sparseattn.maps import softmax

pytestmark = pytest.mark.device


def long_rows(n: int = 8000, d: int = 32):
    """Global tokens: rows 0 and 1 have degree n, the others 3; peaked scores (q·3)."""
    gen = torch.Generator().manual_seed(0)
    q = 3 * torch.randn(1, 2, n, d, generator=gen)
    k, v = (torch.randn(1, 2, n, d, generator=gen) for _ in range(2))
    return q, k, v, sa.global_tokens(2).graph(n)


def full_rows_float64(q, k, v, scale):
    """Softmax attention of the two global rows (they see every key), in float64."""
    scores = q[..., :2, :].double() @ k.double().transpose(-1, -2) * scale
    return scores.softmax(-1) @ v.double()


def test_long_float32_rows_sum_to_one_and_match_float64():
    q, k, v, graph = long_rows()
    scale = q.shape[-1] ** -0.5
    ones = gather_attention(q, k, torch.ones_like(v), graph, softmax(), scale)
    assert (ones - 1).abs().max() < 1e-6
    out = gather_attention(q, k, v, graph, softmax(), scale)
    want = full_rows_float64(q, k, v, scale)
    torch.testing.assert_close(out[..., :2, :].double(), want, atol=1e-6, rtol=1e-6)


def test_long_float32_rows_backward_matches_float64():
    q, k, v, graph = long_rows()
    scale = q.shape[-1] ** -0.5
    q32, q64 = q.clone().requires_grad_(), q.double().requires_grad_()
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    gather_attention(q32, k, v, graph, softmax(), scale).backward(grad)
    full_rows_float64(q64, k, v, scale).backward(grad[..., :2, :].double())
    torch.testing.assert_close(
        q32.grad[..., :2, :].double(), q64.grad[..., :2, :], atol=1e-6, rtol=1e-6
    )


def test_rows_longer_than_a_piece_of_any_length_are_exact():
    """Degrees just around multiples of PIECE (the neighbour lists are padded to pieces)."""
    n = 3 * PIECE + 5
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, n, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    for degree in (PIECE - 1, PIECE, PIECE + 1, 2 * PIECE + 3, n):
        graph = sa.random(k=degree, seed=degree).graph(n)
        want = dense_attention(q, k, v, graph, softmax(), 0.3)
        got = gather_attention(q, k, v, graph, softmax(), 0.3)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
