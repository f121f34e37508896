"""Loading a sparsified model saved with ``save_pretrained``: :func:`from_pretrained` (the
configuration's form: :mod:`sparseattn.hf.persist`; docs/persistence.md)."""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from ..serialize import pattern_from_config, prob_map_from_config
from .persist import saved_config
from .registry import sparsify

__all__ = ["apply_config", "from_pretrained"]


def apply_config(model: nn.Module, config: dict) -> nn.Module:
    """Sparsify ``model`` as ``config`` (a saved sparse configuration) says, layer by layer."""
    for layer, entry in sorted(config["layers"].items(), key=lambda item: int(item[0])):
        if "unsaved" in entry:
            raise ValueError(
                f"layer {layer}'s sparse configuration was not saved ({entry['unsaved']}): "
                "sparsify the loaded model yourself, with the same arguments"
            )
        sparsify(
            model,
            pattern_from_config(entry["pattern"]),
            prob_map=prob_map_from_config(entry["prob_map"]),
            engine=entry["engine"],
            layers=[int(layer)],
        )
    return model


def from_pretrained(path: str | os.PathLike, model_class: Any = None, **kwargs) -> nn.Module:
    """Load a model saved with ``save_pretrained`` after :func:`~sparseattn.hf.sparsify`, with
    its sparse attention: ``model_class.from_pretrained(path, **kwargs)`` (default
    ``transformers.AutoModel``; any task class, e.g. ``AutoModelForMaskedLM``), then every
    saved layer configured as it was. A folder without a sparse configuration loads as it is.

    Raises:
        ValueError: for a configuration written by a newer sparseattn (format), or a layer
            whose configuration could not be saved (a method hook, a learned mask or α).
    """
    if model_class is None:
        from transformers import AutoModel as model_class
    config = saved_config(path)
    if config is None:
        return model_class.from_pretrained(path, **kwargs)
    kwargs.setdefault("attn_implementation", config["original"])
    return apply_config(model_class.from_pretrained(path, **kwargs), config)
