"""Every subcommand with bad options: one line ``Error: …``, a non-zero status, no traceback and
no run folder (options are validated before a model loads or a folder is written; issue 17)."""

from __future__ import annotations

import pytest

from sparseattn.lab.cli import main

BAD = {
    "patterns n=0": ["patterns", "--n", "0"],
    "patterns n=abc": ["patterns", "--n", "abc"],
    "demo n=0": ["demo", "--n", "0"],
    "demo n=-3": ["demo", "--n", "-3"],
    "dmin k=0": ["expressivity", "dmin", "--k", "0"],
    "dmin n=1": ["expressivity", "dmin", "--n", "1"],
    "dmin eps1=2": ["expressivity", "dmin", "--eps1", "2"],
    "dmin d-step odd": ["expressivity", "dmin", "--d-step", "3"],
    "dmin q=-1": ["expressivity", "dmin", "--q", "-1"],
    "bound n=1": ["expressivity", "bound", "--n", "1"],
    "bound gamma=nan": ["expressivity", "bound", "--n", "8", "--gamma", "nan"],
    "weak param=abc": ["expressivity", "weak", "--param", "w=abc"],
    "weak param unknown": ["expressivity", "weak", "--param", "zz=1"],
    "weak param no =": ["expressivity", "weak", "--param", "w"],
    "weak d=0": ["expressivity", "weak", "--d", "0"],
    "weak d-hid below d": ["expressivity", "weak", "--d", "4", "--d-hid", "2"],
    "weak n=0": ["expressivity", "weak", "--n", "0"],
    "weak pattern": ["expressivity", "weak", "--pattern", "nope"],
    "fidelity window=0": ["fidelity", "--window", "0"],
    "fidelity engine": ["fidelity", "--engine", "nope"],
    "fidelity split": ["fidelity", "--split", "nope"],
    "copying depths=x": ["copying", "--depths", "x"],
    "copying columns": ["copying", "--patterns", "nope"],
    "copying quick+paper": ["copying", "--quick", "--paper"],
    "lm widths=x": ["lm", "--widths", "x"],
    "lm patterns": ["lm", "--patterns", "nope"],
    "lm causal-form": ["lm", "--causal-form", "nope"],
    "lm prob-map": ["lm", "--prob-map", "nope"],
    "analyze n=0": ["analyze", "window", "--n", "0"],
    "analyze pattern": ["analyze", "nope"],
    "analyze threads=0": ["analyze", "window", "--threads", "0"],
    "dam seq-len=2": ["dam", "--seq-len", "2"],
    "dam variant": ["dam", "--variant", "nope"],
    "dam lam=-1": ["dam", "--lam", "-1"],
    "sparsefinder threads=0": ["sparsefinder", "--threads", "0"],
    "sparsefinder-decoder threads=0": ["sparsefinder-decoder", "--threads", "0"],
    "sparsefinder-decoder valid-windows=0": ["sparsefinder-decoder", "--valid-windows", "0"],
    "bench ns=abc": ["bench", "--ns", "abc"],
    "bench ns=0": ["bench", "--ns", "0"],
    "bench only": ["bench", "--only", "nope"],
    "bench suite": ["bench", "nope"],
    "mca alphas=abc": ["mca", "--alphas", "abc"],
    "mca alphas=-1": ["mca", "--alphas", "-1"],
    "mca alphas=nan": ["mca", "--alphas", "nan"],
    "mca max-passages=0": ["mca", "--max-passages", "0"],
    "tour threads=-1": ["tour", "--threads", "-1"],
    "unknown command": ["nope"],
    "unknown option": ["patterns", "--zz", "1"],
}


@pytest.mark.parametrize("argv", BAD.values(), ids=BAD.keys())
def test_bad_options_give_one_line_and_no_run_folder(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # every default results/ folder is relative
    status = main(argv)
    out, err = capsys.readouterr()
    assert status != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), err
    assert "Traceback" not in out + err
    assert list(tmp_path.iterdir()) == [], "a run folder was written"


def test_help_and_a_good_command_still_work(capsys):
    assert main(["patterns", "--n", "8"]) == 0
    assert "window" in capsys.readouterr().out
    assert main(["--help"]) == 0


def test_the_console_entry_point_prints_one_line(tmp_path):
    """The installed script path (``app()``) goes through the same one-line handler."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "sparseattn.lab.cli", "mca", "--alphas", "-1"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip().count("\n") == 0
        and proc.stderr.startswith("Error: ")
        and "alphas" in proc.stderr
    )
    assert list(tmp_path.iterdir()) == []
