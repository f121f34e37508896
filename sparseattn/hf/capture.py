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


def _state_of(model: nn.Module):
    """What holds a sparsified model's counts and capture: Longformer, LED and BigBird keep
    their own state (their forwards are their own, docs/checkpoints.md), other models a
    ``State``."""
    if longformer.is_longformer(model):
        return longformer.model_state(model)
    if bigbird.is_bigbird(model):
        return bigbird.model_state(model)
    return model_state(model)


def _own_forward_layers(model: nn.Module) -> int | None:
    """The layer count of a Longformer, LED or BigBird (whose sparsified layers run a forward
    of sparseattn's, and the others transformers' own), None for other models."""
    if longformer.is_longformer(model):
        return len(longformer.attention_modules(model))
    if bigbird.is_bigbird(model):
        return len(bigbird.attention_modules(model))  # raises once switched to full attention
    return None


def attention_sparsity(
    model: nn.Module, reset: bool = False, of: str = "weights"
) -> dict[int, float]:
    """Per layer, the sparsity of the attention actually used since sparsify (or the last
    reset), summed over heads and batch items of every forward call, among real tokens
    (Sparsefinder eq. 5 restricted to real tokens; the pairs are those the model's own mask
    allows, j ≤ i in a decoder):

    * ``of="weights"``: 1 − (non-zero attention weights) / (all real pairs). A sparse map
      (α-entmax, sparsemax, …) also zeroes allowed pairs: its non-zeros are counted exactly
      on a model sparsified with ``count_weights=True``, by one more pass of the layer's
      engine under no_grad with values of ones per call (the support indicator
      :func:`sparseattn.maps.support` gives each query's count; about one more forward of
      the attention); without it such a layer raises a ValueError here. With softmax it
      equals "graph".
    * ``of="graph"``: 1 − (allowed pairs of the pattern's graph) / (all real pairs).

    Layers run by a method hook (e.g. MCA) report their graph's sparsity under both. A
    Longformer or LED counts its local rows on their graph (the window, the call's global
    keys) and its global rows on every real key; a BigBird its layout's keys as a set.
    """
    check_model(model)
    check_choice("of", of, ["weights", "graph"])
    state = _state_of(model)
    if state is None:
        return {}
    used = state.nonzero if of == "weights" else state.edges
    uncounted = [layer for layer in sorted(state.pairs) if layer not in used]
    if uncounted:
        raise ValueError(
            f"layers {uncounted} use a map that zeroes weights; their non-zero weights are "
            "counted only with count_weights=True (one more pass of the attention per call): "
            "hf.sparsify(model, layers=[], count_weights=True) turns it on for this model and "
            'starts the counts again; of="graph" counts the keys each row may read'
        )
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
    so long runs keep no tensors). An unmodified model is sparsified for the duration of the
    block and restored afterwards: with exact attention (dense, softmax), or a Longformer, LED
    or BigBird with its own configuration (``sparsify(model)``: its own attention, to float
    rounding).

    On a Longformer or LED each row is recorded as the layer computes it: a global token's row
    holds the scores of the global projections (``query_global · key_global``) and attends to
    every real key; ``q`` and ``k`` are the regular projections. On a BigBird a block the
    layout lists r times weighs r times (its keys' probs are their total weight,
    ρ(scores + log r)); calls that transformers switched to full attention (short inputs) are
    not recorded. On these models only the layers sparseattn runs can be recorded: asking for
    another (``layers``, or all by default) raises a ValueError naming them.
    """
    check_model(model)
    wanted_layers = check_layers(layers)
    if callback is not None and not callable(callback):
        raise TypeError(f"callback must be callable or None, got {type(callback).__name__}")
    num_layers = _own_forward_layers(model)
    temporary = _state_of(model) is None
    if temporary:
        sparsify(model, layers=[] if num_layers is None else None)
    try:
        state = _state_of(model)
        if state.capture is not None:
            raise RuntimeError("capture_attention is already active on this model")
        wanted = None if wanted_layers is None else frozenset(wanted_layers)
        if num_layers is not None:
            asked = range(num_layers) if wanted is None else sorted(wanted)
            missing = [layer for layer in asked if layer not in state.specs]
            if missing:
                raise ValueError(
                    f"capture_attention records the layers sparseattn runs; layers {missing} "
                    f"of this {type(model).__name__} run transformers' own attention: sparsify "
                    f"them too, or pass layers= among {sorted(state.specs)}"
                )
        state.capture = Capture(wanted, callback, [])
        try:
            yield state.capture.records
        finally:
            state.capture = None
    finally:
        if temporary:
            restore(model)
