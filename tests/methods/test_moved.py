"""Import paths from before ``sparseattn.methods``: still working, deprecated, the same objects.

The checks run in fresh processes, so that nothing imported by the test run hides a failure.
"""

import pytest
from fresh import fresh

OLD_TO_NEW = {
    "sparseattn.learned_mask": "sparseattn.methods.sparsebert.learned_mask",
    "sparseattn.montecarlo": "sparseattn.methods.mca.montecarlo",
    "sparseattn.analysis.connectivity": "sparseattn.methods.yun.connectivity",
    "sparseattn.analysis.relaxed": "sparseattn.methods.yun.relaxed",
    "sparseattn.analysis.expressivity": "sparseattn.methods.likhosherstov.expressivity",
    "sparseattn.analysis.order_types": "sparseattn.methods.likhosherstov.order_types",
    "sparseattn.predict": "sparseattn.methods.sparsefinder",
    "sparseattn.predict.predictors": "sparseattn.methods.sparsefinder.predictors",
    "sparseattn.minilm": "sparseattn.hf.minilm",
    "sparseattn.kvcache": "sparseattn.hf.kvcache",
}


@pytest.fixture(scope="module")
def moved():
    """One fresh process imports every old path (each for the first time there), then checks
    the forwarding ``sparseattn.analysis`` and a pickle written under an old path."""
    return fresh(f"""
        import importlib, json, pickle, warnings
        out = {{}}
        for old, new in {OLD_TO_NEW!r}.items():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                o = importlib.import_module(old)
            n = importlib.import_module(new)
            out[old] = {{
                "same": o is n,
                "spec": o.__spec__.name,
                "package": hasattr(o, "__path__") == hasattr(n, "__path__"),
                "warnings": [str(w.message) for w in caught if w.category is DeprecationWarning],
            }}
        warnings.simplefilter("ignore")
        import sparseattn.analysis as old
        from sparseattn.methods import likhosherstov, yun
        try:
            old.no_such_name
            missing = "no error"
        except AttributeError as e:
            missing = str(e)
        out["analysis"] = {{
            "yun": old.assumption1 is yun.assumption1,
            "likhosherstov": old.weak_sam_approx_d1 is likhosherstov.weak_sam_approx_d1,
            "all": sorted(old.__all__) == sorted(yun.__all__ + likhosherstov.__all__),
            "missing": missing,
        }}
        # a pickle written before the move names sparseattn.montecarlo.MCAMethod
        from sparseattn.methods.mca import MCAMethod
        data = pickle.dumps(MCAMethod(0.25), protocol=0)
        assert b"sparseattn.methods.mca.montecarlo" in data
        old_data = data.replace(b"sparseattn.methods.mca.montecarlo", b"sparseattn.montecarlo")
        back = pickle.loads(old_data)
        out["pickle"] = {{"cls": type(back) is MCAMethod, "alpha": back.alpha}}
        print(json.dumps(out))
    """)


@pytest.mark.parametrize("old", sorted(OLD_TO_NEW))
def test_old_path_is_the_new_module_with_a_deprecation(moved, old):
    new, got = OLD_TO_NEW[old], moved[old]
    assert got["same"] and got["package"]
    assert got["spec"] == new  # the alias does not rename the real module
    assert any(old in w and new in w for w in got["warnings"]), got["warnings"]


def test_analysis_forwards_to_both_papers(moved):
    got = moved["analysis"]
    assert got["yun"] and got["likhosherstov"] and got["all"]
    assert "no_such_name" in got["missing"]


def test_object_pickled_under_the_old_path_loads(moved):
    assert moved["pickle"] == {"cls": True, "alpha": 0.25}


def test_methods_package_imports_no_method():
    got = fresh("""
        import json, sys
        import sparseattn.methods
        print(json.dumps(sorted(m for m in sys.modules if m.startswith("sparseattn.methods."))))
    """)
    assert got == []
