"""The CPU ``auto`` rule's decisions (issue 28, item 2) and the ``sparseattn bench auto`` suite.

The decisions are checked without timing anything: the rule compares estimated costs per
graph (docs/engines.md, "The `auto` rule"); ``sparseattn bench auto`` measured them
(docs/benchmarks.md, "The `auto` grid", docs/results/auto/).
"""

from __future__ import annotations

import json

import pytest
import torch

import sparseattn as sa
from sparseattn.attention import choose_engine, resolve_graph
from sparseattn.engines import costs
from sparseattn.engines.costs import DENSE_LIMIT
from sparseattn.lab import cli
from sparseattn.maps import entmax, softmax


def _pick(pattern, n, batch, heads=4, d=16, grad=True, rho=None, dropout_p=0.0):
    q, k = (torch.randn(batch, heads, n, d, requires_grad=grad) for _ in range(2))
    graph = resolve_graph(pattern, q, k)
    return choose_engine(graph, q, k, softmax() if rho is None else rho, dropout_p)


@pytest.mark.parametrize("pattern", [sa.strided(16), sa.fixed(16)], ids=["strided", "fixed"])
def test_the_issue_case_goes_to_the_dense_engine(pattern):
    """The toy model of the issue (E = 64, H = 4, n = 256, batch 32, training): the block
    layout of Child et al.'s patterns at w = 16 covers every block, so masked SDPA is faster
    (measured 41–49 against 92–119 ms forward + backward, docs/results/auto/before)."""
    assert _pick(pattern, 256, 32) == "dense"


@pytest.mark.parametrize("batch", [1, 4, 32])
def test_the_rule_is_per_graph(batch):
    """Every engine's cost grows as B·H: the batch does not move the choice (within the
    memory cap); before, batch 32 took the block engine where batch 1 took dense."""
    assert _pick(sa.strided(16), 256, batch) == "dense"
    assert _pick(sa.longformer(128, 4), 1024, batch) == "block"
    assert _pick(sa.window(512), 8192, batch, grad=False) == "block"


def test_scattered_graphs_gather_and_long_banded_ones_block():
    assert _pick(sa.random(k=64), 4096, 1, d=64, grad=False) == "gather"
    assert _pick(sa.longformer(512, 16), 8192, 1, d=64) == "block"
    # fixed(64) at n = 4096: the summary columns leave most entries of the b = 16 blocks empty
    assert _pick(sa.fixed(64), 4096, 4) == "gather"


def test_dense_stays_under_the_memory_cap():
    pattern = sa.strided(32)  # at n = 1024 every block holds an edge: dense by cost
    n = 1024
    assert _pick(pattern, n, 32) == "dense"  # 32·4·1024² = 2²⁷ entries: at the cap
    assert 32 * 4 * n * n == DENSE_LIMIT
    assert _pick(pattern, n, 33) != "dense"
    # where the dense engine materialises the scores (other maps, dropout): 1/32 of the cap
    assert _pick(pattern, n, 1, rho=entmax(1.5)) == "dense"  # 4·1024² = 2²² entries
    assert _pick(pattern, n, 2, rho=entmax(1.5)) != "dense"
    assert _pick(pattern, n, 2, dropout_p=0.1) != "dense"


def test_a_zero_limit_turns_dense_off(monkeypatch):
    monkeypatch.setattr(costs, "DENSE_LIMIT", 0)
    assert _pick(sa.strided(16), 256, 32) != "dense"


def test_the_decision_is_cached_per_request(monkeypatch):
    q, k = (torch.randn(2, 4, 256, 16, requires_grad=True) for _ in range(2))
    graph = resolve_graph(sa.strided(16), q, k)
    first = choose_engine(graph, q, k, softmax())
    calls = []
    import sparseattn.engines.capabilities as table

    real = table.request_reasons
    monkeypatch.setattr(
        table, "request_reasons", lambda *a, **kw: calls.append(a) or real(*a, **kw)
    )
    assert choose_engine(graph, q, k, softmax()) == first
    assert not calls  # the cached answer: no capability walk
    choose_engine(graph, q[:1], k[:1], softmax())  # another request: decided anew
    assert calls


def test_bench_auto_quick_runs_and_reports(tmp_path, capsys):
    """``sparseattn bench auto-quick`` (restricted to two lengths of one pattern): a row per
    cell with every engine timed, auto's pick and the ratio, a markdown table and a figure."""
    run = tmp_path / "run"
    args = ["bench", "auto-quick", "--out", str(tmp_path), "--run", "run"]
    assert cli.main([*args, "--ns", "64,128", "--only", "window"]) == 0
    data = json.loads((run / "results.json").read_text())
    rows = [r for r in data["rows"] if "ms" in r]
    assert {(r["n"], r["batch"]) for r in rows} == {(64, 1), (128, 1), (64, 32), (128, 32)}
    for r in rows:
        # every engine at the first length; later, one more than 3x the fastest may be skipped
        if r["n"] == 64:
            assert set(r["ms"]) == {"auto", "dense", "block", "gather", "rows"}
        assert "auto" in r["ms"] and r["ratio"] > 0
        assert r["fastest"] != "auto"
    table = (run / "results.md").read_text()
    assert "| window | 64 | 1 | 16 |" in table and "misses" in table
    assert (run / "autogrid.png").stat().st_size > 1000
    assert "auto/fastest" in capsys.readouterr().out


def test_the_decision_knows_key_padding_and_score_modifiers():
    """With a score modifier (and, off the CPU, with key padding) the dense engine
    materialises the scores: its memory cap drops to DENSE_LIMIT // 32, and the cached
    decision is per such request. On CPU, key padding keeps SDPA's fused kernel (the graph ∩
    the real keys) and its cap."""
    n = 1024
    bsz = DENSE_LIMIT // (32 * n * n) * 4  # past the materialised-scores cap
    q = torch.zeros(bsz, 1, n, 16)
    graph = sa.window(4 * n).graph(n)  # every key: dense is the cheapest
    rho = softmax()
    assert choose_engine(graph, q, q, rho) == "dense"
    assert choose_engine(graph, q, q, rho, score_mod=True) != "dense"
    assert choose_engine(graph, q, q, rho, key_padding=True) == "dense"
    assert choose_engine(graph, q, q, rho, key_padding=True, score_mod=True) != "dense"
    assert choose_engine(graph, q, q, rho) == "dense"  # the cache kept them apart
