"""What a sparsified model's attention did: :func:`capture_attention` (an
:class:`~sparseattn.hf.state.AttentionRecord` per layer call) and :func:`attention_sparsity`
(the real-token counts of every call since :func:`~sparseattn.hf.sparsify`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

from torch import nn

from ..validate import check_choice, check_model
from . import bigbird, longformer
from .registry import restore, sparsify
from .state import AttentionRecord, Capture, check_layers, model_state

__all__ = ["attention_sparsity", "capture_attention"]


def _counts_of(model: nn.Module):
    """What holds a sparsified model's counts: Longformer, LED and BigBird keep their own
    state (their forwards are their own, docs/checkpoints.md), other models a ``State``."""
    if longformer.is_longformer(model):
        return longformer.model_state(model)
    if bigbird.is_bigbird(model):
        return bigbird.model_state(model)
    return model_state(model)


#: Longformer, LED and BigBird run from forwards of their own (docs/checkpoints.md).
_NOT_YET = (
    "{} does not support {} yet: sparseattn runs its attention from a forward of its own, "
    "which does not record what it attends to"
)


def attention_sparsity(
    model: nn.Module, reset: bool = False, of: str = "weights"
) -> dict[int, float]:
    """Per layer, the sparsity of the attention actually used since sparsify (or the last
    reset), summed over heads and batch items of every forward call, among real tokens
    (Sparsefinder eq. 5 restricted to real tokens; the pairs are those the model's own mask
    allows, j ≤ i in a decoder):

    * ``of="weights"``: 1 − (non-zero attention weights) / (all real pairs). A sparse map
      (α-entmax, sparsemax, …) also zeroes allowed pairs: its non-zeros are counted exactly,
      by one more pass of the layer's engine under no_grad with values of ones (the support
      indicator :func:`sparseattn.maps.support` gives each query's count; about one more
      forward of the attention, without its P·V product). With softmax it equals "graph".
    * ``of="graph"``: 1 − (allowed pairs of the pattern's graph) / (all real pairs).

    Layers run by a method hook (e.g. MCA) report their graph's sparsity under both. A
    Longformer or LED counts its local rows on their graph (the window, the call's global
    keys) and its global rows on every real key; a BigBird its layout's keys as a set.
    """
    check_model(model)
    check_choice("of", of, ["weights", "graph"])
    state = _counts_of(model)
    if state is None:
        return {}
    used = state.nonzero if of == "weights" else state.edges
    out = {layer: 1.0 - used[layer] / state.pairs[layer] for layer in sorted(state.pairs)}
    if reset:
        state.edges.clear()
        state.pairs.clear()
        state.nonzero.clear()
    return out


@contextlib.contextmanager
def capture_attention(
    model: nn.Module,
    layers: Iterable[int] | None = None,
    callback: Callable[[AttentionRecord], None] | None = None,
) -> Iterator[list[AttentionRecord]]:
    """Record q, k, scores and probabilities of every forward call inside the ``with`` block.

    Yields a list that fills with one :class:`AttentionRecord` per layer and forward call (in
    call order), or stays empty when ``callback`` is given (each record is passed to it instead,
    so long runs keep no tensors). An unmodified model is sparsified with exact attention
    (dense, softmax) for the duration of the block and restored afterwards.
    """
    check_model(model)
    if longformer.is_longformer(model) or bigbird.is_bigbird(model):
        raise NotImplementedError(_NOT_YET.format("capture_attention", type(model).__name__))
    wanted_layers = check_layers(layers)
    if callback is not None and not callable(callback):
        raise TypeError(f"callback must be callable or None, got {type(callback).__name__}")
    temporary = model_state(model) is None
    if temporary:
        sparsify(model, layers=[])
    state = model_state(model)
    if state.capture is not None:
        raise RuntimeError("capture_attention is already active on this model")
    wanted = None if wanted_layers is None else frozenset(wanted_layers)
    state.capture = Capture(wanted, callback, [])
    try:
        yield state.capture.records
    finally:
        state.capture = None
        if temporary:
            restore(model)
