"""A sparsified model as an artifact: what ``save_pretrained`` writes of its sparse attention
and how it is read back (docs/persistence.md).

:func:`~sparseattn.hf.sparsify` keeps the configuration on ``model.config`` as two entries that
``save_pretrained`` writes into ``config.json``:

* ``"sparseattn"``: ``{"format": FORMAT, "version": <sparseattn's>, "original": <the
  attention implementation sparsify replaced>, "layers": {"<l>": {"pattern": …, "prob_map": …,
  "engine": …}}}`` — patterns and maps in the form of :mod:`sparseattn.serialize`; a layer whose
  configuration has no such form (a method hook, a learned α or mask, an AttentionGraph) is
  written as ``{"unsaved": "<why>"}``;
* ``"attn_implementation": "sparseattn"``, so that transformers never loads it as a dense
  model in silence: without ``import sparseattn.hf`` it refuses the name; with it, a model
  loaded by ``AutoModel.from_pretrained`` that :func:`from_pretrained` did not configure
  raises at its first forward, naming :func:`~sparseattn.hf.from_pretrained`
  (:mod:`sparseattn.hf.load`), which loads it configured.
"""

from __future__ import annotations

import json
import os
from typing import Any

from torch import nn

from .. import __version__
from ..serialize import FORMAT, pattern_config, prob_map_config
from .state import ATTN_NAME, LayerSpec, State

__all__ = ["CONFIG_KEY", "NotConfiguredError", "forget_config", "record_config", "saved_config"]

#: The entry of ``model.config`` (and ``config.json``) holding the sparse configuration.
CONFIG_KEY = "sparseattn"


class NotConfiguredError(RuntimeError):
    """A model saved sparsified was loaded without its sparse configuration."""


def _layer_config(spec: LayerSpec) -> dict:
    from ..attention import sparse_attention

    if spec.method is not sparse_attention:
        return {"unsaved": f"method {spec.method!r} is not sparse_attention"}
    try:
        return {
            "pattern": pattern_config(spec.pattern),
            "prob_map": prob_map_config(spec.prob_map),
            "engine": spec.engine,
        }
    except TypeError as err:
        return {"unsaved": str(err)}


def record_config(model: nn.Module, state: State) -> None:
    """Write the sparse configuration of ``state`` onto ``model.config`` (sparsify calls it)."""
    config = {
        "format": FORMAT,
        "version": __version__,
        "original": state.original,
        "layers": {str(layer): _layer_config(spec) for layer, spec in sorted(state.specs.items())},
    }
    setattr(model.config, CONFIG_KEY, config)
    model.config.attn_implementation = ATTN_NAME


def forget_config(model: nn.Module) -> None:
    """Remove what :func:`record_config` wrote (``restore`` calls it)."""
    for name in (CONFIG_KEY, "attn_implementation"):
        if name in model.config.__dict__:
            delattr(model.config, name)


def saved_config(source: Any) -> dict | None:
    """The sparse configuration of a config object, a config dict or a saved folder."""
    if isinstance(source, (str, os.PathLike)):
        path = os.path.join(source, "config.json")
        if not os.path.isfile(path):
            return None
        with open(path) as f:
            source = json.load(f)
    config = (
        source.get(CONFIG_KEY) if isinstance(source, dict) else getattr(source, CONFIG_KEY, None)
    )
    if config is None:
        return None
    if not isinstance(config, dict) or not isinstance(config.get("format"), int):
        raise ValueError(
            f"{CONFIG_KEY!r} in this config is not a sparseattn configuration: {config!r}"
        )
    if config["format"] > FORMAT:
        raise ValueError(
            f"this model was saved by sparseattn {config.get('version')} in format "
            f"{config['format']}; this sparseattn ({__version__}) reads format {FORMAT} and "
            "older: upgrade sparseattn"
        )
    return config
