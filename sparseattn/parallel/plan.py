"""The context-parallel plan: for a pattern at global length N sharded over P ranks, which keys
each rank needs from which rank, which rows are merged across ranks, and what that costs.

The sequence is cut into contiguous shards, rank r owning the queries *and* keys
``boundaries[r] … boundaries[r + 1] − 1`` (near-equal parts by default, any N). For rank r:

* its **non-global rows** are computed where they live, on its own keys plus the keys
  ``recv[s]`` received from every other rank s — exactly the keys those rows read outside the
  shard (:func:`.rules.key_intervals`), optionally rounded out to blocks;
* its **global rows** (rows that read all or nearly all keys: Longformer's and BigBird's
  global tokens, STAR's relay, BigBird's first and last block) pull no keys: every rank
  computes them over its own keys and the partial results are merged (log-sum-exp for
  softmax, a threshold τ shared across ranks for α-entmax and sparsemax).

A candidate row (:func:`.rules.global_candidates`) is global when it reads a key outside its
owner's shard; when candidates are more than half of all rows (a dense layout), none is, and
their keys are fetched instead. Nothing here builds the pattern's graph: planning N = 2²⁰ over
64 ranks takes a fraction of a second for the window, global-token, causal and block families.

**Block rounding** (``block > 1``): every interval a rank receives is widened outward to
multiples of ``block`` in global positions, then cut to the sending rank's shard. It trades a
few extra keys for block-aligned runs; the default ``block = 1`` moves exactly the keys needed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from ..validate import check_int, check_positive
from . import intervals as iv
from .rules import global_candidates, key_intervals

__all__ = [
    "Plan",
    "RankPlan",
    "balanced_boundaries",
    "check_boundaries",
    "even_boundaries",
    "plan",
    "work_profile",
]

#: Rows at which :func:`work_profile` reads the pattern's rows (at most n).
PROFILE_SAMPLES = 4096


def even_boundaries(n: int, parts: int) -> tuple[int, ...]:
    """Contiguous near-equal shards of n positions over ``parts`` ranks: the first n mod
    parts shards hold one position more. Returns the parts + 1 boundaries (0 first, n last)."""
    n, parts = check_int("n", n, 0), check_positive("parts", parts)
    sizes = [n // parts + (r < n % parts) for r in range(parts)]
    return tuple(int(x) for x in np.r_[0, np.cumsum(sizes)])


def check_boundaries(boundaries: Sequence[int], n: int | None = None) -> tuple[int, ...]:
    """Validated shard boundaries: ints from 0 up to n, non-decreasing."""
    if isinstance(boundaries, (str, bytes)) or not isinstance(boundaries, Sequence):
        raise TypeError(f"boundaries must be a sequence of ints, got {type(boundaries).__name__}")
    b = tuple(check_int(f"boundaries[{i}]", x, 0) for i, x in enumerate(boundaries))
    if len(b) < 2 or b[0] != 0 or any(y < x for x, y in zip(b[:-1], b[1:], strict=True)):
        raise ValueError(
            f"boundaries must start at 0 and never decrease (P + 1 entries), got {list(b)}"
        )
    if n is not None and b[-1] != n:
        raise ValueError(f"boundaries must end at n={n}, got {list(b)}")
    return b


@dataclasses.dataclass(frozen=True, eq=False)
class RankPlan:
    """One rank's part of a :class:`Plan`; intervals are global positions (:mod:`.intervals`).

    Attributes:
        rank: r; ``start``, ``stop``: its shard [start, stop).
        need: the keys outside the shard that its non-global rows read (exact, unrounded).
        recv: per source rank s, the keys received from s (``need`` on s's shard, rounded
            when the plan's block > 1); empty at s = r.
        send: per destination rank, the keys of this shard it sends there.
        global_rows: the global rows this rank owns (positions).
        local_rows: its non-global rows (intervals).
    """

    rank: int
    start: int
    stop: int
    need: np.ndarray
    recv: tuple[np.ndarray, ...]
    send: tuple[np.ndarray, ...]
    global_rows: np.ndarray
    local_rows: np.ndarray

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def recv_keys(self) -> int:
        return sum(iv.total(x) for x in self.recv)

    @property
    def send_keys(self) -> int:
        return sum(iv.total(x) for x in self.send)

    @property
    def keys(self) -> np.ndarray:
        """Every key this rank holds during the call: its shard and what it receives, in
        ascending global order (the order of the extended key tensor)."""
        return iv.union(iv.span(self.start, self.stop), *self.recv)


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """Who sends which keys to whom, for a pattern at length n over ``len(ranks)`` ranks.

    Attributes:
        n: the global length N; ``boundaries``: the P + 1 shard boundaries;
        block: the rounding of received intervals (1 = exact need);
        global_rows: every global row (sorted positions), merged across ranks;
        ranks: one :class:`RankPlan` per rank.
    """

    n: int
    boundaries: tuple[int, ...]
    block: int
    global_rows: np.ndarray
    ranks: tuple[RankPlan, ...]

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def owner(self, positions: np.ndarray) -> np.ndarray:
        """The rank owning each position."""
        return np.searchsorted(np.asarray(self.boundaries[1:]), positions, side="right")

    def traffic(
        self,
        rank: int,
        *,
        batch: int,
        heads: int,
        d: int,
        kv_heads: int | None = None,
        d_v: int | None = None,
        dtype: torch.dtype = torch.float32,
        key_padding: bool = False,
        prob_map: str = "softmax",
    ) -> dict[str, int]:
        """Bytes rank ``rank`` moves per call, for q (batch, heads, n, d) and k, v (batch,
        kv_heads, n, d / d_v) of ``dtype``.

        Keys: ``halo_send`` / ``halo_recv`` — keys and values (and, with ``key_padding``, the
        mask, one value per batch item) sent to / received from the other ranks in forward;
        ``halo_grad_send`` / ``halo_grad_recv`` — their gradients going back in backward;
        ``global_forward`` / ``global_backward`` — the payload of the all-reduces that merge
        the global rows (float64; for sparse maps without the threshold steps), and
        ``global_step`` — the payload of one threshold step (0 for softmax and hardmax);
        ``kv`` — the peak key/value memory: this rank's keys and the received ones.
        Collectives count their input payload once per rank (not the algorithm's hops).
        """
        rp = self.ranks[rank]
        kv_heads = heads if kv_heads is None else kv_heads
        d_v = d if d_v is None else d_v
        item = torch.empty((), dtype=dtype).element_size()
        per_key = batch * kv_heads * (d + d_v) * item
        mask = batch * item if key_padding else 0
        out = {
            "halo_send": rp.send_keys * (per_key + mask),
            "halo_recv": rp.recv_keys * (per_key + mask),
            "halo_grad_send": rp.recv_keys * per_key,
            "halo_grad_recv": rp.send_keys * per_key,
            "kv": (rp.size + rp.recv_keys) * per_key,
        }
        rows = batch * heads * len(self.global_rows) if self.world_size > 1 else 0
        fwd, step, bwd = _global_payload(prob_map, d, d_v)
        out["global_forward"] = rows * fwd * 8
        out["global_step"] = rows * step * 8
        out["global_backward"] = rows * bwd * 8
        return out

    def table(self, **shape) -> list[dict[str, int]]:
        """:meth:`traffic` of every rank, with its rank, shard size and key counts."""
        rows = []
        for rp in self.ranks:
            row = {"rank": rp.rank, "rows": rp.size, "recv_keys": rp.recv_keys}
            row["global_rows"] = len(rp.global_rows)
            rows.append(row | self.traffic(rp.rank, **shape))
        return rows


def _global_payload(prob_map: str, d: int, d_v: int) -> tuple[int, int, int]:
    """Values per global row and head moved by the merge: forward (fixed), one threshold step,
    backward. Forward: the queries (d), the row max (1), the weighted values at the end (d_v)
    and between them: softmax the denominator Σe^(z−m) (1), hardmax the count of maxima (1),
    sparsemax / sparselin Σd and |S| per Michelot step (2), 1.5-entmax Σd, Σd², |S| and the
    support check per step (4), other α the key count (1), Σd^r and Σd^(r−1) per step (2)
    and Σp (1).
    Backward: dO (d_v), Σ s·g and Σ s for the sparse maps (2), dq (d)."""
    if prob_map in ("softmax", "hardmax"):
        return d + 1 + 1 + d_v, 0, d_v + d
    if prob_map in ("sparsemax", "sparselin_gen"):
        return d + 1 + d_v, 2, d_v + 2 + d
    if prob_map == "entmax15":
        return d + 1 + d_v, 4, d_v + 2 + d
    return d + 1 + 1 + 1 + d_v, 2, d_v + 2 + d  # any other α


def plan(
    pattern: object,
    n: int,
    world_size: int | None = None,
    boundaries: Sequence[int] | None = None,
    *,
    block: int = 1,
) -> Plan:
    """The context-parallel plan of ``pattern`` at length n (see the module docstring).

    Args:
        pattern: a static Pattern or an AttentionGraph of n × n.
        n: the global length N.
        world_size: P, for near-equal contiguous shards (:func:`even_boundaries`).
        boundaries: the P + 1 shard boundaries instead (0 … n, non-decreasing).
        block: round received intervals out to multiples of ``block`` (1: exact).
    Returns:
        a :class:`Plan`.
    Raises:
        ValueError: a data-dependent pattern, a pattern without a rule beyond
            ``rules.FALLBACK_MAX_N``, boundaries that do not fit n.
    """
    n = check_positive("n", n)
    block = check_positive("block", block)
    if boundaries is None:
        if world_size is None:
            raise ValueError("give world_size or boundaries")
        bounds = even_boundaries(n, world_size)
    else:
        bounds = check_boundaries(boundaries, n)
        if world_size is not None and len(bounds) != world_size + 1:
            raise ValueError(f"boundaries has {len(bounds) - 1} shards but world_size={world_size}")
    parts = len(bounds) - 1
    glob = _global_rows(pattern, n, bounds) if parts > 1 else np.zeros(0, dtype=np.int64)
    needs, locals_ = [], []
    for r in range(parts):
        lo, hi = bounds[r], bounds[r + 1]
        mine = glob[(glob >= lo) & (glob < hi)]
        runs = iv.subtract_points(iv.span(lo, hi), mine)
        keys = iv.union(*(key_intervals(pattern, n, int(a), int(b)) for a, b in runs))
        needs.append(iv.subtract(keys, lo, hi))
        locals_.append(runs)
    recv = [
        tuple(
            iv.EMPTY
            if s == r
            else iv.round_out(
                iv.clip(needs[r], *bounds[s : s + 2]), block, *bounds[s : s + 2]
            )  # fmt: skip
            for s in range(parts)
        )
        for r in range(parts)
    ]
    ranks = tuple(
        RankPlan(
            r,
            bounds[r],
            bounds[r + 1],
            needs[r],
            recv[r],
            tuple(recv[t][r] for t in range(parts)),
            glob[(glob >= bounds[r]) & (glob < bounds[r + 1])],
            locals_[r],
        )  # fmt: skip
        for r in range(parts)
    )
    return Plan(n, bounds, block, glob, ranks)


def _global_rows(pattern: object, n: int, bounds: tuple[int, ...]) -> np.ndarray:
    """The candidates that read a key outside their owner's shard; none when the candidates
    are more than half of all rows (a dense-like layout: fetching is the plan then)."""
    cand = global_candidates(pattern, n)
    if not len(cand) or len(cand) > n // 2:
        return np.zeros(0, dtype=np.int64)
    owner = np.searchsorted(np.asarray(bounds[1:]), cand, side="right")
    keep = [
        iv.total(iv.subtract(key_intervals(pattern, n, int(i), int(i) + 1), *bounds[o : o + 2])) > 0
        for i, o in zip(cand.tolist(), owner.tolist(), strict=True)
    ]
    return cand[np.asarray(keep, dtype=bool)]


def work_profile(
    pattern: object, n: int, samples: int = PROFILE_SAMPLES
) -> tuple[np.ndarray, np.ndarray]:
    """Where the work of attention lies along the sequence: positions x (sorted, 0 and n − 1
    included) and w(x), the score entries that position x costs its owner — the keys row x
    reads (0 for a global-row candidate) plus the global rows that read key x (their partial
    results are computed where the keys live). Exact at the ``samples`` positions (rows read
    by :func:`.rules.key_intervals`); between them the profile is taken as linear."""
    n = check_positive("n", n)
    xs = np.unique(np.linspace(0, n - 1, min(n, samples)).round().astype(np.int64))
    cand = global_candidates(pattern, n)
    if len(cand) > n // 2:  # a dense-like layout: no row is merged (see plan())
        cand = cand[:0]
    degree = np.array(
        [0 if x in cand else iv.total(key_intervals(pattern, n, x, x + 1)) for x in xs.tolist()]
    )
    cover = np.zeros(len(xs), dtype=np.int64)
    for j in cand.tolist():
        keys = key_intervals(pattern, n, j, j + 1)
        k = np.searchsorted(keys[:, 0], xs, side="right") - 1
        cover += (k >= 0) & (xs < keys[np.maximum(k, 0), 1]) if len(keys) else 0
    return xs, (degree + cover).astype(np.float64)


def _cumulative(xs: np.ndarray, w: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Σ_{i < at} w(i) for the piecewise-linear profile through (xs, w)."""
    grid = np.arange(int(xs[-1]) + 2) if xs[-1] < 1 << 22 else None
    if grid is not None:  # exact sums of the interpolated profile
        dense = np.interp(grid[:-1], xs, w)
        cum = np.r_[0.0, np.cumsum(dense)]
        return cum[np.clip(at, 0, len(cum) - 1)]
    steps = np.r_[0.0, np.cumsum((w[1:] + w[:-1]) / 2 * np.diff(xs))]  # trapezoids
    return np.interp(at, xs, steps)


def balanced_boundaries(
    pattern: object, n: int, parts: int, samples: int = PROFILE_SAMPLES
) -> tuple[int, ...]:
    """Contiguous shards of equal work instead of equal length (issue 42 item 3): the cuts
    where the cumulative :func:`work_profile` crosses r/P of the total. Shards stay
    contiguous, so a window's halo stays a halo; dense causal attention gets cuts near
    n·√(r/P) (the late rows read more keys). Returns P + 1 boundaries for :func:`plan`,
    :func:`~sparseattn.parallel.shard` and :func:`~sparseattn.parallel.sparse_attention`."""
    n, parts = check_positive("n", n), check_positive("parts", parts)
    xs, w = work_profile(pattern, n, samples)
    grid = np.arange(n + 1)
    cum = _cumulative(xs, w, grid)
    targets = cum[-1] * np.arange(parts + 1) / parts
    cuts = np.searchsorted(cum, targets, side="left")
    # the nearer of the two positions around each target
    cuts = cuts.clip(0, n)
    below = (cuts - 1).clip(0, n)
    nearer = np.abs(cum[below] - targets) < np.abs(cum[cuts] - targets)
    cuts = np.where(nearer, below, cuts)
    cuts[0], cuts[-1] = 0, n
    return tuple(int(c) for c in np.maximum.accumulate(cuts))
