"""Yun et al. (NeurIPS 2020), "O(n) connections are expressive enough": the analyses, executed.

The framework itself — sparsity patterns {A_k^l}, probability maps ρ, head configurations — is
the core (:mod:`sparseattn.patterns`, :mod:`sparseattn.maps`, :func:`sparseattn.sparse_attention`).
This package checks the paper's assumptions on it and runs its proof:

* :func:`assumption1` — self-loops, chain γ and hops s of a pattern cycle (§3.2, Assumption 1);
  :func:`hops`, :func:`find_chain`, :func:`strided_hops` (the closed rule for STRIDED's s);
  :mod:`.connectivity`;
* :func:`assumption2` — a scale t under which ρ[t·] approaches the hardmax σ_H (§3.2,
  Assumption 2; appendix B's closed forms in :func:`closed_form_t`); :mod:`.maps`;
* :func:`yun_contextual_mapping` and :func:`verify_contextual_mapping` — the contextual mapping of
  Lemma 7 (appendix D–E: positional embedding D.1, quantization Lemma 6, selective shifts E.2.2–3,
  all-max-shifts E.2.4) in exact arithmetic; :func:`sparsebert_contextual_mapping` runs SparseBERT's
  Lemma 4 (A_k = [n] \\ {k}) on the same machinery; :mod:`.construction`;
* :func:`relaxed_context_ids`, :func:`relaxed_error_table` — Theorem 1 step 3 (appendix F.2):
  the mapping with ρ[t·] in place of σ_H through ``sparse_attention``; :mod:`.relaxed`.

Imports only the core. The copying task and the language models are the lab's
(``sparseattn copying``, ``sparseattn lm``).
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
from .maps import Assumption2Report, assumption2, closed_form_t, margin_inputs
from .relaxed import (
    exact_threshold,
    relaxed_context_ids,
    relaxed_error_table,
    step3_temperature,
)

__all__ = [
    "exact_threshold",
    "relaxed_context_ids",
    "relaxed_error_table",
    "step3_temperature",
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
