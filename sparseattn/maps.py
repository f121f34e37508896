"""Probability maps ρ: padded ragged rows of attention scores → attention weights.

Yun et al. 2020 (§3.1, appendix B) write attention as ``ρ(scores) · V``. Every map here acts
along the last dim of ``scores`` (..., K), with an optional bool ``valid`` mask (``None`` = all
valid) marking the real entries of a padded row: padding gets exactly 0 weight and gradient and
is never read; a row sums to 1, one with no valid entry maps to zeros (never NaN). Half-precision
scores are computed in float32. Sparse maps output exact zeros.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from numbers import Real

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx

from .fastmaps import entmax_rows, shifted_rows
from .validate import all_finite

__all__ = [
    "ProbabilityMap",
    "entmax",
    "hardmax",
    "resolve_prob_map",
    "softmax",
    "sparselin_gen",
    "sparsemax",
    "support",
]

#: Score dtypes a map computes in float32 (and returns in their own dtype).
_HALF = (torch.bfloat16, torch.float16)

Kernel = Callable[[Tensor, Tensor], Tensor]
"""``kernel(z, valid) -> p``: z (..., K) shifted scores (valid max 0, padding 0), valid (..., K)."""


class NonFiniteScoresError(ValueError):
    """Scores with NaN or ±inf at a valid entry (callers may name the cause, e.g. ``scale``)."""


class ProbabilityMap:
    """A probability map ρ applied along the last dim of a padded score tensor.

    Attributes:
        name: short name, e.g. ``"entmax"``.
        sparse: whether the map can give exact zeros to valid entries.
        params: hyper-parameters shown by ``repr``, e.g. ``{"alpha": 1.5}``.
        alpha: the α tensor of ``entmax(tensor)`` (one α per row), else None; engines lay it
            out with :meth:`row_alpha` and :meth:`with_alpha`.
    """

    def __init__(
        self,
        name: str,
        kernel: Kernel,
        *,
        sparse: bool,
        fast: Callable[[Tensor, Tensor | None], Tensor] | None = None,
        alpha_tensor: Tensor | None = None,
        **params: float,
    ) -> None:
        self.name = name
        self.sparse = sparse
        self.params = params
        self.alpha = alpha_tensor
        self._kernel = kernel
        self._fast = fast
        #: (public factory, its arguments): how ``pickle``, ``copy.deepcopy`` and
        #: :func:`prob_map_config` rebuild this map (its kernels are closures); set by the
        #: factories below.
        self.recipe: tuple[Callable[..., ProbabilityMap], tuple] | None = None

    def __reduce__(self):
        if self.recipe is None:
            raise TypeError(
                f"{self!r} was not made by a factory of sparseattn.maps (softmax, entmax, ...): "
                "it cannot be pickled or copied"
            )
        return self.recipe

    @property
    def is_softmax(self) -> bool:
        """Whether this map is the softmax (also α-entmax at α = 1): engines take its closed
        forms (fused kernels, dS = P ⊙ (dP − Σ P⊙dP), log-sum-exp merging)."""
        return self.name == "softmax" or (
            self.name == "entmax" and self.alpha is None and self.params.get("alpha") == 1.0
        )

    def forward_only(self, scores: Tensor, valid: Tensor | None = None) -> Tensor:
        """ρ(scores) without autograd, for engines that recompute weights in backward: for
        entmax maps :mod:`sparseattn.fastmaps`' thresholds, the weights overwriting ``scores``
        (contiguous, consumed), else this map under ``no_grad``. Inputs are trusted."""
        if self._fast is not None:
            return self._fast(scores, valid)
        with torch.no_grad():
            return self(scores, valid)

    def row_alpha(self, bsz: int, heads: int, n_q: int) -> Tensor | None:
        """α expanded to (B, H, n_q, 1) — one α per attention row — or None for a fixed map."""
        if self.alpha is None:
            return None
        try:
            return self.alpha.expand(bsz, heads, n_q, 1)
        except RuntimeError as err:
            raise ValueError(
                f"alpha of shape {tuple(self.alpha.shape)} must broadcast to one α per "
                f"attention row, (batch, heads, n_q, 1) = {(bsz, heads, n_q, 1)}"
            ) from err

    def with_alpha(self, alpha: Tensor) -> ProbabilityMap:
        """This α-entmax map with α replaced by ``alpha`` (laid out like an engine's rows)."""
        return _entmax_tensor(alpha)

    def __call__(self, scores: Tensor, valid: Tensor | None = None) -> Tensor:
        """Weights ρ(scores) of shape (..., K) for scores (..., K) and a bool mask ``valid``."""
        if not isinstance(scores, Tensor) or not scores.is_floating_point():
            kind = scores.dtype if isinstance(scores, Tensor) else type(scores).__name__
            raise TypeError(f"scores must be a floating-point tensor, got {kind}")
        if scores.dim() == 0:
            raise ValueError("scores must have at least one dim (the row dim K), got a 0-d tensor")
        if valid is None:
            valid = torch.ones_like(scores, dtype=torch.bool)
        elif not isinstance(valid, Tensor) or valid.dtype != torch.bool:
            kind = valid.dtype if isinstance(valid, Tensor) else type(valid).__name__
            raise TypeError(f"valid must be a bool tensor or None, got {kind}")
        else:
            try:
                valid = valid.expand(scores.shape)
            except RuntimeError as err:
                raise ValueError(
                    f"valid of shape {tuple(valid.shape)} must broadcast to scores of shape "
                    f"{tuple(scores.shape)}"
                ) from err
        if scores.shape[-1] == 0:
            return torch.zeros_like(scores)
        # half precision: a bf16 cumsum or row sum of a few hundred entries is too coarse for
        # a threshold or a denominator, so the map runs in float32 (autograd through the casts)
        z = _shift(scores.float() if scores.dtype in _HALF else scores, valid)
        # one reduction: NaN or ±inf at a valid entry makes z (hence its sum) non-finite
        if not all_finite(z):
            raise NonFiniteScoresError("scores must be finite at valid entries, got NaN or ±inf")
        return self._kernel(z, valid).to(scores.dtype)

    def __repr__(self) -> str:
        if self.alpha is not None:
            return f"{self.name}(alpha=<tensor of shape {tuple(self.alpha.shape)}>)"
        args = ", ".join(f"{key}={value!r}" for key, value in self.params.items())
        return f"{self.name}({args})"


def _shift(scores: Tensor, valid: Tensor) -> Tensor:
    """Valid scores minus their detached row max (exact for shift-invariant ρ); padding → 0."""
    row_max = scores.detach().masked_fill(~valid, -math.inf).amax(-1, keepdim=True)
    return torch.where(valid, scores - row_max, 0.0)


def _safe_divide(num: Tensor, den: Tensor) -> Tensor:
    """num / den, with den = 0 (an all-invalid row, where num = 0 too) giving 0."""
    return num / torch.where(den > 0, den, 1.0)


def _softmax(z: Tensor, valid: Tensor) -> Tensor:
    e = torch.where(valid, z.exp(), 0.0)
    return _safe_divide(e, e.sum(-1, keepdim=True))


def _hardmax(z: Tensor, valid: Tensor) -> Tensor:
    top = (valid & (z == 0)).to(z.dtype)  # z == 0 exactly at the row maxima
    # `z * 0` keeps the output in the autograd graph with its true (zero) gradient.
    return _safe_divide(top, top.sum(-1, keepdim=True)) + z * 0


def _sorted_rows(x: Tensor, valid: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Rows sorted descending, padding last and set to 0 (no -inf in a cumsum): the sorted rows
    (..., K), the ranks k = 1..K (K,) and ``in_row`` (..., K): k ≤ count."""
    xs = x.masked_fill(~valid, -math.inf).sort(dim=-1, descending=True).values
    k = torch.arange(1, x.shape[-1] + 1, dtype=x.dtype, device=x.device)
    in_row = k <= valid.sum(-1, keepdim=True)
    return xs.masked_fill(~in_row, 0.0), k, in_row


def _threshold_at_support(per_k: Tensor, support: Tensor) -> Tensor:
    """τ = per_k[k* − 1] with k* = |support| (..., 1); rows with no support read index 0."""
    last = (support.sum(-1, keepdim=True) - 1).clamp_min(0)
    return per_k.gather(-1, last)


def _sparsemax_sort(z: Tensor, valid: Tensor) -> Tensor:
    """Sparsemax by sorting (Martins & Astudillo 2016): p = [z − τ]₊, τ = (Σ_{j≤k*} z_(j) − 1)/k*,
    k* = max{k : 1 + k z_(k) > Σ_{j≤k} z_(j)}."""
    zs, k, in_row = _sorted_rows(z, valid)
    cumsum = zs.cumsum(-1)
    support = in_row & (1 + k * zs > cumsum)
    tau = _threshold_at_support((cumsum - 1) / k, support)
    return (z - tau).clamp_min(0.0).masked_fill(~valid, 0.0)


def _entmax15_sort(z: Tensor, valid: Tensor) -> Tensor:
    """1.5-entmax by sorting (Peters et al. 2019): with x = z/2 sorted, for each prefix k,
    τ_k = mean_k − sqrt([(1 − k·var_k)/k]₊); k* = |{k : τ_k ≤ x_(k)}|; p = [x − τ_{k*}]₊²."""
    x = z / 2
    xs, k, in_row = _sorted_rows(x, valid)
    mean = xs.cumsum(-1) / k
    mean_sq = (xs * xs).cumsum(-1) / k
    delta = (1 - k * (mean_sq - mean * mean)) / k
    tau_k = mean - delta.clamp_min(0.0).sqrt()
    tau = _threshold_at_support(tau_k, in_row & (tau_k <= xs))
    return (x - tau).clamp_min(0.0).square().masked_fill(~valid, 0.0)


#: Below this many entries the sort-based kernels (one pass of fused ops) beat the Newton
#: kernels of :mod:`sparseattn.fastmaps` (a few passes per step); above, Newton is 1.3-5x faster.
_SORT_BELOW = 8192


class _EntmaxFunction(torch.autograd.Function):
    """α-entmax (α > 1) with the closed-form backward (Peters et al. 2019): with s = p^{2−α} on
    the support (α = 2: s = 1[p > 0]), ∂L/∂z = s⊙g − s · Σ(s⊙g) / Σs."""

    @staticmethod
    def forward(ctx: FunctionCtx, z: Tensor, valid: Tensor, alpha: float) -> Tensor:
        if alpha == 2.0 and z.numel() < _SORT_BELOW:
            p = _sparsemax_sort(z, valid)
        elif alpha == 1.5 and z.numel() < _SORT_BELOW:
            p = _entmax15_sort(z, valid)
        else:  # Newton on τ with an exact finish (α = 1.5, 2) or to float precision
            p = shifted_rows(z, valid, alpha)
        ctx.alpha = alpha
        ctx.save_for_backward(p)
        return p

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor, None, None]:
        (p,) = ctx.saved_tensors
        s = torch.where(p > 0, p.pow(2.0 - ctx.alpha), 0.0)
        sg = s * grad
        return sg - s * _safe_divide(sg.sum(-1, keepdim=True), s.sum(-1, keepdim=True)), None, None


def _entmax_kernel(alpha: float) -> Kernel:
    return lambda z, valid: _EntmaxFunction.apply(z, valid, alpha)


class _EntmaxAlphaFunction(torch.autograd.Function):
    """α-entmax with a tensor α (one per row, (..., 1)) and its gradient in α.

    ∂L/∂z is the closed form of :class:`_EntmaxFunction` with s = p^{2−α} per row. With
    ŝ = s / Σs and the Shannon terms h = p log p (0 off the support), the gradient in α is the
    one of the ``entmax`` package's ``EntmaxBisectFunction`` (Correia et al. 2019):
    ∂L/∂α = Σ_j g_j [(p_j − ŝ_j)/(α − 1)² − (h_j − ŝ_j Σ_i h_i)/(α − 1)].
    """

    @staticmethod
    def forward(ctx: FunctionCtx, z: Tensor, valid: Tensor, alpha: Tensor) -> Tensor:
        a = alpha.detach().to(z.dtype)
        p = shifted_rows(z, valid, a)
        ctx.save_for_backward(p, a)
        ctx.alpha_shape = alpha.shape
        return p

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor, None, Tensor | None]:
        p, a = ctx.saved_tensors
        s = torch.where(p > 0, p.pow(2.0 - a), 0.0)
        s_sum = s.sum(-1, keepdim=True)
        sg = s * grad
        dz = sg - s * _safe_divide(sg.sum(-1, keepdim=True), s_sum)
        d_alpha = None
        if ctx.needs_input_grad[2]:
            h = torch.where(p > 0, p * p.log(), 0.0)
            skew = _safe_divide(s, s_sum)
            term = (p - skew) / (a - 1) ** 2 - (h - skew * h.sum(-1, keepdim=True)) / (a - 1)
            d_alpha = (grad * term).sum(-1, keepdim=True).sum_to_size(ctx.alpha_shape)
        return dz, None, d_alpha


def _entmax_tensor(alpha: Tensor) -> ProbabilityMap:
    def kernel(z: Tensor, valid: Tensor) -> Tensor:
        rows = (*z.shape[:-1], 1)
        try:
            fits = torch.broadcast_shapes(alpha.shape, rows) == rows
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(
                f"alpha of shape {tuple(alpha.shape)} must broadcast to one α per row of "
                f"scores, {rows}"
            )
        return _EntmaxAlphaFunction.apply(z, valid, alpha)

    rho = ProbabilityMap(
        "entmax",
        kernel,
        sparse=True,
        alpha_tensor=alpha,
        fast=lambda s, valid: entmax_rows(s, valid, alpha.detach().to(s.dtype), out=s),
    )
    return _made_by(rho, entmax, alpha)


def _fixed_fast(alpha: float) -> Callable[[Tensor, Tensor | None], Tensor]:
    return lambda s, valid: entmax_rows(s, valid, alpha, out=s)


def _made_by(rho: ProbabilityMap, factory: Callable[..., ProbabilityMap], *args) -> ProbabilityMap:
    """``rho`` with its recipe: ``factory(*args)`` gives it back (pickle, deepcopy, config)."""
    rho.recipe = (factory, args)
    return rho


def _check_real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def softmax() -> ProbabilityMap:
    """Softmax σ_S (Yun et al. appendix B.1): p_j = exp(v_j) / Σ_i exp(v_i) over valid entries."""
    return _made_by(ProbabilityMap("softmax", _softmax, sparse=False), softmax)


def hardmax() -> ProbabilityMap:
    """Hardmax: one-hot on the argmax of the valid entries (the limit in Yun et al. Assumption 2);
    m tied maxima get 1/m each. Piecewise constant: its gradient is exactly zero."""
    return _made_by(ProbabilityMap("hardmax", _hardmax, sparse=True), hardmax)


def sparsemax() -> ProbabilityMap:
    """Sparsemax (Martins & Astudillo 2016), the Euclidean projection onto the simplex:
    p = [v − τ]₊ with Σ p = 1; equals ``entmax(2)``. Exact, sort-based."""
    rho = ProbabilityMap("sparsemax", _entmax_kernel(2.0), sparse=True, fast=_fixed_fast(2.0))
    return _made_by(rho, sparsemax)


def sparselin_gen(lam: float) -> ProbabilityMap:
    """Sparselin-gen (Yun et al. appendix B.2): ρ(v)_j = max(0, (v_j − τ)/(1 − λ)), Σ ρ = 1,
    i.e. sparsemax(v / (1 − λ)); ``lam`` ∈ [0, 1)."""
    lam = _check_real("lam", lam)
    if not 0.0 <= lam < 1.0:
        raise ValueError(f"lam must lie in [0, 1), got {lam}")
    sparsemax_kernel = _entmax_kernel(2.0)

    def kernel(z: Tensor, valid: Tensor) -> Tensor:
        return sparsemax_kernel(z / (1 - lam), valid)

    return _made_by(
        ProbabilityMap("sparselin_gen", kernel, sparse=True, lam=lam), sparselin_gen, lam
    )


def entmax(alpha: float | Tensor) -> ProbabilityMap:
    """α-entmax (Yun et al. appendix B.3): p_j = [(α−1) v_j − τ]₊^{1/(α−1)} with Σ p = 1.

    α = 1 is softmax; α = 1.5 and α = 2 (sparsemax) are exact (sort-based on short inputs,
    :mod:`sparseattn.fastmaps` on long ones); any other α > 1 uses safeguarded Newton on τ to
    float precision. Backward is closed-form. A number ``alpha`` must be finite and ≥ 1.

    ``alpha`` may also be a floating tensor, every entry finite and > 1, one α per row:
    broadcastable to ``scores.shape[:-1] + (1,)``, e.g. (H, 1, 1) per head (the Adaptively
    Sparse Transformer, Correia et al. 2019); with ``requires_grad`` the map gives ∂L/∂α.
    """
    if isinstance(alpha, Tensor):
        if not alpha.is_floating_point():
            raise TypeError(f"alpha must be a floating-point tensor, got {alpha.dtype}")
        a = alpha.detach()
        if not bool(torch.isfinite(a).all()) or not bool((a > 1.0).all()):
            raise ValueError("a tensor alpha must be finite and > 1 in every entry")
        return _entmax_tensor(alpha)
    alpha = _check_real("alpha", alpha)
    if alpha < 1.0:
        raise ValueError(f"alpha must be >= 1 (1 = softmax), got {alpha}")
    if alpha == 1.0:
        return _made_by(
            ProbabilityMap("entmax", _softmax, sparse=False, alpha=alpha), entmax, alpha
        )
    kernel, fast = _entmax_kernel(alpha), _fixed_fast(alpha)
    if alpha - 1.0 < _WIDEN_BELOW:  # 1/(α − 1) exponents lose float32 precision: use float64
        kernel, fast = _in_float64(kernel), _in_float64(fast)
    rho = ProbabilityMap("entmax", kernel, sparse=True, fast=fast, alpha=alpha)
    return _made_by(rho, entmax, alpha)


#: For 1 < α < 1 + _WIDEN_BELOW, α-entmax of float32/16 scores is computed in float64 (in
#: float32 the error grows like 1e-8/(α − 1): 0.06 at α = 1 + 1e-7; in float64 it is ~1e-9).
_WIDEN_BELOW = 1e-3


def _in_float64(fn: Callable[[Tensor, Tensor | None], Tensor]):
    def widened(x: Tensor, valid: Tensor | None) -> Tensor:
        return fn(x, valid) if x.dtype == torch.float64 else fn(x.double(), valid).to(x.dtype)

    return widened


class _Support(ProbabilityMap):
    """1.0 where ρ gives a positive weight, 0.0 elsewhere (see :func:`support`)."""

    def __init__(self, rho: ProbabilityMap) -> None:
        super().__init__(
            "support",
            lambda z, valid: (rho._kernel(z, valid) > 0).to(z.dtype),
            sparse=True,
            fast=lambda s, valid: (rho.forward_only(s, valid) > 0).to(s.dtype),
            alpha_tensor=rho.alpha,
        )
        self.rho = rho
        self.recipe = (support, (rho,))

    def with_alpha(self, alpha: Tensor) -> ProbabilityMap:
        return _Support(self.rho.with_alpha(alpha))


def support(rho: ProbabilityMap) -> ProbabilityMap:
    """The indicator of ρ's support, 1[ρ(scores)_j > 0], as a map (forward only): through an
    engine with values of ones it counts each query's non-zero weights (``attention_sparsity``)."""
    return _Support(rho)


_NAMED: dict[str, Callable[[], ProbabilityMap]] = {
    "softmax": softmax,
    "hardmax": hardmax,
    "sparsemax": sparsemax,
    "entmax15": lambda: entmax(1.5),
    "entmax": lambda: entmax(1.5),
}


def resolve_prob_map(spec: str | ProbabilityMap) -> ProbabilityMap:
    """A ProbabilityMap from a name (``"softmax"``, ``"hardmax"``, ``"sparsemax"``,
    ``"entmax15"``, ``"entmax"`` = 1.5-entmax) or an existing map (returned as is)."""
    if isinstance(spec, ProbabilityMap):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"spec must be a str or a ProbabilityMap, got {type(spec).__name__}")
    if spec not in _NAMED:
        raise ValueError(f"spec must be one of {sorted(_NAMED)}, got {spec!r}")
    return _NAMED[spec]()
