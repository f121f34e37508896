"""Theorem 1, step 3 of Yun et al. (2020), executed: the contextual mapping with ρ[t·] for σ_H.

Lemma 7's network g_c (:func:`~sparseattn.methods.yun.yun_contextual_mapping`) uses hardmax
heads ψ^l(Z; b_Q)_k = u^T Z_{A_k^l} σ_H[(u^T Z_{A_k^l})^T (u^T Z_k − b_Q)]. Appendix F.2 (the
proof of Lemma 4) replaces σ_H by a map ρ that satisfies Assumption 2 at a temperature t,

    ψ̃^l(Z; b_Q)_k = u^T Z_{A_k^l} ρ[t (u^T Z_{A_k^l})^T (u^T Z_k − b_Q)],

and shows that the first row of g̃_c(H) stays within δ̃/4 of g_c(H) for every H ∈ H_δ once t is
large enough (η chosen as in F.2, ζ the score margin). Here every Ψ̃ and Ω̃ layer is one call of
:func:`sparseattn.sparse_attention` with the layer's pattern, the map and ``scale = t`` (head
size 1: query u^T Z_k − b_Q, key = value = u^T Z_j), batched over grid inputs, in float64. The
ids of the exact hardmax interpreter (``fractions.Fraction``) are the reference.

Float64 holds the construction only while every id is a multiple of δ below 2^53 δ
(δ = 1/2 or 1/4; :func:`check_float64_ids` refuses larger cases).

One piece: the relaxed layers, step 3's constants (η, t, the margins) and the error table that
uses them are one proof step executed; apart, the table would lose its definitions.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from fractions import Fraction

import torch
from torch import Tensor

from ...attention import sparse_attention
from ...graph import AttentionGraph
from ...maps import ProbabilityMap, resolve_prob_map
from ...patterns import Pattern, PatternCycle
from ...validate import check_finite_float, check_positive
from .connectivity import PatternLike, cycle_graphs
from .construction import (
    ContextualMapping,
    IdentityLayer,
    Matrix,
    SelectiveShift,
    _cell_to_column,
    _grids,
    yun_contextual_mapping,
)
from .maps import closed_form_t

__all__ = [
    "RelaxedRow",
    "RelaxedTable",
    "ValueMapping",
    "check_float64_ids",
    "cycle_patterns",
    "exact_threshold",
    "format_relaxed_summary",
    "format_relaxed_table",
    "grid_inputs",
    "hardmax_margin",
    "prefix_max",
    "relaxed_attention",
    "relaxed_context_ids",
    "relaxed_error_table",
    "step3_eta",
    "step3_temperature",
    "value_mapping",
]


# --------------------------------------------------------------------------- inputs
def cycle_patterns(patterns: PatternLike) -> tuple[Pattern | AttentionGraph, ...]:
    """The per-layer patterns (A^1, …, A^p) of a cycle, as objects sparse_attention takes."""
    if isinstance(patterns, PatternCycle):
        return tuple(patterns.patterns)
    if isinstance(patterns, Pattern | AttentionGraph):
        return (patterns,)
    if isinstance(patterns, Sequence) and not isinstance(patterns, str):
        return tuple(patterns)
    raise TypeError(
        f"patterns must be a Pattern, PatternCycle or sequence of them, got {type(patterns)}"
    )


def grid_inputs(cm: ContextualMapping, max_inputs: int = 4096, seed: int = 0) -> list[Matrix]:
    """H = G + E for every G ∈ G_δ (or a seeded sample of ``max_inputs``), as Fraction columns.

    Returns a list of B matrices; H[k][r] = H_{r,k} (n columns of d entries).
    """
    max_inputs = check_positive("max_inputs", max_inputs)
    m = cm.delta.denominator
    grids, _ = _grids(cm, max_inputs, seed)
    return [
        [
            [value + cm.embedding[k] for value in _cell_to_column(cell, cm.d, m, cm.delta)]
            for k, cell in enumerate(cells)
        ]
        for cells in grids
    ]


def _as_tensor(h: Sequence[Matrix]) -> Tensor:
    """Fraction matrices → float64 (B, n, d), refusing any entry float64 cannot hold."""
    out = torch.tensor([[[float(x) for x in col] for col in m] for m in h], dtype=torch.float64)
    exact = all(Fraction(float(x)) == x for m in h for col in m for x in col)
    if not exact:
        raise ValueError("the inputs are not exactly representable in float64 (δ = 1/2^k?)")
    return out


def check_float64_ids(cm: ContextualMapping) -> int:
    """The bits the ids need at resolution δ; ValueError where float64 (53 bits) cannot hold them.

    Bound: u^T g_c(H)_k < (2snδ^{−nd−1})^s (z̃_{γ(n)} + δ) ≤ (2snδ^{−nd−1})^s n δ^{−nd}
    (Yun E.2.4–E.2.5 with eq. 11 at i = n; eq. 10's last step, z̃_{γ(n)} ≤ δ^{−nd} − δ, drops
    the factor n − 1 + δ — STAR w=1 at n = 8, d = 1, δ = 1/2 reaches 2.26e11 > δ^{−nd} c^s =
    6.9e10). Every id is a multiple of δ, exact in binary for δ = 2^{−k}.
    """
    m = cm.delta.denominator
    if m & (m - 1):
        raise ValueError(f"delta must be 1/2^k for exact float64 ids, got {cm.delta}")
    c = 2 * cm.hops * cm.n * Fraction(m) ** (cm.n * cm.d + 1)
    bound = c**cm.hops * cm.n * Fraction(m) ** (cm.n * cm.d)
    bits = math.ceil(math.log2(bound * m))
    if bits > 53:
        raise ValueError(
            f"the ids reach {float(bound):.3g} at resolution δ = {cm.delta}: {bits} bits, "
            "more than float64's 53; use a smaller n, d or 1/δ"
        )
    return bits


# --------------------------------------------------------------------------- the network g̃_c
def _check_patterns_match(cm: ContextualMapping, items: tuple) -> None:
    graphs = cycle_graphs(items, cm.n)
    attend = tuple(
        tuple(tuple(g.col[g.crow[k] : g.crow[k + 1]].tolist()) for k in range(cm.n)) for g in graphs
    )
    if attend != cm.attend:
        raise ValueError("patterns do not give the graphs cm was built with")


def _heads(z: Tensor, biases: Tensor, pattern, rho: ProbabilityMap, t: float, engine: str):
    """ψ̃(Z; b_Q) for each b_Q in ``biases``: z (B, n) → (B, len(biases), n) (Yun F.2).

    One sparse_attention call with head size 1: q = u^T Z_k − b_Q, k = v = u^T Z_j, scale t.
    """
    b, n = z.shape
    heads = len(biases)
    q = (z[:, None, :] - biases[None, :, None])[..., None]
    kv = z[:, None, :, None].expand(b, heads, n, 1)
    return sparse_attention(q, kv, kv, pattern, prob_map=rho, engine=engine, scale=t)[..., 0]


def relaxed_attention(
    cm: ContextualMapping,
    patterns: PatternLike,
    h: Sequence[Matrix] | Tensor,
    prob_map: str | ProbabilityMap,
    t: float,
    *,
    engine: str = "auto",
) -> Tensor:
    """g̃_c(H): Lemma 7's attention layers with σ_H → ρ[t·] (Yun appendix F.2), in float64.

    Ψ̃^l(Z; c, b, b')= Z + c e^{(1)} (ψ̃^l(Z; b) − ψ̃^l(Z; b')) (two heads, one call) and
    Ω̃^l(Z; c) = Z + c e^{(1)} ψ̃^l(Z; 0) (one head); identity layers add nothing.

    Args:
        cm: a Lemma-7 construction (:func:`yun_contextual_mapping`).
        patterns: the pattern cycle ``cm`` was built from (layer m uses entry m mod p).
        h: B inputs H ∈ H_δ — Fraction matrices (:func:`grid_inputs`) or float64 (B, n, d).
        prob_map: ρ, e.g. "softmax", "sparsemax", "entmax15" (or "hardmax": g_c in float64).
        t: the temperature t > 0 of Assumption 2 (the score scale).
        engine: the sparse_attention engine.
    Returns:
        float64 (B, n, d): g̃_c(H), column k is g̃_c(H)_k (only row 1 differs from H).
    """
    if not isinstance(cm, ContextualMapping) or cm.gamma is None:
        raise TypeError("cm must be a ContextualMapping of yun_contextual_mapping")
    rho = resolve_prob_map(prob_map)
    t = check_finite_float("t", t, 0.0, low_open=True)
    items = cycle_patterns(patterns)
    _check_patterns_match(cm, items)
    z_mat = h if isinstance(h, Tensor) else _as_tensor(h)
    if z_mat.dtype != torch.float64 or z_mat.shape[1:] != (cm.n, cm.d):
        raise ValueError(f"h must be float64 (B, {cm.n}, {cm.d}), got {tuple(z_mat.shape)}")
    z_mat = z_mat.clone()
    u = _u(cm)
    for layer in cm.layers:
        if isinstance(layer, IdentityLayer):
            continue
        z = z_mat @ u
        pattern = items[layer.layer]
        if isinstance(layer, SelectiveShift):
            biases = torch.tensor([float(layer.b_lo), float(layer.b_hi)], dtype=torch.float64)
            out = _heads(z, biases, pattern, rho, t, engine)
            shift = float(layer.c) * (out[:, 0] - out[:, 1])
        else:
            out = _heads(z, torch.zeros(1, dtype=torch.float64), pattern, rho, t, engine)
            shift = float(layer.c) * out[:, 0]
        z_mat[:, :, 0] += shift
    return z_mat


def _u(cm: ContextualMapping) -> Tensor:
    return torch.tensor([float(x) for x in cm.u], dtype=torch.float64)


def relaxed_context_ids(
    cm: ContextualMapping,
    patterns: PatternLike,
    h: Sequence[Matrix] | Tensor,
    prob_map: str | ProbabilityMap,
    t: float,
    *,
    engine: str = "auto",
) -> Tensor:
    """u^T g̃_c(H) as float64 (B, n): the context ids of :func:`relaxed_attention`."""
    return relaxed_attention(cm, patterns, h, prob_map, t, engine=engine) @ _u(cm)


# --------------------------------------------------------------------------- Lemma 8 / F.3
def _phi_exact(x: Tensor, delta: float) -> Tensor:
    """φ'(x) = 1 on [−δ/2, δ/2), else 0 (Yun E.3)."""
    return ((x >= -delta / 2) & (x < delta / 2)).to(x.dtype)


def _phi_relu(x: Tensor, delta: float) -> Tensor:
    """φ̃'(x) of Yun F.3 from four ReLUs: 1 on [−δ/4, δ/4], linear to 0 at ±δ/2, 0 outside."""
    y = 4 * x / delta
    relu = torch.relu
    return relu(y + 2) - relu(y + 1) - relu(y - 1) + relu(y - 2)


@dataclasses.dataclass(frozen=True)
class ValueMapping:
    """Lemma 8's token-wise feed-forward layers, one per (H, k): Z ↦ Z + w φ'(u^T Z − a).

    Attributes:
        delta: δ; u: float64 (d,), u = (1, δ^{−1}, …).
        ids: float64 (L,), the window centres a = u^T g_c(H)_k, L = B·n layers.
        shifts: float64 (L, d), w = f̄(H − E)_k − g_c(H)_k.
    """

    delta: float
    u: Tensor
    ids: Tensor
    shifts: Tensor

    def __call__(self, z: Tensor, *, relu: bool = True) -> Tensor:
        """g_v (``relu=False``: φ', E.3) or g̃_v (φ̃', F.3) on float64 (B, n, d), layer by layer."""
        phi = _phi_relu if relu else _phi_exact
        out = z.clone()
        for a, w in zip(self.ids.tolist(), self.shifts, strict=True):
            out += phi(out @ self.u - a, self.delta)[..., None] * w
        return out


def value_mapping(cm: ContextualMapping, h: Sequence[Matrix], targets: Tensor) -> ValueMapping:
    """Lemma 8 (Yun E.3) for the inputs ``h``: send u^T g_c(H)_k to ``targets[b, k]`` = f̄(G)_k.

    Args:
        cm: the Lemma-7 construction; its exact g_c(H) (Fractions) gives the windows.
        h: B inputs H ∈ H_δ (:func:`grid_inputs`).
        targets: float64 (B, n, d), the values f̄(H − E) (e.g. :func:`prefix_max`).
    """
    if targets.dtype != torch.float64 or targets.shape != (len(h), cm.n, cm.d):
        raise ValueError(f"targets must be float64 ({len(h)}, {cm.n}, {cm.d})")
    g = [cm.attention(x) for x in h]
    ids = _as_tensor([[[v] for v in cm.column_ids(m)] for m in g]).reshape(-1)
    shifts = targets - _as_tensor(g)
    return ValueMapping(float(cm.delta), _u(cm), ids, shifts.reshape(-1, cm.d))


def prefix_max(g: Tensor) -> Tensor:
    """f̄(G)_k = max_{j ≤ k} G_j entrywise: (B, n, d) → (B, n, d), a target that needs context."""
    return g.cummax(dim=1).values


# --------------------------------------------------------------------------- t of Assumption 2
def hardmax_margin(cm: ContextualMapping, h: Sequence[Matrix]) -> Fraction:
    """ζ_H: the least gap between the top and second score of any head row of g_c on ``h``.

    Scores v_j = u^T Z_j (u^T Z_k − b_Q), j ∈ A_k^l, over every Ψ/Ω layer of the exact hardmax
    run (rows with one key have no gap). This is the margin ζ that Assumption 2 sees; F.2 takes
    ζ = δ/2, but a selective shift meets |u^T Z_k − b_Q| = δ/2 and key gaps of δ, so ζ_H can be
    as small as δ²/2.
    """
    best: Fraction | None = None
    for x in h:
        z = [list(column) for column in x]
        for layer in cm.layers:
            if isinstance(layer, IdentityLayer):
                continue
            ids = cm.column_ids(z)
            biases = (layer.b_lo, layer.b_hi) if isinstance(layer, SelectiveShift) else (0,)
            for k, keys in enumerate(cm.attend[layer.layer]):
                if len(keys) < 2:
                    continue
                for b in biases:
                    top, second = sorted(ids[j] * (ids[k] - b) for j in keys)[-1:-3:-1]
                    gap = top - second
                    best = gap if best is None or gap < best else best
            z = dataclasses.replace(cm, layers=(layer,)).attention(z)
    if best is None:
        raise ValueError("no head row has two keys")
    return best


def step3_eta(cm: ContextualMapping, delta_tilde: Fraction | None = None) -> float:
    """The least η of Yun appendix F.2 (δ̃ = δ by default, the resolution the ids need).

    min{ δ/2; ½ δ^{2d} ln(1 + δ^{(j+1)d} δ̃ / (8n²)) for j = 1..n−1 (selective shifts);
    δ^{nd}/(sn) ln(1 + δ^{s(nd+1)+nd} δ̃ / (2^{s+3} s^s n^{s+1})) (all-max-shifts) }.
    """
    delta = float(cm.delta)
    dt = delta if delta_tilde is None else float(delta_tilde)
    n, d, s = cm.n, cm.d, cm.hops
    etas = [delta / 2]
    etas += [
        0.5 * delta ** (2 * d) * math.log1p(delta ** ((j + 1) * d) * dt / (8 * n * n))
        for j in range(1, n)
    ]
    etas.append(
        delta ** (n * d)
        / (s * n)
        * math.log1p(delta ** (s * (n * d + 1) + n * d) * dt / (2 ** (s + 3) * s**s * n ** (s + 1)))
    )
    return min(etas)


def step3_temperature(
    cm: ContextualMapping, prob_map: str | ProbabilityMap, zeta: float
) -> tuple[float, str]:
    """t of Assumption 2 (appendix B, :func:`closed_form_t`) at margin ζ and F.2's least η.

    The row length given to the softmax bound is the largest |A_k^l| of the cycle.
    """
    keys = max(len(row) for pattern in cm.attend for row in pattern)
    found = closed_form_t(prob_map, zeta, step3_eta(cm), keys)
    if found is None:
        raise ValueError(f"no closed-form t of appendix B for {prob_map!r}")
    return found


def exact_threshold(prob_map: str | ProbabilityMap, zeta_h: Fraction) -> float | None:
    """The t from which ρ[t·] is exactly one-hot on every head row of g_c: 1/((α − 1)ζ_H).

    α-entmax (α > 1) is one-hot on a column iff (α − 1)·t·(v_(1) − v_(2)) ≥ 1 (B.3's argument
    and its converse); sparsemax is α = 2. By induction over the layers, g̃_c = g_c exactly
    from this t on (in exact arithmetic). None for softmax, which is never one-hot.
    """
    rho = resolve_prob_map(prob_map)
    alpha = 2.0 if rho.name == "sparsemax" else rho.params.get("alpha")
    if rho.name not in ("sparsemax", "entmax") or alpha is None or alpha <= 1:
        return None
    return 1 / ((alpha - 1) * float(zeta_h))


# --------------------------------------------------------------------------- the table
@dataclasses.dataclass(frozen=True)
class RelaxedRow:
    """One run of g̃_c at one (ρ, t) on every input of a :class:`RelaxedTable`.

    Attributes:
        prob_map, t: the map and its temperature; ``label`` names a special t ("" on the grid).
        max_error: max over inputs and columns of |u^T g̃_c(H)_k − u^T g_c(H)_k| (float64).
        within_bound: max_error ≤ δ/4, F.2's bound δ̃/4 with δ̃ = δ (what Lemma 8 needs).
        property_7_1, property_7_2: the relaxed ids are distinct within / across inputs.
        value_error: max |g̃_v(g̃_c(H)) − f̄(G)| with Lemma 8's layers for f̄ = prefix max and
            F.3's four-ReLU φ̃' (F.3: ≤ δ̃/4 whenever max_error is).
    """

    prob_map: str
    t: float
    label: str
    max_error: float
    within_bound: bool
    property_7_1: bool
    property_7_2: bool
    value_error: float


@dataclasses.dataclass(frozen=True)
class RelaxedTable:
    """The outcome of :func:`relaxed_error_table` for one pattern, n, d, δ.

    Attributes:
        zeta_paper: F.2's margin δ/2; zeta_h: the hardmax run's (:func:`hardmax_margin`).
        eta: F.2's least η (:func:`step3_eta`).
        id_bits: bits the ids need at resolution δ (:func:`check_float64_ids`).
        max_id: the largest hardmax id; ulp: float64's spacing there (an error of 0 means less
            than ulp/2 for softmax).
        rows: one :class:`RelaxedRow` per (map, t), hardmax first (the float64 control).
    """

    pattern: str
    n: int
    d: int
    delta: str
    hops: int
    inputs: int
    attention_layers: int
    value_layers: int
    zeta_paper: float
    zeta_h: float
    eta: float
    id_bits: int
    max_id: float
    ulp: float
    rows: tuple[RelaxedRow, ...]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def header(self) -> str:
        """One sentence: the configuration, its sizes, margins, η and the largest id."""
        return (
            f"{self.pattern}, n = {self.n}, d = {self.d}, δ = {self.delta}, s = {self.hops}: "
            f"{self.inputs} inputs, {self.attention_layers} attention layers, "
            f"{self.value_layers} Lemma-8 layers; ζ_H = {self.zeta_h:g} (F.2: δ/2 = "
            f"{self.zeta_paper:g}), η = {self.eta:.3g}, largest id {self.max_id:.6g} "
            f"(float64 ulp {self.ulp:.2g})"
        )


@dataclasses.dataclass(frozen=True)
class _Reference:
    """What every row is compared with: the exact ids (B, n) and the Lemma-8 targets (B, n, d)."""

    cm: ContextualMapping
    patterns: PatternLike
    x: Tensor
    exact: Tensor
    targets: Tensor
    values: ValueMapping
    engine: str


def _reference(cm: ContextualMapping, patterns: PatternLike, h, engine: str) -> _Reference:
    x = _as_tensor(h)
    exact = _as_tensor([[[v] for v in cm.context_ids(m)] for m in h])[..., 0]
    embedding = torch.tensor(cm.embedding, dtype=torch.float64)[None, :, None]
    targets = prefix_max(x - embedding)
    return _Reference(cm, patterns, x, exact, targets, value_mapping(cm, h, targets), engine)


def _row(ref: _Reference, rho: ProbabilityMap, t: float, label: str) -> RelaxedRow:
    z = relaxed_attention(ref.cm, ref.patterns, ref.x, rho, t, engine=ref.engine)
    ids = z @ _u(ref.cm)
    error = float((ids - ref.exact).abs().max())
    distinct_within = bool((ids.sort(dim=1).values.diff(dim=1) > 0).all())
    return RelaxedRow(
        prob_map=rho.name if rho.name != "entmax" else f"{rho.params['alpha']:g}-entmax",
        t=float(t),
        label=label,
        max_error=error,
        within_bound=error <= float(ref.cm.delta) / 4,
        property_7_1=distinct_within or ref.cm.n == 1,
        property_7_2=ids.unique().numel() == ids.numel(),
        value_error=float((ref.values(z) - ref.targets).abs().max()),
    )


def _special_ts(cm: ContextualMapping, rho: ProbabilityMap, zeta_h: Fraction) -> dict[float, str]:
    """The t of Assumption 2 at ζ = δ/2 (F.2), δ²/2 (the selective shifts' least margin) and
    ζ_H, and the exactness threshold, by name
    (rounded to 12 significant digits, so that t's equal up to rounding share a row)."""
    found = [
        (step3_temperature(cm, rho, float(cm.delta) / 2)[0], "t_A2(ζ = δ/2)"),
        (step3_temperature(cm, rho, float(cm.delta) ** 2 / 2)[0], "t_A2(ζ = δ²/2)"),
        (step3_temperature(cm, rho, float(zeta_h))[0], "t_A2(ζ_H)"),
        (exact_threshold(rho, zeta_h), "exact from here"),
    ]
    special: dict[float, str] = {}
    for t, name in found:
        if t is not None:
            key = _round(t)
            special[key] = f"{special[key]}; {name}" if key in special else name
    return special


def _round(t: float) -> float:
    return float(f"{t:.12g}")


def relaxed_error_table(
    patterns: PatternLike,
    n: int,
    d: int = 1,
    delta: Fraction | float | str = Fraction(1, 2),
    *,
    maps: Sequence[str | ProbabilityMap] = ("softmax", "sparsemax", "entmax15"),
    ts: Sequence[float] = tuple(2.0 ** (k / 2) for k in range(17)),
    max_inputs: int = 4096,
    engine: str = "auto",
) -> RelaxedTable:
    """Run Yun's g_c with σ_H → ρ[t·] (appendix F.2) over a grid of t, against exact hardmax.

    For each map, the t of ``ts`` plus the t of Assumption 2 at F.2's η with ζ = δ/2 (F.2's
    choice), ζ = δ²/2 (the least margin of a selective shift: |z_k − b_Q| ≥ δ/2 times key gaps
    ≥ δ) and the run's margin ζ_H, and (sparse maps) the exactness threshold 1/((α − 1)ζ_H).
    Each row is every grid input (or a seeded sample of ``max_inputs``) through
    :func:`relaxed_attention`, compared with the Fraction interpreter's ids, then through
    Lemma 8's value mapping (F.3's ReLU form) for f̄ = :func:`prefix_max`.

    Returns:
        A :class:`RelaxedTable`; :func:`format_relaxed_table` renders it as Markdown.
    """
    cm = yun_contextual_mapping(patterns, n, d, delta)
    bits = check_float64_ids(cm)
    h = grid_inputs(cm, max_inputs)
    ref = _reference(cm, patterns, h, engine)
    zeta_h = hardmax_margin(cm, h)
    rows = [_row(ref, resolve_prob_map("hardmax"), 1.0, "control")]
    for spec in maps:
        rho = resolve_prob_map(spec)
        special = _special_ts(cm, rho, zeta_h)
        for t in sorted({_round(float(t)) for t in ts} | set(special)):
            rows.append(_row(ref, rho, t, special.get(t, "")))
    max_id = float(ref.exact.max())
    return RelaxedTable(
        pattern=cm.label,
        n=cm.n,
        d=cm.d,
        delta=str(cm.delta),
        hops=cm.hops,
        inputs=len(h),
        attention_layers=len(cm.layers),
        value_layers=len(ref.values.ids),
        zeta_paper=float(cm.delta) / 2,
        zeta_h=float(zeta_h),
        eta=step3_eta(cm),
        id_bits=bits,
        max_id=max_id,
        ulp=math.ulp(max_id),
        rows=tuple(rows),
    )


def format_relaxed_table(table: RelaxedTable) -> str:
    """Markdown: :meth:`RelaxedTable.header`, then one line per (map, t)."""
    head = (
        table.header() + "\n\n"
        "| ρ | t | which t | max abs(ids_ρ,t − ids_H) | ≤ δ/4 | 7.1 | 7.2 | Lemma 8 error |\n"
        "|---|---|---|---|---|---|---|---|\n"
    )
    lines = [
        f"| {r.prob_map} | {r.t:.4g} | {r.label} | {r.max_error:.3g} | {r.within_bound} | "
        f"{r.property_7_1} | {r.property_7_2} | {r.value_error:.3g} |"
        for r in table.rows
    ]
    return head + "\n".join(lines) + "\n"


def _cell(row: RelaxedRow | None) -> str:
    """An error, bold where ≤ δ/4, with the properties that fail."""
    if row is None:
        return "—"
    text = f"**{row.max_error:.3g}**" if row.within_bound else f"{row.max_error:.3g}"
    failed = [p for p, ok in (("7.1", row.property_7_1), ("7.2", row.property_7_2)) if not ok]
    return text + (f" ({', '.join(failed)} fail)" if failed else "")


def format_relaxed_summary(
    table: RelaxedTable, ts: Sequence[float] = tuple(2.0**k for k in range(9))
) -> str:
    """Markdown, one column per map: max |ids_ρ,t − ids_H| at each t of ``ts`` (bold: ≤ δ/4;
    failing properties named), then the special t's as "t → error"."""
    names = list(dict.fromkeys(r.prob_map for r in table.rows if r.label != "control"))
    by = {(r.prob_map, r.t): r for r in table.rows}
    lines = ["| t | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for t in ts:
        lines.append(f"| {t:g} | " + " | ".join(_cell(by.get((m, t))) for m in names) + " |")
    for label in ("t_A2(ζ = δ/2)", "t_A2(ζ = δ²/2)", "t_A2(ζ_H)", "exact from here"):
        cells = []
        for m in names:
            row = next((r for r in table.rows if r.prob_map == m and label in r.label), None)
            cells.append("—" if row is None else f"{row.t:.4g} → {_cell(row)}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
