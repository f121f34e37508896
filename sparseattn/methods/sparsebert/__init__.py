"""SparseBERT (Shi et al., ICML 2021): learned differentiable attention masks; no diagonal.

* :class:`DifferentiableAttentionMask` — DAM: per-head mask logits ℓ, relaxed by a Gumbel-sigmoid
  with a straight-through estimator, M = M_hard + M_soft − stopgrad(M_soft), entering as the
  additive bias (1 − M)·b before any probability map ρ, with the sparsity penalty λ‖M‖₁;
  DAM_u (one logit per entry, optionally symmetric) and DAM_s (one per diagonal offset, a Toeplitz
  band; §4); :meth:`~DifferentiableAttentionMask.extract` gives the binary mask 1[ℓ > 0] as a
  :class:`LearnedMaskPattern` that plugs into ``sparse_attention`` like any pattern;
* the empty-row rules (:func:`keep_row_max`, :func:`keep_best_offset`) that keep a row from
  falling back to dense attention under an additive bias;
* attention without the diagonal (the pattern A_k = [n] \\ {k} of appendix A.2.2, Lemma 4) is
  the core's :func:`sparseattn.no_diagonal` / :func:`sparseattn.dense_no_diagonal`, re-exported
  here; the universal-approximation construction of Lemma 4 is executed beside Yun et al.'s, on
  the same machinery (:func:`sparseattn.methods.yun.sparsebert_contextual_mapping`).

:mod:`.learned_mask` holds the mask. Imports only the core; the training experiment is the lab's
(``sparseattn dam``).
"""

from . import learned_mask
from .learned_mask import *  # noqa: F403  (the names of learned_mask.__all__)

__all__ = learned_mask.__all__
