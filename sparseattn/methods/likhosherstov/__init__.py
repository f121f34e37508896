"""Likhosherstov, Choromanski & Weller (AAAI 2023): the patterns one attention matrix expresses.

* :func:`usam`, :func:`sam`, :func:`csam` — the self-attention matrix, eqs. (1), (2) and its causal
  form (CSAM); :func:`weakly_approximates` — Definition 0.1 (eq. 4); :func:`ratio_errors` — the
  least ε₁, ε₂ of eqs. (7)/(8) and (23)/(24);
* :func:`weak_sam_approx_d1` — Algorithm 1, the polynomial decider for d = 1 (Theorem 0.3), with
  an independent exhaustive check :func:`weak_sam_approx_d1_lp`;
* :func:`weak_sam_approx_d2` — an exact decider for d = 2 at small n by planar order types
  (:mod:`.order_types`), where Theorem 0.2 makes the general d > 1 question NP-hard;
  :func:`try_weak_approx` searches for a witness by gradient descent and never answers
  "impossible";
* :func:`construct_sam` — the O(log n) construction of Theorem 0.4 (eqs. 9, 14–17, Lemma 0.6) and
  of Corollary 0.7 (``causal=True``); :func:`theorem_d` — the d of eq. (6)/(22);
  :func:`least_construct_d` and :func:`random_sparse_stochastic` — the d_min study.

:mod:`.expressivity` holds the paper's objects, :mod:`.order_types` the d = 2 decider. Imports only
the core; the d_min experiment is the lab's (``sparseattn expressivity``).
"""

from .expressivity import (
    RatioErrors,
    SAMConstruction,
    WeakApproxResult,
    construct_sam,
    construction_weights,
    csam,
    least_construct_d,
    random_sparse_stochastic,
    ratio_errors,
    sam,
    theorem_d,
    theorem_slope,
    try_weak_approx,
    usam,
    weak_sam_approx_d1,
    weak_sam_approx_d1_lp,
    weakly_approximates,
)
from .order_types import (
    OrderType,
    candidate_chirotopes,
    chirotope,
    order_types,
    representable_families,
    separable_subsets,
    weak_sam_approx_d2,
)

__all__ = [
    "OrderType",
    "RatioErrors",
    "SAMConstruction",
    "WeakApproxResult",
    "candidate_chirotopes",
    "chirotope",
    "construct_sam",
    "construction_weights",
    "csam",
    "least_construct_d",
    "order_types",
    "random_sparse_stochastic",
    "ratio_errors",
    "representable_families",
    "sam",
    "separable_subsets",
    "theorem_d",
    "theorem_slope",
    "try_weak_approx",
    "usam",
    "weak_sam_approx_d1",
    "weak_sam_approx_d1_lp",
    "weak_sam_approx_d2",
    "weakly_approximates",
]
