"""Small runs that tell the truth (issue 28, item 5): output that is not a terminal (progress
bars become a few plain lines, rich tables keep their natural width), ``sparseattn demo`` times
warm calls beside the first one, ``--quick`` runs say what they cannot show, and run folders
are named after their configuration."""

from __future__ import annotations

import io
import re
import time

import typer

from sparseattn.lab import cli
from sparseattn.lab.progress import tqdm

CONTROL = re.compile(r"[\r\x1b\x08]")


def test_a_piped_progress_bar_writes_plain_lines_only():
    stream = io.StringIO()
    with tqdm(total=2000, desc="cells", file=stream) as bar:
        for i in range(2000):
            bar.update()
            bar.set_postfix(loss=1.0 / (i + 1))  # tqdm redraws on every new postfix
            if i == 1000:
                bar.write("halfway", file=stream)
    with tqdm(total=5, desc="inner", file=stream, position=1, leave=False, mininterval=0) as bar:
        bar.update(5)
    text = stream.getvalue()
    assert not CONTROL.search(text)
    lines = text.splitlines()
    assert "halfway" in lines
    # the 30 s interval: the first draw and the final one, not one line per update
    assert [line.split(":")[0] for line in lines if line.startswith("cells")] == ["cells"] * 2
    assert lines[-1].startswith("inner") and "5/5" in lines[-1]


def test_a_bar_on_a_terminal_is_left_to_tqdm():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    with tqdm(total=3, desc="t", file=stream, mininterval=0) as bar:
        for _ in range(3):
            time.sleep(0.001)
            bar.update()
    assert "\r" in stream.getvalue()  # tqdm redraws in place there


def test_piped_tables_keep_their_width_and_demo_times_warm_calls(capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(cli, "console", cli._console())  # stdout is captured: not a terminal
    assert cli.main(["demo", "--n", "96", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert not CONTROL.search(out)
    header = next(line for line in out.splitlines() if "computation" in line)
    assert len(header) > 80  # one line: the table is not folded at 80 columns
    for column in ("first call", "warm (median of 2)", "max |out − masked dense|"):
        assert column in header
    rows = [line for line in out.splitlines() if "engine='block'" in line]
    assert len(rows) == 1 and rows[0].count(" ms") == 2


def test_every_quick_run_says_what_it_can_and_cannot_show():
    """Each command with ``--quick`` has its note (bench and tour are small suites by design)."""
    root = typer.main.get_command(cli.app)
    quick = {
        name
        for name, command in root.commands.items()
        if any("--quick" in p.opts for p in getattr(command, "params", []))
    }
    assert quick - {"bench", "tour"} == set(cli.QUICK_NOTES)
    assert all("cannot" in note or "not" in note for note in cli.QUICK_NOTES.values())


def test_mca_run_folders_follow_the_configuration():
    """``mca --quick`` took the full run's folder name ``default``, so a later full run was
    refused; now the name comes from the fields the folder is pinned to."""
    from sparseattn.lab.experiments.mca import MCAConfig

    full = MCAConfig()
    quick = MCAConfig((0.0, 0.2, 1.0), 16)  # what `sparseattn mca --quick` builds
    assert quick.run_name() != full.run_name()
    assert MCAConfig((0.5,), 48).run_name() == full.run_name()  # same cells, other α: resumes
    assert MCAConfig(run="mine").run_name() == "mine"
