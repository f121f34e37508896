"""Fast thresholds for sparse probability maps on rows: sparsemax, 1.5-entmax and α-entmax
(docs/engines.md, "Fast row maps").

All three maps have the form p = [x − τ]₊^{1/(α−1)} with x = (α − 1)·z and τ the unique
threshold with Σ p = 1 (Peters et al. 2019; Yun et al. appendix B.3). Instead of sorting whole
rows, τ is found by Newton's method from the left of the root, started at a lower bound
(:func:`_start`): Michelot's algorithm for sparsemax and Newton with the exact closed form on
the support for 1.5-entmax (both exact), safeguarded Newton to float precision (then the row
renormalised) for any other α. Rows are processed in pieces of ``PIECE`` entries.
Inputs follow :mod:`sparseattn.maps`: scores (..., K) with a bool ``valid`` mask; padding is
never read and gets exactly 0; a row without valid entries gives zeros. Forward only: the
maps of :mod:`sparseattn.maps` add the closed-form backward.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["entmax15_rows", "entmax_rows", "shifted_rows", "sparsemax_rows"]

#: Newton step at which 1.5-entmax first checks the support (then after every step).
_FIRST_STEPS = 1
#: Tile width for the start τ₀: the threshold of the rows' tile maxima (see ``_start``).
TILE = 16
#: Rows shorter than this start at τ₀ = max − 1 (the tile maxima would not pay off).
_TILED_FROM = 512
#: Newton steps on the tile maxima for the start τ₀.
_START_STEPS = 3
#: Most Newton steps before a row is taken as converged (only float ties at τ get there).
_MAX_STEPS = 60
#: Entries per piece of rows: small pieces keep every temporary in cache and re-use memory.
PIECE = 1 << 19

# Bool ops are several times slower than float passes in torch on CPU: supports are counted
# as Σ sign([x − τ]₊) and masks applied as −inf.


def _rows(
    scores: Tensor,
    valid: Tensor | None,
    alpha: float | Tensor,
    shifted: bool = False,
    out: Tensor | None = None,
) -> Tensor:
    if scores.shape[-1] == 0:
        return torch.zeros_like(scores)
    shape, k = scores.shape, scores.shape[-1]
    flat = scores.reshape(-1, k)
    vflat = None if valid is None else valid.expand(shape).reshape(-1, k)
    aflat = None
    if isinstance(alpha, Tensor):  # per-row α, broadcastable to (..., 1)
        aflat = alpha.detach().to(scores.dtype).expand(*shape[:-1], 1).reshape(-1, 1)
    # each piece is read (into its shifted copy) before its weights are written: out may be
    # scores itself
    out = torch.empty_like(flat) if out is None else out.view(-1, k)
    step = max(1, PIECE // k)
    for i in range(0, flat.shape[0], step):
        v = None if vflat is None else vflat[i : i + step]
        a = alpha if aflat is None else aflat[i : i + step]
        _piece(flat[i : i + step], v, a, shifted, out[i : i + step])
    return out.view(shape)


def _piece(
    z: Tensor, valid: Tensor | None, alpha: float | Tensor, shifted: bool, out: Tensor
) -> None:
    """Weights of the rows z (R, K) written into ``out`` (R, K)."""
    # For α > 2, p = d^{1/(α−1)} is steep at d = 0: one float32 ulp of τ moves small weights
    # by ~1e-4, so the threshold is found in float64 (the scores' values are exact there).
    # Half-precision rows are thresholded in float32: bf16 sums of a few hundred entries are
    # too coarse for the support to settle (Michelot's iteration cycles).
    per_row = isinstance(alpha, Tensor)
    steep = bool((alpha > 2.0).any()) if per_row else alpha > 2.0
    work = z.double() if steep and z.dtype == torch.float32 else z
    if z.dtype in (torch.bfloat16, torch.float16):
        work = z.float()
    x = work if valid is None else work.masked_fill(~valid, -math.inf)
    k = x.shape[-1]
    tiles = None
    if k >= _TILED_FROM:  # strided groups: the reduction runs over a middle dim (vectorised)
        tiles = x[:, : k - k % TILE].view(x.shape[0], TILE, -1).amax(1)
    # x ← (x − max)·(α − 1) in one pass where α is a number (the max from the tile maxima)
    scale = alpha.to(x.dtype) - 1.0 if per_row else alpha - 1.0
    mx = None
    if not shifted:
        mx = (x if tiles is None else tiles).amax(-1, keepdim=True)
        if tiles is not None and k % TILE:
            mx = torch.maximum(mx, x[:, k - k % TILE :].amax(-1, keepdim=True))
        mx.masked_fill_(mx == -math.inf, 0.0)
    if per_row:
        x = (x if mx is None else x - mx) * scale
    elif mx is not None:
        x = torch.add(mx * -scale, x, alpha=scale)
    elif scale != 1.0:
        x = x * scale
    if tiles is not None:
        tiles = ((tiles if mx is None else tiles - mx) * scale).clamp_min_(-1.0)
    if not per_row and alpha == 2.0:
        torch.sub(x, _sparsemax_tau(x, tiles), out=out).clamp_min_(0.0)
        return
    if not per_row and alpha == 1.5:
        torch.sub(x, _entmax15_tau(x, tiles), out=out).clamp_min_(0.0).square_()
        return
    a = alpha.to(x.dtype) if per_row else alpha
    p = (x - _entmax_tau(x, a, tiles)).clamp_min_(0.0).pow_(1.0 / (a - 1.0))
    total = p.sum(-1, keepdim=True)
    out.copy_(p.div_(torch.where(total > 0, total, 1.0)))


def _start(x: Tensor, alpha: float | Tensor, tiles: Tensor | None) -> Tensor:
    """A lower bound τ₀ ≤ τ (R, 1) for rows x = (α−1)·z (R, K) with max 0: the threshold of
    the tile maxima ``tiles`` (R, K/TILE) (a subset of the row: dropping entries only lowers
    the threshold), by ``_START_STEPS`` Newton steps from the left; never below the exact
    bound max − 1 = −1. Without tiles (short rows): −1."""
    t = torch.full((x.shape[0], 1), -1.0, dtype=x.dtype, device=x.device)
    if tiles is None:
        return t
    r = 1.0 / (alpha - 1.0)
    tiny = torch.finfo(x.dtype).tiny
    for _ in range(_START_STEPS):
        d = (tiles - t).clamp_min_(0.0)
        if isinstance(alpha, float) and alpha == 2.0:  # Michelot's step
            count = d.sign().sum(-1, keepdim=True)  # 0 only on rows without valid entries
            t = t + (d.sum(-1, keepdim=True) - 1) / count.clamp_min(1.0)
        elif isinstance(alpha, float) and alpha == 1.5:  # Newton on ‖[x − τ]₊‖₂ − 1
            norm = torch.linalg.vector_norm(d, 2, -1, keepdim=True)
            t = t + norm * (norm - 1) / d.sum(-1, keepdim=True).clamp_min(tiny)
        else:
            d_r = d.pow(r)
            total = d_r.sum(-1, keepdim=True)
            slope = d_r.div_(d).nan_to_num_(0.0, 0.0, 0.0).sum(-1, keepdim=True) * r
            step = torch.where(
                torch.as_tensor(r > 1), r * (total - total.pow(1 - 1 / r)), total - 1
            )
            t = t + step / slope.clamp_min(tiny)
    if not isinstance(alpha, float) or alpha not in (1.5, 2.0):
        # for r < 1 (α > 2) f is concave and Newton can overshoot: keep t only if f(t) ≥ 0
        below = (tiles - t).clamp_min_(0.0).pow_(r).sum(-1, keepdim=True) >= 1
        t = torch.where(below, t, -1.0)
    return t.clamp_min_(-1.0)


def _sparsemax_tau(x: Tensor, tiles: Tensor | None = None) -> Tensor:
    """Exact sparsemax threshold (R, 1) of rows x (R, K) with max 0 (Michelot's algorithm:
    τ ← (Σ_S x − 1)/|S| for S = {x > τ}, from τ₀ ≤ τ (``_start``), until |S| stops
    shrinking)."""
    tau = _start(x, 2.0, tiles)
    todo = torch.arange(x.shape[0], device=x.device)
    xs, t, k_old = x, tau.clone(), None
    while todo.numel():
        d = (xs - t).clamp_min_(0.0)
        k = d.sign().sum(-1, keepdim=True)
        if k_old is not None:
            done = (k == k_old).squeeze(1)  # S unchanged since τ = t was computed from it
            tau[todo[done]] = t[done]
            keep = ~done
            todo, xs, t, d, k = todo[keep], xs[keep], t[keep], d[keep], k[keep]
        t = torch.where(k > 0, t + (d.sum(-1, keepdim=True) - 1) / k.clamp_min(1.0), t)
        k_old = k
    return tau


def _entmax15_tau(x: Tensor, tiles: Tensor | None = None) -> Tensor:
    """Exact 1.5-entmax threshold (R, 1) for rows x (R, K) already halved, with max 0; only
    rows whose closed-form finish fails the support check are compacted and stepped on."""
    tau = _start(x, 1.5, tiles)
    todo: Tensor | None = None  # None: all rows, in order
    xs, t = x, tau.clone()
    d = torch.empty_like(x)
    tiny = torch.finfo(x.dtype).tiny
    for step in range(1, _MAX_STEPS + 1):
        torch.sub(xs, t, out=d).clamp_min_(0.0)
        norm = torch.linalg.vector_norm(d, 2, -1, keepdim=True)
        total = d.sum(-1, keepdim=True)
        if step >= _FIRST_STEPS:
            # closed form on S = {x > t}: with d = x − t on S, mean_S x = t + Σd/k and
            # var_S x = Σd²/k − (Σd/k)²; τ_S is exact iff S = {x > τ_S}: the counts agree
            k = d.sign_().sum(-1, keepdim=True)
            kc = k.clamp_min(1.0)
            mean_d = total / kc
            var = norm.square() / kc - mean_d.square()
            exact = t + mean_d - ((1 - kc * var) / kc).clamp_min(0.0).sqrt()
            done = torch.sub(xs, exact, out=d).clamp_min_(0.0).sign_().sum(-1, keepdim=True) == k
            if step == _MAX_STEPS:  # float ties at τ: Newton's τ has converged by now
                exact = torch.where(done, exact, t)
                done = torch.ones_like(done)
            if todo is None and bool(done.all()):
                return exact
            done = done.squeeze(1)
            if todo is None:
                todo = torch.arange(x.shape[0], device=x.device)
            tau[todo[done]] = exact[done]
            keep = ~done
            if not bool(keep.any()):
                break
            todo, xs, t, norm, total = todo[keep], xs[keep], t[keep], norm[keep], total[keep]
            d = d[: xs.shape[0]]
        # Newton on the convex, nearly linear G(τ) = ‖[x − τ]₊‖₂ − 1 (same root as f)
        t = t + norm * (norm - 1) / total.clamp_min(tiny)
    return tau


def _entmax_tau(x: Tensor, alpha: float | Tensor, tiles: Tensor | None = None) -> Tensor:
    """α-entmax threshold (R, 1) of rows x = (α−1)·z (R, K) with max 0, to float precision.

    ``alpha`` is a number or a per-row tensor (R, 1)."""
    r = 1.0 / (alpha - 1.0)
    finfo = torch.finfo(x.dtype)
    tau = torch.full((x.shape[0], 1), -1.0, dtype=x.dtype, device=x.device)
    todo = torch.arange(x.shape[0], device=x.device)
    xs = x
    # f(lo) >= 0: a lower bound (``_start``)
    lo = _start(x, alpha, tiles)
    hi = -lo.new_full(lo.shape, float(x.shape[-1])).pow(1.0 - alpha)  # f(hi) <= 0: all ≤ 1/K
    t = lo.clone()
    for _ in range(_MAX_STEPS):
        d = (xs - t).clamp_min_(0.0)
        d_r = d.pow(r)
        total = d_r.sum(-1, keepdim=True)  # Σ d^r
        slope = d_r.div_(d).nan_to_num_(0.0, 0.0, 0.0).sum(-1, keepdim=True) * r  # −f'(τ)
        f = total - 1
        lo = torch.where(f >= 0, t, lo)
        hi = torch.where(f <= 0, t, hi)
        # r > 1: Newton on the convex, nearly linear ‖[x − τ]₊‖_r − 1 (same root); else on f
        newton = t + torch.where(
            torch.as_tensor(r > 1), r * (total - total.pow(1.0 - 1.0 / r)), f
        ) / slope.clamp_min(finfo.tiny)
        new = torch.where((newton >= lo) & (newton <= hi), newton, (lo + hi) / 2)
        done = (((new - t).abs() <= 4 * finfo.eps) | (hi - lo <= 4 * finfo.eps)).squeeze(1)
        tau[todo[done]] = new[done]
        keep = ~done
        todo, xs, t, lo, hi = todo[keep], xs[keep], new[keep], lo[keep], hi[keep]
        if isinstance(r, Tensor):
            r = r[keep]
        if not todo.numel():
            break
    tau[todo] = t
    return tau


def sparsemax_rows(scores: Tensor, valid: Tensor | None = None) -> Tensor:
    """Sparsemax (Martins & Astudillo 2016) along the last dim of scores (..., K), ``valid`` a
    bool mask broadcastable to them or None: p = [z − τ]₊, Σ p = 1 (forward only)."""
    return _rows(scores, valid, 2.0)


def entmax15_rows(scores: Tensor, valid: Tensor | None = None) -> Tensor:
    """1.5-entmax (Peters et al. 2019) along the last dim: p = [z/2 − τ]₊², Σ p = 1; as
    :func:`sparsemax_rows`."""
    return _rows(scores, valid, 1.5)


def entmax_rows(
    scores: Tensor,
    valid: Tensor | None = None,
    alpha: float | Tensor = 1.5,
    out: Tensor | None = None,
) -> Tensor:
    """α-entmax (α > 1) along the last dim: p = [(α−1) z − τ]₊^{1/(α−1)}, Σ p = 1.

    α = 1.5 and 2 exact, any other α to float precision; ``alpha`` may be a tensor
    broadcastable to ``scores.shape[:-1] + (1,)`` (one α per row). Forward only. ``out``: a
    contiguous tensor of scores' shape and dtype for the weights (``scores`` itself works).
    """
    if isinstance(alpha, Tensor):
        if not bool((alpha > 1.0).all()):
            raise ValueError("alpha must be > 1 here (1 is softmax) in every entry")
        return _rows(scores, valid, alpha, out=out)
    if not alpha > 1.0:
        raise ValueError(f"alpha must be > 1 here (1 is softmax), got {alpha}")
    return _rows(scores, valid, float(alpha), out=out)


def shifted_rows(z: Tensor, valid: Tensor, alpha: float) -> Tensor:
    """The kernel form used by :mod:`sparseattn.maps`: ``z`` already shifted so that the
    valid entries' max is 0 (padding holds anything finite), ``valid`` of z's shape."""
    return _rows(z, valid, alpha, shifted=True)
