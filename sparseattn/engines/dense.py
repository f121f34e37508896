"""Dense engine: the masked n_q × n_k reference (O(n²) memory; ground truth in tests)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..graph import AttentionGraph
from ..maps import ProbabilityMap
from .common import grid_indices
from .precision import compute_dtype

__all__ = ["dense_attention", "fused_with_padding"]


def dense_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    graph: AttentionGraph,
    prob_map: ProbabilityMap,
    scale: float,
    key_valid: Tensor | None = None,
    dropout_p: float = 0.0,
    score_mod: Callable | None = None,
) -> Tensor:
    """out_i = Σ_{j ∈ A_i} ρ(score_mod(scale · q_i·k_j))_j v_j over a dense mask (Yun eq. 3).

    Shapes: q (B, H, n_q, d), k (B, H, n_k, d), v (B, H, n_k, d_v) → (B, H, n_q, d_v);
    ``key_valid`` (B, n_k), True for real keys; ``score_mod`` as in
    ``sparse_attention`` (autograd reaches what it reads).
    """
    # the mask, 4-D on q's device, cached on the graph (auto picks dense for small score
    # matrices, where building it costs as much as the attention); SDPA on CPU runs a 3-D
    # (H, n_q, n_k) mask ~3x slower than (1, H, n_q, n_k)
    mask = graph.cached(("dense_mask", q.device), lambda: _mask4d(graph.to(q.device).to_dense()))
    if key_valid is not None:
        mask = mask & key_valid[:, None, None, :]
    padding_ok = key_valid is None or fused_with_padding(q.device.type)
    if prob_map.is_softmax and score_mod is None and padding_ok:
        # every graph row has a key (checked by the API), so SDPA's fused kernel is exact;
        # with key padding a row may be left without keys, which it gives 0 (its weights'
        # meaning here) and zero gradients
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale
        )
    dtype = compute_dtype(q)  # half precision on CPU: float32 scores and weights
    scores = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) * scale
    if score_mod is not None:
        bsz, heads, n_q, n_k = scores.shape
        rows = torch.arange(n_q, device=q.device)
        scores = score_mod(scores, *grid_indices(bsz, heads, rows, n_k, q.device))
    weights = prob_map(scores, mask)
    if dropout_p:
        weights = F.dropout(weights, dropout_p)
    return (weights @ v.to(dtype)).to(q.dtype)


def fused_with_padding(device_type: str) -> bool:
    """Whether SDPA's fused kernel serves softmax rows with key padding on this device: it
    must give a row without keys 0 and zero gradients. torch's CPU kernels do
    (``tests/engines/test_engines_fast.py::test_dense_engine_with_key_padding_is_sdpa_on_cpu``
    checks it); the CUDA kernels are unverified (no GPU run yet), so there the scores are
    materialised."""
    return device_type == "cpu"


def _mask4d(mask: Tensor) -> Tensor:
    """A dense mask (…, n_q, n_k) with 4 dims."""
    return mask.reshape((1,) * (4 - mask.dim()) + mask.shape)
