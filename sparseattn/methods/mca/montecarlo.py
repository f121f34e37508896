"""MCA: Monte-Carlo approximation of the attention value product (Kim & Ko, AAAI 2022).

Only the value projection H = X·W_V + b is approximated; the scores, the probability map and
the product A·H̃ stay exact. Per head h with weight slice W_h (d_in × d_head), token j's value row
is estimated from r_j input features drawn i.i.d. with p_h(k) = ‖W_h[k, :]‖² / ‖W_h‖_F²:

    H̃[j] = (1/r_j) Σ_t X[j, k_t] W_h[k_t, :] / p_h(k_t) + b_h              (unbiased, Lemma 1)
    E‖H̃[j] − X[j]W_h‖ ≤ ‖X[j]‖ ‖W_h‖_F / √r_j                               (Lemma 1, eq. 4)

The sample sizes follow the attention each token receives (eq. 7):
r_j = min(⌊(n · max_i A[i, j] / α)²⌋, d_in), at least 1; r_j = d_in is computed exactly, and
α = 0 means exact everywhere. A token that no query attends to (max_i A[i, j] = 0: an α-entmax
zero in every row, a key outside the pattern, padding) gets r_j = 0: its value row never reaches
Ỹ, so skipping it is exact and costs nothing. Then E‖Ỹ[i] − Y[i]‖ ≤ α β ‖W_h‖_F with β the
mean row norm of X (Theorem 2; the supplement's eq. 8 divides by n once more, a slip — β
already holds the 1/n). With the floor in eq. 7 the bound can exceed that by up to √2 for
tokens with r_j < 2·(…)²; tests check it with margin.

Unlike the reference code, every token draws its own samples (independent errors), r_j never
rounds to 0 for a token that is attended, and padding tokens are excluded from the cost.

Two cost accountings. Ours (:func:`sample_sizes` with a query mask, ``macs_kept``): n counts the
real tokens, the max runs over real queries, and Σ r_j / (n_real · d_in) averages over real
tokens. The reference code's (:func:`reference_sample_sizes`, ``macs_kept_reference``): inputs
padded to a fixed length (128), that padded length as n, the max over every query row, r_j
rounded down with no lower bound, and r_j / d_in averaged over every position, padding
included — where r_j = 0. On short passages the padding dominates that average.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from ...attention import attention_weights
from ...graph import AttentionGraph
from ...maps import ProbabilityMap
from ...patterns import Pattern
from ...validate import (
    check_bool,
    check_finite_float,
    check_finite_tensor,
    check_generator,
    check_positive,
    check_seed,
    check_tensor,
)

__all__ = [
    "MCAMethod",
    "MCAOutput",
    "head_weights",
    "mc_value_projection",
    "mca_attention",
    "reference_sample_sizes",
    "sample_sizes",
]


def head_weights(weight: Tensor, num_heads: int) -> Tensor:
    """nn.Linear weight (H·d_head, d_in) → per-head W_h of shape (H, d_in, d_head)."""
    check_tensor("weight", weight, dim=2, floating=True)
    check_positive("num_heads", num_heads)
    out_features, d_in = weight.shape
    if out_features % num_heads:
        raise ValueError(
            f"weight rows ({out_features}) must be divisible by num_heads ({num_heads})"
        )
    return weight.view(num_heads, out_features // num_heads, d_in).transpose(1, 2)


def sample_sizes(
    weights: Tensor, alpha: float, d_in: int, query_mask: Tensor | None = None
) -> Tensor:
    """MCA eq. (7): r_j = min(⌊(n · max_i A[i, j] / α)²⌋, d_in), at least 1 — and 0 when no
    query attends to token j (max_i A[i, j] = 0: exact at no cost).

    Args:
        weights: attention A of shape (B, H, n_q, n_k).
        alpha: error knob α ≥ 0; 0 means exact (r_j = d_in).
        d_in: number of input features.
        query_mask: optional bool (B, n_q), True for real queries; n counts real tokens and the
            max runs over real queries only.
    Returns:
        LongTensor (B, H, n_k) in [0, d_in] (0 only where the column of A is all zero; at α = 0
        every token gets d_in: the exact projection).
    """
    alpha = check_finite_float("alpha", alpha, 0.0)
    check_positive("d_in", d_in)
    check_tensor("weights", weights, dim=4, floating=True)
    check_finite_tensor("weights", weights)
    bsz, heads, n_q, n_k = weights.shape
    if query_mask is not None:
        check_tensor("query_mask", query_mask, dtype=torch.bool, shape=(bsz, n_q))
    if alpha == 0:
        return torch.full((bsz, heads, n_k), d_in, dtype=torch.long, device=weights.device)
    if query_mask is not None:
        weights = weights.masked_fill(~query_mask[:, None, :, None], 0.0)
        n = query_mask.sum(-1).view(bsz, 1, 1).to(weights.dtype)
    else:
        n = float(n_q)
    top = weights.amax(dim=-2)  # (B, H, n_k): the most attention token j receives
    r = _eq7(top, n, alpha, d_in).clamp(1, d_in)
    return torch.where(top > 0, r, 0)


def _eq7(top: Tensor, n: Tensor | float, alpha: float, d_in: int) -> Tensor:
    """min(⌊(n · top / α)²⌋, d_in) as a LongTensor of top's shape (α > 0)."""
    root = (n * top / alpha).double().clamp(max=float(d_in))  # (d_in)² cannot overflow
    return torch.floor(root**2).clamp(max=d_in).long()


def reference_sample_sizes(weights: Tensor, alpha: float, d_in: int) -> Tensor:
    """The sample sizes as the MCA reference code computes them (its cost accounting).

    r_j = min(⌊(n · max_i A[i, j] / α)²⌋, d_in) with n = A's padded length and the max over every
    query row (padding queries too), with no lower bound: a token whose scaled attention is
    below α/n gets r_j = 0, and so does padding (no query attends to it). The reference code's
    metric is the mean of r_j / d_in over every position, padding included.

    Args:
        weights: A of shape (B, H, n_q, n_k), padding keys at zero.
        alpha: α ≥ 0 (0: r_j = d_in everywhere).
        d_in: number of input features.
    Returns:
        LongTensor (B, H, n_k) in [0, d_in].
    """
    alpha = check_finite_float("alpha", alpha, 0.0)
    check_positive("d_in", d_in)
    check_tensor("weights", weights, dim=4, floating=True)
    check_finite_tensor("weights", weights)
    bsz, heads, _, n_k = weights.shape
    if alpha == 0:
        return torch.full((bsz, heads, n_k), d_in, dtype=torch.long, device=weights.device)
    return _eq7(weights.amax(dim=-2), float(n_k), alpha, d_in)


def mc_value_projection(
    x: Tensor,
    weight: Tensor,
    r: Tensor,
    bias: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Monte-Carlo estimate of X·W_h (+ b_h) with r_j samples for token j (Lemma 1).

    Cost follows Σ r_j: all samples of a head are drawn at once and reduced per token with
    index_add, so work is O(Σ_j r_j · d_head), never n · d_in · d_head, except for tokens with
    r_j = d_in, which are projected exactly.

    Args:
        x: (B, n, d_in).
        weight: (H, d_in, d_head) per-head value weights (see ``head_weights``).
        r: LongTensor (B, H, n), sample sizes in [0, d_in]; 0 skips the token (its row is just
            the bias: for padding, which no query attends to).
        bias: optional (H, d_head).
        generator: torch.Generator for reproducible draws.
    Returns:
        H̃ of shape (B, H, n, d_head).
    """
    _check_projection(x, weight, bias)
    generator = check_generator("generator", generator)
    bsz, n, d_in = x.shape
    heads, _, d_head = weight.shape
    check_tensor("r", r, shape=(bsz, heads, n))
    if r.is_floating_point() or r.dtype == torch.bool:
        raise TypeError(f"r must be an integer tensor, got {r.dtype}")
    if r.numel() and (int(r.min()) < 0 or int(r.max()) > d_in):
        raise ValueError(f"r must lie in [0, d_in = {d_in}], got [{int(r.min())}, {int(r.max())}]")
    r = r.long()
    tokens = bsz * n
    x_flat = x.reshape(tokens, d_in)
    r_flat = r.transpose(0, 1).reshape(heads * tokens)  # pair id = head · tokens + token
    prob = weight.double().pow(2).sum(-1)
    total_mass = prob.sum(-1, keepdim=True)
    # (H, d_in): p_h(k); an all-zero head samples uniformly (every term is 0 either way)
    prob = torch.where(total_mass > 0, prob / total_mass.clamp_min(1e-300), 1.0 / d_in)
    bias = x.new_zeros(heads, d_head) if bias is None else bias
    exact = (r_flat >= d_in).view(heads, tokens)
    if exact.all():  # α = 0: one fused product
        return torch.einsum("bnd,hde->bhne", x, weight) + bias[None, :, None, :]
    out = x.new_zeros(heads * tokens, d_head)
    for h in exact.any(-1).nonzero().flatten().tolist():
        out[h * tokens + exact[h].nonzero().flatten()] = x_flat[exact[h]] @ weight[h]
    pairs = ((r_flat > 0) & ~exact.flatten()).nonzero().flatten()
    if pairs.numel():
        counts = r_flat[pairs]
        total = int(counts.sum())
        pair_of = torch.repeat_interleave(pairs, counts, output_size=total)  # one per sample
        head, token = pair_of // tokens, pair_of % tokens
        # inverse-CDF draws for all heads at once: head h's CDF lives in (h, h + 1]
        cdf = prob.cumsum(-1)
        cdf[:, -1] = 1.0
        draw_device = x.device if generator is None else generator.device
        u = torch.rand(total, dtype=torch.float64, generator=generator, device=draw_device)
        u = u.to(x.device)
        flat_feat = torch.searchsorted(
            (cdf + torch.arange(heads, device=x.device)[:, None]).flatten(), u + head, right=True
        )
        feat = flat_feat - head * d_in
        coef = x_flat[token, feat] / (prob.flatten()[flat_feat] * r_flat[pair_of]).to(x.dtype)
        terms = coef[:, None] * weight.reshape(heads * d_in, d_head)[flat_feat]  # (S, d_head)
        out[pairs] = torch.segment_reduce(terms, "sum", lengths=counts)  # samples are grouped
    return out.view(heads, bsz, n, d_head).transpose(0, 1) + bias[None, :, None, :]


def _check_projection(x: Tensor, weight: Tensor, bias: Tensor | None) -> None:
    """x (B, n, d_in) and weight (H, d_in, d_head) finite floats of one dtype; bias (H, d_head)."""
    check_tensor("x", x, dim=3, floating=True)
    check_tensor("weight", weight, dim=3, floating=True)
    if x.shape[-1] < 1:
        raise ValueError(f"x must have d_in >= 1 features, got shape {tuple(x.shape)}")
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"weight must have shape (H, d_in = {x.shape[-1]}, d_head), got {tuple(weight.shape)}"
        )
    if weight.dtype != x.dtype:
        raise TypeError(f"weight must have x's dtype {x.dtype}, got {weight.dtype}")
    if bias is not None:
        check_tensor("bias", bias, floating=True, shape=(weight.shape[0], weight.shape[2]))
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and t.device.type == "meta":
            raise ValueError(f"{name} is on the meta device; the projection needs its values")
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}, got {t.device}")
    if bias is not None:
        check_finite_tensor("bias", bias)
    check_finite_tensor("x", x)
    check_finite_tensor("weight", weight)


@dataclass
class MCAOutput:
    """Result of ``mca_attention``: out (B, H, n_q, d_head); r (B, H, n_k) sample sizes;
    macs_kept: Σ r_j / (n_real · d_in), the fraction of value-projection multiply-adds kept;
    projection_seconds: wall-clock of the sampled projection; weights: the exact attention A
    (B, H, n_q, n_k) that set r."""

    out: Tensor
    r: Tensor
    macs_kept: float
    projection_seconds: float
    weights: Tensor


def mca_attention(
    x: Tensor,
    q: Tensor,
    k: Tensor,
    value_weight: Tensor,
    value_bias: Tensor | None,
    alpha: float,
    pattern: Pattern | AttentionGraph,
    prob_map: str | ProbabilityMap = "softmax",
    scale: float | None = None,
    key_padding_mask: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> MCAOutput:
    """Ỹ = A · H̃ with A exact on the pattern's graph under ρ, and H̃ sampled (MCA).

    Args:
        x: (B, n, d_in) the layer input; q, k: (B, H, n, d).
        value_weight: (H, d_in, d_head); value_bias: (H, d_head) or None.
        alpha: α ≥ 0 (0: exact).
        pattern, prob_map, scale: as in ``sparse_attention``.
        key_padding_mask: optional bool (B, n), True for padding tokens (as in
            ``sparse_attention`` and ``nn.MultiheadAttention``): they are ignored as keys and
            get no samples (r_j = 0). Refused when it masks every key of an item.
    """
    check_tensor("x", x, floating=True)
    if x.dim() != 3 or (
        isinstance(q, Tensor) and q.dim() == 4 and x.shape[:2] != (q.shape[0], q.shape[2])
    ):
        raise ValueError(f"x must have shape (batch, n, d_in) matching q, got {tuple(x.shape)}")
    _check_projection(x, value_weight, value_bias)
    if isinstance(q, Tensor) and q.device.type != "meta" and q.device != x.device:
        raise ValueError(f"x must be on q's device {q.device}, got {x.device}")
    alpha = check_finite_float("alpha", alpha, 0.0)
    if isinstance(q, Tensor) and q.dim() == 4 and value_weight.shape[0] != q.shape[1]:
        raise ValueError(
            f"value_weight must have one slice per head ({q.shape[1]}), got {value_weight.shape[0]}"
        )
    weights = attention_weights(
        q, k, pattern, prob_map=prob_map, scale=scale, key_padding_mask=key_padding_mask
    )
    real = None if key_padding_mask is None else ~key_padding_mask.to(x.device)
    r = sample_sizes(weights, alpha, x.shape[-1], real)
    if real is not None:
        r = r * real[:, None, :]  # padding: no samples, no cost
    start = time.perf_counter()
    values = mc_value_projection(x, value_weight, r, value_bias, generator)
    seconds = time.perf_counter() - start
    n_real = x.shape[0] * x.shape[1] if real is None else int(real.sum())
    full = n_real * r.shape[1] * x.shape[-1]
    kept = float(r.sum()) / full if full else 1.0  # nothing real to project: nothing dropped
    return MCAOutput(weights @ values, r, kept, seconds, weights)


class MCAMethod:
    """MCA as a method hook for :func:`sparseattn.hf.sparsify` (BERT family).

    ``sparsify(model, method=MCAMethod(alpha=0.2))`` approximates every configured layer's value
    product; the pattern and ρ of the layer still apply. The hook accumulates what it kept:
    ``macs_kept`` = Σ r_j / Σ d_in over layers, heads and real tokens (our accounting), the
    reference code's accounting of the same calls (``macs_kept_reference``: its r_j, averaged
    over every position, padding included; ``macs_kept_reference_real``: its r_j on real tokens
    only), and the wall-clock of the sampled projections next to the exact one (``seconds``).
    With ``track_error=True`` it also records, per layer, the mean over real queries of
    ‖Ỹ_i − Y_i‖ and the Theorem 2 bound α·β·‖W_h‖_F averaged over heads.
    """

    def __init__(self, alpha: float, seed: int = 0, track_error: bool = False) -> None:
        self.alpha = check_finite_float("alpha", alpha, 0.0)
        self.generator = torch.Generator().manual_seed(check_seed("seed", seed))
        self.track_error = check_bool("track_error", track_error)
        self.samples = 0.0
        self.full = 0.0
        self.reference = {"samples": 0.0, "full": 0.0, "real_samples": 0.0, "real_full": 0.0}
        self.errors: dict[int, list[tuple[float, float]]] = {}
        self.seconds = {"sampled": 0.0, "exact": 0.0}

    @property
    def macs_kept(self) -> float:
        """Σ r_j / Σ d_in over layers, heads and real tokens (eq. 7 with n = real tokens)."""
        return self.samples / self.full if self.full else 1.0

    @property
    def macs_kept_reference(self) -> float:
        """The reference code's metric: mean r_j / d_in over every position, padding included
        (:func:`reference_sample_sizes`)."""
        ref = self.reference
        return ref["samples"] / ref["full"] if ref["full"] else 1.0

    @property
    def macs_kept_reference_real(self) -> float:
        """The reference code's r_j, averaged over real tokens only."""
        ref = self.reference
        return ref["real_samples"] / ref["real_full"] if ref["real_full"] else 1.0

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        pattern: Pattern | AttentionGraph,
        prob_map: str | ProbabilityMap = "softmax",
        engine: str = "auto",
        scale: float | None = None,
        key_padding_mask: Tensor | None = None,
        dropout_p: float = 0.0,
        context=None,
    ) -> Tensor:
        if context is None or context.hidden_states is None:
            raise ValueError("MCA needs the layer input: use it through sparseattn.hf.sparsify")
        heads = q.shape[1]
        lin = context.value_proj
        weight = head_weights(lin.weight, heads)
        bias = None if lin.bias is None else lin.bias.view(heads, -1)
        x = context.hidden_states
        res = mca_attention(
            x,
            q,
            k,
            weight,
            bias,
            self.alpha,
            pattern,
            prob_map,
            scale,
            key_padding_mask,
            self.generator,
        )
        real = (
            torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
            if key_padding_mask is None
            else ~key_padding_mask
        )
        start = time.perf_counter()
        with torch.no_grad():
            lin(x)  # the exact projection this replaces, timed on the same input
        self.seconds["exact"] += time.perf_counter() - start
        self.seconds["sampled"] += res.projection_seconds
        self.samples += float(res.r.sum())
        self.full += float(real.sum()) * heads * x.shape[-1]
        ref_r = reference_sample_sizes(res.weights, self.alpha, x.shape[-1])
        self.reference["samples"] += float(ref_r.sum())
        self.reference["full"] += float(ref_r.numel()) * x.shape[-1]
        self.reference["real_samples"] += float((ref_r * real[:, None, :]).sum())
        self.reference["real_full"] += float(real.sum()) * heads * x.shape[-1]
        if self.track_error:
            exact = res.weights @ v
            err = (res.out - exact).norm(dim=-1)  # (B, H, n)
            mean_err = float((err * real[:, None, :]).sum() / (real.sum() * heads))
            beta = float(x.norm(dim=-1)[real].mean())
            bound = self.alpha * beta * float(weight.pow(2).sum((1, 2)).sqrt().mean())
            self.errors.setdefault(context.layer, []).append((mean_err, bound))
        return res.out
