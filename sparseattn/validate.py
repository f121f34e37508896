"""Validation helpers for the public boundary (docs/architecture.md, "Errors"): one home for
every argument check.

Each helper returns the value (an int stays an int, a real becomes a float) or raises a
``TypeError`` (wrong kind) / ``ValueError`` (wrong value) naming the argument and the
expectation, e.g. ``w must be an int >= 1, got 2.5``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Integral, Real

import torch
from torch import Tensor, nn

__all__ = [
    "check_bool",
    "check_choice",
    "check_finite_float",
    "check_finite_tensor",
    "check_generator",
    "check_int",
    "check_model",
    "check_positive",
    "check_probability",
    "check_seed",
    "check_tensor",
]

#: The seeds ``torch.Generator.manual_seed`` takes: 64-bit, negative ones wrapping modulo 2⁶⁴.
SEED_RANGE = (-(2**63), 2**64 - 1)


def _kind(value: object) -> str:
    return type(value).__name__


def check_int(name: str, value: object, minimum: int | None = None) -> int:
    """An integer (``bool`` and floats refused, numpy/torch integer scalars accepted) that is
    at least ``minimum`` when given."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        if isinstance(value, Tensor) and value.dim() == 0 and not value.is_floating_point():
            value = int(value)
        else:
            raise TypeError(f"{name} must be an int, got {_kind(value)} {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_seed(name: str, value: object) -> int:
    """A random seed: an int that ``torch.Generator.manual_seed`` takes, i.e. in
    [−2⁶³, 2⁶⁴ − 1] (larger ones overflow its 64-bit state)."""
    value = check_int(name, value)
    low, high = SEED_RANGE
    if not low <= value <= high:
        raise ValueError(
            f"{name} must be a 64-bit seed in [-2**63, 2**64 - 1] (what torch.Generator."
            f"manual_seed takes), got {value}"
        )
    return value


def check_positive(name: str, value: object) -> int:
    """A size parameter: an int >= 1."""
    return check_int(name, value, 1)


def check_finite_float(
    name: str,
    value: object,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """A finite real number (``bool`` refused) inside the optional interval.

    ``low``/``high`` are inclusive unless ``low_open``/``high_open``.
    """
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, got {_kind(value)} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    below = low is not None and (value <= low if low_open else value < low)
    above = high is not None and (value >= high if high_open else value > high)
    if below or above:
        lo = "(-inf" if low is None else f"{'(' if low_open else '['}{low:g}"
        hi = "inf)" if high is None else f"{high:g}{')' if high_open else ']'}"
        raise ValueError(f"{name} must lie in {lo}, {hi}, got {value:g}")
    return value


def check_probability(name: str, value: object, *, allow_one: bool = True) -> float:
    """A probability in [0, 1] (or [0, 1) with ``allow_one=False``, e.g. a dropout rate)."""
    return check_finite_float(name, value, 0.0, 1.0, high_open=not allow_one)


def check_bool(name: str, value: object) -> bool:
    """A real ``bool`` (no truthy ints or strings)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {_kind(value)} {value!r}")
    return value


def check_choice(name: str, value: object, choices: Sequence[str]) -> str:
    """One of a fixed set of strings."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, one of {list(choices)}, got {_kind(value)}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value


def check_generator(name: str, value: object) -> torch.Generator | None:
    """None or a ``torch.Generator`` (an int seed is refused: pass ``seed=`` where offered)."""
    if value is not None and not isinstance(value, torch.Generator):
        raise TypeError(f"{name} must be a torch.Generator or None, got {_kind(value)}")
    return value


def check_tensor(
    name: str,
    value: object,
    *,
    dim: int | None = None,
    floating: bool = False,
    dtype: torch.dtype | None = None,
    shape: Sequence[int | None] | None = None,
) -> Tensor:
    """A tensor of the given rank, kind and shape (``None`` in ``shape`` = any size)."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {_kind(value)}")
    if dtype is not None and value.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {value.dtype}")
    if floating and not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {value.dtype}")
    if dim is not None and value.dim() != dim:
        raise ValueError(f"{name} must have {dim} dims, got shape {tuple(value.shape)}")
    if shape is not None and (
        value.dim() != len(shape)
        or any(s is not None and s != t for s, t in zip(shape, value.shape, strict=True))
    ):
        want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
        raise ValueError(f"{name} must have shape {want}, got {tuple(value.shape)}")
    return value


def all_finite(value: Tensor) -> bool:
    """Whether every entry of ``value`` is finite: one sum read back to the host (NaN and ±inf
    propagate into it; a few µs); only when the sum is not (overflow, or a bad entry) is
    every entry checked. Reads the value: on a GPU the host waits for the device."""
    return math.isfinite(value.detach().sum().item()) or bool(torch.isfinite(value).all())


def check_finite_tensor(name: str, value: Tensor) -> Tensor:
    """Refuse NaN or ±inf anywhere in ``value`` (:func:`all_finite`)."""
    if not (value.numel() and value.is_floating_point()) or value.device.type == "meta":
        return value
    if not all_finite(value):
        raise ValueError(f"{name} contains NaN or inf")
    return value


def check_model(model: object) -> None:
    """Refuse anything but a torch.nn.Module where a Hugging Face model is expected."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be a Hugging Face model (a torch.nn.Module), got {type(model).__name__}"
        )
