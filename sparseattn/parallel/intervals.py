"""Sets of key positions as sorted, disjoint half-open intervals (the planner's currency).

An interval set is an int64 numpy array of shape (m, 2): rows ``[start, stop)`` sorted by
``start``, non-empty, neither overlapping nor touching (touching intervals are merged). Every
operation returns a set in that normal form, in O(m log m) at most; nothing here is O(n) in
the sequence length unless the set itself has O(n) intervals.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "EMPTY",
    "as_index",
    "blocks",
    "clip",
    "difference",
    "from_points",
    "intersect",
    "intersect_sets",
    "locate",
    "merge",
    "round_out",
    "span",
    "subtract",
    "subtract_points",
    "total",
    "union",
]

#: The empty set.
EMPTY = np.zeros((0, 2), dtype=np.int64)


def merge(iv: np.ndarray | list) -> np.ndarray:
    """The normal form of any collection of [start, stop) pairs (empty ones dropped)."""
    iv = np.asarray(iv, dtype=np.int64).reshape(-1, 2)
    iv = iv[iv[:, 1] > iv[:, 0]]
    if len(iv) <= 1:
        return iv.copy()
    iv = iv[np.argsort(iv[:, 0], kind="stable")]
    # a new run starts where the start lies past every earlier stop
    reach = np.maximum.accumulate(iv[:, 1])
    new = np.ones(len(iv), dtype=bool)
    new[1:] = iv[1:, 0] > reach[:-1]
    first = np.flatnonzero(new)
    last = np.r_[first[1:], len(iv)] - 1
    return np.stack([iv[first, 0], reach[last]], 1)


def span(start: int, stop: int) -> np.ndarray:
    """The single interval [start, stop) (empty when stop <= start)."""
    return merge([[start, stop]])


def union(*sets: np.ndarray) -> np.ndarray:
    """The union of interval sets."""
    return merge(np.concatenate([EMPTY, *sets]))


def clip(iv: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """The set ∩ [lo, hi)."""
    out = np.stack([np.maximum(iv[:, 0], lo), np.minimum(iv[:, 1], hi)], 1)
    return out[out[:, 1] > out[:, 0]]


intersect = clip


def subtract(iv: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """The set minus [lo, hi)."""
    return union(clip(iv, np.iinfo(np.int64).min, lo), clip(iv, hi, np.iinfo(np.int64).max))


def intersect_sets(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a ∩ b for two sets in normal form: a sweep over their endpoints, O(m log m)."""
    if not len(a) or not len(b):
        return EMPTY.copy()
    pts = np.concatenate([a[:, 0], a[:, 1], b[:, 0], b[:, 1]])
    step = np.repeat(np.array([1, -1, 1, -1]), [len(a), len(a), len(b), len(b)])
    order = np.argsort(pts, kind="stable")
    pts, depth = pts[order], np.cumsum(step[order])
    both = np.flatnonzero(depth[:-1] == 2)  # between event i and i + 1 both sets cover
    return merge(np.stack([pts[both], pts[both + 1]], 1))


def difference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a minus b for two sets in normal form."""
    if not len(a) or not len(b):
        return a.copy()
    lo, hi = a[0, 0], a[-1, 1]
    gaps = np.stack([np.r_[lo, b[:, 1]], np.r_[b[:, 0], hi]], 1)
    gaps = np.stack([np.maximum(gaps[:, 0], lo), np.minimum(gaps[:, 1], hi)], 1)
    return intersect_sets(a, merge(gaps))


def subtract_points(iv: np.ndarray, points: np.ndarray) -> np.ndarray:
    """The set minus the given positions."""
    return difference(iv, from_points(points))


def total(iv: np.ndarray) -> int:
    """The number of positions in the set."""
    return int((iv[:, 1] - iv[:, 0]).sum())


def from_points(points: np.ndarray) -> np.ndarray:
    """The set of the given integer positions (any order, repeats allowed)."""
    p = np.unique(np.asarray(points, dtype=np.int64).reshape(-1))
    if not len(p):
        return EMPTY.copy()
    cut = np.flatnonzero(np.diff(p) != 1) + 1
    starts = p[np.r_[0, cut]]
    stops = p[np.r_[cut - 1, len(p) - 1]] + 1
    return np.stack([starts, stops], 1)


def blocks(block_ids: np.ndarray, block: int, n: int) -> np.ndarray:
    """The positions of the given blocks of ``block`` positions, cut at n."""
    runs = from_points(block_ids)
    return clip(runs * block, 0, n)


def round_out(iv: np.ndarray, block: int, lo: int, hi: int) -> np.ndarray:
    """Each interval widened to multiples of ``block`` (global positions), then cut to
    [lo, hi): the block rounding of a plan."""
    if block == 1:
        return clip(iv, lo, hi)
    wide = np.stack([iv[:, 0] // block * block, -(-iv[:, 1] // block) * block], 1)
    return clip(merge(wide), lo, hi)


def as_index(iv: np.ndarray) -> np.ndarray:
    """The positions of the set in ascending order (an int64 array of ``total(iv)``)."""
    lengths = iv[:, 1] - iv[:, 0]
    if not len(iv):
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(iv[:, 0] - np.r_[0, np.cumsum(lengths)[:-1]], lengths)
    return np.arange(int(lengths.sum()), dtype=np.int64) + offsets


def locate(iv: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """For positions inside the set: their rank in it (the index into ``as_index(iv)``).

    Raises:
        ValueError: when a position lies outside the set.
    """
    positions = np.asarray(positions, dtype=np.int64)
    k = np.searchsorted(iv[:, 0], positions, side="right") - 1
    inside = (k >= 0) & (positions < iv[np.maximum(k, 0), 1]) if len(iv) else k >= 0
    if not np.all(inside):
        raise ValueError(f"positions {positions[~inside][:8].tolist()} lie outside the key set")
    offsets = np.r_[0, np.cumsum(iv[:, 1] - iv[:, 0])[:-1]]
    return offsets[k] + positions - iv[k, 0]
