"""Import paths from before ``sparseattn.methods``: still working, deprecated, the same objects.

Each check runs in a fresh process, so that nothing imported by the test run hides a failure.
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


@pytest.mark.parametrize("old", sorted(OLD_TO_NEW))
def test_old_path_is_the_new_module_with_a_deprecation(old):
    new = OLD_TO_NEW[old]
    got = fresh(f"""
        import importlib, json, warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            old = importlib.import_module({old!r})
        new = importlib.import_module({new!r})
        print(json.dumps({{
            "same": old is new,
            "spec": old.__spec__.name,
            "package": hasattr(old, "__path__"),
            "new_package": hasattr(new, "__path__"),
            "warnings": [str(w.message) for w in caught if w.category is DeprecationWarning],
        }}))
    """)
    assert got["same"]
    assert got["spec"] == new  # the alias does not rename the real module
    assert got["package"] == got["new_package"]
    assert any(old in w and new in w for w in got["warnings"]), got["warnings"]


def test_analysis_forwards_to_both_papers():
    got = fresh("""
        import json, warnings
        warnings.simplefilter("ignore")
        import sparseattn.analysis as old
        from sparseattn.methods import likhosherstov, yun
        try:
            old.no_such_name
            missing = "no error"
        except AttributeError as e:
            missing = str(e)
        print(json.dumps({
            "yun": old.assumption1 is yun.assumption1,
            "likhosherstov": old.weak_sam_approx_d1 is likhosherstov.weak_sam_approx_d1,
            "all": sorted(old.__all__) == sorted(yun.__all__ + likhosherstov.__all__),
            "missing": missing,
        }))
    """)
    assert got["yun"] and got["likhosherstov"] and got["all"]
    assert "no_such_name" in got["missing"]


def test_object_pickled_under_the_old_path_loads():
    """A pickle written before the move names ``sparseattn.montecarlo.MCAMethod``."""
    got = fresh("""
        import json, pickle, warnings
        warnings.simplefilter("ignore")
        from sparseattn.methods.mca import MCAMethod
        data = pickle.dumps(MCAMethod(0.25), protocol=0)
        assert b"sparseattn.methods.mca.montecarlo" in data
        old = data.replace(b"sparseattn.methods.mca.montecarlo", b"sparseattn.montecarlo")
        back = pickle.loads(old)
        print(json.dumps({"cls": type(back) is MCAMethod, "alpha": back.alpha}))
    """)
    assert got == {"cls": True, "alpha": 0.25}


def test_methods_package_imports_no_method():
    got = fresh("""
        import json, sys
        import sparseattn.methods
        print(json.dumps(sorted(m for m in sys.modules if m.startswith("sparseattn.methods."))))
    """)
    assert got == []
