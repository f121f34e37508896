"""Pattern and map analysis: Yun et al. Assumptions 1–2 and the contextual mapping, executed.

* :func:`assumption1` — self-loops, chain γ and hops s of a pattern cycle (Yun §3.2);
  :func:`strided_hops`, the closed rule for STRIDED's s;
* :func:`assumption2` — a scale t under which a probability map approaches the hardmax;
* :func:`yun_contextual_mapping`, :func:`sparsebert_contextual_mapping` and
  :func:`verify_contextual_mapping` — the constructions of Yun Lemma 7 and SparseBERT Lemma 4,
  run in exact arithmetic on every grid input;
* :mod:`.expressivity` — which patterns a self-attention matrix can express (Likhosherstov
  et al.): SAM, weak approximation, Algorithm 1, the Theorem 0.4 construction;
* :mod:`.relaxed` — Yun Theorem 1 step 3: the contextual mapping with softmax, sparsemax or
  1.5-entmax at temperature t through ``sparse_attention``, against the exact hardmax ids;
* :mod:`.order_types` — the exact d = 2 decider of weak approximation for n <= 6 (planar order
  types), against which the d > 1 search is checked.
"""

from .connectivity import (
    Assumption1Report,
    ChainResult,
    HopsResult,
    assumption1,
    cycle_graphs,
    find_chain,
    hops,
    named_pattern,
    strided_hops,
)
from .construction import (
    ContextualMapping,
    ContextualMappingReport,
    sparsebert_contextual_mapping,
    verify_contextual_mapping,
    yun_contextual_mapping,
)
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
from .maps import Assumption2Report, assumption2, closed_form_t, margin_inputs
from .order_types import (
    OrderType,
    candidate_chirotopes,
    chirotope,
    order_types,
    representable_families,
    separable_subsets,
    weak_sam_approx_d2,
)
from .relaxed import (
    exact_threshold,
    relaxed_context_ids,
    relaxed_error_table,
    step3_temperature,
)

__all__ = [
    "RatioErrors",
    "SAMConstruction",
    "WeakApproxResult",
    "construct_sam",
    "construction_weights",
    "csam",
    "least_construct_d",
    "random_sparse_stochastic",
    "ratio_errors",
    "sam",
    "theorem_d",
    "theorem_slope",
    "try_weak_approx",
    "usam",
    "weak_sam_approx_d1",
    "weak_sam_approx_d1_lp",
    "weakly_approximates",
    "exact_threshold",
    "relaxed_context_ids",
    "relaxed_error_table",
    "step3_temperature",
    "OrderType",
    "candidate_chirotopes",
    "chirotope",
    "order_types",
    "representable_families",
    "separable_subsets",
    "weak_sam_approx_d2",
    "Assumption1Report",
    "Assumption2Report",
    "ChainResult",
    "ContextualMapping",
    "ContextualMappingReport",
    "HopsResult",
    "assumption1",
    "assumption2",
    "closed_form_t",
    "cycle_graphs",
    "find_chain",
    "hops",
    "strided_hops",
    "margin_inputs",
    "named_pattern",
    "sparsebert_contextual_mapping",
    "verify_contextual_mapping",
    "yun_contextual_mapping",
]
