"""`sparseattn tour --quick`: the report is written, self-contained, and renders in Chromium.

The quick tour runs once (module fixture, ~25 s on one thread). Its HTML is opened in headless
Chromium (`--dump-dom`); the page's own script sets ``body[data-images-loaded] = "k/n"`` after
the load event, counting the images that decoded (``naturalWidth > 0``). Chromium comes from the
Debian package ``chromium``: the session fixture installs it with apt-get when it is missing and
we are root; otherwise the tests fail (they are not skipped: CI must really render the report).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from test_docs import check

from sparseattn.lab import tour
from sparseattn.lab.cli import app

SECTIONS = list(tour.SECTIONS)
#: How a section's full-size version starts: a command, or a script of the repository's scripts/.
FULL_SIZE = ("sparseattn ", "python scripts/")


@pytest.fixture(scope="session")
def chromium() -> str:
    """Path of the chromium binary, installed from Debian's package when missing."""
    found = shutil.which("chromium")
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                pytest.fail(f"`{' '.join(cmd)}` failed:\n{done.stderr[-2000:]}")
        found = shutil.which("chromium")
    if found is None:
        pytest.fail(
            "headless Chromium is required to check the tour report: install the Debian package "
            "`chromium` (apt-get install chromium), or run the tests as root with apt-get "
            "available so that they install it"
        )
    return found


def render(chromium: str, page: Path, tmp: Path) -> str:
    """The DOM of ``page`` after its load event, as dumped by headless Chromium."""
    profile = tmp / f"chromium-profile-{page.stem}"
    cmd = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=5000",
        "--dump-dom",
        page.resolve().as_uri(),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def images_loaded(dom: str) -> tuple[int, int]:
    match = re.search(r'<body[^>]*\bdata-images-loaded="(\d+)/(\d+)"', dom)
    assert match, "the page's script did not run (no data-images-loaded on <body>)"
    return int(match[1]), int(match[2])


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    """Run the quick tour once through the command line; the folder it wrote."""
    out = tmp_path_factory.mktemp("tour")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "sparseattn.lab.cli", "tour", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return out


def test_every_section_ran_and_every_figure_loads_in_chromium(report, chromium, tmp_path):
    summary = json.loads((report / "tour.json").read_text())
    assert list(summary["sections"]) == SECTIONS
    figures = []
    for key, record in summary["sections"].items():
        assert record["status"] == "ok", f"{key}: {record.get('error')}"
        assert any(cmd.startswith(FULL_SIZE) for _, cmd in record["commands"]), key
        figures += record["figures"]
    # one figure per section, except the copying table
    assert len(figures) == len(SECTIONS) - 1
    for name in figures:
        assert (report / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name

    dom = render(chromium, report / "index.html", tmp_path)
    assert images_loaded(dom) == (len(figures), len(figures))
    statuses = re.findall(r'<section id="(\w+)" data-status="(\w+)"', dom)
    assert statuses == [(key, "ok") for key in SECTIONS]
    assert 'class="error-box"' not in dom


def test_every_command_the_report_names_exists(report):
    """The commands the sections print (built at run time) pass the docs' command check."""
    summary = json.loads((report / "tour.json").read_text())
    root = typer.main.get_command(app)
    for record in summary["sections"].values():
        for _, command in record["commands"]:
            if command.startswith("sparseattn "):
                check(root, command.removeprefix("sparseattn "))
            elif command.startswith("python scripts/"):
                script = command.split()[1]
                assert (Path(__file__).resolve().parents[2] / script).is_file(), command


def test_report_is_self_contained(report):
    page = (report / "index.html").read_text()
    sources = re.findall(r'<img [^>]*src="([^"]*)"', page)
    assert sources and all(s.startswith("data:image/png;base64,") for s in sources)
    assert not re.search(r'(src|href)="(https?:)?//', page), "external reference in the report"
    assert "<link" not in page and "<script src" not in page
    for key in SECTIONS:  # every section names its full-size command
        section = page.split(f'<section id="{key}"', 1)[1].split("</section>", 1)[0]
        assert "Full-size version" in section, key
        assert "<code>sparseattn " in section or "<code>python scripts/" in section, key


def test_a_broken_figure_is_detected(report, chromium, tmp_path):
    """The check can fail: corrupt one embedded PNG and Chromium counts it as not loaded."""
    page = (report / "index.html").read_text()
    start = page.index("data:image/png;base64,") + len("data:image/png;base64,")
    broken = page[:start] + "iVBORw0KGgoAAAANSUhEUgAAAAEAAAAB" + page[start + 200 :]
    path = tmp_path / "broken.html"
    path.write_text(broken)
    loaded, total = images_loaded(render(chromium, path, tmp_path))
    assert total == page.count("<img ") and loaded == total - 1


def test_a_failing_section_becomes_an_error_box(tmp_path, monkeypatch, chromium):
    def broken(config, out, work):
        raise RuntimeError("deliberate failure")

    monkeypatch.setitem(tour.SECTIONS, "dmin", ("4d. d_min", broken))
    config = tour.quick_config(out=str(tmp_path / "tour"), sections=("gallery", "dmin"))
    result = tour.run(config, log=lambda _: None)
    assert result["sections"]["gallery"]["status"] == "ok"
    assert result["sections"]["dmin"]["status"] == "error"
    assert "deliberate failure" in result["sections"]["dmin"]["error"]
    dom = render(chromium, Path(result["index"]), tmp_path)
    assert re.findall(r'<section id="(\w+)" data-status="(\w+)"', dom) == [
        ("gallery", "ok"),
        ("dmin", "error"),
    ]
    assert dom.count('class="error-box"') == 1
    assert images_loaded(dom) == (1, 1)


def test_config_is_validated():
    with pytest.raises(ValueError, match="sections"):
        tour.TourConfig(sections=("gallery", "nope")).validate()
    with pytest.raises(ValueError, match="threads"):
        tour.TourConfig(threads=0).validate()
