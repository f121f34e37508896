"""`sparseattn lm` (Yun Fig. 1a, small): the quick sweep end to end, resuming, causality of every
configuration's graphs (brute force over the edges and the model's logits), bad CLI options."""

from __future__ import annotations

import json
import math
import socket

import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

from sparseattn.lab.cli import main
from sparseattn.lab.experiments import lm, runner
from sparseattn.lab.experiments.lm import COLUMNS, LMConfig, column_pattern, layer_patterns
from sparseattn.patterns import HeadSplit

FORMS = ("child", "tril")


def _layer_graphs(column: str, w: int, config: LMConfig, seed: int = 0):
    """The (heads, n, n) bool adjacency of every layer of a column (a single graph broadcast)."""
    pattern = column_pattern(column, w, config, seed)
    out = []
    for p in layer_patterns(pattern, config.layers):
        split = isinstance(p, HeadSplit)
        graph = p.graph(config.n, num_heads=config.heads) if split else p.graph(config.n)
        out.append((graph, graph.to_dense().expand(config.heads, config.n, config.n)))
    return out


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("column", COLUMNS)
def test_every_configuration_is_causal(column, form):
    """No edge (i, j) with j > i, in every layer and head, at every default w, checked edge by
    edge; every query keeps itself (so no row is empty) and, but for dense, some pair is cut."""
    config = LMConfig(causal_form=form)
    n = config.n
    for w in config.widths:
        for graph, adj in _layer_graphs(column, w, config, seed=3):
            rows, cols = graph.row_indices(), graph.col
            assert bool((cols <= rows).all()), f"{column} w={w}: a key after its query"
            for h in range(config.heads):  # brute force over all n^2 pairs
                for i in range(0, n, 37):
                    assert not adj[h, i, i + 1 :].any()
                    assert adj[h, i, i]
            possible = n * (n + 1) // 2
            if column != "dense":
                assert int(adj.sum()) < config.heads * possible
            else:
                assert int(adj.sum()) == config.heads * possible


def test_child_strided_keeps_the_previous_w_tokens():
    """The default causal form is Child et al.'s: A¹_i = {i − w + 1, …, i}, A²_i = i − m·w."""
    config = LMConfig(n=64, widths=(8,))
    (_, a1), (_, a2) = _layer_graphs("strided-sequential", 8, config)
    i = 40
    assert a1[0, i].nonzero().flatten().tolist() == list(range(33, 41))
    assert a2[0, i].nonzero().flatten().tolist() == [0, 8, 16, 24, 32, 40]


@pytest.mark.parametrize("column", ["strided-multihead", "fixed-sequential", "random", "star"])
def test_model_logits_do_not_see_later_bytes(column):
    """Changing bytes after position t leaves the logits at positions <= t unchanged."""
    config = lm.quick_config(widths=(4,))
    pattern = column_pattern(column, 4, config, seed=1)
    torch.manual_seed(0)
    model = lm.make_model(config).eval()
    windows = torch.randint(256, (2, config.n + 1))
    changed = windows.clone()
    t = 37
    changed[:, t + 1 :] = torch.randint(256, changed[:, t + 1 :].shape)
    with torch.no_grad():
        a = lm.next_byte_logits(model, windows, pattern)
        b = lm.next_byte_logits(model, changed, pattern)
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1])
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])


def test_random_matches_the_mean_sparsity_of_the_other_columns():
    config = LMConfig()
    for w in config.widths:
        got = lm.sparsity(column_pattern("random", w, config), config.n, config.heads)
        assert abs(got - lm.random_target(w, config)) < 0.01


def test_quick_sweep_end_to_end_then_resume_skips_finished_cells(tmp_path, monkeypatch):
    """The CLI's --quick path writes every cell, the table, metrics and the figure; a re-run
    trains nothing; deleting one cell retrains exactly that cell."""
    out = tmp_path / "lm"
    argv = ["lm", "--quick", "--steps", "3", "--out-dir", str(out), "--run", "q"]
    assert main(argv) == 0
    folder = out / "q"
    config = lm.quick_config(steps=3)
    names = {lm.cell_name(*k) for k in lm.cell_keys(config)}
    assert {p.stem for p in (folder / "cells").glob("*.json")} == names
    assert len(names) == 6 * 2 + 2 + 2 + 1
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["complete"]
    assert (folder / "lm.png").stat().st_size > 0
    assert "STRIDED UNION" in (folder / "table.md").read_text()
    for key, entry in metrics["summary"].items():
        assert entry["perplexity"] > 1 and 0 <= entry["sparsity"] < 1, key
    assert metrics["summary"]["dense"]["sparsity"] == 0

    calls = []
    real_train = lm.train

    def counting_train(*args, **kwargs):
        calls.append(args[1:4])
        return real_train(*args, **kwargs)

    monkeypatch.setattr(lm, "train", counting_train)
    before = (folder / "cells" / "star-w4-s0.json").read_text()
    assert main(argv) == 0
    assert calls == []
    (folder / "cells" / "fixed-union-w8-s0.json").unlink()
    assert main(argv) == 0
    assert calls == [("fixed-union", 8, 0)]
    assert (folder / "cells" / "star-w4-s0.json").read_text() == before


def test_a_run_folder_with_another_config_is_refused(tmp_path):
    argv = ["lm", "--quick", "--steps", "1", "--patterns", "dense", "--out-dir", str(tmp_path)]
    assert main([*argv, "--run", "r"]) == 0
    assert main([*argv, "--run", "r", "--lr", "0.01"]) == 2


BAD = {
    "widths=x": ["lm", "--widths", "x"],
    "widths>=n": ["lm", "--n", "16", "--widths", "16"],
    "widths=0": ["lm", "--widths", "0"],
    "n=4": ["lm", "--n", "4"],
    "seeds=-1": ["lm", "--seeds", "-1"],
    "patterns": ["lm", "--patterns", "nope"],
    "causal-form": ["lm", "--causal-form", "nope"],
    "d not multiple of heads": ["lm", "--d", "30"],
    "steps=0": ["lm", "--steps", "0"],
    "lr=0": ["lm", "--lr", "0"],
    "parallel": ["lm", "--parallel", "nope"],
    "threads=0": ["lm", "--threads", "0"],
}


@pytest.mark.parametrize("argv", BAD.values(), ids=BAD.keys())
def test_bad_options_give_one_line_and_no_run_folder(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    status = main(argv)
    out, err = capsys.readouterr()
    assert status != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), err
    assert "Traceback" not in out + err
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- scale-out
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TINY = dict(steps=3, widths=(4,), progress=False)


def _worker(rank: int, world: int, port: int, out: str) -> None:
    tdist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        torch.set_num_threads(1)
        config = lm.quick_config(**TINY, dtype="float64")
        model, metrics = lm.train(config, "fixed-multihead", 4, 0, runner.Dist(rank, world))
        torch.save({"state": model.state_dict(), "loss": metrics["loss"]}, f"{out}/{rank}.pt")
        sweep = lm.quick_config(**TINY, out_dir=f"{out}/sweep", columns=("dense",), seeds=(0, 1, 2))
        lm.run(sweep, dist=runner.Dist(rank, world))
    finally:
        tdist.destroy_process_group()


def test_ddp_matches_single_process_and_cells_are_shared(tmp_path):
    """Two gloo workers: data-parallel training equals one process on the same global batch
    (float64, identical parameters and validation loss); a two-worker sweep trains each
    pending cell once, spread over both workers, and rank 0 alone writes the table."""
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    a, b = (torch.load(tmp_path / f"{r}.pt") for r in (0, 1))
    model, metrics = lm.train(lm.quick_config(**TINY, dtype="float64"), "fixed-multihead", 4, 0)
    for name, ref in model.state_dict().items():
        assert torch.equal(a["state"][name], b["state"][name]), name
        torch.testing.assert_close(a["state"][name], ref, rtol=1e-9, atol=1e-9)
    assert a["loss"] == b["loss"] == pytest.approx(metrics["loss"], rel=1e-9)
    written = {p.stem: json.loads(p.read_text()) for p in tmp_path.rglob("sweep/*/cells/*.json")}
    assert set(written) == {"dense-s0", "dense-s1", "dense-s2"}
    assert {c["rank"] for c in written.values()} == {0, 1}
    assert len(list(tmp_path.rglob("sweep/*/table.md"))) == 1


def test_ngram_reference_by_hand():
    """Add-α bigram on a four-byte text, scored on the two predicted bytes, by hand."""
    train, valid, a = torch.tensor([1, 2, 1, 2]), torch.tensor([1, 2, 1]), 0.01
    p12, p21 = (2 + a) / (2 + 256 * a), (1 + a) / (1 + 256 * a)
    expected = math.exp(-(math.log(p12) + math.log(p21)) / 2)
    assert lm.ngram_perplexity(train, valid, 2, 2, a) == pytest.approx(expected, rel=1e-12)
    unigram = math.exp(-(math.log((2 + a) / (4 + 256 * a)) * 2) / 2)  # both scored bytes
    valid2 = torch.tensor([1, 2, 2])
    assert lm.ngram_perplexity(train, valid2, 2, 1, a) == pytest.approx(unigram, rel=1e-12)


@pytest.mark.parametrize(
    "field, value",
    [("positions", "rotary"), ("dropout", 1.0), ("warmup", -1), ("dtype", "float16")],
)
def test_config_fields_outside_the_cli_are_validated(field, value):
    with pytest.raises(ValueError, match=field):
        LMConfig(**{field: value}).validate()
