"""Sparsefinder (Treviso et al. 2022): predict the α-entmax attention graph before computing it.

* :class:`LayerGraphs`, :class:`GraphBatch` — gold graphs G_h = {(i, j) : p_ij > 0} and their
  q, k per layer and head (§4.1); :class:`TokenBatch`, :func:`token_batches` — padding-free
  token batches (:mod:`.extract`);
* :class:`QKProjection` — per-head projections q′, k′ ∈ R^r trained with :func:`hinge_loss`,
  eq. 7 (:mod:`.projection`);
* :class:`DistancePredictor`, :class:`QuantizationPredictor`, :class:`KMeansPredictor`,
  :class:`ChunkedPredictor` and :class:`FixedParts` (§4.3–4.7, §6.1; :mod:`.predictors`);
  the baselines :class:`WindowBaseline`, :class:`BigBirdBaseline`, :class:`LongformerBaseline`,
  :class:`StridedBaseline`, :class:`LSHBaseline` (Reformer), :class:`RoutingBaseline`
  (:mod:`.baselines`);
* :func:`recall` (eq. 4), :func:`sparsity` (eq. 5), :func:`exact_fraction`,
  :func:`pareto_frontier`, :func:`sweep` (:mod:`.evaluate`);
* :class:`PredictedPattern` — the predicted graph as a data-dependent Pattern for
  ``hf.sparsify``, and :func:`key_padding`, the padding mask for it (:mod:`.pattern`).

The package imports only the core. Around it: :func:`sparseattn.hf.graphs.extract_graphs` fills
the containers from a Hugging Face model (hooks); the lab holds the 1.5-entmax MiniLM teacher
(:mod:`sparseattn.lab.experiments.sparsefinder_teacher`), the downstream effect inside it
(:mod:`sparseattn.lab.experiments.sparsefinder_downstream`) and the pipeline shared by the encoder
and decoder experiments (:mod:`sparseattn.lab.experiments.sparsefinder_pipeline`). The experiments
are :mod:`sparseattn.lab.experiments.sparsefinder` (``sparseattn sparsefinder``) and
:mod:`sparseattn.lab.experiments.sparsefinder_lm` (``sparseattn sparsefinder-decoder``).
"""

from .baselines import (
    BigBirdBaseline,
    LongformerBaseline,
    LSHBaseline,
    RoutingBaseline,
    StridedBaseline,
    WindowBaseline,
)
from .evaluate import (
    Tally,
    dominance,
    exact_fraction,
    frontier_value,
    pareto_frontier,
    recall,
    sparsity,
    sweep,
)
from .extract import GraphBatch, LayerGraphs, TokenBatch, token_batches
from .pattern import PredictedPattern, key_padding
from .predictors import (
    ChunkedPredictor,
    DistancePredictor,
    FixedParts,
    GraphPredictor,
    KMeansPredictor,
    QuantizationPredictor,
    bucket_graph,
    kmeans,
    merge_union,
)
from .projection import QKProjection, hinge_loss

__all__ = [
    "BigBirdBaseline",
    "ChunkedPredictor",
    "DistancePredictor",
    "FixedParts",
    "GraphBatch",
    "GraphPredictor",
    "KMeansPredictor",
    "LSHBaseline",
    "LayerGraphs",
    "LongformerBaseline",
    "PredictedPattern",
    "QKProjection",
    "QuantizationPredictor",
    "RoutingBaseline",
    "StridedBaseline",
    "Tally",
    "TokenBatch",
    "WindowBaseline",
    "bucket_graph",
    "dominance",
    "exact_fraction",
    "frontier_value",
    "hinge_loss",
    "key_padding",
    "kmeans",
    "merge_union",
    "pareto_frontier",
    "recall",
    "sparsity",
    "sweep",
    "token_batches",
]
