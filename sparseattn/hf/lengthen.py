"""The Longformer paper's recipe to make a long model from a short one (Beltagy, Peters and Cohan
2020, §5 "Pretraining and finetuning"): :func:`lengthen` turns a RoBERTa or BERT model from
transformers into transformers' Longformer of the same weights, then runs its attention on
sparseattn (:func:`sparseattn.hf.longformer.sparsify`).

What is copied, for a source with P learned positions (RoBERTa-base: 512):

* the learned position table, extended to ``max_positions`` by copying the P learned rows
  again and again (row p of the new model's positions is row p mod P of the original's), as
  the paper does. RoBERTa and Longformer count positions from ``pad_token_id + 1`` (2 for
  RoBERTa's pad id 1: rows 0 and 1 are not positions); those leading rows are copied as they
  are. BERT counts from 0: its row p becomes the Longformer's row ``pad_token_id + 1 + p``
  (the Longformer's row ``pad_token_id`` — the padding tokens' — is zero);
* ``query_global``, ``key_global`` and ``value_global`` of each layer from its ``query``,
  ``key`` and ``value`` (the paper's initialisation);
* everything else under its Longformer name: word, position and token-type embeddings, layer
  norms, the attention output and feed-forward layers, the pooler, the heads (MLM head, BERT's
  ``cls.predictions`` included; classification heads). Every weight of the source is used and
  every weight of the Longformer is set, which is checked.

Exactness: a Longformer layer whose window covers the input (``attention_window ≥ 2·n`` for n
tokens: keys i − w/2 … i + w/2) is the original's full attention, and a global token with the
copied global projections attends as a local one would, so on inputs within the original's
length the lengthened model gives the original's outputs on the real tokens, to float
rounding (padding rows differ: Longformer zeroes their attention, RoBERTa and BERT do not, and
neither means anything by them). With a narrower window, or beyond the original's length, it is
a new model, the starting point the paper continues pretraining (MLM) from.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..graph import AttentionGraph
from ..maps import ProbabilityMap
from ..patterns import Pattern, PatternCycle
from ..validate import check_int, check_model
from . import longformer

__all__ = ["lengthen"]

#: The source classes per model family, and the Longformer class each becomes.
_TARGETS = {
    "roberta": {
        "RobertaModel": "LongformerModel",
        "RobertaForMaskedLM": "LongformerForMaskedLM",
        "RobertaForSequenceClassification": "LongformerForSequenceClassification",
        "RobertaForTokenClassification": "LongformerForTokenClassification",
    },
    "bert": {
        "BertModel": "LongformerModel",
        "BertForMaskedLM": "LongformerForMaskedLM",
        "BertForTokenClassification": "LongformerForTokenClassification",
    },
}

#: BERT's MLM head under its Longformer (RoBERTa) names: (BERT prefix, Longformer prefix).
_BERT_HEAD = (
    ("cls.predictions.transform.dense.", "lm_head.dense."),
    ("cls.predictions.transform.LayerNorm.", "lm_head.layer_norm."),
    ("cls.predictions.decoder.", "lm_head.decoder."),
    ("cls.predictions.bias", "lm_head.bias"),
)

#: The global projections and the regular one each starts from.
_GLOBAL = {"query_global": "query", "key_global": "key", "value_global": "value"}

#: Config keys not carried over to the LongformerConfig.
_NOT_CARRIED = {
    "transformers_version",
    "architectures",
    "_name_or_path",
    "model_type",
    "attention_window",
    "max_position_embeddings",
}


def _source_class(model: nn.Module) -> tuple[str, str, str]:
    """(family, the transformers source class's name, the Longformer class's name), or a
    ValueError saying what is supported."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for cls in type(model).__mro__:
        if not cls.__module__.startswith("transformers.models."):
            continue
        for family, targets in _TARGETS.items():
            if cls.__name__ in targets and model_type == family:
                return family, cls.__name__, targets[cls.__name__]
    supported = ", ".join(name for targets in _TARGETS.values() for name in targets)
    why = ""
    if model_type == "bert" and "SequenceClassification" in type(model).__name__:
        why = (
            " (BERT classifies from its pooler, a Longformer from its own classification head "
            "over token 0: no Longformer class holds BERT's head)"
        )
    raise ValueError(
        f"lengthen takes a RoBERTa or BERT model from transformers ({supported}); got "
        f"{type(model).__name__} with model_type {model_type!r}{why}"
    )


def _check_source(model: nn.Module, family: str, target: str) -> int:
    """Refuse what the Longformer cannot reproduce; returns the source's first position row
    (RoBERTa: pad_token_id + 1, BERT: 0)."""
    config = model.config
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        raise ValueError(
            "lengthen takes an encoder: a Longformer has no causal self-attention and no "
            "cross-attention (the source config has is_decoder or add_cross_attention)"
        )
    if config.pad_token_id is None:
        raise ValueError(
            "lengthen needs the model's pad_token_id: the Longformer pads its inputs to a "
            "multiple of the window with it and counts positions from pad_token_id + 1"
        )
    if family == "bert" and target == "LongformerForMaskedLM" and config.hidden_act != "gelu":
        raise ValueError(
            "a Longformer's MLM head applies gelu; this BERT's head applies "
            f"{config.hidden_act!r} (its hidden_act), which it cannot reproduce"
        )
    return config.pad_token_id + 1 if family == "roberta" else 0


def _attention_windows(attention_window: int | Sequence[int], layers: int) -> int | list[int]:
    windows = [attention_window] * layers if isinstance(attention_window, int) else attention_window
    windows = [check_int("attention_window", w, minimum=2) for w in windows]
    if len(windows) != layers:
        raise ValueError(
            f"attention_window must be one int or one per layer ({layers}), got {len(windows)}"
        )
    odd = [w for w in windows if w % 2]
    if odd:
        raise ValueError(
            f"attention_window must be even (keys i − w/2 … i + w/2), got {attention_window!r}"
        )
    return attention_window if isinstance(attention_window, int) else windows


def _positions(old: torch.Tensor, first: int, new_first: int, max_positions: int) -> torch.Tensor:
    """The new position table: rows ``new_first + p`` = the original's row ``first + p mod P``
    for p < max_positions (P = the original's learned positions); the rows before
    ``new_first`` copied where both count from the same row, zero otherwise."""
    learned = old.shape[0] - first
    table = old.new_zeros(new_first + max_positions, old.shape[1])
    if first == new_first:
        table[:first] = old[:first]
    table[new_first:] = old[first + torch.arange(max_positions, device=old.device) % learned]
    return table


def _target_key(key: str, family: str, prefix: str) -> str:
    """The Longformer's name for a source weight."""
    if key.startswith(prefix + "."):
        return "longformer." + key[len(prefix) + 1 :]
    if family == "bert":
        for old, new in _BERT_HEAD:
            if key.startswith(old):
                return new + key[len(old) :]
    return key


def lengthen(
    model: nn.Module,
    max_positions: int,
    attention_window: int | Sequence[int] = 512,
    *,
    pattern: Pattern | PatternCycle | Sequence[Pattern] | AttentionGraph | None = None,
    prob_map: str | ProbabilityMap = "softmax",
    engine: str = "auto",
    sparsify: bool = True,
) -> nn.Module:
    """A Longformer of ``model``'s weights taking ``max_positions`` tokens (the Longformer
    paper's recipe, §5; the module docstring lists what is copied).

    ``model``: transformers' ``RobertaModel``, ``RobertaForMaskedLM``,
    ``RobertaForSequenceClassification``, ``RobertaForTokenClassification``, ``BertModel``,
    ``BertForMaskedLM`` or ``BertForTokenClassification``; it is left as it is (the new model
    has weights of its own). Returns the matching ``LongformerModel``,
    ``LongformerForMaskedLM``, ``LongformerForSequenceClassification`` (which gives token 0
    global attention itself) or ``LongformerForTokenClassification``, built from a
    ``LongformerConfig`` carrying the original config's values (sizes, activation, dropouts,
    layer-norm epsilon, token ids, labels) with ``max_position_embeddings = max_positions +
    pad_token_id + 1`` and ``attention_window`` (one even int, or one per layer), on the
    original's device, dtype and train/eval mode.

    With ``sparsify`` (the default) its self-attention runs on sparseattn:
    :func:`sparseattn.hf.longformer.sparsify` with ``pattern`` (None: each layer's window),
    ``prob_map`` and ``engine``; ``sparsify=False`` leaves transformers' Longformer code.

    BERT: its layout is RoBERTa's (the same layer names, token types passed through; the MLM
    head renamed), but it counts positions from 0 for every token while a Longformer counts
    from ``pad_token_id + 1`` over the real tokens only. The tables are aligned so that a token
    at position p has BERT's row p: the same positions wherever the real tokens of an item come
    first (right padding, the tokenizers' default). With left padding, pad ids inside the text
    or ``position_ids`` given in BERT's numbering, the positions differ from BERT's.

    Raises:
        ValueError: an unsupported model (with the supported list; e.g. BERT's sequence
        classifier, whose pooler head no Longformer class has), a decoder, no pad id,
        ``max_positions`` below the original's learned positions, a bad window.
        TypeError: ``model`` not a module, ``max_positions`` not an int.
    """
    import transformers

    check_model(model)
    family, _, target_name = _source_class(model)
    first = _check_source(model, family, target_name)
    config = model.config
    learned = config.max_position_embeddings - first
    max_positions = check_int("max_positions", max_positions, minimum=1)
    if max_positions < learned:
        raise ValueError(
            f"max_positions ({max_positions}) is smaller than the {learned} positions "
            f"{type(model).__name__} already has: lengthen makes a model longer"
        )
    windows = _attention_windows(attention_window, config.num_hidden_layers)
    new_first = config.pad_token_id + 1

    known = set(transformers.LongformerConfig().to_dict())
    values = {
        key: value
        for key, value in config.to_dict().items()
        if key in known and key not in _NOT_CARRIED
    }
    new_config = transformers.LongformerConfig(
        **values,
        attention_window=windows,
        max_position_embeddings=max_positions + new_first,
    )
    source = model.state_dict()
    base = model.base_model
    kwargs = {}
    if target_name == "LongformerModel":
        kwargs["add_pooling_layer"] = getattr(base, "pooler", None) is not None
    target = getattr(transformers, target_name)(new_config, **kwargs)

    prefix = model.base_model_prefix
    weights = {_target_key(key, family, prefix): value for key, value in source.items()}
    wanted = target.state_dict()
    for key in wanted:
        module_path, _, leaf = key.rpartition(".")
        owner, _, name = module_path.rpartition(".")
        if name in _GLOBAL and owner.endswith("attention.self"):
            weights[key] = weights[f"{owner}.{_GLOBAL[name]}.{leaf}"]
        elif key.endswith("embeddings.position_embeddings.weight"):
            weights[key] = _positions(weights[key], first, new_first, max_positions)
    missing, unexpected = set(wanted) - set(weights), set(weights) - set(wanted)
    if missing or unexpected:  # a layout this table does not know: refuse, copy nothing wrong
        raise ValueError(
            f"{type(model).__name__}'s weights do not map onto {target_name}'s: not set "
            f"{sorted(missing)[:5]}, left over {sorted(unexpected)[:5]}"
        )
    reference = next(iter(source.values()))
    target.to(device=reference.device, dtype=model.get_input_embeddings().weight.dtype)
    with torch.no_grad():
        target.load_state_dict(weights, strict=True)
    target.train(model.training)
    if sparsify:
        longformer.sparsify(target, pattern, prob_map, engine)
    return target
