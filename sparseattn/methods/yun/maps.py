"""Assumption 2 of Yun et al. (2020), §3.2 and appendix B, checked for a probability map.

Assumption 2: for every margin ζ > 0 and η ∈ (0, 1] there is a scale t > 0 such that every
column v whose maximum v_{j*} exceeds all other entries by at least ζ gives
ρ[t v]_{j*} ≥ 1 − η and Σ_{j ≠ j*} ρ[t v]_j ≤ η — the map approaches the hardmax σ_H.

:func:`closed_form_t` returns the scale of appendix B where one exists; :func:`assumption2` then
checks it (or, for a map without a closed form, finds one by doubling and bisection) on random
inputs with the margin and on adversarial ones (all other entries exactly ζ below the max),
comparing ρ[t v] with the hardmax of v.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from ...maps import ProbabilityMap, hardmax, resolve_prob_map
from ...validate import check_finite_float, check_int, check_positive

__all__ = ["Assumption2Report", "assumption2", "closed_form_t", "margin_inputs"]

#: Slack allowed on the two inequalities (float64 rounding of the map).
TOL = 1e-9
#: Most float64 entries of the test columns (rows × n) that :func:`margin_inputs` allocates.
MAX_INPUT_ENTRIES = 1 << 27


def _check_args(
    zeta: float, eta: float, n: int, top_k: int | None
) -> tuple[float, float, int, int | None]:
    zeta = check_finite_float("zeta", zeta, 0.0, low_open=True)
    eta = check_finite_float("eta", eta, 0.0, 1.0, low_open=True)
    n = check_positive("n", n)
    top_k = None if top_k is None else check_positive("top_k", top_k)
    return zeta, eta, n, top_k


def closed_form_t(
    prob_map: str | ProbabilityMap, zeta: float, eta: float, n: int, top_k: int | None = None
) -> tuple[float, str] | None:
    """The scale t of Yun et al. appendix B for ρ at margin ζ, tolerance η and length n.

    * softmax (B.1): the least t with 1 / (1 + (m − 1) e^{−tζ}) ≥ 1 − η, i.e.
      t = ln((m − 1)(1 − η)/η) / ζ with m = n, or m = min(k, n) for softmax on the top-k inputs;
    * sparsemax and sparselin-gen(λ) (B.2): t = (1 − η)/ζ;
    * α-entmax, α > 1 (B.3): t = 1 / (ζ(α − 1)) (then ρ[t v] is exactly one-hot);
    * hardmax: ρ[t v] = σ_H[v] for every t > 0.

    Where the bound holds for every t > 0 (η = 1, or a single candidate) it returns 1/ζ.
    Returns (t, which formula) or None for a map without a closed form here.
    """
    rho = resolve_prob_map(prob_map)
    zeta, eta, n, top_k = _check_args(zeta, eta, n, top_k)
    found = _closed_form_t(rho, zeta, eta, n, top_k)
    if found is not None and not math.isfinite(found[0]):
        raise ValueError(f"zeta={zeta:g} is too small: the scale t of {found[1]} overflows")
    return found


def _closed_form_t(
    rho: ProbabilityMap, zeta: float, eta: float, n: int, top_k: int | None
) -> tuple[float, str] | None:
    m = n if top_k is None else min(top_k, n)
    name = "softmax" if rho.is_softmax else rho.name
    if name == "softmax":
        if eta >= 1 or m == 1:
            return 1 / zeta, "B.1: every t > 0 works here; 1/ζ"
        t = math.log((m - 1) * (1 - eta) / eta) / zeta
        label = "B.1 top-k softmax" if top_k is not None else "B.1 softmax"
        if t <= 0:
            return 1 / zeta, f"{label}: every t > 0 works here; 1/ζ"
        return t, f"{label}: t = ln((m−1)(1−η)/η)/ζ, m = {m}"
    if name in ("sparsemax", "sparselin_gen"):
        if eta >= 1:
            return 1 / zeta, "B.2: every t > 0 works here; 1/ζ"
        return (1 - eta) / zeta, "B.2: t = (1−η)/ζ"
    if name == "entmax":
        alpha = rho.params["alpha"]
        step = zeta * (alpha - 1)
        return (1 / step if step > 0 else math.inf), f"B.3: t = 1/(ζ(α−1)), α = {alpha:g}"
    if name == "hardmax":
        return 1 / zeta, "σ_H[t v] = σ_H[v] for every t > 0; 1/ζ"
    return None


def margin_inputs(n: int, zeta: float, samples: int = 256, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Float64 test columns with a unique maximum at least ζ above every other entry.

    Returns ``(v, adversarial)``: v of shape (rows, n) and a Bool[rows] marking the adversarial
    rows, whose other entries all sit exactly ζ below the maximum (the worst case of B.1), at
    several offsets and maximum positions. The other ``samples`` rows are Gaussian at scales 1,
    10 and 100 with the maximum raised to ζ (half of them exactly, half with extra room) above
    the runner-up.
    """
    n = check_positive("n", n)
    zeta = check_finite_float("zeta", zeta, 0.0, low_open=True)
    samples = check_int("samples", samples, 0)
    seed = check_int("seed", seed, 0)
    if (samples + 9) * n > MAX_INPUT_ENTRIES:
        raise ValueError(
            f"n={n} and samples={samples} need {(samples + 9) * n:,} test entries; "
            f"at most {MAX_INPUT_ENTRIES:,} are allocated"
        )
    gen = torch.Generator().manual_seed(seed)
    adversarial = []
    for offset in (0.0, 3.7, -250.0):
        for pos in {0, n - 1, n // 2}:
            row = torch.full((n,), offset - zeta, dtype=torch.float64)
            row[pos] = offset
            adversarial.append(row)
    adv = torch.stack(adversarial)
    scale = torch.tensor([1.0, 10.0, 100.0], dtype=torch.float64)[
        torch.randint(3, (samples,), generator=gen)
    ]
    v = torch.randn(samples, n, generator=gen, dtype=torch.float64) * scale[:, None]
    top = torch.randint(n, (samples,), generator=gen)
    others = v.scatter(1, top[:, None], -math.inf).amax(1)
    if n == 1:
        others = torch.zeros(samples, dtype=torch.float64)
    extra = torch.rand(samples, generator=gen, dtype=torch.float64) * zeta
    extra[: samples // 2] = 0.0
    v.scatter_(1, top[:, None], (others + zeta + extra)[:, None])
    flags = torch.zeros(len(adv) + samples, dtype=torch.bool)
    flags[: len(adv)] = True
    return torch.cat([adv, v]), flags


@dataclasses.dataclass(frozen=True)
class Assumption2Report:
    """The outcome of :func:`assumption2`.

    Attributes:
        t: the scale checked; ``method`` says where it came from.
        t_least: the least t (bisection to 1e-6 relative) that passes on the adversarial
            inputs — how tight ``t`` is (None if t fails there).
        holds: both inequalities held (within ``TOL``) on every test input.
        worst_max_weight: min over inputs of ρ[t v]_{j*} (must be ≥ 1 − η).
        worst_rest: max over inputs of Σ_{j≠j*} ρ[t v]_j (must be ≤ η).
        worst_l1_to_hardmax: max over inputs of ‖ρ[t v] − σ_H[v]‖₁.
        inputs: how many columns were tested (``adversarial`` of them adversarial).
    """

    prob_map: str
    zeta: float
    eta: float
    n: int
    top_k: int | None
    t: float
    method: str
    t_least: float | None
    holds: bool
    worst_max_weight: float
    worst_rest: float
    worst_l1_to_hardmax: float
    inputs: int
    adversarial: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _evaluate(rho: ProbabilityMap, v: Tensor, t: float, top_k: int | None) -> tuple[Tensor, ...]:
    """(weight of j*, weight of the rest, L1 to hardmax) per row of v for ρ[t v]."""
    target = hardmax()(v)
    valid = None
    if top_k is not None and top_k < v.shape[-1]:
        keep = v.topk(top_k, dim=-1).indices
        valid = torch.zeros_like(v, dtype=torch.bool).scatter_(-1, keep, True)
    with torch.no_grad():
        weights = rho(t * v, valid)
    top = (weights * target).sum(-1)
    rest = (weights * (1 - target)).sum(-1)
    return top, rest, (weights - target).abs().sum(-1)


def _passes(rho: ProbabilityMap, v: Tensor, t: float, eta: float, top_k: int | None) -> bool:
    top, rest, _ = _evaluate(rho, v, t, top_k)
    return bool((top >= 1 - eta - TOL).all() and (rest <= eta + TOL).all())


def _least(rho: ProbabilityMap, v: Tensor, hi: float, eta: float, top_k: int | None) -> float:
    """Bisection for the least passing t in (0, hi], assuming passing is monotone in t
    (40 halvings: 1e-12 of ``hi`` when every t > 0 passes, as for hardmax)."""
    lo = 0.0
    for _ in range(40):
        if hi - lo <= 1e-6 * hi:
            break
        mid = (lo + hi) / 2
        if _passes(rho, v, mid, eta, top_k):
            hi = mid
        else:
            lo = mid
    return hi


def assumption2(
    prob_map: str | ProbabilityMap,
    zeta: float,
    eta: float,
    n: int,
    *,
    top_k: int | None = None,
    t: float | None = None,
    samples: int = 256,
    seed: int = 0,
) -> Assumption2Report:
    """Check Yun et al. Assumption 2 for ``prob_map`` at margin ζ, tolerance η, length n.

    Args:
        prob_map: a ProbabilityMap or a name accepted by ``resolve_prob_map``.
        zeta: the margin ζ > 0 between the maximum and every other entry.
        eta: the tolerance η ∈ (0, 1].
        n: the column length (keys per query).
        top_k: apply the map to the top-k entries only (softmax with top-k inputs, B.1).
        t: the scale to check; default: :func:`closed_form_t`, or for a map without one the
            least scale found by doubling from 1/ζ and bisection on the test inputs.
        samples: random test columns besides the adversarial ones (see :func:`margin_inputs`).
        seed: seed of the random test columns.
    Returns:
        An :class:`Assumption2Report`; ``holds`` is the verdict, checked against σ_H[v].
    """
    rho = resolve_prob_map(prob_map)
    zeta, eta, n, top_k = _check_args(zeta, eta, n, top_k)
    if t is not None:
        t = check_finite_float("t", t, 0.0, low_open=True)
    v, flags = margin_inputs(n, zeta, samples, seed)
    if t is not None:
        method = "given"
    else:
        found = closed_form_t(rho, zeta, eta, n, top_k)
        if found is not None:
            t, method = found
        else:
            t = 1 / zeta
            while not _passes(rho, v, t, eta, top_k):
                t *= 2
                if t * zeta > 1e12:
                    raise ValueError(f"no scale t ≤ 1e12/ζ satisfies Assumption 2 for {rho!r}")
            t = _least(rho, v, t, eta, top_k)
            method = "search: doubling from 1/ζ, then bisection on the test inputs"
    if not math.isfinite(t * float(v.abs().max())):
        raise ValueError(f"t={t:g} overflows float64 on the test inputs (zeta={zeta:g})")
    top, rest, l1 = _evaluate(rho, v, float(t), top_k)
    holds = bool((top >= 1 - eta - TOL).all() and (rest <= eta + TOL).all())
    adv = v[flags]
    t_least = _least(rho, adv, float(t), eta, top_k) if _passes(rho, adv, t, eta, top_k) else None
    return Assumption2Report(
        prob_map=repr(rho),
        zeta=float(zeta),
        eta=float(eta),
        n=n,
        top_k=top_k,
        t=float(t),
        method=method,
        t_least=t_least,
        holds=holds,
        worst_max_weight=float(top.min()),
        worst_rest=float(rest.max()),
        worst_l1_to_hardmax=float(l1.max()),
        inputs=int(v.shape[0]),
        adversarial=int(flags.sum()),
    )
