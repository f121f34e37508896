"""Tests for the copying task (Yun et al. §5.2, G.1) and its scale-out (DDP, distributed sweeps).

References are independent of the code under test: the ``0 s 0 s`` format checked position by
position, sparsity levels against ``pattern.graph(n).sparsity`` of patterns built here and the
paper's printed levels, a causality check by perturbing future tokens, and a single-process run
as the reference for the two-process DistributedDataParallel run.
"""

from __future__ import annotations

import json
import socket
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

from sparseattn.lab.experiments import copying
from sparseattn.lab.experiments.copying import (
    COLUMNS,
    CopyConfig,
    CopyModel,
    Dist,
    column_pattern,
    copy_sequences,
    random_keys,
    random_target,
    sparsity,
    task_tensors,
    train,
)
from sparseattn.patterns import HeadSplit, causal_fixed, causal_strided, dense, fixed, star, strided

TINY = dict(n=12, d=16, vocab=8, w=3, steps=3, warmup=1, batch_size=8, train_size=64)
TINY.update(test_size=16, eval_batch=16, progress=False, threads=1)


# ---------------------------------------------------------------- data
def test_copy_sequences_have_the_0s0s_format():
    seqs = copy_sequences(50, 16, 10, torch.Generator().manual_seed(3))
    assert seqs.shape == (50, 16) and seqs.dtype == torch.long
    for row in seqs.tolist():
        assert row[0] == 0 and row[8] == 0
        assert row[1:8] == row[9:16]
        assert all(1 <= t <= 9 for t in row[1:8])
    again = copy_sequences(50, 16, 10, torch.Generator().manual_seed(3))
    assert torch.equal(seqs, again)
    assert len({tuple(r) for r in seqs[:, 1:8].tolist()}) > 45  # strings actually vary


def test_bidirectional_inputs_hide_the_second_half():
    seqs = copy_sequences(4, 12, 8, torch.Generator().manual_seed(0))
    inputs, pos, targets = task_tensors(seqs, 8, causal=False)
    assert torch.equal(inputs[:, :6], seqs[:, :6])
    assert (inputs[:, 6:] == 8).all()  # the separator and s are both masked
    assert pos.tolist() == [7, 8, 9, 10, 11]
    assert torch.equal(targets, seqs[:, 1:6])  # the copy of the first s


def test_causal_targets_are_the_next_tokens():
    seqs = copy_sequences(4, 12, 8, torch.Generator().manual_seed(0))
    inputs, pos, targets = task_tensors(seqs, 8, causal=True)
    assert torch.equal(inputs, seqs)
    assert pos.tolist() == [6, 7, 8, 9, 10]
    for b in range(4):
        for t, p in enumerate(pos.tolist()):
            assert targets[b, t] == seqs[b, p + 1] == seqs[b, p - 5]


@pytest.mark.parametrize("column", COLUMNS)
def test_causal_models_do_not_see_the_future(column):
    config = CopyConfig(**TINY, causal=True)
    torch.manual_seed(0)
    model = CopyModel(config, column_pattern(column, config), depth=2).eval()
    seqs = copy_sequences(2, 12, 8, torch.Generator().manual_seed(1))
    changed = seqs.clone()
    changed[:, 8:] = (changed[:, 8:] % 7) + 1  # a different future from position 8 on
    with torch.no_grad():
        a, b = model(seqs), model(changed)
    assert torch.allclose(a[:, :8], b[:, :8], atol=1e-6)
    assert not torch.allclose(a[:, 8:], b[:, 8:])


# ---------------------------------------------------------------- sparsity levels
def _mean(*xs):
    return sum(xs) / len(xs)


@pytest.mark.parametrize("causal, form", [(False, "child"), (True, "tril"), (True, "child")])
def test_reported_sparsity_matches_the_pattern_graphs(causal, form):
    n, w = 64, 8
    config = CopyConfig(n=n, causal=causal, causal_form=form)
    child = causal and form == "child"
    strided_, fixed_ = (causal_strided, causal_fixed) if child else (strided, fixed)

    def level(p):
        return float((p.causal() if causal else p).graph(n).sparsity)

    expected = {
        "strided-union": level(strided_(w)),
        "strided-multihead": _mean(level(strided_(w, 1)), level(strided_(w, 2))),
        "strided-sequential": _mean(level(strided_(w, 1)), level(strided_(w, 2))),
        "fixed-union": level(fixed_(w)),
        "fixed-multihead": _mean(level(fixed_(w, 1)), level(fixed_(w, 2))),
        "fixed-sequential": _mean(level(fixed_(w, 1)), level(fixed_(w, 2))),
        "star": level(star(w)),
        "dense": 0.0,
    }
    for column, value in expected.items():
        got = sparsity(column_pattern(column, config), n, config.heads)
        assert got == pytest.approx(value, abs=1e-12), column
        assert f"({value:.1%})" in copying.column_header(column, config)
    # a SEQUENTIAL stack of three layers uses A1, A2, A1
    model = CopyModel(config, column_pattern("fixed-sequential", config), depth=3)
    parts = [level(fixed_(w, 1)), level(fixed_(w, 2)), level(fixed_(w, 1))]
    assert model.layer_sparsity() == pytest.approx(parts, abs=1e-12)


def test_random_sparsity_is_matched_to_the_other_columns():
    config = CopyConfig(n=64)
    others = [c for c in COLUMNS if c not in ("random", "dense")]
    target = _mean(*(sparsity(column_pattern(c, config), 64, 4) for c in others))
    assert random_target(config) == pytest.approx(target)
    k = random_keys(config)
    assert abs((1 - k / 64) - target) <= 0.5 / 64 + 1e-12
    pattern = column_pattern("random", config)
    assert sparsity(pattern, 64, 4) == pytest.approx(1 - k / 64)
    causal = CopyConfig(n=64, causal=True)
    got = sparsity(column_pattern("random", causal), 64, 4)
    assert abs(got - random_target(causal)) < 0.02


def test_random_graphs_are_drawn_per_head_and_per_layer():
    config = CopyConfig(n=64)
    pattern = column_pattern("random", config)
    assert len(pattern) == 4
    layer0 = pattern[0].graph(64, num_heads=4).to_dense()
    layer1 = pattern[1].graph(64, num_heads=4).to_dense()
    assert not torch.equal(layer0[0], layer0[1])
    assert not torch.equal(layer0[0], layer1[0])
    k = random_keys(config)
    assert (layer0.sum(-1) == k).all()  # k keys for every query of every head
    again = column_pattern("random", replace(config, depths=(1, 2, 3, 4, 5, 6)))
    assert torch.equal(again[1].graph(64, num_heads=4).to_dense(), layer1)


def test_paper_scale_sparsity_levels_match_table_1_headers():
    """At n = 256, w = 16 the measured levels round to the paper's printed ones (±1.5 points;
    the paper rounds and does not say how it counts STAR's relay)."""
    config = CopyConfig(n=256, w=16)
    for column, (paper, _) in copying.PAPER_TABLE1.items():
        got = 100 * sparsity(column_pattern(column, config), 256, 4)
        assert abs(got - paper) <= 1.5, (column, got, paper)


def test_connectivity_ceilings_by_hand():
    """n = 64, w = 8. Bidirectional: the symbol at q comes from q − 32, a multiple of the stride
    (STRIDED reaches it in one layer, its window part alone never); FIXED reaches it in one
    layer only when q − 32 ends a segment (7, 15, 23, 31: 4 of 31); STAR only at the relay
    q = 63. Causal: q predicts q + 1, whose source is q − 31 = 3·8 + 4 + 3 hops back: three
    STRIDED layers; STAR hops at most 8 back per layer: four."""
    bi, ca = CopyConfig(n=64), CopyConfig(n=64, causal=True, causal_form="tril")
    expect = [
        (bi, "strided-union", 1, 1.0),
        (bi, "strided-multihead", 1, 1.0),
        (bi, "strided-sequential", 1, 0.0),
        (bi, "strided-sequential", 2, 1.0),
        (bi, "fixed-union", 1, 4 / 31),
        (bi, "fixed-sequential", 1, 0.0),
        (bi, "star", 1, 1 / 31),
        (bi, "star", 2, 1.0),
        (bi, "dense", 1, 1.0),
        (ca, "strided-union", 2, 0.0),
        (ca, "strided-union", 3, 1.0),
        (ca, "star", 3, 0.0),
        (ca, "star", 4, 1.0),
        (ca, "dense", 1, 1.0),
    ]
    for config, column, depth, value in expect:
        got = copying.reachable_fraction(column, depth, config)
        assert got == pytest.approx(value), (config.causal, column, depth)


def test_child_causal_ceilings():
    """Child et al.'s causal STRIDED keeps the previous w tokens and every w-th one back, so the
    causal source q − (n/2 − 1) is two hops away: 31 = 3·8 + 7 at n = 64, 127 = 7·16 + 15 at
    the paper's n = 256, w = 16 — in every head configuration. One layer reaches none of it."""
    for n in (64, 256):
        config = CopyConfig(n=n, causal=True)  # causal_form="child" is the default
        for column in ("strided-union", "strided-multihead", "strided-sequential"):
            assert copying.reachable_fraction(column, 1, config) == 0.0, (n, column)
            assert copying.reachable_fraction(column, 2, config) == 1.0, (n, column)
    # FIXED: both readings are one graph
    tril = CopyConfig(n=64, causal=True, causal_form="tril")
    for column in ("fixed-union", "fixed-multihead", "fixed-sequential"):
        a = column_pattern(column, CopyConfig(n=64, causal=True))
        b = column_pattern(column, tril)
        for pa, pb in zip(copying.as_cycle(a), copying.as_cycle(b), strict=True):
            ga = pa.graph(64, num_heads=4) if isinstance(pa, HeadSplit) else pa.graph(64)
            gb = pb.graph(64, num_heads=4) if isinstance(pb, HeadSplit) else pb.graph(64)
            assert torch.equal(ga.to_dense(), gb.to_dense()), column


def test_identity_keeps_the_names_of_earlier_runs():
    """Fields added later are left out of the identity at the value earlier runs used, so the
    run folders quoted in docs/experiments.md still resolve; a new value names a new run."""
    assert CopyConfig().run_name() == "bidir-n64-d64-w8-cb96ed44"
    tril = CopyConfig(causal=True, causal_form="tril")
    assert tril.run_name() == "causal-n64-d64-w8-2edc3566"
    assert CopyConfig(causal_form="tril").run_name() == CopyConfig().run_name()  # bidirectional
    assert CopyConfig(causal=True).identity()["causal_form"] == "child"
    assert CopyConfig(causal=True).run_name() != tril.run_name()
    assert CopyConfig(stop_accuracy=0.99).run_name() != CopyConfig().run_name()
    with pytest.raises(ValueError, match="causal_form"):
        CopyConfig(causal=True, causal_form="child-ish").validate()
    with pytest.raises(ValueError, match="stop_accuracy"):
        CopyConfig(stop_accuracy=1.5).validate()


def test_dense_column_is_dense():
    assert sparsity(column_pattern("dense", CopyConfig(n=16)), 16, 4) == 0.0
    assert float(dense().graph(16).sparsity) == 0.0


# ---------------------------------------------------------------- training
def test_tiny_dense_model_learns_to_copy():
    config = CopyConfig(
        n=10, d=32, vocab=6, steps=150, warmup=10, batch_size=32, train_size=2000,
        test_size=200, lr=1e-2, progress=False,
    )  # fmt: skip
    torch.set_num_threads(1)
    _, metrics = train(config, "dense", depth=2)
    assert metrics["chance"] == pytest.approx(0.2)
    assert metrics["accuracy"] > 0.9, metrics["accuracy"]
    assert metrics["curve"][-1]["loss"] < metrics["curve"][0]["loss"]


def test_training_stops_after_two_checks_at_stop_accuracy():
    """A learnable cell with ``stop_accuracy`` ends at a check step once two checks in a row
    reach it (the last curve point shows it), long before its step budget; the held-out
    accuracy is still measured on the test set."""
    config = CopyConfig(
        n=10, d=32, vocab=6, steps=1000, warmup=10, batch_size=32, train_size=2000,
        test_size=200, lr=1e-2, progress=False, stop_accuracy=0.9,
    )  # fmt: skip
    torch.set_num_threads(1)
    _, metrics = train(config, "dense", depth=2)
    every = copying.STOP_CHECK_EVERY
    assert metrics["steps"] == 1000 and metrics["steps_trained"] < 1000
    assert (metrics["steps_trained"] - 1) % every == 0 and metrics["steps_trained"] > every
    assert metrics["curve"][-1]["batch_accuracy"] >= 0.9
    assert metrics["accuracy"] > 0.8
    _, full = train(replace(config, stop_accuracy=None, steps=60), "dense", depth=2)
    assert full["steps_trained"] == 60  # without it the whole budget is trained


def test_seeds_table_lists_every_seed_the_paper_and_the_ceiling(tmp_path):
    configs = [
        CopyConfig(**TINY, out_dir=str(tmp_path), depths=(1,), columns=("star", "dense"), seed=s)
        for s in (0, 1)
    ]
    for config in configs:
        copying.run(config, dist=Dist())
    table = copying.seeds_table(configs)
    star_cell = table.splitlines()[2].split("|")[2]
    assert star_cell.count("%") == 3 and " / " in star_cell  # two seeds and one ceiling
    assert "(1.5;" in star_cell  # the paper's 1-layer STAR: 1.53 %
    assert "(—; 100%)" in table.splitlines()[2].split("|")[3]  # dense: not in the paper
    assert "Seeds 0, 1" in table
    copying.seeds_figure(configs, tmp_path / "seeds.png")
    assert (tmp_path / "seeds.png").stat().st_size > 1000


def test_sweep_writes_cells_skips_finished_ones_and_resumes(tmp_path, monkeypatch):
    config = CopyConfig(**TINY, out_dir=str(tmp_path), depths=(1, 2), columns=("dense", "star"))
    result = copying.run(config, dist=Dist())
    folder = Path(result["folder"])
    names = {p.stem for p in (folder / "cells").glob("*.json")}
    assert names == {"dense-L1", "dense-L2", "star-L1", "star-L2"}
    cell = json.loads((folder / "cells" / "star-L2.json").read_text())
    assert cell["column"] == "star" and cell["depth"] == 2 and cell["test_tokens"] == 16 * 5
    assert cell["sparsity"] == pytest.approx(float(star(3).graph(12).sparsity))
    assert 0.0 <= cell["accuracy"] <= 1.0
    assert not list(folder.rglob("*.tmp"))  # atomic writes leave no temporaries
    table = (folder / "table.md").read_text()
    assert "| 2-layer |" in table and "STAR (" in table and "DENSE (0.0%)" in table
    assert result["complete"]
    assert (folder / "copying.png").read_bytes()[:4] == b"\x89PNG"  # every experiment: a PNG

    calls = []
    real_train = copying.train

    def counting_train(cfg, column, depth, *args, **kwargs):
        calls.append((column, depth))
        return real_train(cfg, column, depth, *args, **kwargs)

    monkeypatch.setattr(copying, "train", counting_train)
    copying.run(config, dist=Dist())
    assert calls == []  # everything finished: nothing retrained
    (folder / "cells" / "dense-L2.json").unlink()
    copying.run(config, dist=Dist())
    assert calls == [("dense", 2)]
    # a different config may not write into the same run folder
    with pytest.raises(ValueError, match="different config"):
        copying.run(replace(config, lr=1e-4, run=result["run"]), dist=Dist())


# ---------------------------------------------------------------- scale-out
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out: str) -> None:
    tdist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        torch.set_num_threads(1)
        config = CopyConfig(**{**TINY, "dtype": "float64"})
        model, metrics = train(config, "strided-multihead", 2, Dist(rank, world))
        torch.save(
            {"state": model.state_dict(), "accuracy": metrics["accuracy"]}, f"{out}/{rank}.pt"
        )
        sweep = CopyConfig(**TINY, out_dir=f"{out}/sweep", depths=(1, 2, 3), columns=("dense",))
        copying.run(sweep, dist=Dist(rank, world))
    finally:
        tdist.destroy_process_group()


def test_ddp_matches_single_process_and_cells_are_shared(tmp_path):
    """Two gloo workers on 127.0.0.1: identical parameters, equal to one process on the same
    global batch (float64); a two-worker sweep trains each pending cell exactly once."""
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    a, b = (torch.load(tmp_path / f"{r}.pt") for r in (0, 1))
    config = CopyConfig(**{**TINY, "dtype": "float64"})
    model, metrics = train(config, "strided-multihead", 2)
    torch.manual_seed(config.seed)
    init = CopyModel(config, column_pattern("strided-multihead", config), 2).double()
    moved = False
    for name, ref in model.state_dict().items():
        assert torch.equal(a["state"][name], b["state"][name]), name
        torch.testing.assert_close(a["state"][name], ref, rtol=1e-9, atol=1e-9)
        moved |= not torch.allclose(ref, init.state_dict()[name])
    assert moved  # the steps did change the parameters
    assert a["accuracy"] == b["accuracy"] == pytest.approx(metrics["accuracy"])

    cells = tmp_path / "sweep"
    written = {p.stem: json.loads(p.read_text()) for p in cells.rglob("cells/*.json")}
    assert set(written) == {"dense-L1", "dense-L2", "dense-L3"}
    assert {c["rank"] for c in written.values()} == {0, 1}  # shared over both workers
    assert len(list(cells.rglob("table.md"))) == 1
