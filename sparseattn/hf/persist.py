"""A sparsified model as an artifact: what ``save_pretrained`` writes of its sparse attention
and how it is read back (docs/persistence.md).

:func:`~sparseattn.hf.sparsify` keeps the configuration on ``model.config`` as two entries that
``save_pretrained`` writes into ``config.json``:

* ``"sparseattn"``: ``{"format": FORMAT, "version": <sparseattn's>, "original": <the
  attention implementation sparsify replaced>, "layers": {"<l>": {"pattern": …, "prob_map": …,
  "engine": …}}}`` — patterns and maps in the form of :mod:`sparseattn.serialize`, their
  learned tensors (a mask's logits, α) as buffers of the layer's module referred to by their
  state-dict keys (:func:`record_config`); a layer whose configuration has no such form (a
  method hook, an AttentionGraph) is written as ``{"unsaved": "<why>"}``;
* ``"attn_implementation": "sparseattn"``, so that transformers never loads it as a dense
  model in silence: without ``import sparseattn.hf`` it refuses the name; with it, a model
  loaded by ``AutoModel.from_pretrained`` that :func:`from_pretrained` did not configure
  raises at its first forward, naming :func:`~sparseattn.hf.from_pretrained`
  (:mod:`sparseattn.hf.load`), which loads it configured.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from typing import Any

from torch import nn

from .. import __version__
from ..patterns import Pattern, PatternCycle
from ..serialize import FORMAT, pattern_config, prob_map_config
from .state import ATTN_NAME, LayerSpec

__all__ = [
    "CONFIG_KEY",
    "NotConfiguredError",
    "forget_config",
    "guard",
    "record_config",
    "saved_config",
]

#: The entry of ``model.config`` (and ``config.json``) holding the sparse configuration.
CONFIG_KEY = "sparseattn"


class NotConfiguredError(RuntimeError):
    """A model saved sparsified was loaded without its sparse configuration."""


#: The prefix of the buffers holding a layer's learned tensors (mask logits, α).
BUFFER_PREFIX = "sparseattn_"


def _layer_config(spec: LayerSpec, store, own: bool = False) -> dict:
    from ..attention import sparse_attention

    if spec.method is not sparse_attention:
        return {"unsaved": f"method {spec.method!r} is not sparse_attention"}
    if own:  # the model's own configuration (BigBird's layout): sparsify(pattern=None)
        try:
            return {
                "pattern": None,
                "prob_map": prob_map_config(spec.prob_map, store),
                "engine": spec.engine,
            }
        except TypeError as err:
            return {"unsaved": str(err)}
    if not isinstance(spec.pattern, (Pattern, PatternCycle)):
        return {"unsaved": f"a {type(spec.pattern).__name__} has no config form"}
    try:
        return {
            "pattern": pattern_config(spec.pattern, store),
            "prob_map": prob_map_config(spec.prob_map, store),
            "engine": spec.engine,
        }
    except TypeError as err:
        return {"unsaved": str(err)}


def record_config(
    model: nn.Module,
    specs: dict[int, LayerSpec],
    original: str,
    named: list[tuple[str, nn.Module]],
    own: frozenset[int] = frozenset(),
) -> None:
    """Write the sparse configuration of the layers ``specs`` onto ``model.config``, with the
    attention implementation ``original`` that loading must ask for (sparsify calls it).

    ``named[l]`` is layer l's (qualified name, module). A learned tensor of a layer's pattern
    or map (a mask's logits, α) becomes a buffer of that module, ``sparseattn_<path>``, so
    that the model's state dict (and ``save_pretrained``) holds it; the configuration refers
    to it by its state-dict key. A tensor shared by several layers is held once. The layers
    ``own`` follow the model's own configuration (``sparsify(pattern=None)``, where that is
    more than a pattern): their pattern is written as null."""
    _drop_buffers(named)
    held: dict[int, str] = {}

    def store_for(layer: int):
        name, module = named[layer]

        def store(path: str, tensor) -> str:
            if id(tensor) not in held:
                buffer = BUFFER_PREFIX + path.replace(".", "_")
                if isinstance(tensor, nn.Parameter):  # learned in this model: train it there
                    module.register_parameter(buffer, tensor)
                else:
                    module.register_buffer(buffer, tensor)
                held[id(tensor)] = f"{name}.{buffer}" if name else buffer
            return held[id(tensor)]

        return store

    config = {
        "format": FORMAT,
        "version": __version__,
        "original": original,
        "layers": {
            str(layer): _layer_config(spec, store_for(layer), layer in own)
            for layer, spec in sorted(specs.items())
        },
    }
    setattr(model.config, CONFIG_KEY, config)
    model.config.attn_implementation = ATTN_NAME


def _drop_buffers(named: list[tuple[str, nn.Module]]) -> None:
    for _, module in named:
        held = [*module._buffers, *module._parameters]
        for buffer in [b for b in held if b.startswith(BUFFER_PREFIX)]:
            delattr(module, buffer)


def forget_config(model: nn.Module, named: list[tuple[str, nn.Module]]) -> None:
    """Remove what :func:`record_config` wrote (``restore`` calls it)."""
    _drop_buffers(named)
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


def guard(
    cls: type,
    layer_of: Callable[[nn.Module], int],
    served: Callable[[nn.Module], bool] = lambda _module: False,
) -> None:
    """Make a transformers attention class that does not dispatch through
    ``AttentionInterface`` (Longformer's, LED's, BigBird's) refuse to run a layer that its
    model's config says was saved sparsified, when the model was loaded without its sparse
    configuration (``AutoModel.from_pretrained`` instead of
    :func:`~sparseattn.hf.from_pretrained`): its ``forward`` raises :class:`NotConfiguredError`
    then, and is transformers' own otherwise (one attribute read per call). ``layer_of(module)``
    is the layer index the configuration uses; ``served(module)`` says whether sparseattn
    serves the module's attention (a guard on the module around a patched one). Sparsified
    modules run their own ``forward`` (an instance attribute), which this does not reach.
    Installed once per class by ``import sparseattn.hf``."""
    original = cls.forward
    if getattr(original, "_sparseattn_guard", False):
        return

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        config = getattr(getattr(self, "config", None), CONFIG_KEY, None)
        saved = isinstance(config, dict) and str(layer_of(self)) in config.get("layers", {})
        if saved and not served(self):
            raise NotConfiguredError(
                f"layer {layer_of(self)} of this model was saved sparsified by sparseattn "
                f"{config.get('version')}, and it was loaded without its sparse configuration: "
                "load it with sparseattn.hf.from_pretrained(path, model_class=...)"
            )
        return original(self, *args, **kwargs)

    forward._sparseattn_guard = True
    cls.forward = forward
