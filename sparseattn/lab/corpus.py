"""The embedded default corpus: English prose from Python's own reference manual.

Source: the ``pydoc_data.topics`` module of the Python standard library (the text that
``help("for")`` shows — sections of the Python Language Reference), licensed under the Python
Software Foundation License. It ships with every CPython, so nothing is downloaded; its exact
text follows the interpreter's version, so the passages (not the rule that makes them) may
differ between Python versions.

Pipeline: per topic, drop indented lines (code, grammar rules, examples), tables and headings,
collapse whitespace, drop paragraphs an earlier topic already had (aggregate topics such as
``compound`` and ``specialnames`` repeat the text of others), cut the remaining words into
passages of ``words_per_passage`` words, and assign each passage to train / validation / test
by a hash of its text (stable under reordering and independent of any random state).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re

__all__ = ["Corpus", "Passage", "clean_topic", "load_corpus", "SPLITS"]

SPLITS = ("train", "validation", "test")
_UNDERLINE = re.compile(r"^[*=\-~^#]+$")


@dataclasses.dataclass(frozen=True)
class Passage:
    """One passage: ``id`` is ``"<topic>/<index>"``; ``text`` is whitespace-collapsed prose."""

    id: str
    topic: str
    text: str

    def halves(self) -> tuple[str, str]:
        """The first and second half of the passage by words (used by the retrieval metric)."""
        words = self.text.split()
        mid = len(words) // 2
        return " ".join(words[:mid]), " ".join(words[mid:])


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Deterministic train / validation / test passages."""

    train: tuple[Passage, ...]
    validation: tuple[Passage, ...]
    test: tuple[Passage, ...]

    def split(self, name: str) -> tuple[Passage, ...]:
        if name not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {name!r}")
        return getattr(self, name)


def clean_topic(text: str) -> list[str]:
    """Prose paragraphs of one topic: indented lines (code blocks, grammar, examples), table
    rows, lines that are less than 60 % letters, and headings (a line followed by an underline
    of ``*``, ``=``, ``-``…) removed; each run of kept lines is one paragraph, whitespace
    collapsed."""
    lines = text.splitlines()
    paragraphs, current = [], []
    for i, line in enumerate(lines):
        drop = (
            not line.strip()
            or line[0].isspace()
            or bool(_UNDERLINE.match(line.strip()))
            or line[0] in "|+"  # a table row
            or not _mostly_letters(line)  # a simple-table rule or a line of symbols
            or (i + 1 < len(lines) and bool(_UNDERLINE.match(lines[i + 1].strip() or " ")))
        )
        if drop:
            if current:
                paragraphs.append(" ".join(" ".join(current).split()))
                current = []
        else:
            current.append(line)
    if current:
        paragraphs.append(" ".join(" ".join(current).split()))
    return paragraphs


def _mostly_letters(line: str) -> bool:
    chars = line.replace(" ", "")
    return sum(c.isalpha() for c in chars) >= 0.6 * len(chars)


def _bucket(text: str) -> float:
    """A number in [0, 1) fixed by the passage text (first 8 bytes of its SHA-256)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2.0**64


def load_corpus(
    words_per_passage: int = 128, fractions: tuple[float, float, float] = (0.7, 0.1, 0.2)
) -> Corpus:
    """Cut the reference-manual prose into passages and split them deterministically.

    Args:
        words_per_passage: words per passage (≈ 1.3–1.5 MiniLM word-piece tokens per word on this
            text); a topic's remainder shorter than half of this is dropped.
        fractions: shares of (train, validation, test), summing to 1.
    Returns:
        A :class:`Corpus`; the same arguments always give the same passages and split.
    """
    from pydoc_data import topics

    if isinstance(words_per_passage, bool) or not isinstance(words_per_passage, int):
        raise TypeError(f"words_per_passage must be an int, got {type(words_per_passage).__name__}")
    if words_per_passage < 8:
        raise ValueError(f"words_per_passage must be >= 8, got {words_per_passage}")
    if len(fractions) != 3 or min(fractions) < 0 or abs(sum(fractions) - 1) > 1e-9:
        raise ValueError(
            f"fractions must be three non-negative shares summing to 1, got {fractions}"
        )
    bounds = (fractions[0], fractions[0] + fractions[1])
    splits: dict[str, list[Passage]] = {name: [] for name in SPLITS}
    seen: set[str] = set()
    for topic in sorted(topics.topics):
        paragraphs = [p for p in clean_topic(topics.topics[topic]) if p not in seen]
        seen.update(paragraphs)
        words = " ".join(paragraphs).split()
        for index, start in enumerate(range(0, len(words), words_per_passage)):
            chunk = words[start : start + words_per_passage]
            if len(chunk) < words_per_passage // 2:
                continue
            text = " ".join(chunk)
            u = _bucket(text)
            name = SPLITS[0] if u < bounds[0] else SPLITS[1] if u < bounds[1] else SPLITS[2]
            splits[name].append(Passage(f"{topic}/{index}", topic, text))
    return Corpus(*(tuple(splits[name]) for name in SPLITS))
