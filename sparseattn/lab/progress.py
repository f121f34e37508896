"""Progress bars that degrade cleanly when output is not a terminal.

On a terminal :class:`tqdm` is tqdm's bar. When its stream is piped or redirected (a log
file, CI), tqdm would still redraw in place — a carriage return and, for stacked bars,
cursor-movement codes per update, tens of kilobytes per run. There each redraw becomes one
plain line instead, at most every :data:`PIPED_INTERVAL` seconds (and at the end), without
control characters. The experiments import their ``tqdm`` from here.
"""

from __future__ import annotations

import re
import sys
from typing import Any, TextIO

from .._extras import require

_tqdm = require("tqdm", "experiments", "progress bars").tqdm

__all__ = ["PIPED_INTERVAL", "tqdm"]

#: Seconds between progress lines when the stream is not a terminal.
PIPED_INTERVAL = 30.0
_CONTROL = re.compile(r"\x1b\[[0-9;]*[A-Za-z]|[\r\x08]")


class _Lines:
    """A stream wrapper that writes each non-blank redraw of a bar as one line."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        line = _CONTROL.sub("", text).strip()
        if line:
            self.stream.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()


def _is_terminal(stream: object) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except ValueError:  # a closed stream
        return False


class tqdm(_tqdm):  # noqa: N801 - a drop-in for tqdm.tqdm
    """``tqdm.tqdm`` with the same arguments; off a terminal, plain lines (module doc)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        stream = kwargs.get("file") or sys.stderr
        self._piped = not kwargs.get("disable") and not _is_terminal(stream)
        if self._piped:
            kwargs["file"] = _Lines(stream)
            kwargs.setdefault("mininterval", PIPED_INTERVAL)
            kwargs["dynamic_ncols"] = False
            kwargs.setdefault("ncols", 100)
        super().__init__(*args, **kwargs)

    # tqdm redraws at once on a new postfix or description; piped, they wait for the next line
    def set_postfix(self, ordered_dict=None, refresh: bool = True, **kwargs: Any) -> None:
        super().set_postfix(ordered_dict, refresh=refresh and not self._piped, **kwargs)

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        super().set_description(desc, refresh=refresh and not self._piped)
