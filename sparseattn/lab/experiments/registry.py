"""The experiments, registered once: what ``sparseattn <command>`` and the tour loop over.

Each experiment module ends with one :class:`Experiment`, ``EXPERIMENT``: its config class, its
quick config, its ``run``, its summary tables (what the command prints and the tour shows) and
its figures. :data:`EXPERIMENTS` names the module of each, by command; :func:`experiment`
imports it on first use (the Sparsefinder experiments import transformers, seconds that
``sparseattn --help`` should not pay). The command line keeps what is its own (options, their
parsing, the notes after a ``--quick`` run), the tour what is its own (its sizes, its words,
the HTML); the path config → run → summary is written here once.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["EXPERIMENTS", "Experiment", "SummaryTable", "experiment", "figures_in", "markdown"]

#: The experiments by command name (``sparseattn <name>``; ``dmin`` is ``sparseattn
#: expressivity dmin``): the module under :mod:`sparseattn.lab.experiments` whose ``EXPERIMENT``
#: describes it.
EXPERIMENTS: dict[str, str] = {
    "copying": "copying",
    "lm": "lm",
    "dam": "dam",
    "mca": "mca",
    "dmin": "dmin",
    "sparsefinder": "sparsefinder",
    "sparsefinder-decoder": "sparsefinder_lm",
}


@dataclass(frozen=True)
class SummaryTable:
    """One table of an experiment's summary: a title, the column names, the rows as text (each
    cell formatted by the experiment) and the notes that follow it (sentences about it)."""

    title: str
    header: Sequence[str]
    rows: Sequence[Sequence[str]]
    notes: Sequence[str] = ()

    def markdown(self) -> str:
        """The table in markdown (first column left-aligned, the others right-aligned): the
        title and each note as a paragraph of its own; an empty cell is written ``| |``."""
        lines = [
            "| " + " | ".join(self.header) + " |",
            "|---|" + "---:|" * (len(self.header) - 1),
        ]
        lines += ["|" + "".join(f" {c} |" if c else " |" for c in row) for row in self.rows]
        return "\n\n".join([*([self.title] if self.title else []), "\n".join(lines), *self.notes])


def markdown(summary: Sequence[SummaryTable | str]) -> str:
    """A summary as the text a run writes to ``table.md`` (ends with a newline)."""
    parts = (s.rstrip("\n") if isinstance(s, str) else s.markdown() for s in summary)
    return "\n\n".join(parts) + "\n"


def figures_in(folder: str | Path, *names: str) -> list[Path]:
    """The figures among ``names`` that a run wrote into ``folder``, in that order."""
    return [Path(folder) / name for name in names if (Path(folder) / name).exists()]


@dataclass(frozen=True)
class Experiment:
    """One experiment, as the command line and the tour run it.

    - ``config``: the config class, ``config(**fields)``; ``quick(**fields)`` the smoke-run
      config (``None``: the command has no ``--quick``). :meth:`configure` picks one and
      validates it.
    - ``run(config)`` runs (or resumes) the experiment and returns its result dict.
    - ``summary(config, result)``: what the command prints and the tour shows, a list of
      :class:`SummaryTable` (notes included) and of ready text (a markdown table the run
      wrote, printed as it is).
    - ``figures(config, result)``: the PNGs the run wrote, the main one first.
    - ``wrote``: the line the command prints after the summary, formatted with ``folder`` (the
      run folder) and ``run`` (its name); empty: none.
    - ``markdown``: the command prints the summary as the markdown the run writes to
      ``table.md`` (:func:`markdown`) rather than as terminal tables.
    - ``distributed``: the experiment runs under ``torchrun``; only rank 0 prints.
    """

    name: str
    config: Callable[..., Any]
    run: Callable[[Any], dict[str, Any]]
    summary: Callable[[Any, dict[str, Any]], list[SummaryTable | str]]
    figures: Callable[[Any, dict[str, Any]], list[Path]]
    quick: Callable[..., Any] | None = None
    wrote: str = ""
    markdown: bool = False
    distributed: bool = False

    def configure(self, quick: bool = False, **fields: Any) -> Any:
        """The quick config (``quick``) or the config, with ``fields`` set, validated."""
        if quick and self.quick is None:
            raise ValueError(f"{self.name} has no quick configuration")
        config = (self.quick if quick else self.config)(**fields)
        return config.validate()

    def written(self, config: Any, result: dict[str, Any]) -> str:
        """The :attr:`wrote` line for this run (empty when there is none)."""
        return self.wrote.format(folder=result.get("folder"), run=config.run_name())


def experiment(name: str) -> Experiment:
    """The registered experiment ``name`` (a key of :data:`EXPERIMENTS`), its module imported."""
    if name not in EXPERIMENTS:
        raise ValueError(f"experiment must be one of {sorted(EXPERIMENTS)}, got {name!r}")
    module = importlib.import_module(f"{__package__}.{EXPERIMENTS[name]}")
    return module.EXPERIMENT
