"""Sparsefinder (Treviso et al. 2022): predict the α-entmax attention graph before computing it.

* :mod:`.extract` — containers for gold graphs G_h = {(i, j) : p_ij > 0} and their q, k (§4.1),
  and padding-free token batches;
* :mod:`.projection` — per-head projections q′, k′ ∈ R^r trained with the hinge loss of eq. 7;
* :mod:`.predictors` — distance, quantization, k-means and chunked predictors, fixed parts
  (§4.3–4.7, §6.1); :mod:`.baselines` — window, BigBird, Longformer, strided, Reformer LSH, Routing;
* :mod:`.evaluate` — recall (eq. 4), sparsity (eq. 5), exact queries, Pareto frontiers;
  :mod:`.pattern` — a data-dependent Pattern for ``hf.sparsify`` (and ``key_padding``, the
  padding mask for it).

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
