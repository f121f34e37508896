"""MCA (Kim & Ko, AAAI 2022): Monte-Carlo approximation of the attention value product.

Only the value projection H = X·W_V is approximated, row by row, from r_j input features drawn
with p_h(k) = ‖W_h[k, :]‖² / ‖W_h‖_F² (unbiased, Lemma 1, eq. 4); the sample sizes follow the
attention each token receives, r_j = min(⌊(n · max_i A[i, j] / α)²⌋, d_in) (eq. 7), so that
E‖Ỹ[i] − Y[i]‖ ≤ α β ‖W_h‖_F (Theorem 2).

* :func:`sample_sizes` (eq. 7, real tokens only) and :func:`reference_sample_sizes` (the
  authors' accounting, padding included);
* :func:`mc_value_projection` — H̃ from the drawn features (Lemma 1); :func:`head_weights`;
* :func:`mca_attention` — the attention output with H̃ and the exact scores, map and product,
  on any pattern and map of the library; :class:`MCAOutput` — output, r_j and the MACs kept;
* :class:`MCAMethod` — the method as a layer option for ``hf.sparsify(…, method="mca")``.

:mod:`.montecarlo` holds it. Imports only the core; the experiment is the lab's
(``sparseattn mca``).
"""

from . import montecarlo
from .montecarlo import *  # noqa: F403  (the names of montecarlo.__all__)

__all__ = montecarlo.__all__
