"""Sparsefinder (Treviso et al. 2022): predict the α-entmax attention graph before computing it.

* :mod:`.extract` — gold graphs G_h = {(i, j) : p_ij > 0} and their q, k, through hooks (§4.1);
* :mod:`.projection` — per-head projections q′, k′ ∈ R^r trained with the hinge loss of eq. 7;
* :mod:`.predictors` — distance, quantization, k-means and chunked predictors, fixed parts
  (§4.3–4.7, §6.1); :mod:`.baselines` — window, BigBird, Longformer, strided, Reformer LSH, Routing;
* :mod:`.evaluate` — recall (eq. 4), sparsity (eq. 5), exact queries, Pareto frontiers, the
  downstream effect inside a model; :mod:`.pattern` — a data-dependent Pattern for ``hf.sparsify``
  (and ``key_padding``, the padding mask for it);
* :mod:`.teacher` — the 1.5-entmax MiniLM teacher.

The experiment is :mod:`sparseattn.experiments.sparsefinder` (``sparseattn sparsefinder``).
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
    downstream,
    exact_fraction,
    frontier_value,
    pareto_frontier,
    recall,
    sparsity,
    sweep,
)
from .extract import GraphBatch, LayerGraphs, TokenBatch, extract_graphs, token_batches
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
from .teacher import TeacherConfig, load_teacher

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
    "TeacherConfig",
    "TokenBatch",
    "WindowBaseline",
    "bucket_graph",
    "dominance",
    "downstream",
    "exact_fraction",
    "extract_graphs",
    "frontier_value",
    "hinge_loss",
    "key_padding",
    "kmeans",
    "load_teacher",
    "merge_union",
    "pareto_frontier",
    "recall",
    "sparsity",
    "sweep",
    "token_batches",
]
