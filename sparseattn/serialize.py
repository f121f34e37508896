"""Patterns and probability maps as plain data: the versioned form a saved model carries.

A pattern (a frozen dataclass of ints, floats, bools, strings and patterns) is written as
``{"pattern": "<module>.<class>", "fields": {...}}``, a probability map as the factory that made
it, ``{"prob_map": "entmax", "args": [1.5]}``: JSON, as a Hugging Face ``config.json`` holds
(docs/persistence.md). A tensor (a learned mask's logits, a learned α) is state: it goes to a
``store(key, tensor) -> ref`` callback (``key`` its path, e.g. ``"parts.1.logits"``) and is
written as ``{"tensor": ref}``, read back by ``load(ref)``; without ``store`` it is refused.
Reading names no code outside ``sparseattn``.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

from torch import Tensor

from . import maps
from .patterns import Pattern, PatternCycle

__all__ = [
    "FORMAT",
    "pattern_config",
    "pattern_from_config",
    "prob_map_config",
    "prob_map_from_config",
]

#: The version of the form written here; a reader refuses a higher one (written by a newer
#: sparseattn) with a message that names both.
FORMAT = 1

_MAPS = {
    f.__name__: f
    for f in (maps.softmax, maps.hardmax, maps.sparsemax, maps.sparselin_gen, maps.entmax)
}


Store = Callable[[str, Tensor], str]
Load = Callable[[str], Tensor]


def _value(name: str, value: Any, store: Store | None) -> Any:
    if isinstance(value, (Pattern, PatternCycle)):
        return pattern_config(value, store, prefix=f"{name}.")
    if isinstance(value, (tuple, list)):
        return [_value(f"{name}.{i}", v, store) for i, v in enumerate(value)]
    if isinstance(value, Tensor) and store is not None:
        return {"tensor": store(name, value)}
    if isinstance(value, Tensor):
        raise TypeError(
            f"field {name!r} holds a tensor, which is state, not configuration: save the "
            "model's state dict (torch.save) for patterns learned from data"
        )
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"field {name!r} holds a {type(value).__name__}, which has no config form")


def pattern_config(
    pattern: Pattern | PatternCycle, store: Store | None = None, prefix: str = ""
) -> dict:
    """``pattern`` as JSON-able data (the module docstring), its tensors to ``store``; a
    TypeError for a tensor without ``store``, or other state."""
    if not isinstance(pattern, (Pattern, PatternCycle)) or not dataclasses.is_dataclass(pattern):
        raise TypeError(f"pattern must be a sparseattn Pattern, got {type(pattern).__name__}")
    cls = type(pattern)
    fields = {
        f.name: _value(prefix + f.name, getattr(pattern, f.name), store)
        for f in dataclasses.fields(pattern)
        if f.init
    }
    return {"pattern": f"{cls.__module__}.{cls.__qualname__}", "fields": fields}


def _read(value: Any, load: Load | None) -> Any:
    if isinstance(value, dict) and "pattern" in value:
        return pattern_from_config(value, load)
    if isinstance(value, dict) and "tensor" in value:
        if load is None:
            raise ValueError(f"this config refers to a saved tensor {value['tensor']!r}: pass load")
        return load(value["tensor"])
    if isinstance(value, list):
        return tuple(_read(v, load) for v in value)
    return value


def pattern_from_config(config: dict, load: Load | None = None) -> Pattern | PatternCycle:
    """The pattern :func:`pattern_config` wrote (its tensors from ``load``); a ValueError for a
    config that is not one, or names a class outside sparseattn."""
    if not isinstance(config, dict) or not isinstance(config.get("pattern"), str):
        raise ValueError(f"a pattern config is a dict with a 'pattern' class name, got {config!r}")
    module, _, name = config["pattern"].rpartition(".")
    if module != "sparseattn" and not module.startswith("sparseattn."):
        raise ValueError(f"a pattern config names sparseattn's classes only, got {module!r}")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(
            f"this sparseattn has no pattern class {config['pattern']!r}: was it saved by "
            "another version?"
        ) from err
    if not (isinstance(cls, type) and issubclass(cls, (Pattern, PatternCycle))):
        raise ValueError(f"{config['pattern']!r} is not a pattern class")
    return cls(**{k: _read(v, load) for k, v in config.get("fields", {}).items()})


def prob_map_config(rho: maps.ProbabilityMap, store: Store | None = None) -> dict:
    """``rho`` as its factory's name and arguments, e.g. ``{"prob_map": "entmax", "args":
    [1.5]}``, a tensor α to ``store`` (key ``"alpha"``); a TypeError without ``store`` then,
    or for a map not made by a factory of :mod:`sparseattn.maps`."""
    recipe = getattr(rho, "recipe", None)
    if recipe is None or recipe[0].__name__ not in _MAPS:
        raise TypeError(f"{rho!r} was not made by a factory of sparseattn.maps")
    factory, args = recipe
    if store is not None:
        args = [{"tensor": store("alpha", a)} if isinstance(a, Tensor) else a for a in args]
    elif any(isinstance(a, Tensor) for a in args):
        raise TypeError(
            f"{rho!r} has a tensor α, which is state, not configuration: a learned α lives in "
            "the model's parameters"
        )
    return {"prob_map": factory.__name__, "args": list(args)}


def prob_map_from_config(config: dict, load: Load | None = None) -> maps.ProbabilityMap:
    """The map :func:`prob_map_config` wrote (a tensor α from ``load``)."""
    if not isinstance(config, dict) or config.get("prob_map") not in _MAPS:
        raise ValueError(f"a prob_map config names one of {sorted(_MAPS)}, got {config!r}")
    return _MAPS[config["prob_map"]](*(_read(a, load) for a in config.get("args", ())))
