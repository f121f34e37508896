"""SparseBERT's differentiable attention mask (DAM; Shi et al., ICML 2021) and its extraction.

Per head a matrix of mask logits ℓ decides which attention entries survive. Training relaxes the
binary mask with a Gumbel-sigmoid (the two-class Gumbel-softmax of the authors' code, written
on ℓ = logit_keep − logit_drop) and a straight-through estimator:

    g ~ Logistic(0, 1)  (= the difference of two Gumbel(0, 1) draws)
    M_soft = σ((ℓ + g) / τ),    M_hard = 1[ℓ + g > 0]
    M = M_hard + M_soft − stopgrad(M_soft)          (forward: M_hard; backward: ∂M_soft)

M enters the attention as an additive bias before any probability map ρ of the library,

    A = ρ(QKᵀ/√d + (1 − M) · b),   b = ``bias_value`` = −1e4 by default (the authors' value),

and the loss gains the sparsity penalty λ·‖M‖₁ (the authors' unnormalised count of kept
entries; ``normalized=True`` uses the mean, λ·‖M‖₁ / #entries, so λ no longer scales with the
number of heads, layers and n²).

Variants (SparseBERT §4): DAM_u (``structured=False``) learns one logit per (head, i, j),
optionally symmetric (ℓ_ij = ℓ_ji; the authors symmetrise); DAM_s (``structured=True``) learns
one logit per head and diagonal offset, M_ij = m_|i−j| (a symmetric Toeplitz band pattern).
One mask per head shared by all layers (``num_layers=None``, as the authors) or one per layer.

Empty rows. A row whose every entry is dropped would, under an additive bias, silently fall back
to *dense* attention (the same −1e4 on every score cancels in ρ). We define instead: DAM_u — a
row with no kept entry keeps the one entry of its largest (noisy) logit (the first, if tied, so
a row of equal logits keeps one entry, not all), and when the logits are symmetric the mirrored
entry is kept too, so the mask stays symmetric; DAM_s —
if the kept offsets leave some row empty (exactly when no offset d ≤ ⌈(n − 1)/2⌉, the offsets
every row has, is kept), the largest-logit offset among those is kept as well, so the mask stays
Toeplitz. The same rule holds in training (on ℓ + g), in evaluation (on ℓ) and in
:meth:`DifferentiableAttentionMask.extract`, so the extracted pattern reproduces the evaluated
model exactly.

Extraction: M = 1[ℓ > 0] without noise → :class:`LearnedMaskPattern`, a Pattern whose graph has
``batch_shape (H,)`` and plugs into ``sparse_attention`` / ``SparseAttention`` like any fixed
pattern.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from ...graph import AttentionGraph
from ...patterns import Pattern, PatternCycle, cycle
from ...patterns.diagonal import NoDiagonal, dense_no_diagonal, drop_diagonal, no_diagonal
from ...validate import check_bool, check_finite_float, check_positive, check_seed

__all__ = [
    "DifferentiableAttentionMask",
    "LearnedMaskPattern",
    "NoDiagonal",
    "dense_no_diagonal",
    "drop_diagonal",
    "hard_from_logits",
    "keep_best_offset",
    "keep_row_max",
    "kept_by_offset",
    "no_diagonal",
    "offset_means",
    "toeplitz",
]


def keep_row_max(hard: Tensor, logits: Tensor) -> Tensor:
    """DAM_u's empty-row rule: ``hard`` (bool, (..., n, n)) with every empty row given the one
    entry of its largest logit (the first of tied maxima). When ``logits`` is symmetric the
    added entries are mirrored as well, so a symmetric mask stays symmetric."""
    empty = ~hard.any(-1, keepdim=True)
    if not bool(empty.any()):
        return hard
    first = torch.zeros_like(hard).scatter_(-1, logits.argmax(-1, keepdim=True), True)
    added = empty & first
    if torch.equal(logits, logits.transpose(-1, -2)):
        added = added | added.transpose(-1, -2)
    return hard | added


def keep_best_offset(hard: Tensor, logits: Tensor) -> Tensor:
    """DAM_s's empty-row rule on offset decisions ``hard`` (bool, (..., n), offsets 0 … n − 1).

    Every row of an n × n Toeplitz mask contains the offsets d ≤ r = ⌈(n − 1)/2⌉; some row is
    empty exactly when none of those is kept. Then the largest-logit offset d ≤ r (ties all) is
    added, which fills every row and keeps the mask Toeplitz.
    """
    r = hard.shape[-1] // 2 + 1  # the offsets 0 … ⌈(n − 1)/2⌉
    uncovered = ~hard[..., :r].any(-1, keepdim=True)
    if not bool(uncovered.any()):
        return hard
    head = logits[..., :r]
    top = torch.zeros_like(hard)
    top[..., :r] = head == head.amax(-1, keepdim=True)
    return hard | (uncovered & top)


def toeplitz(x: Tensor, n: int) -> Tensor:
    """(..., N) per-offset values → (..., n, n) with entry (i, j) = x[..., |i − j|]; n ≤ N."""
    offset = torch.arange(n, device=x.device)
    offset = (offset[:, None] - offset).abs()
    return x[..., :n][..., offset]


def hard_from_logits(z: Tensor, n: int, structured: bool) -> Tensor:
    """BoolTensor (..., n, n): 1[z > 0] with the empty-row rule.

    Args:
        z: DAM_s: (..., N) offset logits; DAM_u: (..., N, N) full logits (already mirrored
            when symmetric). The top-left n × n block (offsets < n) is used.
    """
    if structured:
        zo = z[..., :n]
        return toeplitz(keep_best_offset(zo > 0, zo), n)
    zz = z[..., :n, :n]
    return keep_row_max(zz > 0, zz)


def offset_means(x: Tensor) -> Tensor:
    """Mean of ``x`` (..., n, n) over each diagonal band {(i, j) : |i − j| = d} and the leading
    dims: a FloatTensor (n,) indexed by the offset d."""
    if x.dim() < 2 or x.shape[-1] != x.shape[-2]:
        raise ValueError(f"expected shape (..., n, n), got {tuple(x.shape)}")
    n = x.shape[-1]
    offset = (torch.arange(n)[:, None] - torch.arange(n)).abs().flatten()
    mean = x.double().reshape(-1, n, n).mean(0).flatten().cpu()
    total = torch.bincount(offset, weights=mean, minlength=n)
    return (total / torch.bincount(offset, minlength=n)).float()


def kept_by_offset(mask: Tensor) -> Tensor:
    """Fraction of kept entries at each diagonal offset |i − j|, averaged over leading dims.

    Args:
        mask: (..., n, n), bool or {0, 1}.
    Returns:
        FloatTensor (n,): entry d is the kept fraction of {(i, j) : |i − j| = d}.
    """
    return offset_means(mask.float())


#: Largest |init_std| and |bias_value|: logits and scores + bias stay finite in float32.
_LIMIT = 1e30


def _check_real(name: str, value: object) -> float:
    return check_finite_float(name, value)


def _check_tau(tau: object) -> float:
    return check_finite_float("tau", tau, 0.0, low_open=True)


class DifferentiableAttentionMask(nn.Module):
    """SparseBERT's DAM: learnable per-head attention masks (DAM_u or DAM_s).

    Args:
        max_len: N, the longest sequence the mask is built for; any n ≤ N uses the top-left
            n × n block (for DAM_s: offsets 0 … n − 1).
        num_heads: H.
        structured: False = DAM_u (logits (H, N, N)); True = DAM_s (logits (H, N), one per
            diagonal offset, M_ij = m_|i−j|, always symmetric).
        symmetric: DAM_u only: ℓ_ij = ℓ_ji (the upper triangle is mirrored; noise too).
        num_layers: None = one mask per head shared by all layers (the authors' choice);
            an int L = one mask per layer (layer l uses mask l mod L).
        tau: Gumbel-sigmoid temperature τ > 0.
        lam: λ ≥ 0 of the sparsity penalty λ·‖M‖₁.
        normalized: penalty λ·mean(M) instead of λ·sum(M).
        init_std: logits start at init_std · N(0, 1) (authors: 1e-3, so half the entries are
            kept at first).
        bias_value: b < 0, the additive score bias of a dropped entry, (1 − M)·b.
        seed: seed of the logits' initialisation.

    Shapes: :meth:`sample` and :meth:`hard_mask` give (L, H, n, n) with L = 1 when shared.
    """

    def __init__(
        self,
        max_len: int,
        num_heads: int,
        *,
        structured: bool = False,
        symmetric: bool = False,
        num_layers: int | None = None,
        tau: float = 1.0,
        lam: float = 0.0,
        normalized: bool = False,
        init_std: float = 1e-3,
        bias_value: float = -1e4,
        seed: int = 0,
    ) -> None:
        super().__init__()
        check_positive("max_len", max_len)
        check_positive("num_heads", num_heads)
        if num_layers is not None:
            check_positive("num_layers", num_layers)
        lam = _check_real("lam", lam)
        if lam < 0:
            raise ValueError(f"lam (the sparsity penalty weight λ) must be >= 0, got {lam}")
        # bounded so that logits and scores + bias stay finite in float32
        init_std = check_finite_float("init_std", init_std, 0.0, _LIMIT)
        bias_value = check_finite_float("bias_value", bias_value, -_LIMIT, 0.0, high_open=True)
        check_bool("structured", structured)
        check_bool("symmetric", symmetric)
        check_bool("normalized", normalized)
        check_seed("seed", seed)
        self.max_len, self.num_heads = max_len, num_heads
        self.structured, self.symmetric = bool(structured), bool(symmetric) or bool(structured)
        self.shared = num_layers is None
        self.num_masks = 1 if num_layers is None else num_layers
        self.tau = tau
        self.lam, self.normalized = lam, bool(normalized)
        self.bias_value = bias_value
        shape = (self.num_masks, num_heads, max_len) + (() if structured else (max_len,))
        gen = torch.Generator().manual_seed(seed)
        self.logits = nn.Parameter(torch.randn(shape, generator=gen) * init_std)

    # ------------------------------------------------------------------ properties
    @property
    def tau(self) -> float:
        """The Gumbel-sigmoid temperature τ (> 0); may be annealed during training."""
        return self._tau

    @tau.setter
    def tau(self, value: float) -> None:
        self._tau = _check_tau(value)

    @property
    def variant(self) -> str:
        """``"DAM_s"`` or ``"DAM_u"``."""
        return "DAM_s" if self.structured else "DAM_u"

    def _check_n(self, n: int | None) -> int:
        if n is None:
            return self.max_len
        check_positive("n", n)
        if n > self.max_len:
            raise ValueError(
                f"sequence length n={n} exceeds max_len={self.max_len}, the length this "
                "DifferentiableAttentionMask was built for; build it with max_len >= n"
            )
        return n

    # ------------------------------------------------------------------ the mask
    def _expand(self, x: Tensor, n: int) -> Tensor:
        """Parameter-shaped (L, H, N[, N]) → (L, H, n, n): Toeplitz or (symmetric) crop."""
        if self.structured:
            return toeplitz(x, n)
        x = x[..., :n, :n]
        if self.symmetric:
            upper = torch.triu(x)
            x = upper + torch.triu(x, 1).transpose(-1, -2)
        return x

    def full_logits(self, n: int | None = None) -> Tensor:
        """The logits as (L, H, n, n) matrices (expanded for DAM_s, mirrored if symmetric)."""
        return self._expand(self.logits, self._check_n(n))

    def _draw(
        self, n: int | None, noise: bool | None, generator: torch.Generator | None
    ) -> tuple[Tensor, Tensor]:
        """z = ℓ (+ g) in parameter shape and expanded to (L, H, n, n)."""
        n = self._check_n(n)
        noise = self.training if noise is None else noise
        z = self.logits
        if noise:
            at = z.device if generator is None else generator.device
            u = torch.rand(z.shape, generator=generator, dtype=z.dtype, device=at).to(z.device)
            u = u.clamp(1e-6, 1 - 1e-6)
            z = z + (torch.log(u) - torch.log1p(-u))  # Logistic(0, 1) = Gumbel − Gumbel
        return z, self._expand(z, n)

    def relaxed(
        self,
        n: int | None = None,
        noise: bool | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """One draw of the relaxation.

        Args:
            n: length (≤ max_len; default max_len).
            noise: add Logistic noise g (default: in training mode only).
            generator: for the noise.
        Returns:
            ``(soft, hard, z)``, each (L, H, n, n): z = ℓ + g, soft = σ(z / τ) (differentiable),
            hard = 1[z > 0] (bool, before the empty-row rule). As τ → 0, soft → hard.
        """
        _, z = self._draw(n, noise, generator)
        return torch.sigmoid(z / self.tau), z > 0, z

    def sample(
        self,
        n: int | None = None,
        noise: bool | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """The straight-through mask M (L, H, n, n): forward the hard 0/1 mask (with the
        empty-row rule), backward the gradient of σ((ℓ + g)/τ).

        In eval mode (or ``noise=False``) M = 1[ℓ > 0] exactly, the extracted mask.
        """
        z_param, z = self._draw(n, noise, generator)
        soft = torch.sigmoid(z / self.tau)
        decisions = z_param if self.structured else z
        hard = hard_from_logits(decisions.detach(), z.shape[-1], self.structured)
        return hard.to(soft.dtype) + (soft - soft.detach())

    def bias(self, mask: Tensor) -> Tensor:
        """The additive score bias (1 − M)·b for a mask from :meth:`sample` (same shape)."""
        return (1 - mask) * self.bias_value

    def penalty(self, mask: Tensor) -> Tensor:
        """λ·‖M‖₁ = λ·Σ M (or λ·mean M when ``normalized``) for a mask from :meth:`sample`."""
        return self.lam * (mask.mean() if self.normalized else mask.sum())

    def forward(
        self, n: int, generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """One sample for a forward pass: ``(bias, penalty, mask)``; bias and mask (L, H, n, n).

        Layer l of a model uses ``bias[l % L]`` (see :meth:`for_layer`).
        """
        mask = self.sample(n, generator=generator)
        return self.bias(mask), self.penalty(mask), mask

    def for_layer(self, x: Tensor, layer: int) -> Tensor:
        """The (H, n, n) slice of an (L, H, n, n) tensor that layer ``layer`` uses."""
        return x[layer % x.shape[0]]

    # ------------------------------------------------------------------ deterministic view
    @torch.no_grad()
    def hard_mask(self, n: int | None = None) -> Tensor:
        """BoolTensor (L, H, n, n): M = 1[ℓ > 0] with the empty-row rule, no noise."""
        n = self._check_n(n)
        z = self.logits if self.structured else self.full_logits(n)
        return hard_from_logits(z, n, self.structured)

    def sparsity(self, n: int | None = None) -> float:
        """Fraction of dropped entries of :meth:`hard_mask`, over layers, heads and n²."""
        return 1.0 - float(self.hard_mask(n).float().mean())

    def extract(self, layer: int | None = None) -> LearnedMaskPattern | PatternCycle:
        """The deterministic learned pattern(s) M = 1[ℓ > 0] (no noise; empty rows keep their
        largest-logit key).

        Returns:
            a :class:`LearnedMaskPattern` (graph batch_shape (H,)) when the mask is shared or
            ``layer`` is given; otherwise a ``cycle`` of the L per-layer patterns, so that
            ``SparseAttention(..., pattern=cycle, layer_index=l)`` takes layer l's mask.
        """
        z = (self.logits if self.structured else self.full_logits()).detach().cpu()
        if self.shared or layer is not None:
            index = 0 if self.shared else layer % self.num_masks
            return LearnedMaskPattern(z[index].clone(), self.structured)
        return cycle(*(LearnedMaskPattern(z[i].clone(), self.structured) for i in range(len(z))))

    def extra_repr(self) -> str:
        return (
            f"{self.variant}, max_len={self.max_len}, num_heads={self.num_heads}, "
            f"layers={'shared' if self.shared else self.num_masks}, "
            f"symmetric={self.symmetric}, tau={self.tau:g}, lam={self.lam:g}, "
            f"normalized={self.normalized}"
        )


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class LearnedMaskPattern(Pattern):
    """A fixed per-head pattern from learned mask logits: A_i^h = {j : ℓ^h_ij > 0}.

    Empty rows follow the DAM's rule (module docstring). At a length n below the logits' N,
    the top-left n × n block (offsets < n) is used, with the same rule.

    Args:
        logits: FloatTensor (H, N, N) of full logits, or (H, N) of per-offset logits when
            ``structured`` (DAM_s; M_ij = 1[m_|i−j| > 0]).
        structured: whether ``logits`` are per-offset.
    Graphs have ``batch_shape (H,)`` and broadcast to (batch, heads) in ``sparse_attention``;
    :meth:`allows` returns a leading head dim (H, ...).
    """

    logits: Tensor
    structured: bool = False

    def __post_init__(self) -> None:
        lg = self.logits
        if not isinstance(lg, Tensor) or not lg.is_floating_point():
            raise TypeError("logits must be a floating-point tensor")
        if self.structured and lg.dim() != 2:
            raise ValueError(f"structured logits must have shape (heads, N), got {tuple(lg.shape)}")
        if not self.structured and (lg.dim() != 3 or lg.shape[-1] != lg.shape[-2]):
            raise ValueError(f"logits must have shape (heads, N, N), got {tuple(lg.shape)}")
        if not torch.isfinite(lg).all():
            raise ValueError("logits contain NaN or inf")

    @property
    def name(self) -> str:
        return "learned"

    @property
    def num_heads(self) -> int:
        return self.logits.shape[0]

    @property
    def max_len(self) -> int:
        return self.logits.shape[-1]

    def mask(self, n: int | None = None) -> Tensor:
        """BoolTensor (H, n, n) of allowed entries."""
        n = self.max_len if n is None else check_positive("n", n)
        if n > self.max_len:
            raise ValueError(
                f"sequence length n={n} exceeds the learned mask's length {self.max_len}"
            )
        return hard_from_logits(self.logits, n, self.structured)

    def _graph(self, n: int) -> AttentionGraph:
        return AttentionGraph.from_dense(self.mask(n))

    def _allows(self, q_idx: Tensor, kv_idx: Tensor, n: int) -> Tensor:
        mask = self._on(("mask", n), q_idx.device, lambda: self.mask(n))
        return mask[:, q_idx.clamp(0, n - 1), kv_idx.clamp(0, n - 1)]

    def allows_head(self, head: Tensor, q_idx: Tensor, kv_idx: Tensor, n: int) -> Tensor:
        """FlexAttention-shaped predicate (h, q_idx, kv_idx) at length n."""
        head, q_idx, kv_idx = torch.broadcast_tensors(
            torch.as_tensor(head), torch.as_tensor(q_idx), torch.as_tensor(kv_idx)
        )
        inside = (q_idx >= 0) & (q_idx < n) & (kv_idx >= 0) & (kv_idx < n)
        mask = self._on(("mask", n), q_idx.device, lambda: self.mask(n))
        return inside & mask[head.long(), q_idx.clamp(0, n - 1), kv_idx.clamp(0, n - 1)]

    def params(self) -> dict:
        return {"heads": self.num_heads, "max_len": self.max_len, "structured": self.structured}

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)

    def __repr__(self) -> str:
        kind = ", structured" if self.structured else ""
        return f"learned(heads={self.num_heads}, max_len={self.max_len}{kind})"
