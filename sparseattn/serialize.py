"""Patterns and probability maps as plain data: the versioned form a saved model carries.

A pattern is a frozen dataclass of ints, floats, bools, strings and other patterns, so it is
written as ``{"pattern": "<module>.<class>", "fields": {...}}`` (nested patterns likewise,
tuples as lists); a probability map as the factory that made it and its arguments,
``{"prob_map": "entmax", "args": [1.5]}``. Both are JSON, so they fit a Hugging Face
``config.json`` (docs/persistence.md). What holds a tensor (a learned mask's logits, a learned
α) is not configuration: it belongs in a state dict, and is refused here with a TypeError that
says so.

Reading is restricted to the classes and factories of this package: a config names no code
outside ``sparseattn``.
"""

from __future__ import annotations

import dataclasses
import importlib
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


def _value(name: str, value: Any) -> Any:
    if isinstance(value, (Pattern, PatternCycle)):
        return pattern_config(value)
    if isinstance(value, (tuple, list)):
        return [_value(name, v) for v in value]
    if isinstance(value, Tensor):
        raise TypeError(
            f"field {name!r} holds a tensor, which is state, not configuration: save the "
            "model's state dict (torch.save) for patterns learned from data"
        )
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"field {name!r} holds a {type(value).__name__}, which has no config form")


def pattern_config(pattern: Pattern | PatternCycle) -> dict:
    """``pattern`` as JSON-able data (see the module docstring).

    Raises:
        TypeError: for a pattern that holds a tensor (learned, predicted) or other state.
    """
    if not isinstance(pattern, (Pattern, PatternCycle)) or not dataclasses.is_dataclass(pattern):
        raise TypeError(f"pattern must be a sparseattn Pattern, got {type(pattern).__name__}")
    cls = type(pattern)
    fields = {
        f.name: _value(f.name, getattr(pattern, f.name))
        for f in dataclasses.fields(pattern)
        if f.init
    }
    return {"pattern": f"{cls.__module__}.{cls.__qualname__}", "fields": fields}


def _read(value: Any) -> Any:
    if isinstance(value, dict) and "pattern" in value:
        return pattern_from_config(value)
    if isinstance(value, list):
        return tuple(_read(v) for v in value)
    return value


def pattern_from_config(config: dict) -> Pattern | PatternCycle:
    """The pattern :func:`pattern_config` wrote.

    Raises:
        ValueError: for a config that is not one, or names a class outside sparseattn.
    """
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
    return cls(**{k: _read(v) for k, v in config.get("fields", {}).items()})


def prob_map_config(rho: maps.ProbabilityMap) -> dict:
    """``rho`` as its factory's name and arguments, e.g. ``{"prob_map": "entmax", "args":
    [1.5]}``.

    Raises:
        TypeError: for a map with a tensor α (learned: state, not configuration) or one not
            made by a factory of :mod:`sparseattn.maps`.
    """
    recipe = getattr(rho, "recipe", None)
    if recipe is None or recipe[0].__name__ not in _MAPS:
        raise TypeError(f"{rho!r} was not made by a factory of sparseattn.maps")
    factory, args = recipe
    if any(isinstance(a, Tensor) for a in args):
        raise TypeError(
            f"{rho!r} has a tensor α, which is state, not configuration: a learned α lives in "
            "the model's parameters"
        )
    return {"prob_map": factory.__name__, "args": list(args)}


def prob_map_from_config(config: dict) -> maps.ProbabilityMap:
    """The map :func:`prob_map_config` wrote."""
    if not isinstance(config, dict) or config.get("prob_map") not in _MAPS:
        raise ValueError(f"a prob_map config names one of {sorted(_MAPS)}, got {config!r}")
    return _MAPS[config["prob_map"]](*config.get("args", ()))
