"""The contextual mapping of Yun et al. (2020) Lemma 7 and of SparseBERT Lemma 4, executed.

A contextual mapping sends every quantized input sequence to n "context ids" u^T g_c(H)_k that
are distinct within the sequence (Property 7.1) and across sequences (Property 7.2). The proofs
build it from sparse attention layers with hardmax heads of head size 1; here those layers are
built for a concrete pattern, n, d and δ and run in exact rational arithmetic
(``fractions.Fraction``) — the ids grow like δ^{−nd·s}, far beyond float precision.

Yun et al. appendix D–E (0-based tokens here):

* positional embedding (D.1): E_{γ(1)} = (n − 1)·1_d, E_{γ(i)} = (i − 2)·1_d for i ≥ 2, with γ
  the chain of Assumption 1.2, so column γ(i) of H = G + E lies in its own unit cube;
* quantization (Lemma 6, E.1): d·n/δ token-wise feed-forward layers
  Z ↦ Z + e^{(r)} φ(e^{(r)T} Z − kδ), φ(t) = −t on [0, δ) and 0 elsewhere;
* selective shifts (E.2.2–E.2.3): for i = 2..n and every value b of z_{γ(i)} = u^T H_{γ(i)},
  one block of p layers holding Ψ^{l_i}(·; δ^{−d}, b − δ/2, b + δ/2) at position l_i (a layer
  with γ(i − 1) ∈ A_{γ(i)}^{l_i}) and identities elsewhere: p(n − 1)/δ^d layers;
* all-max-shifts (E.2.4): Ω^{(i−1) mod p + 1}(·; 2snδ^{−nd−1}) for i = 1..s.

Ψ^l(Z; c, b, b')_k adds c (ψ(Z; b)_k − ψ(Z; b')_k) to Z_{1,k}, where the hardmax head
ψ(Z; b_Q)_k = u^T Z_{A_k^l} σ_H[(u^T Z_{A_k^l})^T (u^T Z_k − b_Q)] has key, query and value
u^T Z (head size 1); Ω^l(Z; c)_k adds c ψ(Z; 0)_k.

SparseBERT appendix A.2.2 (Lemma 4) does the same with dense attention without the diagonal,
A_k = [n] \\ {k}, no positional embedding: δ^{−d} selective shifts (one per value b) and two
global shifts Z ↦ Z + (Δ_h/δ) ψ(Z; 0), Δ_h = δ(δ^{−d} − 1)(δ^{−nd} + δ^{−d} + 1). Its inputs
must have pairwise distinct columns (a permutation-equivariant map cannot separate equal
tokens), the set on which the proof's ordering l_1 < … < l_n is taken.

One piece: the layer types, their exact interpreter, the two constructions (Yun, SparseBERT)
and the verifier all work on one exact-arithmetic representation of the network.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import time
from collections.abc import Sequence
from fractions import Fraction

from ...patterns import Pattern, PatternCycle
from ...validate import check_bool, check_int, check_positive
from .connectivity import PatternLike, assumption1, cycle_graphs

__all__ = [
    "AllMaxShift",
    "ContextualMapping",
    "ContextualMappingReport",
    "IdentityLayer",
    "Quantize",
    "SelectiveShift",
    "sparsebert_contextual_mapping",
    "verify_contextual_mapping",
    "yun_contextual_mapping",
]

Matrix = list[list[Fraction]]  # n columns of d entries: Z[k][r] is Z_{r,k}

#: Most layers (attention plus quantization) a construction builds; more is refused up front.
MAX_LAYERS = 1 << 20


# --------------------------------------------------------------------------- layers
@dataclasses.dataclass(frozen=True)
class Quantize:
    """Lemma 6 feed-forward layer: Z_{r,:} ↦ Z_{r,:} + φ(Z_{r,:} − kδ), φ(t) = −t on [0, δ)."""

    row: int
    k: int
    delta: Fraction

    def __call__(self, z: Matrix) -> None:
        low = self.k * self.delta
        for column in z:
            t = column[self.row] - low
            if 0 <= t < self.delta:
                column[self.row] -= t


@dataclasses.dataclass(frozen=True)
class SelectiveShift:
    """Ψ^l(·; c, b_lo, b_hi): two hardmax heads of size 1 on pattern ``layer`` (Yun E.2.1)."""

    layer: int
    c: Fraction
    b_lo: Fraction
    b_hi: Fraction


@dataclasses.dataclass(frozen=True)
class AllMaxShift:
    """Ω^l(·; c): one hardmax head of size 1 with b_Q = 0 on pattern ``layer`` (Yun E.2.1)."""

    layer: int
    c: Fraction


@dataclasses.dataclass(frozen=True)
class IdentityLayer:
    """An attention layer of pattern ``layer`` that adds nothing (keeps the cycle in phase)."""

    layer: int


Layer = SelectiveShift | AllMaxShift | IdentityLayer


def _head(z: Sequence[Fraction], keys: Sequence[int], query: Fraction) -> Fraction:
    """Hardmax attention with scalar keys = values = z_j and scalar query (ties share weight)."""
    scores = [z[j] * query for j in keys]
    best = max(scores)
    winners = [z[j] for j, score in zip(keys, scores, strict=True) if score == best]
    return sum(winners, Fraction(0)) / len(winners)


# --------------------------------------------------------------------------- the network
@dataclasses.dataclass(frozen=True)
class ContextualMapping:
    """A modified sparse Transformer g_c ∘ g_q with hardmax heads (Yun Lemmas 6–7).

    Attributes:
        name: which construction ("yun2020-lemma7" or "sparsebert-lemma4").
        label: the pattern(s) it was built for.
        n, d, delta: sequence length, token dimension and grid step δ (1/δ an integer ≥ 2).
        attend: attend[l][k] = the sorted keys A_k^l of pattern l (0-based).
        embedding: the positional embedding, column k is embedding[k] · 1_d.
        gamma: the chain γ used (None for SparseBERT).
        hops: s of Assumption 1.3 (the number of all-max-shift layers).
        quantization: the Lemma-6 feed-forward layers (d · range/δ of them).
        layers: the attention layers, layer m using pattern m mod p.
        distinct_columns: inputs must have pairwise distinct columns (SparseBERT).
        paper_layers: the attention-layer count stated by the paper.
    """

    name: str
    label: str
    n: int
    d: int
    delta: Fraction
    attend: tuple[tuple[tuple[int, ...], ...], ...]
    embedding: tuple[int, ...]
    gamma: tuple[int, ...] | None
    hops: int
    quantization: tuple[Quantize, ...]
    layers: tuple[Layer, ...]
    distinct_columns: bool
    paper_layers: int

    @property
    def u(self) -> tuple[Fraction, ...]:
        """u = (1, δ^{−1}, …, δ^{−d+1}): u^T H_k is the column id (Yun eq. 7)."""
        return tuple(1 / self.delta**i for i in range(self.d))

    @property
    def input_space_size(self) -> int:
        """|H_δ| = δ^{−dn}, or the number of grids with distinct columns."""
        cells = int(1 / self.delta) ** self.d
        if self.distinct_columns:
            return math.perm(cells, self.n)
        return cells**self.n

    def column_ids(self, z: Matrix) -> list[Fraction]:
        """u^T Z_k for every column k."""
        u = self.u
        return [sum((a * b for a, b in zip(u, column, strict=True)), Fraction(0)) for column in z]

    def quantize(self, x: Matrix) -> Matrix:
        """g_q(X + E): run the quantization layers on a copy of X + E."""
        z = [[value + self.embedding[k] for value in column] for k, column in enumerate(x)]
        for layer in self.quantization:
            layer(z)
        return z

    def attention(self, h: Matrix) -> Matrix:
        """g_c(H): run the attention layers on a copy of H (columns of Fractions)."""
        z = [list(column) for column in h]
        for layer in self.layers:
            if isinstance(layer, IdentityLayer):
                continue
            ids = self.column_ids(z)
            attend = self.attend[layer.layer]
            if isinstance(layer, SelectiveShift):
                shift = [
                    layer.c
                    * (
                        _head(ids, attend[k], ids[k] - layer.b_lo)
                        - _head(ids, attend[k], ids[k] - layer.b_hi)
                    )
                    for k in range(self.n)
                ]
            else:
                shift = [layer.c * _head(ids, attend[k], ids[k]) for k in range(self.n)]
            for column, value in zip(z, shift, strict=True):
                column[0] += value
        return z

    def context_ids(self, h: Matrix) -> list[Fraction]:
        """q(H) = u^T g_c(H) (Lemma 7)."""
        return self.column_ids(self.attention(h))


def _check_sizes(n: int, d: int, delta: Fraction | float | str) -> tuple[int, int, Fraction]:
    n, d = check_positive("n", n), check_positive("d", d)
    if isinstance(delta, bool) or not isinstance(delta, Fraction | int | float | str):
        raise TypeError(f"delta must be a Fraction, float or str like '1/2', got {delta!r}")
    try:
        delta = Fraction(delta)
    except (ValueError, OverflowError, ZeroDivisionError) as err:
        raise ValueError(f"delta must be 1/m for an integer m >= 2, got {delta!r}") from err
    if delta <= 0 or delta.numerator != 1 or delta.denominator < 2:
        raise ValueError(f"delta must be 1/m for an integer m >= 2, got {delta}")
    if d * math.log2(delta.denominator) > math.log2(MAX_LAYERS):
        raise ValueError(
            f"d={d} and delta={delta} give δ^-d = {delta.denominator}^{d} grid values per "
            f"token; at most {MAX_LAYERS:,} layers are built"
        )
    return n, d, delta


def _check_layers(count: int) -> None:
    if count > MAX_LAYERS:
        raise ValueError(f"n, d and delta give {count:,} layers; at most {MAX_LAYERS:,} are built")


def yun_contextual_mapping(
    patterns: PatternLike,
    n: int,
    d: int = 1,
    delta: Fraction | float | str = Fraction(1, 2),
    *,
    gamma: Sequence[int] | None = None,
    strict: bool = True,
    hops: int | None = None,
) -> ContextualMapping:
    """Build g_c ∘ g_q of Yun et al. Lemmas 6–7 (appendix E.1–E.2) for a pattern cycle.

    Args:
        patterns: a Pattern, PatternCycle or sequence (layer l uses entry l mod p).
        n, d: sequence length (≥ 2) and token dimension.
        delta: the grid step δ = 1/m, m ≥ 2 (a Fraction, float or "1/2").
        gamma: the chain γ (0-based); default: the one :func:`assumption1` finds.
        strict: require ``gamma`` to be a chain (Assumption 1.2). With ``strict=False`` a
            ``gamma`` that is not one is accepted, using pattern 1 where γ(i−1) ∉ ∪_l
            A_{γ(i)}^l — to watch the construction fail. Assumptions 1.1 and 1.3 are always
            required (ValueError otherwise).
        hops: the s of the all-max-shifts Ω (their count, and c = 2snδ^{−nd−1}); default the
            least s of Assumption 1.3. A smaller s than that builds the network a wrong hop
            count would give (e.g. Yun §3.4's s = 2 for STRIDED) — to watch Property 7.2 fail.
    Returns:
        A :class:`ContextualMapping` with p(n − 1)/δ^d + s attention layers.
    """
    n, d, delta = _check_sizes(n, d, delta)
    strict = check_bool("strict", strict)
    if n < 2:
        raise ValueError(f"Lemma 7 needs n >= 2, got {n}")
    _check_layers((n - 1) * delta.denominator**d + d * n * delta.denominator)
    if gamma is not None:
        if isinstance(gamma, str) or not isinstance(gamma, Sequence):
            raise TypeError(f"gamma must be a sequence of ints, got {type(gamma).__name__}")
        gamma = tuple(check_int(f"gamma[{i}]", g) for i, g in enumerate(gamma))
        if sorted(gamma) != list(range(n)):
            raise ValueError(f"gamma must be a permutation of 0..{n - 1}, got {gamma}")
    graphs = cycle_graphs(patterns, n)
    p = len(graphs)
    _check_layers(p * (n - 1) * delta.denominator**d + d * n * delta.denominator)
    report = assumption1(graphs)
    if report.hops is None or not report.self_loops:
        raise ValueError(
            f"Assumption 1 fails: self_loops={report.self_loops}, hops={report.hops} "
            f"({report.hops_reason})"
        )
    s = report.hops if hops is None else check_positive("hops", hops)
    attend = tuple(
        tuple(tuple(g.col[g.crow[k] : g.crow[k + 1]].tolist()) for k in range(n)) for g in graphs
    )
    if gamma is None:
        if report.chain is None:
            raise ValueError(f"Assumption 1.2 fails: {report.chain_status} ({report.chain_reason})")
        gamma = report.chain
    gamma = tuple(int(g) for g in gamma)
    if sorted(gamma) != list(range(n)):
        raise ValueError(f"gamma must be a permutation of 0..{n - 1}, got {gamma}")
    embedding = [0] * n
    embedding[gamma[0]] = n - 1
    for i in range(1, n):
        embedding[gamma[i]] = i - 1
    m = delta.denominator
    cells = m**d  # δ^{−d}
    big_delta = sum(Fraction(m) ** i for i in range(d))  # Δ = Σ_{i<d} δ^{−i}
    layers: list[Layer] = []
    for i in range(1, n):  # the paper's i = 2..n
        prev, here = gamma[i - 1], gamma[i]
        chosen = [l for l in range(p) if prev in attend[l][here]]
        if not chosen and strict:
            raise ValueError(f"gamma is not a chain: token {here} attends to {prev} in no layer")
        l_i = chosen[0] if chosen else 0
        base = (i - 1) * big_delta
        for value in range(cells):  # b over [(i−2)Δ : δ : (i−2)Δ + δ^{−d+1} − δ]
            b = base + value * delta
            for l in range(p):
                if l == l_i:
                    layers.append(SelectiveShift(l, Fraction(cells), b - delta / 2, b + delta / 2))
                else:
                    layers.append(IdentityLayer(l))
    c_omega = 2 * s * n * Fraction(m) ** (n * d + 1)  # 2snδ^{−nd−1}
    layers += [AllMaxShift(i % p, c_omega) for i in range(s)]
    quantization = tuple(Quantize(r, k, delta) for r in range(d) for k in range(n * m))
    if isinstance(patterns, PatternCycle):
        label = " → ".join(repr(q) for q in patterns.patterns)
    elif isinstance(patterns, Pattern):
        label = repr(patterns)
    else:
        label = " → ".join(repr(q) for q in patterns)
    return ContextualMapping(
        name="yun2020-lemma7",
        label=label,
        n=n,
        d=d,
        delta=delta,
        attend=attend,
        embedding=tuple(embedding),
        gamma=gamma,
        hops=s,
        quantization=quantization,
        layers=tuple(layers),
        distinct_columns=False,
        paper_layers=p * (n - 1) * cells + s,
    )


def sparsebert_contextual_mapping(
    n: int,
    d: int = 2,
    delta: Fraction | float | str = Fraction(1, 2),
    *,
    global_shifts: int = 2,
) -> ContextualMapping:
    """Build SparseBERT's Lemma 4 (appendix A.2.2): attention without the diagonal.

    A_k = [n] \\ {k}; δ^{−d} selective shifts Z ↦ Z + δ^{−d} Ψ(Z; b − δ/2, b + δ/2), one per
    value b ∈ [0 : δ : δ^{−d+1} − δ], then two global shifts Z ↦ Z + (Δ_h/δ) ψ(Z; 0).
    The lemma states δ^{−d} + 1 layers; its proof uses two global shifts, δ^{−d} + 2 layers,
    the default here (``global_shifts`` changes it). Needs n ≥ 3 (with n = 2 a token's max and
    min over the others coincide).
    """
    n, d, delta = _check_sizes(n, d, delta)
    m = delta.denominator
    cells = m**d
    if n < 3:
        raise ValueError(f"Lemma 4 needs n >= 3, got {n}")
    global_shifts = check_int("global_shifts", global_shifts, 0)
    _check_layers(cells + global_shifts + d * m)
    if n > cells:
        raise ValueError(f"n={n} tokens cannot be pairwise distinct among δ^-d={cells} values")
    attend = (tuple(tuple(j for j in range(n) if j != k) for k in range(n)),)
    layers: list[Layer] = []
    for value in range(cells):
        b = value * delta
        layers.append(SelectiveShift(0, Fraction(cells), b - delta / 2, b + delta / 2))
    big_h = delta * (cells - 1) * (Fraction(m) ** (n * d) + cells + 1)  # Δ_h
    layers += [AllMaxShift(0, big_h / delta) for _ in range(global_shifts)]
    return ContextualMapping(
        name="sparsebert-lemma4",
        label="dense without diagonal",
        n=n,
        d=d,
        delta=delta,
        attend=attend,
        embedding=(0,) * n,
        gamma=None,
        hops=global_shifts,
        quantization=tuple(Quantize(r, k, delta) for r in range(d) for k in range(m)),
        layers=tuple(layers),
        distinct_columns=True,
        paper_layers=cells + 1,
    )


# --------------------------------------------------------------------------- verification
@dataclasses.dataclass(frozen=True)
class ContextualMappingReport:
    """The outcome of :func:`verify_contextual_mapping`.

    Attributes:
        inputs: "exhaustive" (every grid input) or "random sample".
        inputs_checked / input_space_size: how many of how many inputs were run.
        attention_layers / paper_layers: layers built against the paper's count.
        quantization_layers: Lemma-6 feed-forward layers; ``quantization_exact`` says whether
            g_q(X + E) = G + E held for a random X in each input's cell.
        property_7_1: ids distinct within each input; property_7_2: across inputs (for
            SparseBERT: across inputs that are not permutations of each other).
        counterexample: the first violation found, in words (None if none).
        max_id_bits: bit length of the largest context id (numerator and denominator).
    """

    construction: str
    pattern: str
    n: int
    d: int
    delta: str
    inputs: str
    inputs_checked: int
    input_space_size: int
    attention_layers: int
    paper_layers: int
    quantization_layers: int
    quantization_exact: bool
    property_7_1: bool
    property_7_2: bool
    counterexample: str | None
    max_id_bits: int
    seconds: float

    @property
    def holds(self) -> bool:
        return self.property_7_1 and self.property_7_2 and self.quantization_exact

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["holds"] = self.holds
        return out


def _grids(cm: ContextualMapping, max_inputs: int, seed: int) -> tuple[list[tuple], bool]:
    """Grid inputs as tuples of per-column cell indices (cell = mixed-radix index of G_k)."""
    cells = cm.delta.denominator**cm.d
    total = cm.input_space_size
    if total <= max_inputs:
        if cm.distinct_columns:
            return list(itertools.permutations(range(cells), cm.n)), True
        return list(itertools.product(range(cells), repeat=cm.n)), True
    rng = random.Random(seed)
    chosen: set[tuple] = set()
    while len(chosen) < max_inputs:
        if cm.distinct_columns:
            chosen.add(tuple(rng.sample(range(cells), cm.n)))
        else:
            chosen.add(tuple(rng.randrange(cells) for _ in range(cm.n)))
    return sorted(chosen), False


def _cell_to_column(cell: int, d: int, m: int, delta: Fraction) -> list[Fraction]:
    return [(cell // m**r) % m * delta for r in range(d)]


def verify_contextual_mapping(
    cm: ContextualMapping,
    *,
    max_inputs: int = 4096,
    seed: int = 0,
    check_quantization: bool = True,
) -> ContextualMappingReport:
    """Run ``cm`` on grid inputs and check Properties 7.1 and 7.2 of Yun et al. Lemma 7.

    Every input G ∈ G_δ (or, for SparseBERT, every G with distinct columns) is run when there
    are at most ``max_inputs`` of them; otherwise a seeded random sample of ``max_inputs``
    distinct inputs (Property 7.2 then covers the sample only). For a construction without
    positional embedding (SparseBERT) Property 7.2 is checked between inputs that are not
    permutations of each other: a permutation-equivariant map gives permuted inputs the same
    ids, so the unrestricted property cannot hold there (Yun et al. 2019 state it so). With
    ``check_quantization`` each input is also fed as X = G + a random offset in [0, δ)^{d×n}
    through g_q, which must return G + E exactly.
    """
    if not isinstance(cm, ContextualMapping):
        raise TypeError(f"cm must be a ContextualMapping, got {type(cm).__name__}")
    max_inputs = check_positive("max_inputs", max_inputs)
    seed = check_int("seed", seed)
    check_quantization = check_bool("check_quantization", check_quantization)
    start = time.perf_counter()
    m = cm.delta.denominator
    grids, exhaustive = _grids(cm, max_inputs, seed)
    rng = random.Random(seed + 1)
    owner: dict[Fraction, tuple[int, tuple]] = {}
    prop1 = prop2 = quant = True
    counterexample = None
    max_bits = 0
    for number, cells in enumerate(grids):
        g = [_cell_to_column(cell, cm.d, m, cm.delta) for cell in cells]
        h = [[value + cm.embedding[k] for value in column] for k, column in enumerate(g)]
        if check_quantization:
            x = [
                [value + Fraction(rng.randrange(97), 97) * cm.delta for value in column]
                for column in g
            ]
            if cm.quantize(x) != h:
                quant = False
                counterexample = counterexample or f"quantization of input {cells} is not G + E"
        ids = cm.context_ids(h)
        max_bits = max(
            max_bits, *(v.numerator.bit_length() + v.denominator.bit_length() for v in ids)
        )
        if len(set(ids)) < cm.n:
            prop1 = False
            counterexample = counterexample or f"input {cells} has repeated ids {ids}"
        # Without a positional embedding the map is permutation-equivariant: permuted inputs
        # share their ids by necessity, so 7.2 compares column multisets (Yun et al. 2019).
        key = tuple(sorted(cells)) if cm.distinct_columns else cells
        for k, value in enumerate(ids):
            other, other_key = owner.setdefault(value, (number, key))
            if other_key != key:
                prop2 = False
                counterexample = counterexample or (
                    f"inputs {grids[other]} and {cells} share the id {value} (column {k})"
                )
    return ContextualMappingReport(
        construction=cm.name,
        pattern=cm.label,
        n=cm.n,
        d=cm.d,
        delta=str(cm.delta),
        inputs="exhaustive" if exhaustive else "random sample",
        inputs_checked=len(grids),
        input_space_size=cm.input_space_size,
        attention_layers=len(cm.layers),
        paper_layers=cm.paper_layers,
        quantization_layers=len(cm.quantization),
        quantization_exact=quant,
        property_7_1=prop1,
        property_7_2=prop2,
        counterexample=counterexample,
        max_id_bits=max_bits,
        seconds=time.perf_counter() - start,
    )
