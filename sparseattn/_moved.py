"""Old import paths of moved modules: they still import, with a DeprecationWarning.

``sparseattn.learned_mask``, ``.montecarlo``, ``.predict[.…]`` and ``.analysis[.…]`` moved under
:mod:`sparseattn.methods`; ``sparseattn.minilm`` and ``.kvcache`` (they need transformers) under
:mod:`sparseattn.hf`. An old name
gives the *same* module object as the new one (classes keep their identity; objects pickled
under the old names load). ``sparseattn.analysis`` held two papers: it forwards each name to
:mod:`~sparseattn.methods.yun` or :mod:`~sparseattn.methods.likhosherstov`. One meta-path
finder, installed by ``import sparseattn``; nothing is imported until an old name is asked for.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

_M = "sparseattn.methods"
MOVED: dict[str, str | tuple[str, ...]] = {
    "sparseattn.learned_mask": f"{_M}.sparsebert.learned_mask",
    "sparseattn.montecarlo": f"{_M}.mca.montecarlo",
    "sparseattn.minilm": "sparseattn.hf.minilm",
    "sparseattn.kvcache": "sparseattn.hf.kvcache",
    "sparseattn.analysis": (f"{_M}.yun", f"{_M}.likhosherstov"),
    "sparseattn.predict": f"{_M}.sparsefinder",
}
MOVED.update(
    {
        f"sparseattn.analysis.{m}": f"{_M}.yun.{m}"
        for m in ("connectivity", "construction", "maps", "relaxed")
    }
)
MOVED.update(
    {f"sparseattn.analysis.{m}": f"{_M}.likhosherstov.{m}" for m in ("expressivity", "order_types")}
)
MOVED.update(
    {
        f"sparseattn.predict.{m}": f"{_M}.sparsefinder.{m}"
        for m in ("baselines", "evaluate", "extract", "pattern", "predictors", "projection")
    }
)


def _forwarding(name: str, targets: tuple[str, ...]) -> types.ModuleType:
    """A package ``name`` whose attributes are those of ``targets``, the first that has one."""
    modules = [importlib.import_module(t) for t in targets]
    module = types.ModuleType(name, f"Moved: see {', '.join(targets)}.")
    module.__path__ = []  # a package, so that its old submodules resolve through the finder
    module.__all__ = [a for m in modules for a in m.__all__]

    def __getattr__(attr: str):
        for m in modules:
            if hasattr(m, attr):
                return getattr(m, attr)
        raise AttributeError(f"module {name!r} has no attribute {attr!r}")

    module.__getattr__ = __getattr__
    return module


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec] = {}

    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        package = isinstance(new, tuple) or new == f"{_M}.sparsefinder"
        return importlib.machinery.ModuleSpec(fullname, self, is_package=package)

    def create_module(self, spec):
        new = MOVED[spec.name]
        shown = new if isinstance(new, str) else " or ".join(new)
        warnings.warn(f"{spec.name} moved to {shown}", DeprecationWarning, stacklevel=2)
        if isinstance(new, tuple):
            return _forwarding(spec.name, new)
        module = importlib.import_module(new)
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module):
        # importlib stamped the alias spec on the real module: it gets its own back.
        real = self._specs.pop(module.__spec__.name, None)
        if real is not None:
            module.__spec__ = real


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias())
