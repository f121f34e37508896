"""Every table in docs/*.md says where its numbers come from (issue 27 item 4).

Above each table, between it and the text before it, stands one source line:

- ``Source: docs/results/<experiment>/<run>/…`` — the result files kept in the repository
  (config + metrics JSON, no weights), with the command that regenerates them; every path named
  must exist, and a kept printed table (.txt, .md) must hold the quoted rows verbatim;
- ``<!-- source: none, <why> -->`` — not a measurement (definitions, a paper's printed numbers,
  a summary of tables above).

Where it is cheap, the test also reads quoted numbers back from the kept files.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))
SOURCE = re.compile(r"^(?:<!-- )?[Ss]ource: (?P<text>.*?)(?: -->)?\s*$")
PATH = re.compile(r"docs/results/[\w./+-]+")


def tables(path: Path) -> list[tuple[int, list[str], str | None]]:
    """(line of the header, the lines above back to the previous table, the source line)."""
    lines = path.read_text().split("\n")
    out, fence, start = [], False, 0
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            fence = not fence
        header = not fence and lines[i].startswith("|") and i + 1 < len(lines)
        if header and re.match(r"^\|[\s:|-]+\|$", lines[i + 1].strip()):  # header + separator
            above = lines[start:i]
            found = [m.group("text") for m in map(SOURCE.match, above) if m]
            out.append((i + 1, above, found[-1] if found else None))
            while i < len(lines) and lines[i].startswith("|"):
                i += 1
            start = i
            continue
        i += 1
    return out


ALL = [(p, line, src) for p in DOCS for line, _, src in tables(p)]


@pytest.mark.parametrize(
    ("doc", "line", "source"), ALL, ids=[f"{p.name}:{line}" for p, line, _ in ALL]
)
def test_every_table_names_its_source(doc: Path, line: int, source: str | None) -> None:
    assert source is not None, f"{doc.name}:{line}: the table has no 'Source:' line above it"
    if source.startswith("none"):
        assert len(source) > len("none, "), f"{doc.name}:{line}: say why there is no source"
        return
    paths = PATH.findall(source)
    assert paths, f"{doc.name}:{line}: name the kept files (docs/results/…)"
    printed = []
    for name in paths:
        path = ROOT / name.rstrip(".")
        assert path.exists(), f"{doc.name}:{line}: {name} does not exist"
        if path.suffix in (".txt", ".md"):  # a printed table: the quoted rows, verbatim
            printed.append(path.read_text().split("\n"))
    if printed:  # a table drawn from several printed tables: each row from one of them
        for row in _rows(doc, line):
            assert any(row in kept for kept in printed), (
                f"{doc.name}:{line}: {row!r} is in none of {paths}"
            )


def _rows(doc: Path, line: int) -> list[str]:
    """The rows (header and separator included) of the table whose header is at ``line``."""
    rows = []
    for row in doc.read_text().split("\n")[line - 1 :]:
        if not row.startswith("|"):
            break
        rows.append(row)
    return rows


def _table_after(doc: str, source_fragment: str) -> list[str]:
    """The rows of the table whose source line contains ``source_fragment``."""
    path = ROOT / "docs" / doc
    lines = path.read_text().split("\n")
    for line, _, source in tables(path):
        if source and source_fragment in source:
            rows = []
            for row in lines[line + 1 :]:
                if not row.startswith("|"):
                    return rows
                rows.append(row)
    raise AssertionError(f"no table sourced from {source_fragment} in {doc}")


def test_mca_accounting_numbers_come_from_the_kept_runs() -> None:
    """docs/mca.md's accounting table quotes seed 0's file; the seed-spread table its seeds."""
    folder = ROOT / "docs/results/mca"
    seed0 = json.loads((folder / "accounting-s0/accounting.json").read_text())
    rows = _table_after("mca.md", "accounting-s0/accounting.json")
    assert len(rows) == len(seed0["rows"])
    for row, got in zip(rows, seed0["rows"], strict=True):
        cells = [c.strip().strip("*") for c in row.strip("|").split("|")]
        assert float(cells[0]) == got["alpha"]
        keys = ("reference_padded", "reference_real_tokens", "ours_padded", "ours_unpadded")
        for cell, key in zip(cells[1:], keys, strict=True):
            assert cell == f"{100 * got[key]:.1f}%", (key, cell, got[key])
    rows = _table_after("mca.md", "accounting-s<seed>")
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        alpha = float(cells[0])
        gaps = []
        names = [p.name for p in folder.iterdir() if re.fullmatch(r"accounting-s\d+", p.name)]
        for name in sorted(names, key=lambda x: int(x.removeprefix("accounting-s"))):
            path = folder / name / "accounting.json"
            got = {r["alpha"]: r for r in json.loads(path.read_text())["rows"]}
            if alpha in got:
                gaps.append(100 * (got[alpha]["ours_padded"] - got[alpha]["ours_unpadded"]))
        assert cells[1] == str(len(gaps))
        assert cells[2] == " / ".join(f"{g:+.2f}" for g in gaps)


def test_mca_sweep_numbers_come_from_the_kept_run() -> None:
    """docs/mca.md's α-sweep table: every number is the kept sweep16 run's (`metrics.json`)."""
    folder = ROOT / "docs/results/mca/sweep16"
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["passages"] == 16
    assert metrics["machine"]["torch_threads"] == 1
    rows = _table_after("mca.md", "sweep16/metrics.json")
    assert len(rows) == len(metrics["cells"])
    for row, cell in zip(rows, metrics["cells"], strict=True):
        assert cell == json.loads((folder / f"cells/alpha_{cell['alpha']:.2f}.json").read_text())
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        assert float(cells[0].strip("*")) == cell["alpha"]
        assert cells[1].replace("*", "").split(" ")[0] == f"{cell['macs_kept']:.1%}"
        if "fewer" in cells[1]:
            assert f"({1 / cell['macs_kept']:.1f}× fewer)" in cells[1], cells[1]
        seconds = cell["projection_seconds"]
        assert cells[2].startswith(f"{seconds['sampled'] / seconds['exact']:.1f}× slower")
        assert cells[3].strip("*") == f"{cell['embedding_cosine_mean']:.4f}"
        assert cells[4] == f"{cell['retrieval_accuracy']:.3f}"
        errors = cell["error_vs_bound"]
        assert cells[5] == " / ".join(f"{errors[la]['mean_error']:.2f}" for la in ("0", "5"))
        assert cells[6] == " / ".join(f"{errors[la]['bound']:.1f}" for la in ("0", "5"))


@pytest.mark.parametrize("n", [256, 4096])
def test_connectivity_table_numbers_come_from_the_kept_reports(n: int) -> None:
    """docs/analysis.md's Assumption 1 tables: each row's sparsity per layer, hops and verdict
    are the kept `sparseattn analyze … --json` report's; the n = 4096 times the kept medians."""
    folder = ROOT / f"docs/results/analysis/connectivity-n{n}"
    rows = _table_after("analysis.md", f"connectivity-n{n}/")
    assert len(rows) == len(list(folder.glob("*.json")))
    for row in rows:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))]
        spec = cells[0].strip("`").replace(" --config ", "-")
        report = json.loads((folder / f"{spec}.json").read_text())
        assert report["n"] == n
        sparsity = " \\| ".join(f"{100 * s:.2f}%" for s in report["sparsity"])
        assert cells[5] == sparsity, (spec, cells[5], sparsity)
        hops = "never" if report["hops"] is None else str(report["hops"])
        assert cells[4].split(" ")[0] == hops, (spec, cells[4], report["hops"])
        assert cells[6].strip("*") == ("yes" if report["satisfied"] else "no"), spec
        if n == 4096:  # the time column: the median of the kept runs
            times = json.loads((ROOT / "docs/results/analysis/times-n4096.json").read_text())
            assert cells[7] == f"{times['seconds'][spec]['median']:.2f} s", (spec, cells[7])


@pytest.mark.parametrize(
    ("run", "columns"),
    [
        ("bidir-n64-d64-w8-cb96ed44", None),  # the default sweep: every column
        ("causal-n64-d64-w8-2edc3566", ("strided-union", "fixed-union", "star")),
    ],
)
def test_copying_n64_numbers_come_from_the_kept_cells(
    run: str, columns: tuple[str, ...] | None
) -> None:
    """docs/experiments.md's n = 64 copying tables (the default sweep; the reduced causal run,
    tril): every accuracy is its kept cell JSON's, and the kept cells are the table's."""
    from sparseattn.lab.experiments.copying import COLUMNS  # the table's order

    columns = COLUMNS if columns is None else columns
    folder = ROOT / "docs/results/copying" / run
    config = json.loads((folder / "config.json").read_text())
    assert config["causal"] == run.startswith("causal")
    rows = _table_after("experiments.md", f"{run}/ (regenerate")
    assert len(rows) == 4
    assert len(list(folder.glob("cells/*.json"))) == len(rows) * len(columns)
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        depth = int(cells[0].removesuffix("-layer"))
        for column, cell in zip(columns, cells[1:], strict=True):
            got = json.loads((folder / f"cells/{column}-L{depth}.json").read_text())
            assert (got["column"], got["depth"]) == (column, depth)
            assert got["causal"] == config["causal"]
            if got["causal"]:  # the tril reading: eq. (4)/(5) masked to j <= i
                assert got["pattern"].endswith(".causal()"), got["pattern"]
            assert cell == f"{got['accuracy']:.2%}", (column, depth, cell, got["accuracy"])


@pytest.mark.parametrize(
    "runs",
    [
        ("bidir-n256-d64-w16-94e23a2c", "bidir-n256-d64-w16-42b0922d"),
        ("causal-n256-d64-w16-0f30b352", "causal-n256-d64-w16-ba074917"),
    ],
    ids=["table1", "table2"],
)
def test_copying_n256_seed_table_comes_from_the_kept_cells(runs: tuple[str, str]) -> None:
    """docs/experiments.md's n = 256 Tables 1 and 2 (two seeds each): each cell's "seed 0 /
    seed 1" accuracies are the kept cell JSONs' of the two runs (seeds 0, 1), and the kept cells
    are the table's."""
    from sparseattn.lab.experiments.copying import COLUMNS

    folders = [ROOT / "docs/results/copying" / run for run in runs]
    configs = [json.loads((f / "config.json").read_text()) for f in folders]
    assert [c["seed"] for c in configs] == [0, 1]
    assert all(c["causal"] == runs[0].startswith("causal") for c in configs)
    rows = _table_after("experiments.md", f"{runs[0]}/ and")
    assert len(rows) == 4
    for folder in folders:
        assert len(list(folder.glob("cells/*.json"))) == len(rows) * len(COLUMNS)
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        depth = int(cells[0].removesuffix("-layer"))
        for column, cell in zip(COLUMNS, cells[1:], strict=True):
            kept = [json.loads((f / f"cells/{column}-L{depth}.json").read_text()) for f in folders]
            want = " / ".join(f"{k['accuracy']:.1%}" for k in kept)
            assert cell.split(" (")[0] == want, (column, depth, cell, want)


def test_copying_longer_budget_numbers_come_from_the_kept_cells() -> None:
    """docs/experiments.md's 3000-step table at n = 256: accuracy, steps and the curve points."""
    folder = ROOT / "docs/results/copying/bidir-n256-d64-w16-e53fddbb"
    rows = _table_after("experiments.md", "bidir-n256-d64-w16-e53fddbb/ (")
    assert len(rows) == 2
    for row in rows:
        cell, accuracy, steps, curve = (c.strip() for c in row.strip().strip("|").split("|"))
        column, depth = cell.split(" L")
        got = json.loads((folder / f"cells/{column}-L{depth}.json").read_text())
        assert accuracy == f"{got['accuracy']:.2%}" and steps == str(got["steps_trained"])
        points = {p["step"]: p["batch_accuracy"] for p in got["curve"]}
        for point in curve.split(", "):
            step, value = point.split(": ")
            assert value == f"{points[int(step)]:.1%}", (cell, point)


def test_sparsefinder_numbers_come_from_the_kept_run() -> None:
    """docs/sparsefinder.md's downstream and shared-QK Reformer tables: every number is the kept
    issue16 run's (`downstream.json`; the w = 1 points of `sweep-points.json`)."""
    folder = ROOT / "docs/results/sparsefinder/issue16"
    down = json.loads((folder / "downstream.json").read_text())["methods"]
    rows = _table_after("sparsefinder.md", "issue16/downstream.json")
    assert len(rows) == sum(len(knobs) for knobs in down.values())
    got = [r for knobs in down.values() for r in knobs.values()]
    for row, r in zip(rows, got, strict=True):
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        assert re.search(rf"\b{r['knob']}\b", cells[0]), (cells[0], r["knob"])
        want = [
            f"{r['graph_sparsity']:.3f}",
            f"{r['embedding_cosine_mean']:.3f} / {r['embedding_cosine_min']:.3f}",
            f"{r['retrieval_accuracy']:.3f}",
            f"{r['retrieval_agreement']:.3f}",
        ]
        assert cells[1:] == want, (cells[0], cells[1:], want)
    points = json.loads((folder / "sweep-points.json").read_text())
    rows = _table_after("sparsefinder.md", "issue16/sweep-points.json")
    for row, method in zip(rows, ("reformer", "reformer_separate"), strict=True):
        cells = [c.strip() for c in row.strip().strip("|").split("|")][1:]
        want = [
            f"{p['sparsity']:.3f}, {p['recall']:.3f}" for p in points[method] if p["window"] == 1
        ]
        assert cells == want, (method, cells, want)


def test_the_checker_sees_a_missing_source_or_one_without_kept_files(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "Text.\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n"
        "Source: run lost.\n\n| c |\n|---|\n| 3 |\n\n"
        "```\n| not | a table |\n|---|---|\n```\n"
    )
    found = tables(page)
    assert [(line, source) for line, _, source in found] == [(3, None), (9, "run lost.")]
    with pytest.raises(AssertionError, match="no 'Source:' line"):
        test_every_table_names_its_source(page, 3, None)
    with pytest.raises(AssertionError, match="name the kept files"):
        test_every_table_names_its_source(page, 9, "run lost.")


def test_sparsefinder_decoder_teacher_numbers_come_from_the_kept_run() -> None:
    """docs/causal.md's decoder teacher table: the kept decoder-a36d3a67 run's `teacher.json`,
    whose numbers are the kept teacher's and softmax twin's `cells/dense-s0.json`."""
    folder = ROOT / "docs/results/sparsefinder/decoder-a36d3a67"
    teacher = json.loads((folder / "teacher.json").read_text())
    twin = teacher["softmax_twin"]
    for cell, sub in ((teacher, "teacher"), (twin, "softmax-twin")):
        kept = json.loads((folder / sub / "cells/dense-s0.json").read_text())
        assert (kept["perplexity"], kept["bits_per_byte"]) == (
            cell["perplexity"],
            cell["bits_per_byte"],
        )
    rows = _table_after("causal.md", "decoder-a36d3a67/teacher.json")
    assert len(rows) == 2
    for row, cell in zip(rows, (twin, teacher), strict=True):
        cells = [c.strip().strip("*") for c in row.strip().strip("|").split("|")]
        assert cells[1:] == [f"{cell['perplexity']:.3f}", f"{cell['bits_per_byte']:.4f}"]


def _gpu_ms(path: str, **key) -> float:
    """The time in ms of the one row of a kept ``sparseattn bench gpu`` run matching ``key``."""
    rows = json.loads((ROOT / "docs/results/gpu/h100-20261127" / path).read_text())["rows"]
    found = [r for r in rows if all(r.get(k) == v for k, v in key.items())]
    assert len(found) == 1, (path, key, len(found))
    return 1e3 * found[0]["time_s"]


def test_gpu_h100_numbers_come_from_the_kept_runs() -> None:
    """docs/benchmarks.md's H100 tables: the flex engine against FlexAttention by hand, the
    stream, the training step, the sparse maps and the calibration, read back from the runs."""
    flex = _table_after("benchmarks.md", "h100-20261127/run1-bench.json (")
    whos = ("flex direct", "sparseattn flex", "sparseattn auto (flex)")
    for row in flex:
        n, mode, *cells = [c.strip() for c in row.strip("|").split("|")]
        main = {"section": "main", "dtype": "bfloat16", "n": int(n), "mode": mode}
        times = [_gpu_ms("run1-bench.json", **main, who=who) for who in whos]
        assert cells[:3] == [f"{t:.3f}" for t in times], row
        assert cells[3] == f"{times[1] / times[0]:.2f}", row
    stream = _table_after("benchmarks.md", "h100-20261127/run3-overhead.json (")
    for row in stream:
        n, mode, ours, hand, ratio = [c.strip() for c in row.strip("|").split("|")]
        key = {"section": "stream", "n": int(n), "mode": mode}
        got = [_gpu_ms("run3-overhead.json", **key, who=w) for w in whos[1::-1]]
        assert [ours, hand, ratio] == [f"{got[0]:.3f}", f"{got[1]:.3f}", f"{got[0] / got[1]:.2f}"]
    step = {"section": "module", "n": 32768}
    ours = _gpu_ms("run1-bench.json", **step, who="SparseAttention")
    mha = _gpu_ms("run1-bench.json", **step, who="nn.MultiheadAttention")
    assert f"| 32768 | 1 | {ours:.2f} | {mha:.2f} | {mha / ours:.2f} |" in _doc("benchmarks.md")
    entmax = {"section": "entmax", "n": 32768, "mode": "fwd+bwd"}
    ent = _gpu_ms("run1-bench.json", **entmax, who="longformer entmax15")
    soft = _gpu_ms("run1-bench.json", **entmax, who="longformer softmax (flex)")
    assert f"| 32768 | fwd+bwd | {ent:.2f} | {ent / soft:.2f} |" in _doc("benchmarks.md")
    cal = {"section": "calibrate", "pattern": "bigbird", "map": "softmax"}
    dense = _gpu_ms("run1-bench.json", **cal, who="dense")
    flex_ms = _gpu_ms("run1-bench.json", **cal, who="flex")
    assert f"| BigBird | 0.189 | {dense:.2f} |" in _doc("benchmarks.md")
    assert f"{flex_ms:.2f} |" in _doc("benchmarks.md")


def test_gpu_h100_evening_numbers_come_from_the_kept_runs() -> None:
    """docs/benchmarks.md's H100 runs 5 and 6: the flex engine against FlexAttention by hand,
    the sparse maps and the tiles, every cell read back from the runs."""
    whos = ("flex direct", "sparseattn flex", "sparseattn auto (flex)", "sdpa dense")
    for row in _table_after("benchmarks.md", "h100-20261127/run5-bench.json ("):
        n, mode, *cells = [c.strip() for c in row.strip("|").split("|")]
        main = {"section": "main", "dtype": "bfloat16", "n": int(n), "mode": mode}
        d, e, a, sd = (_gpu_ms("run5-bench.json", **main, who=who) for who in whos)
        want = [d, e, a, e / d, a / d, sd, sd / e]
        assert cells == [
            f"{x:.3f}" if i in (0, 1, 2, 5) else f"{x:.2f}" for i, x in enumerate(want)
        ]
    for row in _table_after("benchmarks.md", "h100-20261127/run6-entmax.json ("):
        n, mode, *cells = [c.strip() for c in row.strip("|").split("|")]
        key = {"section": "entmax", "n": int(n), "mode": mode}
        t = {w: _gpu_ms("run6-entmax.json", **key, who=w) for w in ("longformer entmax15",
             "longformer softmax (flex)", "causal entmax15 (ours)", "causal sdpa",
             "dense entmax15 (ours)", "dense sdpa")}  # fmt: skip
        ent, soft, causal, sdpa_c, dense, sdpa_d = t.values()
        want = [ent, ent / soft, causal, causal / sdpa_c, dense, dense / sdpa_d]
        assert cells[:6] == [f"{x:.2f}" for x in want], row
    for row in _table_after("benchmarks.md", "h100-20261127/run5-bench.json, the tiles"):
        pattern, who, *cells = [c.strip() for c in row.strip("|").split("|")]
        key = {"section": "tiles", "n": 32768, "pattern": pattern, "who": who}
        got = [_gpu_ms("run5-bench.json", **key, mode=m) for m in ("fwd", "fwd+bwd")]
        assert cells == [f"{x:.2f}" for x in got], row


def _doc(name: str) -> str:
    return (ROOT / "docs" / name).read_text()


def _lm_cell(folder: Path, column: str, w: int | None, seed: int) -> dict:
    name = column if w is None else f"{column}-w{w}"
    return json.loads((folder / f"cells/{name}-s{seed}.json").read_text())


def test_lm_sweep_numbers_come_from_the_kept_cells() -> None:
    """docs/causal.md's 800-step LM table (`sparseattn lm`, the default sweep): every entry is
    the mean of its two kept cells (seeds 0 and 1) ± half their spread, with their mean
    measured sparsity; the table is the run's `table.md` (checked verbatim above)."""
    folder = ROOT / "docs/results/lm/n256-d64-L2-800steps-b310b9e8"
    config = json.loads((folder / "config.json").read_text())
    assert (config["steps"], config["n"], config["causal_form"]) == (800, 256, "child")
    assert len(list(folder.glob("cells/*.json"))) == 50
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["complete"]
    rows = _table_after("causal.md", "n256-d64-L2-800steps-b310b9e8/table.md")
    assert len(rows) == 9
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        column = cells[0].lower().replace(" ", "-")
        widths = [None] if column == "dense" else [16, 32, 64]
        for w, entry in zip(widths, cells[1:], strict=False):
            got = [_lm_cell(folder, column, w, seed) for seed in (0, 1)]
            assert all(c["steps"] == 800 and c["config"] == config for c in got)
            ppl = [c["perplexity"] for c in got]
            sparsity = sum(c["sparsity"] for c in got) / 2
            want = f"{sum(ppl) / 2:.3f} ± {(max(ppl) - min(ppl)) / 2:.3f} ({sparsity:.1%})"
            assert entry == want, (column, w, entry, want)
    levels = metrics["ngram_perplexity"]
    text = (ROOT / "docs/causal.md").read_text()
    assert (
        f"unigram {levels['unigram']:.2f}, **bigram {levels['bigram']:.2f}**, "
        f"trigram {levels['trigram']:.2f}" in text
    )


def test_lm_4000_step_numbers_come_from_the_kept_cells() -> None:
    """docs/causal.md's 4000-step LM check (w = 16, seed 0): the 4000-step column is each kept
    cell's perplexity, the 800-step column the sweep's two-seed mean, the label the measured
    sparsity (both runs' where they differ); its dense cell is the decoder teacher's twin."""
    folder = ROOT / "docs/results/lm/n256-d64-L2-4000steps-92ce7b83"
    sweep = json.loads(
        (ROOT / "docs/results/lm/n256-d64-L2-800steps-b310b9e8/metrics.json").read_text()
    )["summary"]
    config = json.loads((folder / "config.json").read_text())
    assert config["steps"] == 4000
    assert len(list(folder.glob("cells/*.json"))) == 9
    rows = _table_after("causal.md", "n256-d64-L2-4000steps-92ce7b83/metrics.json")
    assert len(rows) == 9
    for row in rows:
        cells = [c.strip().strip("*") for c in row.strip().strip("|").split("|")]
        label, _, sparsities = cells[0].partition(" (")
        column = label.lower().replace(" ", "-")
        w = None if column == "dense" else 16
        got = _lm_cell(folder, column, w, 0)
        assert (got["steps"], got["config"]) == (4000, config)
        short = sweep[column if w is None else f"{column}-w{w}"]
        levels = [f"{short['sparsity']:.1%}", f"{got['sparsity']:.1%}"]
        levels = levels[:1] if levels[0] == levels[1] else levels
        if column == "dense":
            levels = ["0%"]
        assert sparsities.rstrip(")") == " / ".join(levels), (column, sparsities, levels)
        assert cells[1:] == [f"{short['perplexity']:.3f}", f"{got['perplexity']:.3f}"], column
    twin = ROOT / "docs/results/sparsefinder/decoder-a36d3a67/softmax-twin/cells/dense-s0.json"
    dense = _lm_cell(folder, "dense", None, 0)
    assert json.loads(twin.read_text())["perplexity"] == dense["perplexity"]


def test_sparsefinder_timing_numbers_come_from_the_kept_run() -> None:
    """docs/sparsefinder.md's timing table: every entry is the kept timing.json's."""
    kept = json.loads((ROOT / "docs/results/sparsefinder/issue16/timing.json").read_text())
    rows = _table_after("sparsefinder.md", "issue16/timing.json")
    assert len(rows) == len(kept["rows"])
    for row, r in zip(rows, kept["rows"], strict=True):
        cells = [c.strip().strip("*") for c in row.strip().strip("|").split("|")]
        assert cells[0].split(" ")[0] == str(r["n"])
        assert cells[1].startswith("k-means" if r["method"] == "sf_kmeans" else "distance")
        fast = min(r["full_entmax_seconds"], r["full_entmax_per_head_loop_seconds"])
        want = [f"{r[k]:.3f}" for k in ("sparsity", "recall", "exact_queries")]
        want += [
            f"{r[k]:.3f} s"
            for k in (
                "full_entmax_seconds",
                "full_entmax_per_head_loop_seconds",
                "predict_seconds",
                "attention_seconds",
            )
        ]
        want += [f"{r['ratio_total_to_full']:.2f}", f"{r['total_seconds'] / fast:.2f}"]
        assert cells[2:] == want, (r["n"], r["method"], cells[2:], want)


def test_host_overhead_numbers_come_from_the_kept_runs() -> None:
    """docs/engines.md's host time per call, before and after de9853d, from the two rows."""
    keys = (
        "flex direct us",
        "sparseattn flex us",
        "sparseattn flex, call stubbed us",
        "sparseattn flex, call stubbed, no host checks us",
        "sparseattn auto us",
    )
    runs = [
        json.loads((ROOT / f"docs/results/flex/host-overhead-cpu-{c}.json").read_text())["row"]
        for c in ("9b099b5", "de9853d")
    ]
    for c, run in zip(("9b099b5", "de9853d"), runs, strict=True):  # "within 12 µs"
        second = ROOT / f"docs/results/flex/host-overhead-cpu-{c}-second.json"
        again = json.loads(second.read_text())["row"]
        assert all(abs(run[key] - again[key]) <= 12 for key in keys), c
    rows = _table_after("engines.md", "host-overhead-cpu-9b099b5.json")
    assert len(rows) == len(keys)
    for row, key in zip(rows, keys, strict=True):
        cells = [c.strip() for c in row.strip("|").split("|")][1:]
        assert cells == [f"{run[key]:.1f}" for run in runs], row


def test_longformer_pair_share_numbers_come_from_run6_and_the_layout() -> None:
    """docs/engines.md, "Where the Longformer time may go": the forward times of the H100's
    run 6 scaled by the layouts' pair counts (Longformer(512, 16) at n = 32768, block 64)."""
    pytest.importorskip("triton", reason="the pair count is the Triton layout's")
    import sparseattn as sa
    from sparseattn.engines.triton_entmax import graph_layout

    pairs = graph_layout(sa.longformer(512, 16).graph(32768), 64).pairs
    share = pairs / 512**2
    fwd = {"section": "entmax", "n": 32768, "mode": "fwd"}
    ent, dense, flex, sdpa = (
        _gpu_ms("run6-entmax.json", **fwd, who=w)
        for w in ("longformer entmax15", "dense entmax15 (ours)", "longformer softmax (flex)",
                  "dense sdpa")
    )  # fmt: skip
    quoted = (pairs, dense, dense * share, ent, ent / (dense * share), flex, sdpa * share)
    assert [f"{x:.2f}" for x in quoted] == [
        "5602.00", "35.09", "0.75", "5.87", "7.83", "1.03", "0.15"
    ]  # fmt: skip
    assert f"{flex / (sdpa * share):.1f}" == "6.8"
    assert f"{dense * 2 * 132 / 4096:.1f}" == "2.3"  # one program of 512 key blocks, 2 per SM
    text = _doc("engines.md")
    for quote in ("5602 pairs", "(35.09 ms) predicts 0.75 ms", "5.87 ms, 7.8×", "0.15 ms: 6.8×",
                  "about 2.3 ms"):  # fmt: skip
        assert quote in " ".join(text.split()), quote


def test_dmin_grid_tables_are_recomputed_from_the_kept_cells() -> None:
    """docs/expressivity.md's d_min tables quote `printed.md` verbatim (checked above); here
    `printed.md` itself is recomputed from the kept cells (and the full-scan check) by the
    functions that wrote it."""
    from sparseattn.lab.experiments.dmin_grid import printed, summaries

    folder = ROOT / "docs/results/expressivity/dmin-cpu-grid"
    lines = printed(summaries(folder))
    assert (folder / "printed.md").read_text() == "\n".join(lines) + "\n"
