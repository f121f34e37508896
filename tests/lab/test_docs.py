"""The docs stay true to the code: every `sparseattn ...` command that README.md and docs/*.md
quote in code names a real command with real options, and their Python examples run."""

import re
import shlex
from pathlib import Path

import pytest
import typer

from sparseattn.lab.cli import app

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: fenced blocks (with their language) and inline code spans
CODE = re.compile(r"```([^\n]*)\n(.*?)```|`([^`\n]+)`", re.DOTALL)
COMMAND = re.compile(r"(?:^|[\s;&(])sparseattn ([a-z][^#\n]*)", re.MULTILINE)


def quoted_commands():
    for page in PAGES:
        for language, block, span in CODE.findall(page.read_text()):
            if language.strip() == "python" or span.startswith(("import ", "from ")):
                continue
            code = (block or span).replace("\\|", "|")  # a `|` escaped inside a table cell
            for match in COMMAND.finditer(code):
                yield page.relative_to(ROOT).as_posix(), match.group(1).strip()


def check(root, line: str) -> None:
    """Walk ``line`` down the command tree; every ``--option`` must belong to the command.
    Usage sketches are understood: ``a|b``, ``[a|b]`` and ``{a, b}`` list alternatives."""
    line = re.sub(r"\{([^}]*)\}", lambda m: "|".join(m.group(1).replace(" ", "").split(",")), line)
    tokens = [t.strip("[]") for t in shlex.split(line)]
    command, path = root, ["sparseattn"]
    while hasattr(command, "commands") and tokens and not tokens[0].startswith("-"):
        name = tokens.pop(0)
        if "|" in name:  # alternatives: each a command here; the sketch ends
            tokens = [t for t in name.split("|") if t.startswith("-")]
            for sub in (t for t in name.split("|") if not t.startswith("-")):
                assert sub in command.commands, f"`{' '.join(path)}` has no command {sub!r}"
            break
        assert name in command.commands, f"`{' '.join(path)}` has no command {name!r}"
        command, path = command.commands[name], [*path, name]
    options = {"--help"}
    for param in command.params:
        options.update(param.opts + param.secondary_opts)
    for token in tokens:
        for flag in token.split("|"):
            flag = flag.split("=", 1)[0]
            if flag.startswith("--"):
                assert flag in options, f"`{' '.join(path)}` has no option {flag}"


COMMANDS = sorted(set(quoted_commands()))


@pytest.mark.parametrize(("page", "line"), COMMANDS, ids=[f"{p}:{c}" for p, c in COMMANDS])
def test_quoted_command_exists(page, line):
    check(typer.main.get_command(app), line)


def test_the_checker_catches_a_wrong_command_or_option():
    root = typer.main.get_command(app)
    assert len(COMMANDS) > 50  # the docs quote many commands; the regexes find them
    with pytest.raises(AssertionError, match="no option --nope"):
        check(root, "copying --n 256 --nope 3")
    with pytest.raises(AssertionError, match="no command 'weird'"):
        check(root, "expressivity {dmin, weird}")
    check(root, "expressivity dmin|bound|weak")
    check(root, "bench [full|--quick]")


PYTHON = [
    (page.relative_to(ROOT).as_posix(), i, block)
    for page in PAGES
    for i, (language, block, _) in enumerate(CODE.findall(page.read_text()))
    if language.strip() == "python"
]


@pytest.mark.parametrize(("page", "i", "block"), PYTHON, ids=[f"{p}#{i}" for p, i, _ in PYTHON])
def test_python_examples_compile(page, i, block):
    compile(block, f"{page} block {i}", "exec")


#: pages whose examples train something first: run with ``-m slow``
SLOW = {"docs/sparsefinder.md"}  # load_teacher() distils the 1.5-entmax MiniLM (~8 min, 1 core)


@pytest.mark.parametrize(
    "page",
    [
        pytest.param(p, marks=[pytest.mark.slow] if p in SLOW else [])
        for p in sorted({p for p, _, _ in PYTHON})
    ],
)
def test_python_examples_run(page, tmp_path, monkeypatch):
    """A page's Python blocks run in order in one namespace, as a reader would paste them
    (in a scratch folder: nothing is written into the checkout)."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for p, i, block in PYTHON:
        if p == page:
            exec(compile(block, f"{page} block {i}", "exec"), namespace)
