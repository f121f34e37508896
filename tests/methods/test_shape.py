"""Every paper's home has one shape: a package whose docstring names the paper and its public
functions, every name it cites resolves, and ``__all__`` lists what it exports."""

import importlib
import re

import pytest

PACKAGES = {
    "yun": "Yun et al.",
    "sparsebert": "SparseBERT",
    "mca": "MCA",
    "likhosherstov": "Likhosherstov",
    "sparsefinder": "Sparsefinder",
}
ROLE = re.compile(r":(?:func|class|meth|mod):`~?([^`]+)`")


def _resolve(package, ref: str):
    """The object a docstring reference names, relative to ``package`` (Sphinx's rules, enough
    for these docstrings): ``.mod`` a submodule, ``name`` or ``Class.method`` an attribute of
    the package, a dotted path from ``sparseattn`` an absolute one."""
    if ref.startswith("."):
        return importlib.import_module(package.__name__ + ref)
    if ref.startswith("sparseattn"):
        parts = ref.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ModuleNotFoundError:
                continue
            for name in parts[cut:]:
                obj = getattr(obj, name)
            return obj
        raise AssertionError(ref)
    obj = package
    for name in ref.split("."):
        obj = getattr(obj, name)
    return obj


@pytest.mark.parametrize("name", sorted(PACKAGES))
def test_each_method_package_names_its_paper_and_its_functions(name):
    package = importlib.import_module(f"sparseattn.methods.{name}")
    doc = package.__doc__ or ""
    assert PACKAGES[name] in doc.splitlines()[0], doc.splitlines()[0]
    refs = ROLE.findall(doc)
    assert len(refs) >= 3, refs
    for ref in refs:
        _resolve(package, ref)  # raises when the docstring names something that is not there
    assert package.__all__ and all(hasattr(package, n) for n in package.__all__)
    documented = {r.split(".")[-1] for r in refs}
    # the main entry points are named in the docstring, not only exported
    assert len(documented & set(package.__all__)) >= 3


def test_methods_index_lists_every_package():
    index = importlib.import_module("sparseattn.methods").__doc__
    for name in PACKAGES:
        assert f":mod:`.{name}`" in index
