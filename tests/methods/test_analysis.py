"""Tests for sparseattn.methods.yun: Yun et al. Assumptions 1–2 and the executed contextual mapping.

References are independent of the code under test: hop counts from a plain-Python transcription
of the recursion of Yun §3.2 (and BFS eccentricities), chains from brute-force permutation
enumeration, Assumption 2 from the closed forms of appendix B evaluated by hand, and the
selective-shift stage of Lemma 7 from the paper's formula for the unique id z̃_{γ(n)}.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
from collections import deque
from fractions import Fraction

import pytest
import torch
from typer.testing import CliRunner

import sparseattn as sa
from sparseattn.graph import AttentionGraph
from sparseattn.maps import ProbabilityMap, entmax, hardmax, softmax, sparselin_gen, sparsemax
from sparseattn.methods.yun import (
    assumption1,
    assumption2,
    closed_form_t,
    find_chain,
    hops,
    named_pattern,
    sparsebert_contextual_mapping,
    strided_hops,
    verify_contextual_mapping,
    yun_contextual_mapping,
)
from sparseattn.methods.yun.construction import AllMaxShift, SelectiveShift


# --------------------------------------------------------------------------- references
def sets_of(pattern, n: int) -> list[set[int]]:
    """A_k as Python sets from the pattern's predicate (not from its CSR graph)."""
    q, kv = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    mask = pattern.allows(q, kv, n)
    return [set(torch.nonzero(mask[k]).flatten().tolist()) for k in range(n)]


def graph_of(sets: list[set[int]]) -> AttentionGraph:
    n = len(sets)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for k, keys in enumerate(sets):
        mask[k, sorted(keys)] = True
    return AttentionGraph.from_dense(mask)


def reach_sets(layers: list[list[set[int]]], t: int) -> list[set[int]]:
    """S_k^t of Yun §3.2: S^1 = A^1, S^t_k = ∪_{j ∈ A_k^{(t−1) mod p + 1}} S^{t−1}_j."""
    p = len(layers)
    s = [set(a) for a in layers[0]]
    for step in range(2, t + 1):
        pattern = layers[(step - 1) % p]
        s = [set().union(*(s[j] for j in pattern[k])) for k in range(len(pattern))]
    return s


def hops_reference(layers: list[list[set[int]]]) -> int | None:
    """Least s with S_k^s = [n] for all k; None when a (phase, state) repeats first."""
    n, p = len(layers[0]), len(layers)
    full = set(range(n))
    s = [set(a) for a in layers[0]]
    seen = set()
    t = 1
    while True:
        if all(x == full for x in s):
            return t
        key = ((t - 1) % p, tuple(frozenset(x) for x in s))
        if key in seen:
            return None
        seen.add(key)
        pattern = layers[t % p]
        s = [set().union(*(s[j] for j in pattern[k])) for k in range(n)]
        t += 1


def eccentricity_hops(sets: list[set[int]]) -> int | None:
    """p = 1 with self-loops: s = max BFS distance k → j along "k attends to j"."""
    n = len(sets)
    worst = 0
    for source in range(n):
        dist = {source: 0}
        queue = deque([source])
        while queue:
            v = queue.popleft()
            for w in sets[v]:
                if w not in dist:
                    dist[w] = dist[v] + 1
                    queue.append(w)
        if len(dist) < n:
            return None
        worst = max(worst, max(dist.values()))
    return max(worst, 1)


def has_chain(sets: list[set[int]]) -> bool:
    """Brute force over all permutations: γ(i) ∈ A_{γ(i+1)}."""
    n = len(sets)
    return any(
        all(perm[i] in sets[perm[i + 1]] for i in range(n - 1))
        for perm in itertools.permutations(range(n))
    )


def random_sets(n: int, density: float, rng: random.Random, loops: bool) -> list[set[int]]:
    out = []
    for k in range(n):
        keys = {j for j in range(n) if rng.random() < density}
        if loops:
            keys.add(k)
        if not keys:
            keys.add(rng.randrange(n))
        out.append(keys)
    return out


# --------------------------------------------------------------------------- Assumption 1
@pytest.mark.parametrize("n,w", [(64, 8), (96, 8), (36, 4)])
def test_fixed_cycle_satisfies_assumption1_with_two_hops(n, w):
    parts = [sa.fixed(w, 1), sa.fixed(w, 2)]
    report = assumption1(sa.cycle(*parts), n)
    layers = [sets_of(p, n) for p in parts]
    assert report.satisfied
    assert report.self_loops and report.chain_status == "identity"
    assert report.chain == tuple(range(n))
    assert report.hops == 2 == hops_reference(layers)
    assert report.connections == tuple(sum(map(len, a)) for a in layers)


@pytest.mark.parametrize("n,w", [(100, 8), (37, 4)])
def test_fixed_cycle_never_reaches_a_partial_last_segment(n, w):
    """Yun §3.4 says FIXED satisfies Assumption 1 for all w; when w does not divide n the last
    segment has no summary token in [n] (eq. 5), so no token outside it ever reaches it."""
    parts = [sa.fixed(w, 1), sa.fixed(w, 2)]
    report = assumption1(sa.cycle(*parts), n)
    assert report.hops is None and not report.satisfied
    assert hops_reference([sets_of(p, n) for p in parts]) is None
    assert "reaches only" in report.hops_reason


@pytest.mark.parametrize("n,w", [(64, 8), (50, 6), (33, 4)])
def test_strided_cycle_needs_three_hops_at_the_sequence_ends(n, w):
    """Yun §3.4 claims s = 2 for STRIDED. With A_k ∩ [n] truncated at the ends (eq. 4), token
    w − 1 reaches token 0 only after three layers: its stride points are w − 1, 2w − 1, …, and
    the window of w − 1 reaches down to ⌊w/2⌋ − 1 > 0. The brute force agrees: s = 3."""
    parts = [sa.strided(w, 1), sa.strided(w, 2)]
    layers = [sets_of(p, n) for p in parts]
    report = assumption1(sa.cycle(*parts), n)
    assert report.satisfied and report.chain_status == "identity"
    assert 0 not in reach_sets(layers, 2)[w - 1]
    assert report.hops == 3 == hops_reference(layers)
    assert report.hops_by_start == (3, hops_reference(layers[::-1]))


def test_strided_hops_follow_the_stated_rule_in_both_orders_and_for_the_union():
    """Issue 16 item 3: the rule of docs/analysis.md against the brute-force recursion on the
    pattern predicates (eq. 4) and against the library's bitsets, w ≤ 8, n ≤ 32. It is not
    "s = 3 from w = 3 on": the cycle started with the stride needs 4 layers for
    ⌊w/2⌋ + 1 < n ≤ w + ⌈w/2⌉ − 2, and the union needs only 2 when n mod w lies in
    [⌈w/2⌉ − 1, ⌊w/2⌋ + 1] (or n < w + ⌊w/2⌋ + 2)."""
    seen = set()
    for w in range(1, 9):
        a1, a2 = sa.strided(w, 1), sa.strided(w, 2)
        for n in range(2, 33):
            s1, s2, su = sets_of(a1, n), sets_of(a2, n), sets_of(sa.strided(w), n)
            for config, layers, pattern in (
                ("window-first", [s1, s2], sa.cycle(a1, a2)),
                ("stride-first", [s2, s1], sa.cycle(a2, a1)),
                ("union", [su], sa.strided(w)),
            ):
                expected = hops_reference(layers)
                assert strided_hops(w, n, config) == expected == hops(pattern, n).hops, (
                    w,
                    n,
                    config,
                )
                seen.add((config, expected))
    assert seen == {
        ("window-first", 1), ("window-first", 2), ("window-first", 3),
        ("stride-first", 1), ("stride-first", 2), ("stride-first", 3), ("stride-first", 4),
        ("union", 1), ("union", 2), ("union", 3),
    }  # fmt: skip


@pytest.mark.parametrize("d,delta", [(1, Fraction(1, 2)), (2, Fraction(1, 2))])
def test_lemma7_for_strided_w4_fails_with_the_papers_two_hops_and_holds_with_three(d, delta):
    """Issue 16 item 3, negative control: STRIDED w = 4 at n = 4 needs s = 3 (token 0 misses
    token 3 after two layers). Built with Yun §3.4's s = 2 the contextual mapping breaks
    Property 7.2, and the inputs that collide differ exactly at a token the column has not
    reached; with s = 3 both properties hold on every input."""
    n, pattern = 4, sa.cycle(sa.strided(4, 1), sa.strided(4, 2))
    layers = [sets_of(p, n) for p in pattern]
    assert hops_reference(layers) == 3
    good = yun_contextual_mapping(pattern, n, d=d, delta=delta)
    assert good.hops == 3
    report = verify_contextual_mapping(good)
    assert report.holds and report.inputs == "exhaustive"
    assert report.attention_layers == 2 * (n - 1) * delta.denominator**d + 3
    paper = yun_contextual_mapping(pattern, n, d=d, delta=delta, hops=2)
    assert paper.hops == 2 and sum(isinstance(x, AllMaxShift) for x in paper.layers) == 2
    broken = verify_contextual_mapping(paper)
    assert broken.inputs == "exhaustive" and broken.property_7_1 and not broken.property_7_2
    # Why: the selective shifts put the unique id into column γ(n) only, and the Ω layers
    # spread it along the reach sets. After two layers some column k has not seen γ(n), so
    # changing only G_γ(n) leaves q(H)_k unchanged — two different inputs share an id.
    reach, j = reach_sets(layers, 2), paper.gamma[-1]
    unseen = [k for k in range(n) if j not in reach[k]]
    assert unseen
    zero = [[Fraction(0)] * d for _ in range(n)]
    for k in unseen:
        other = [list(col) for col in zero]
        other[j][0] = delta
        h0 = [[x + paper.embedding[i] for x in col] for i, col in enumerate(zero)]
        h1 = [[x + paper.embedding[i] for x in col] for i, col in enumerate(other)]
        assert paper.context_ids(h0)[k] == paper.context_ids(h1)[k]
        assert good.context_ids(h0)[k] != good.context_ids(h1)[k]
    with pytest.raises(ValueError, match="hops"):
        yun_contextual_mapping(pattern, n, d=d, delta=delta, hops=0)


@pytest.mark.parametrize("n,w", [(40, 1), (41, 2), (12, 3)])
def test_star_satisfies_assumption1_with_two_hops(n, w):
    report = assumption1(sa.star(w), n)
    assert report.satisfied and report.chain_status == "identity"
    assert report.hops == 2 == hops_reference([sets_of(sa.star(w), n)])


@pytest.mark.parametrize("n,w", [(17, 2), (40, 3), (40, 4), (70, 7), (130, 16)])
def test_window_hops_match_bfs_and_closed_form(n, w):
    sets = sets_of(sa.window(w), n)
    report = assumption1(sa.window(w), n)
    assert report.hops == eccentricity_hops(sets) == math.ceil((n - 1) / (w // 2))
    assert report.chain_status == "identity"


@pytest.mark.parametrize("seed", range(8))
def test_hops_match_the_set_recursion_on_random_cycles(seed):
    rng = random.Random(seed)
    n = rng.choice([5, 9, 70, 131])  # 70 and 131 span several 64-bit words
    p = rng.choice([1, 2, 3])
    loops = seed % 2 == 0
    density = 3 / n if n > 20 else 0.25
    layers = [random_sets(n, density, rng, loops) for _ in range(p)]
    got = hops([graph_of(a) for a in layers])
    assert got.hops == hops_reference(layers)
    for start in range(p):
        rotated = layers[start:] + layers[:start]
        assert hops([graph_of(a) for a in layers], start=start).hops == hops_reference(rotated)


def test_missing_diagonal_fails_1_1_but_reaches_in_two_hops():
    n = 9
    no_diag = graph_of([set(range(n)) - {k} for k in range(n)])  # SparseBERT's pattern
    report = assumption1(no_diag)
    assert not report.self_loops and report.missing_self_loops == (n,)
    assert not report.satisfied
    assert report.hops == 2 == hops_reference([[set(range(n)) - {k} for k in range(n)]])
    assert report.chain is not None  # dense enough for a chain


def test_global_tokens_alone_miss_self_loops_and_have_no_chain():
    n = 20
    report = assumption1(sa.global_tokens(2), n)
    assert report.missing_self_loops == (n - 2,)
    assert report.chain is None and report.chain_status == "none exists"
    assert not has_chain(sets_of(sa.global_tokens(2), 8))


def test_disconnected_block_local_never_reaches():
    report = assumption1(sa.block_local(4), 16)
    assert report.hops is None and report.hops_reason.startswith("never")
    assert report.chain is None and report.chain_status == "none exists"
    assert hops_reference([sets_of(sa.block_local(4), 16)]) is None


def test_chain_search_agrees_with_permutation_brute_force():
    rng = random.Random(0)
    outcomes = set()
    for trial in range(150):
        n = 4 + trial % 3
        sets = random_sets(n, 0.3, rng, loops=trial % 2 == 0)
        result = find_chain(graph_of(sets))
        exists = has_chain(sets)
        assert (result.path is not None) == exists
        if exists:
            path = result.path
            assert sorted(path) == list(range(n))
            assert all(path[i] in sets[path[i + 1]] for i in range(n - 1))
        else:
            assert result.status == "none exists"
        outcomes.add(result.status)
    assert {"identity", "found", "none exists"} <= outcomes


def test_chain_search_reports_an_exhausted_budget():
    n = 6
    sets = [set(range(n)) for _ in range(n)]
    sets[1].discard(0)  # identity fails: 1 does not attend to 0
    sets[0].discard(1)  # reverse fails: 0 does not attend to 1
    assert find_chain(graph_of(sets), budget=0).status == "search budget exhausted"
    found = find_chain(graph_of(sets))
    assert found.status == "found" and has_chain(sets)


def test_assumption1_at_4096_for_strided_and_star():
    """Runs at n = 4096 (timings live in docs/analysis.md, not in assertions). One thread: the
    bitset work is memory-bound and two threads on a busy 2-core machine were 10× slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        strided = assumption1(named_pattern("strided", w=64), 4096)
        star = assumption1(sa.star(1), 4096)
    finally:
        torch.set_num_threads(threads)
    assert strided.satisfied and strided.hops == 3 and strided.p == 2
    assert star.satisfied and star.hops == 2


def test_named_pattern_configurations():
    assert len(named_pattern("fixed")) == 2  # SEQUENTIAL cycle of the two parts
    assert named_pattern("fixed", config="union").name == "fixed"
    with pytest.raises(ValueError, match="single part"):
        named_pattern("window", config="sequential")
    with pytest.raises(ValueError, match="takes parameters"):
        named_pattern("star", block=3)
    with pytest.raises(ValueError, match="data-dependent"):
        named_pattern("topk")


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match="n is required"):
        assumption1(sa.window(4))
    with pytest.raises(ValueError, match="expected n=8"):
        assumption1(sa.window(4).graph(6), 8)
    with pytest.raises(TypeError):
        assumption1("window", 8)


# --------------------------------------------------------------------------- Assumption 2
MAPS = [softmax(), sparsemax(), sparselin_gen(0.5), entmax(1.5), entmax(1.3)]


@pytest.mark.parametrize("rho", MAPS, ids=repr)
@pytest.mark.parametrize("n", [2, 33])
def test_assumption2_t_works_and_half_the_least_t_fails(rho, n):
    zeta, eta = 0.3, 0.05
    report = assumption2(rho, zeta, eta, n, samples=64)
    assert report.holds and report.adversarial > 0
    assert report.worst_max_weight >= 1 - eta - 1e-9 and report.worst_rest <= eta + 1e-9
    # independent adversarial column: every other entry exactly ζ below the max
    v = torch.full((1, n), -zeta, dtype=torch.float64)
    v[0, n // 2] = 0.0
    weights = rho(report.t * v)
    assert weights[0, n // 2] >= 1 - eta - 1e-9
    assert report.t_least is not None and report.t_least <= report.t * (1 + 1e-9)
    assert not assumption2(rho, zeta, eta, n, samples=64, t=report.t_least / 2).holds


def test_softmax_closed_form_is_tight_on_the_adversarial_column():
    n, zeta, eta = 50, 0.2, 0.1
    t, _ = closed_form_t(softmax(), zeta, eta, n)
    assert 1 / (1 + (n - 1) * math.exp(-t * zeta)) == pytest.approx(1 - eta, abs=1e-12)
    t_top, _ = closed_form_t(softmax(), zeta, eta, n, top_k=4)
    assert t_top == pytest.approx(math.log(3 * (1 - eta) / eta) / zeta)
    assert assumption2(softmax(), zeta, eta, n, top_k=4, samples=32).holds
    assert not assumption2(softmax(), zeta, eta, n, top_k=4, samples=32, t=t_top * 0.9).holds


def test_closed_forms_of_appendix_b():
    assert closed_form_t(sparselin_gen(0.3), 0.5, 0.2, 10)[0] == pytest.approx(1.6)
    assert closed_form_t(entmax(1.3), 0.5, 0.2, 10)[0] == pytest.approx(1 / (0.5 * 0.3))
    assert closed_form_t(hardmax(), 0.5, 0.2, 10)[0] == pytest.approx(2.0)
    report = assumption2(hardmax(), 0.5, 0.2, 10, samples=16)
    assert report.holds and report.worst_l1_to_hardmax == 0.0


def test_assumption2_searches_when_there_is_no_closed_form():
    tempered = ProbabilityMap("tempered", lambda z, valid: softmax()(z / 3, valid), sparse=False)
    n, zeta, eta = 16, 0.5, 0.05
    report = assumption2(tempered, zeta, eta, n, samples=32)
    assert report.method.startswith("search") and report.holds
    exact = 3 * math.log((n - 1) * (1 - eta) / eta) / zeta  # softmax's B.1 bound at scale t/3
    assert report.t == pytest.approx(exact, rel=1e-5)


# --------------------------------------------------------------------------- Lemma 7
def strided_cycle():
    return sa.cycle(sa.strided(2, 1), sa.strided(2, 2))


def test_lemma7_contextual_mapping_for_strided_is_exact_on_every_input():
    cm = yun_contextual_mapping(strided_cycle(), 4, d=2, delta=Fraction(1, 2))
    report = verify_contextual_mapping(cm)
    assert report.inputs == "exhaustive" and report.inputs_checked == 2 ** (2 * 4)
    assert report.property_7_1 and report.property_7_2 and report.quantization_exact
    s = hops_reference([sets_of(p, 4) for p in strided_cycle()])
    assert cm.hops == s == 2
    assert report.attention_layers == report.paper_layers == 2 * 3 * 4 + s  # p(n−1)/δ^d + s
    assert report.quantization_layers == 2 * 4 * 2  # d·n/δ


@pytest.mark.parametrize("delta", [Fraction(1, 2), Fraction(1, 3)])
def test_lemma7_contextual_mapping_for_star(delta):
    cm = yun_contextual_mapping(sa.star(1), 5, d=1, delta=delta)
    report = verify_contextual_mapping(cm)
    assert report.holds and report.inputs == "exhaustive"
    assert report.attention_layers == report.paper_layers == 4 * delta.denominator + 2


def test_lemma7_selective_shifts_compute_the_papers_unique_id():
    """E.2.3: after the p(n−1)/δ^d selective shifts, column γ(n) holds
    z̃_{γ(n)} = z_{γ(n)} + Σ_{i=1}^{n−1} δ^{−id} (z_{γ(n−i)} − z_{γ(n+1−i)})."""
    n, d, delta = 4, 2, Fraction(1, 2)
    cm = yun_contextual_mapping(strided_cycle(), n, d=d, delta=delta)
    shifts = dataclasses.replace(cm, layers=cm.layers[: -cm.hops])
    gamma = cm.gamma
    rng = random.Random(3)
    for _ in range(20):
        g = [[Fraction(rng.randrange(2), 2) for _ in range(d)] for _ in range(n)]
        h = [[x + cm.embedding[k] for x in col] for k, col in enumerate(g)]
        z = cm.column_ids(h)
        zg = [z[gamma[i]] for i in range(n)]  # z_{γ(1)}, …, z_{γ(n)}
        expected = zg[n - 1] + sum(
            delta ** (-i * d) * (zg[n - 1 - i] - zg[n - i]) for i in range(1, n)
        )
        assert shifts.context_ids(h)[gamma[-1]] == expected


def test_selective_shift_heads_match_library_hardmax_attention():
    """One Ψ layer of the construction equals two hardmax heads of sparse_attention."""
    cm = yun_contextual_mapping(strided_cycle(), 4, d=1, delta=Fraction(1, 2))
    layer = next(x for x in cm.layers if isinstance(x, SelectiveShift))
    pattern = strided_cycle()[layer.layer]
    h = [[Fraction(1, 2) + cm.embedding[k]] for k in range(4)]
    z = torch.tensor([float(v) for v in cm.column_ids(h)], dtype=torch.float64)
    heads = []
    for b in (layer.b_lo, layer.b_hi):
        q = (z - float(b)).view(1, 1, 4, 1)
        kv = z.view(1, 1, 4, 1)
        heads.append(
            sa.sparse_attention(q, kv, kv, pattern, prob_map="hardmax", engine="dense", scale=1.0)
        )
    expected = z + float(layer.c) * (heads[0] - heads[1]).flatten()
    got = [float(v) for v in dataclasses.replace(cm, layers=(layer,)).context_ids(h)]
    assert got == expected.tolist()


def test_lemma7_breaks_when_the_construction_is_broken():
    good = yun_contextual_mapping(strided_cycle(), 4, d=2)
    wrong_gamma = yun_contextual_mapping(strided_cycle(), 4, d=2, gamma=(0, 3, 1, 2), strict=False)
    assert not verify_contextual_mapping(wrong_gamma).property_7_2
    assert isinstance(good.layers[-1], AllMaxShift)
    no_last_omega = dataclasses.replace(good, layers=good.layers[:-1])
    assert not verify_contextual_mapping(no_last_omega).property_7_2
    no_first_psi = dataclasses.replace(good, layers=good.layers[1:])
    assert not verify_contextual_mapping(no_first_psi, check_quantization=False).property_7_2
    with pytest.raises(ValueError, match="not a chain"):
        yun_contextual_mapping(strided_cycle(), 4, d=2, gamma=(0, 3, 1, 2))
    with pytest.raises(ValueError, match="Assumption 1 fails"):
        yun_contextual_mapping(sa.block_local(2), 4)


def test_lemma7_samples_when_the_input_space_is_large():
    cm = yun_contextual_mapping(sa.star(1), 5, d=2, delta=Fraction(1, 2))
    report = verify_contextual_mapping(cm, max_inputs=64, seed=1)
    assert report.inputs == "random sample" and report.inputs_checked == 64
    assert report.input_space_size == 2 ** (2 * 5) and report.holds


# --------------------------------------------------------------------------- SparseBERT
@pytest.mark.parametrize("n,d,delta", [(3, 2, Fraction(1, 2)), (4, 1, Fraction(1, 4))])
def test_sparsebert_lemma4_without_diagonal(n, d, delta):
    cm = sparsebert_contextual_mapping(n, d, delta)
    assert all(k not in cm.attend[0][k] for k in range(n))
    report = verify_contextual_mapping(cm)
    assert report.inputs == "exhaustive"
    assert report.input_space_size == math.perm(delta.denominator**d, n)
    assert report.holds
    assert report.attention_layers == delta.denominator**d + 2
    assert report.paper_layers == delta.denominator**d + 1


def test_sparsebert_map_is_permutation_equivariant_and_breaks_without_global_shifts():
    cm = sparsebert_contextual_mapping(3, 2, Fraction(1, 2))
    h = [[Fraction(0), Fraction(1, 2)], [Fraction(1, 2), Fraction(0)], [Fraction(1, 2)] * 2]
    ids = cm.context_ids(h)
    assert cm.context_ids([h[2], h[0], h[1]]) == [ids[2], ids[0], ids[1]]
    stripped = dataclasses.replace(cm, layers=cm.layers[:-2])
    assert not verify_contextual_mapping(stripped).property_7_2


# --------------------------------------------------------------------------- CLI
def test_cli_analyze_table_and_json():
    from sparseattn.lab.cli import app

    runner = CliRunner()
    threads = str(torch.get_num_threads())  # leave the process's thread count as it is
    args = ["analyze", "fixed", "--n", "64", "--w", "8", "--json", "--threads", threads]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["satisfied"] and data["hops"] == 2 and data["p"] == 2
    table = runner.invoke(
        app, ["analyze", "block_local", "--n", "32", "--block", "8", "--threads", threads]
    )
    assert table.exit_code == 0 and "none exists" in table.output
    bad = runner.invoke(app, ["analyze", "window", "--config", "sequential"])
    assert bad.exit_code != 0
