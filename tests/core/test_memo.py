"""The one cache mechanism (sparseattn.memo.Memo): bounded, safe under threads, never pickled."""

from __future__ import annotations

import copy
import pickle
import sys
import threading

import pytest
import torch

import sparseattn as sa
from sparseattn.graph import AttentionGraph
from sparseattn.memo import Memo


def test_memo_is_a_bounded_lru():
    memo = Memo(2)
    assert memo.get("a", lambda: 1) == 1
    assert memo.get("b", lambda: 2) == 2
    assert memo.get("a", lambda: 99) == 1  # a hit: "a" becomes the most recent
    memo.get("c", lambda: 3)
    assert memo.keys() == ["a", "c"]  # "b", the least recently used, went first
    assert memo.peek("b") is None and memo.peek("a") == 1
    memo.discard(lambda key: key != "a")
    assert memo.keys() == ["c"]
    with pytest.raises(ValueError, match="maxsize"):
        Memo(0)


def test_memo_is_never_pickled_or_copied():
    memo = Memo(3)
    memo.get("a", lambda: torch.zeros(1000))
    for other in (pickle.loads(pickle.dumps(memo)), copy.deepcopy(memo), copy.copy(memo)):
        assert len(other) == 0 and other.maxsize == 3
    pattern = sa.bigbird(2, 1, 2, seed=0)
    pattern.graph(64)
    pattern.allows(torch.arange(64)[:, None], torch.arange(64)[None, :], 64)
    blob = pickle.dumps(pattern)
    assert len(blob) < 2000  # fields only: no graphs, drawn tables or device copies
    assert pickle.loads(blob) == pattern
    graph = pattern.graph(64)
    sa.sparse_attention(*torch.randn(3, 1, 2, 64, 8), graph, engine="block")
    assert len(graph.memo) > 0
    assert len(pickle.loads(pickle.dumps(graph)).memo) == 0


def test_threads_share_one_pattern_at_different_lengths():
    """Four threads, one shared random pattern, lengths that evict each other's graphs and
    draws, the interpreter switching threads as often as it can: before the memo this raised
    'dictionary changed size during iteration' or a KeyError in the draw cache."""
    pattern = sa.bigbird(2, 1, 2, seed=0)
    lengths = [17 + 3 * i for i in range(12)]
    expected = {n: sa.bigbird(2, 1, 2, seed=0).graph(n) for n in lengths}
    errors: list[BaseException] = []

    def work(offset: int) -> None:
        try:
            for step in range(3 * len(lengths)):
                n = lengths[(offset + step) % len(lengths)]
                q = torch.randn(1, 1, n, 4)
                sa.sparse_attention(q, q, q, pattern, engine="gather")
                assert pattern.graph(n) == expected[n]
                i = torch.arange(n)
                allowed = pattern.allows(i[:, None], i[None, :], n)
                assert torch.equal(allowed, expected[n].to_dense())
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[0]
    assert len(pattern.parts[0].memo("graphs")) <= pattern.parts[0].memo("graphs").maxsize


def test_from_neighbours_names_a_mask_of_the_wrong_shape():
    index = torch.arange(6).view(2, 3) % 4
    with pytest.raises(ValueError, match=r"valid of shape \(3, 2\) does not broadcast"):
        AttentionGraph.from_neighbours(index, torch.ones(3, 2, dtype=torch.bool), 4)
