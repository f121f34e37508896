"""The ``sparseattn`` console script (``[project.scripts]``): the command line of the lab
(:mod:`sparseattn.lab.cli`), or, without the ``cli`` extra, one line on stderr naming it (exit
status 1) instead of a traceback. It sits above the lab, which nothing in the library imports."""

from __future__ import annotations

import sys

from .._extras import MissingExtraError

__all__ = ["console_script"]


def console_script() -> None:
    """Run the command line."""
    try:
        from .cli import app
    except MissingExtraError as err:
        sys.exit(f"Error: {err}")
    app()
