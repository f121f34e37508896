"""Sparsefinder's downstream effect: the teacher run on predicted graphs (Treviso et al. 2022).

Part of the lab, beside the teacher (:mod:`sparseattn.lab.experiments.sparsefinder_teacher`): the
1.5-entmax MiniLM with exact entmax on the predicted graphs Ĝ in every layer (Proposition 1),
against the full-entmax teacher, measured with :mod:`sparseattn.lab.fidelity`'s yardsticks (the
paper's downstream evaluation, §5). The graph-level measures (recall, sparsity, Pareto
frontiers) are the method's: :mod:`sparseattn.methods.sparsefinder.evaluate`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor, nn

from ... import hf
from ...maps import ProbabilityMap
from ...methods.sparsefinder.extract import TokenBatch
from ...patterns import Pattern
from .. import fidelity

__all__ = ["downstream", "embed"]


@torch.no_grad()
def embed(model: nn.Module, batches: Sequence[TokenBatch]) -> Tensor:
    """Sentence embeddings (mean pooling + L2 normalisation) in the order of the input texts."""
    total = sum(b.index.numel() for b in batches)
    out = torch.empty(total, model.config.hidden_size)
    for b in batches:
        hidden = model(**b.inputs()).last_hidden_state
        out[b.index] = hf.mean_pool(hidden, b.attention_mask)
    return out


def downstream(
    model: nn.Module,
    sets: dict[str, Sequence[TokenBatch]],
    reference: dict[str, Tensor],
    pattern: Pattern | Sequence[Pattern],
    prob_map: str | ProbabilityMap,
    engine: str = "dense",
) -> dict:
    """The teacher run with ``pattern`` (one per layer, or one for all) and ``prob_map``, against
    the full-entmax teacher's embeddings ``reference`` — with :mod:`sparseattn.lab.fidelity`'s
    metrics.

    ``sets`` holds token batches of the passages (``"passages"``) and of their halves
    (``"first"``, ``"second"``); ``reference`` the teacher's embeddings of each. Returns the mean
    and min embedding cosine on the passages, the half → half retrieval accuracy, its agreement
    with the teacher's retrieval, and the graph sparsity actually used (real tokens, averaged
    over layers). ``model`` is sparsified for the call and restored after.
    """
    for name, table in (("sets", sets), ("reference", reference)):
        missing = {"passages", "first", "second"} - set(table) if isinstance(table, dict) else None
        if missing is None or missing:
            raise ValueError(
                f"{name} must be a dict with keys 'passages', 'first', 'second'"
                + (f"; missing {sorted(missing)}" if missing else "")
            )
    hf.sparsify(
        model, list(pattern) if isinstance(pattern, Sequence) else pattern, prob_map, engine
    )
    try:
        hf.attention_sparsity(model, reset=True, of="graph")
        emb = embed(model, sets["passages"])
        per_layer = hf.attention_sparsity(model, reset=True, of="graph")
        first, second = embed(model, sets["first"]), embed(model, sets["second"])
    finally:
        hf.restore(model)
    cosine = fidelity.embedding_cosine(emb, reference["passages"])
    agree = fidelity.retrieve(first, second) == fidelity.retrieve(
        reference["first"], reference["second"]
    )
    return {
        "embedding_cosine_mean": float(cosine.mean()),
        "embedding_cosine_min": float(cosine.min()),
        "retrieval_accuracy": fidelity.retrieval_accuracy(first, second),
        "retrieval_agreement": float(agree.double().mean()),
        "graph_sparsity": float(np.mean(list(per_layer.values()))),
        "graph_sparsity_per_layer": [per_layer[k] for k in sorted(per_layer)],
    }
