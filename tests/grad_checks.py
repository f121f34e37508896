"""An output and its gradients against a reference's, for the tests."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def assert_close_with_grads(
    out: Tensor,
    ref: Tensor,
    inputs: Sequence[Tensor],
    tol: tuple[float, float],
    grad_tol: tuple[float, float],
    *,
    ref_inputs: Sequence[Tensor] | None = None,
    g: Tensor | None = None,
) -> None:
    """``out`` ≈ ``ref`` within ``tol`` = (atol, rtol); then the gradients of ⟨out, g⟩ in
    ``inputs`` ≈ those of ⟨ref, g⟩ in ``ref_inputs`` (default: ``inputs``) within ``grad_tol``,
    for the upstream gradient ``g`` (default ``torch.randn_like(out)``, drawn after the output
    check)."""
    torch.testing.assert_close(out, ref, atol=tol[0], rtol=tol[1])
    g = torch.randn_like(out) if g is None else g
    got = torch.autograd.grad((out * g).sum(), tuple(inputs))
    want = torch.autograd.grad((ref * g).sum(), tuple(inputs if ref_inputs is None else ref_inputs))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=grad_tol[0], rtol=grad_tol[1])
