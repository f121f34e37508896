"""The ``sparseattn`` command line. Each feature adds its subcommand here, importing lazily.

One file: the command tree, one typer declaration per command (its options and help,
then the registered experiment's config → run → summary); each command imports its
experiment lazily, so the file is long but flat, and splitting it would only scatter the
command line's single source of options.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Annotated

from .._extras import missing

try:
    import typer
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
except ModuleNotFoundError as err:
    raise missing(err, "cli", "the sparseattn command line") from err


class _App(typer.Typer):
    """The app; called without arguments (the console script) it runs :func:`main`."""

    def __call__(self, *args, **kwargs):
        if args or kwargs:
            return super().__call__(*args, **kwargs)
        raise SystemExit(main())


app = _App(
    help="sparseattn: sparse attention patterns, maps, engines and experiments.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
#: Width of tables and text when output is piped or redirected (rich would use 80 columns and
#: fold wide tables); tables keep their natural width, only lines longer than this wrap.
PIPED_WIDTH = 200


def _console() -> Console:
    """The rich console: as usual on a terminal; piped or redirected, :data:`PIPED_WIDTH`
    columns (no colour or cursor codes either: rich writes none off a terminal). A COLUMNS
    environment variable still decides the width."""
    plain = Console()
    if plain.is_terminal or os.environ.get("COLUMNS"):
        return plain
    return Console(width=PIPED_WIDTH)


console = _console()


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status.

    A bad option or value is reported as one line ``Error: …`` on stderr with status 2, never a
    traceback: click's usage errors and the library's ValueError/TypeError (which name the
    argument) alike. Every command validates all its options before it loads a model or writes
    a run folder.
    """
    command = typer.main.get_command(app)
    try:
        result = command.main(args=argv, prog_name="sparseattn", standalone_mode=False)
    except typer.Abort:
        return _fail("aborted", 1)
    except typer.TyperException as err:  # click's usage errors, as typer vendors them
        if type(err).__name__ == "NoArgsIsHelpError":
            typer.echo(err.ctx.get_help(), err=True)
            return 2
        message = err.format_message() if hasattr(err, "format_message") else str(err)
        return _fail(message, getattr(err, "exit_code", 2))
    except (ValueError, TypeError) as err:
        return _fail(str(err), 2)
    return result if isinstance(result, int) else 0


def _fail(message: str, code: int) -> int:
    print(f"Error: {' '.join(message.split())}", file=sys.stderr)
    return code


#: What each command's ``--quick`` run can and cannot show, printed after its results.
QUICK_NOTES = {
    "copying": "n = 32, 200 steps, depths 1-2: it shows that every column trains, is evaluated "
    "and writes its files. It cannot reproduce Tables 1-2: at this length and budget the sparse "
    "columns stay near chance and dense is only partly trained. For the tables: `sparseattn "
    "copying` (n = 64) or `--paper` (docs/experiments.md).",
    "lm": "n = 64, 20 steps, one seed: it shows that every column trains and is evaluated. "
    "20 steps leave every model near its untrained loss, so the perplexities do not rank the "
    "patterns (Fig. 1a needs `sparseattn lm`).",
    "dam": "n = 64, 100 + 40 + 20 steps, two λ: it shows the whole pipeline (warm start, learned "
    "masks, extraction, retraining). The masks have not converged, so the sparsities and "
    "accuracies are not SparseBERT's findings (`sparseattn dam` for those).",
    "sparsefinder": "few passages and knobs (a tiny teacher unless the full one is cached): it "
    "shows every predictor fitting and the evaluation running. It cannot compare methods: the "
    "recall-sparsity points are too few and the teacher too short (`sparseattn sparsefinder`).",
    "sparsefinder-decoder": "a 150-step n = 64 teacher, few knobs: it shows the pipeline on a "
    "decoder. It cannot say how a trained decoder behaves: the teacher's attention is barely "
    "trained (`sparseattn sparsefinder-decoder`).",
    "mca": "α ∈ {0, 0.2, 1.0} on 16 passages, in its own run folder: it shows the sweep and the "
    "accounting. It cannot draw docs/mca.md's curves: three α give three points, and retrieval "
    "accuracy moves in steps of 1/16 (`sparseattn mca` for the table).",
}


def _quick_note(command: str) -> None:
    """Say after a ``--quick`` run what it can and cannot show (:data:`QUICK_NOTES`)."""
    console.print(f"Quick run ({command}): {QUICK_NOTES[command]}", markup=False)


def _experiment(
    name: str,
    quick: bool = False,
    *,
    adjust=None,
    hint: str = "",
    run_errors: bool = True,
    **fields,
) -> None:
    """Run a registered experiment (:mod:`sparseattn.lab.experiments.registry`) as its command:
    its quick config or its config with ``fields`` (those left None keep the defaults),
    ``adjust(config)`` for the options that are not fields, the run, then the summary. A
    ValueError of the config (``hint`` appended) or of the run (unless ``run_errors`` is off)
    is a bad option; an experiment run under torchrun prints from rank 0 only."""
    from .experiments.registry import experiment

    exp = experiment(name)
    try:
        config = exp.configure(quick, **{k: v for k, v in fields.items() if v is not None})
        config = config if adjust is None else adjust(config)
    except ValueError as err:
        raise typer.BadParameter(f"{err}{hint}") from err
    try:
        result = exp.run(config)
    except ValueError as err:
        if not run_errors:
            raise
        raise typer.BadParameter(f"{err}{hint}") from err
    if not exp.distributed or os.environ.get("RANK", "0") == "0":
        _show(exp, config, result)
        if quick:
            _quick_note(name)


def _show(exp, config, result: dict) -> None:
    """An experiment's summary: rich tables (each followed by its notes), or the markdown of
    its ``table.md``; then the line naming what the run wrote."""
    from .experiments.registry import markdown

    summary = exp.summary(config, result)
    if exp.markdown:
        print(markdown(summary))
    else:
        for item in summary:
            if isinstance(item, str):
                print(item)
                continue
            table = Table(title=item.title)
            for col in item.header:
                table.add_column(col)
            for row in item.rows:
                table.add_row(*map(escape, row))
            console.print(table)
            for note in item.notes:
                console.print(note)
    if exp.wrote:
        console.print(exp.written(config, result))


def _number(text: str, name: str, kind: type = float) -> float | int:
    """Parse one number of a comma list or key=value option, naming the option on failure."""
    try:
        return kind(text.strip())
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise typer.BadParameter(f"{name} must be {what}, got {text.strip()!r}") from None


def _numbers(text: str, name: str, kind: type = float) -> tuple:
    """A comma-separated list of numbers (empty items skipped)."""
    return tuple(_number(x, name, kind) for x in text.split(",") if x.strip())


@app.command()
def patterns(n: int = typer.Option(256, min=1, help="sequence length for the edge counts")) -> None:
    """List the named patterns with their parameters, edges per query and sparsity at length n."""
    from ..patterns import NAMED

    table = Table(title=f"named patterns at n = {n}")
    for col in ("pattern", "parameters (example)", "edges/query", "sparsity"):
        table.add_column(col)
    for name, (factory, params) in NAMED.items():
        pattern = factory(**params)
        if pattern.data_dependent:
            k = min(params["k"], n)
            table.add_row(name, _fmt(params), f"{k} (data-dependent)", f"{1 - k / n:.2%}")
            continue
        graph = pattern.graph(n)
        table.add_row(name, _fmt(params), f"{graph.num_edges / n:.1f}", f"{graph.sparsity:.2%}")
    console.print(table)


def _fmt(params: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items()) or "—"


@app.command()
def demo(
    n: int = typer.Option(2048, min=1, help="sequence length of the attention comparison"),
    repeats: int = typer.Option(3, min=1, help="warm calls timed after the first (median)"),
) -> None:
    """A first look: the pattern table, then sparse attention next to dense attention — the
    first (cold) call and the median of warm calls of each."""
    import statistics

    import torch

    from .. import longformer, sparse_attention

    patterns(n=256)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, n, 64) for _ in range(3))
    pattern = longformer(256, 16)
    graph = pattern.graph(n)

    def timed(fn):
        """(output, first call ms, median ms of ``repeats`` warm calls)."""
        times = []
        for _ in range(1 + repeats):
            start = time.perf_counter()
            out = fn()
            times.append((time.perf_counter() - start) * 1e3)
        return out, times[0], statistics.median(times[1:])

    _, sdpa_first, sdpa_warm = timed(
        lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)
    )
    ref, dense_first, dense_warm = timed(lambda: sparse_attention(q, k, v, graph, engine="dense"))
    table = Table(title=escape(f"{pattern!r}: batch 1, 8 heads, n = {n}, d = 64, fp32"))
    for col in (
        "computation",
        "first call",
        f"warm (median of {repeats})",
        "max |out − masked dense|",
    ):
        table.add_column(col)
    table.add_row(
        "full attention (SDPA, no mask)", f"{sdpa_first:.0f} ms", f"{sdpa_warm:.0f} ms", "—"
    )
    table.add_row(
        "masked dense reference (engine='dense')",
        f"{dense_first:.0f} ms",
        f"{dense_warm:.0f} ms",
        "0",
    )
    for engine in ("gather", "block"):
        out, first, warm = timed(
            lambda engine=engine: sparse_attention(q, k, v, graph, engine=engine)
        )
        table.add_row(
            f"sparse (engine='{engine}')",
            f"{first:.0f} ms",
            f"{warm:.0f} ms",
            f"{(out - ref).abs().max():.1e}",
        )
    console.print(table)
    console.print(
        f"The pattern keeps {graph.density:.1%} of the n² connections "
        f"({graph.num_edges / n:.0f} keys per query on average). A first call pays once per "
        "graph for the engine's plan (cached on the graph) and torch's own warm-up; the warm "
        "column is what later calls cost (docs/benchmarks.md quotes warm medians)."
    )


# ------------------------------------------------------------------ expressivity (Likhosherstov)

expressivity_app = typer.Typer(
    help="What one self-attention matrix can express (Likhosherstov et al. 2023).",
    no_args_is_help=True,
)
app.add_typer(expressivity_app, name="expressivity")


@expressivity_app.command("dmin")
def expressivity_dmin(
    k: int = typer.Option(1, help="A = union of k random permutation matrices"),
    gamma: float = typer.Option(2.0, help="nonzeros are 1 or gamma (coin flip)"),
    eps1: float = typer.Option(0.25, help="eq. (7) bound on zero/nonzero ratios, in (0, 1)"),
    eps2: float = typer.Option(2.0, help="eq. (8) log-ratio tolerance, > 0"),
    n: Annotated[
        list[int] | None, typer.Option("--n", help="lengths (repeat); default 16..256")
    ] = None,
    draws: int = typer.Option(5, help="matrices A per n"),
    d_step: int = typer.Option(4, help="d grid step (even)"),
    q: Annotated[
        list[float] | None, typer.Option("--q", help="redraw factors Q (repeat; Fig. 4)")
    ] = None,
    causal: bool = typer.Option(False, help="Corollary 0.7: lower-triangular A and CSAM"),
    paper_grid: bool = typer.Option(False, help="paper grid n = 512..3072 step 256 (hours)"),
    seed: int = typer.Option(0, help="seed for A and Y"),
    run: str | None = typer.Option(None, help="run folder name (default: from the config)"),
    out_dir: str = typer.Option("results/expressivity/dmin", help="results root"),
    threads: int = typer.Option(1, help="torch threads"),
    coarse: int = typer.Option(1, help="1: ascending d scan; m: every m-th d, then fill in"),
    device: str = typer.Option("cpu", help="where the Y draws run (cpu, cuda)"),
    time_limit: float | None = typer.Option(None, help="stop starting cells after this (s)"),
) -> None:
    """Least d for which the Theorem 0.4 construction succeeds, versus n (paper Figs. 3, 4)."""
    from .experiments.dmin import PAPER_NS

    _experiment(
        "dmin",
        k=k,
        gamma=gamma,
        eps1=eps1,
        eps2=eps2,
        ns=tuple(n) if n else (PAPER_NS if paper_grid else None),
        draws=draws,
        d_step=d_step,
        qs=tuple(q) if q else None,
        causal=causal,
        seed=seed,
        run=run,
        out_dir=out_dir,
        threads=threads,
        coarse=coarse,
        device=device,
        time_limit_s=time_limit,
    )


@expressivity_app.command("bound")
def expressivity_bound(
    n: Annotated[list[int], typer.Option("--n", help="sequence lengths (repeat)")],
    k: int = typer.Option(1, help="nonzeros per row and column at most"),
    gamma: float = typer.Option(2.0, help="variation bound (eq. 5)"),
    eps1: float = typer.Option(0.25, help="eq. (7), in (0, 1)"),
    eps2: float = typer.Option(2.0, help="eq. (8), > 0"),
) -> None:
    """The d of Theorem 0.4, eq. (6), for each n (an upper bound on d_min; d = 2n is exact)."""
    from ..methods.likhosherstov.expressivity import theorem_d

    table = Table(title=f"Theorem 0.4: k={k}, γ={gamma:g}, ε1={eps1:g}, ε2={eps2:g}")
    for col in ("n", "d (eq. 6)", "min(d, 2n)"):
        table.add_column(col)
    for length in n:
        try:
            d = theorem_d(length, k, gamma, eps1, eps2)
        except ValueError as err:
            raise typer.BadParameter(str(err)) from err
        table.add_row(str(length), str(d), str(min(d, 2 * length)))
    console.print(table)


@expressivity_app.command("weak")
def expressivity_weak(
    pattern: str = typer.Option("window", help="a named pattern (see `sparseattn patterns`)"),
    param: Annotated[
        list[str] | None, typer.Option(help="pattern parameter key=value (repeat)")
    ] = None,
    n: int = typer.Option(16, help="sequence length"),
    d: Annotated[
        list[int] | None, typer.Option("--d", help="query dimensions (repeat); default 1 2 4")
    ] = None,
    d_hid: int | None = typer.Option(None, help="hidden size (default 2d; 2 for d = 1)"),
    causal: bool = typer.Option(False, help="use the pattern's causal variant"),
) -> None:
    """Can SAM weakly approximate the pattern's mask (Def. 0.1)? d = 1 exact (Algorithm 1),
    d > 1 a search (NP-hard in general: a miss is not a proof of impossibility)."""
    import inspect

    from ..methods.likhosherstov.expressivity import try_weak_approx, weak_sam_approx_d1
    from ..patterns import NAMED

    if pattern not in NAMED:
        raise typer.BadParameter(f"pattern must be one of {sorted(NAMED)}, got {pattern!r}")
    factory, params = NAMED[pattern]
    params = dict(params)
    accepted = list(inspect.signature(factory).parameters)
    for item in param or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"param must look like key=value, got {item!r}")
        if key not in accepted:
            raise typer.BadParameter(f"param {key!r}: {pattern} takes {accepted}")
        params[key] = _number(value, f"param {key}", float if "." in value else int)
    if n < 1:
        raise typer.BadParameter(f"n must be >= 1, got {n}")
    dims = d or [1, 2, 4]
    for dim in dims:
        if dim < 1:
            raise typer.BadParameter(f"d must be >= 1, got {dim}")
        if d_hid is not None and (d_hid < 1 or (dim > 1 and d_hid < dim)):
            raise typer.BadParameter(
                f"d-hid must be >= 1 and >= d for d > 1, got d-hid {d_hid} with d {dim}"
            )
    made = factory(**params)
    if made.data_dependent:
        raise typer.BadParameter(f"{pattern} is data-dependent; pick a static pattern")
    made = made.causal() if causal else made
    mask = made.graph(n).to_dense()
    table = Table(title=escape(f"{made!r} at n = {n}: weak SAM approximation (Def. 0.1)"))
    for col in ("d", "d_hid", "answer", "how"):
        table.add_column(col)
    for dim in dims:
        hid = d_hid if d_hid is not None else (2 if dim == 1 else 2 * dim)
        if dim == 1:
            ok = weak_sam_approx_d1(mask, hid)
            table.add_row("1", str(hid), "yes" if ok else "no", "Algorithm 1 (exact)")
        else:
            res = try_weak_approx(mask, dim, hid)
            answer = "yes (witness)" if res.found else "not found"
            table.add_row(str(dim), str(hid), answer, f"{res.message}, margin {res.margin:.3g}")
    console.print(table)


@app.command()
def fidelity(
    window: Annotated[
        list[int] | None, typer.Option("--window", help="window sizes w (repeat); default 8..128")
    ] = None,
    sparse_window: int = typer.Option(32, help="window of Longformer and BigBird"),
    random_blocks: int = typer.Option(1, help="BigBird random key blocks per query block"),
    entmax: bool = typer.Option(True, help="also evaluate dense attention with 1.5-entmax"),
    engine: str = typer.Option("dense", help="engine (speed only): auto, dense, gather, block"),
    split: str = typer.Option("test", help="corpus split: train, validation or test"),
    max_passages: int = typer.Option(32, help="evaluate at most this many passages"),
    batch_size: int = typer.Option(8, help="passages per forward call"),
    max_length: int = typer.Option(256, help="tokens per passage (truncation)"),
    run: str | None = typer.Option(None, help="run folder name (default: from the config)"),
    out_dir: str = typer.Option("results/fidelity", help="results root"),
) -> None:
    """Pretrained MiniLM without fine-tuning under sparse patterns and 1.5-entmax: embedding
    cosine and retrieval accuracy against the exact model, versus the sparsity actually used."""
    from .fidelity import FidelityConfig, run_study

    config = FidelityConfig(
        windows=tuple(window) if window else FidelityConfig.windows,
        sparse_window=sparse_window,
        random_blocks=random_blocks,
        entmax=entmax,
        engine=engine,
        split=split,
        max_passages=max_passages,
        batch_size=batch_size,
        max_length=max_length,
        run=run,
        out_dir=out_dir,
    )
    try:
        metrics, folder = run_study(config)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    table = Table(
        title=f"all-MiniLM-L6-v2 fidelity, {metrics['passages']} {split} passages "
        f"(exact retrieval {metrics['reference_retrieval_accuracy']:.3f})"
    )
    for col in (
        "method",
        "graph sparsity",
        "zero weights",
        "cosine mean / min",
        "retrieval",
        "agrees",
        "last-layer error",
    ):
        table.add_column(col)
    for row in metrics["methods"].values():
        table.add_row(
            escape(row["name"]),
            f"{row['graph_sparsity']:.1%}",
            f"{row['weight_sparsity']:.1%}",
            f"{row['embedding_cosine_mean']:.3f} / {row['embedding_cosine_min']:.3f}",
            f"{row['retrieval_accuracy']:.3f}",
            f"{row['retrieval_agreement']:.3f}",
            f"{row['layer_rel_error'][-1]:.3f}",
        )
    console.print(table)
    console.print(f"wrote {folder / 'metrics.json'} and {folder / 'fidelity.png'}")


@app.command()
def copying(
    quick: bool = typer.Option(False, help="smoke run: n = 32, d = 32, 200 steps, depths 1,2"),
    paper: bool = typer.Option(False, help="the paper's sizes: n = d = 256, w = 16, r = 512"),
    n: int | None = typer.Option(None, help="sequence length (default 64; --paper 256)"),
    depths: str | None = typer.Option(None, help="attention layers per cell, e.g. 1,2,3,4"),
    pattern_list: str = typer.Option(
        "all", "--patterns", help="columns, e.g. strided-union,star,random,dense (default all)"
    ),
    causal: bool = typer.Option(False, help="autoregressive variant (Table 2)"),
    causal_form: str = typer.Option(
        "child", help="causal STRIDED/FIXED: 'child' (Child et al.) or 'tril' (eq. 4/5, j <= i)"
    ),
    stop_accuracy: float | None = typer.Option(
        None, help="end a cell once its training-batch accuracy reaches this twice in a row"
    ),
    w: int | None = typer.Option(None, help="segment length (default round(√n))"),
    d: int | None = typer.Option(None, help="embedding dimension (default 64)"),
    steps: int | None = typer.Option(None, help="optimiser steps per cell"),
    batch_size: int | None = typer.Option(None, help="global batch size"),
    lr: float | None = typer.Option(None, help="peak learning rate"),
    parallel: str = typer.Option("cells", help="under torchrun: 'cells' or 'data' (DDP)"),
    threads: int = typer.Option(1, help="torch threads per process"),
    seed: int = typer.Option(0, help="seed for data, model and RANDOM"),
    seeds: str | None = typer.Option(
        None, help="several seeds, e.g. 0,1: one run each, then a table of all of them"
    ),
    run: str | None = typer.Option(None, help="run folder name (default: from the config)"),
    out_dir: str = typer.Option("results/copying", help="results root"),
) -> None:
    """The copying task (Yun et al. §5.2, Tables 1–2): accuracy per pattern and depth.

    Resumable (finished cells are skipped); runs unchanged under `torchrun`."""
    from .experiments.copying import COLUMNS, paper_config, seeds_figure, seeds_table
    from .experiments.registry import experiment

    exp = experiment("copying")
    overrides = {
        "n": n,
        "w": w,
        "d": d,
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "causal": causal,
        "causal_form": causal_form,
        "stop_accuracy": stop_accuracy,
        "parallel": parallel,
        "threads": threads,
        "seed": seed,
        "run": run,
        "out_dir": out_dir,
    }
    try:
        if depths:
            overrides["depths"] = _numbers(depths, "depths", int)
        if pattern_list != "all":
            overrides["columns"] = tuple(x.strip() for x in pattern_list.split(","))
        overrides = {k: v for k, v in overrides.items() if v is not None}
        if quick and paper:
            raise ValueError("give at most one of --quick and --paper")
        seed_list = _numbers(seeds, "seeds", int) if seeds else (seed,)
        if run and len(seed_list) > 1:
            raise ValueError("--run names one folder; leave it out with several --seeds")
        fields = [{**overrides, "seed": s} for s in seed_list]
        if paper:
            configs = [paper_config(**f).validate() for f in fields]
        else:
            configs = [exp.configure(quick, **f) for f in fields]
        results = [exp.run(c) for c in configs]
    except ValueError as err:
        raise typer.BadParameter(f"{err} (columns: {', '.join(COLUMNS)})") from err
    if os.environ.get("RANK", "0") == "0":
        for config, result in zip(configs, results, strict=True):
            _show(exp, config, result)
        if len(configs) > 1:
            table, folder = seeds_table(configs), Path(results[0]["folder"])
            (folder / "seeds.md").write_text(table)
            seeds_figure(configs, folder / "seeds.png")
            print(table)
            console.print(f"wrote {folder}/seeds.md and seeds.png (every seed)")
        if quick:
            _quick_note("copying")


@app.command()
def lm(
    quick: bool = typer.Option(False, help="smoke run: n = 64, d = 32, 20 steps, w = 4,8, 1 seed"),
    n: int | None = typer.Option(None, help="context length in bytes (default 256)"),
    widths: str | None = typer.Option(None, help="segment lengths w, one sparsity level each"),
    seeds: str | None = typer.Option(None, help="seeds, e.g. 0,1"),
    pattern_list: str = typer.Option(
        "all", "--patterns", help="columns, e.g. strided-union,star,random,dense (default all)"
    ),
    causal_form: str | None = typer.Option(None, help="'child' (default) or 'tril' (Yun G.2)"),
    prob_map: str | None = typer.Option(
        None, help="ρ of every head: softmax (default), entmax15 or sparsemax"
    ),
    save_model: bool = typer.Option(False, help="also write each cell's weights (cells/*.pt)"),
    d: int | None = typer.Option(None, help="embedding dimension (default 64)"),
    layers: int | None = typer.Option(None, help="Transformer blocks (default 2)"),
    steps: int | None = typer.Option(None, help="optimiser steps per cell (default 800)"),
    batch_size: int | None = typer.Option(None, help="global batch size (default 4)"),
    lr: float | None = typer.Option(None, help="peak learning rate"),
    dtype: str | None = typer.Option(None, help="float32 (default) or float64"),
    parallel: str = typer.Option(
        "cells",
        help="under torchrun: 'cells', 'data' (DDP) or 'context' (each window's sequence "
        "sharded over the workers)",
    ),
    threads: int = typer.Option(1, help="torch threads per process"),
    run: str | None = typer.Option(None, help="run folder name (default: from the config)"),
    out_dir: str = typer.Option("results/lm", help="results root"),
) -> None:
    """Language modelling (Yun et al. §5, Fig. 1a): validation perplexity against sparsity.

    Byte-level causal LMs on the embedded corpus. Resumable (finished cells are skipped);
    runs unchanged under `torchrun`; writes table.md, metrics.json, lm.png, cells/*.json.
    `torchrun --nproc-per-node P -m sparseattn.lab.cli lm --parallel context` trains each
    cell with its sequence sharded over P processes (docs/parallel.md)."""
    from .experiments.lm import COLUMNS

    columns = None if pattern_list == "all" else tuple(x.strip() for x in pattern_list.split(","))
    _experiment(
        "lm",
        quick,
        hint=f" (columns: {', '.join(COLUMNS)})",
        run_errors=False,
        n=n,
        widths=_numbers(widths, "widths", int) if widths is not None else None,
        seeds=_numbers(seeds, "seeds", int) if seeds is not None else None,
        columns=columns,
        causal_form=causal_form,
        prob_map=prob_map,
        save_model=save_model or None,
        d=d,
        layers=layers,
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        dtype=dtype,
        parallel=parallel,
        threads=threads,
        run=run,
        out_dir=out_dir,
    )


@app.command()
def analyze(
    pattern: str = typer.Argument(..., help="a named pattern (see `sparseattn patterns`)"),
    n: int = typer.Option(256, "--n", help="sequence length"),
    w: int | None = typer.Option(None, "--w", help="window / segment / stride parameter w"),
    global_tokens: int | None = typer.Option(None, help="global tokens (longformer, bigbird)"),
    random_blocks: int | None = typer.Option(None, help="random key blocks (bigbird)"),
    block: int | None = typer.Option(None, help="block size (bigbird, block_local)"),
    density: float | None = typer.Option(None, help="keys per query / n (random)"),
    tokens: int | None = typer.Option(None, help="number of global tokens (global_tokens)"),
    seed: int | None = typer.Option(None, help="seed of random patterns"),
    config: str | None = typer.Option(
        None, help="union | sequential (default: sequential for strided and fixed, Yun §3.4)"
    ),
    chain_budget: int = typer.Option(200_000, help="expansions of the Hamiltonian-path search"),
    threads: int = typer.Option(1, help="torch threads (the bitset work is memory-bound)"),
    as_json: bool = typer.Option(False, "--json", help="print the report as JSON"),
) -> None:
    """Yun et al. Assumption 1 for a pattern: self-loops, chain γ, hops s, connections/layer."""
    import json

    import torch

    from ..methods.yun import assumption1, named_pattern

    if threads < 1:
        raise typer.BadParameter(f"threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    given = {
        "w": w,
        "global_tokens": global_tokens,
        "random_blocks": random_blocks,
        "block": block,
        "density": density,
        "tokens": tokens,
        "seed": seed,
    }
    try:
        made = named_pattern(pattern, config, **{k: v for k, v in given.items() if v is not None})
        report = assumption1(made, n, chain_budget=chain_budget)
    except (TypeError, ValueError) as err:
        raise typer.BadParameter(str(err)) from err
    if as_json:
        typer.echo(json.dumps({"pattern": pattern, **report.to_dict()}))
        return
    table = Table(title=escape(f"Assumption 1 (Yun et al. §3.2): {pattern} at n = {n}"))
    table.add_column("check")
    table.add_column("result")
    for check, result in report.summary_rows():
        table.add_row(check, escape(result))
    console.print(table)


@app.command()
def dam(
    quick: bool = typer.Option(False, help="smoke run, 1–2 minutes: n = 64, 100 + 40 + 20 steps"),
    lam: Annotated[
        list[float] | None, typer.Option("--lam", help="λ of λ‖M‖₁ (repeat); default 1e-4..1e-1")
    ] = None,
    variant: Annotated[
        list[str] | None, typer.Option("--variant", help="unstructured / structured (repeat)")
    ] = None,
    baseline: Annotated[
        list[str] | None,
        typer.Option("--baseline", help="fixed patterns to compare (repeat); default all"),
    ] = None,
    seq_len: int | None = typer.Option(None, help="sequence length n (default 128)"),
    warm_steps: int | None = typer.Option(None, help="shared dense MLM warm-start steps"),
    dam_steps: int | None = typer.Option(None, help="steps learning the mask (DAM cells)"),
    finetune_steps: int | None = typer.Option(None, help="steps with the extracted mask"),
    prob_map: str | None = typer.Option(None, help="ρ: softmax, sparsemax, entmax15, …"),
    normalized: bool = typer.Option(False, help="penalty λ·mean(M) instead of λ·sum(M)"),
    seed: int = typer.Option(0, help="seed of initialisation, batches and Gumbel noise"),
    threads: int = typer.Option(1, help="torch threads"),
    run: str | None = typer.Option(None, help="run folder name (default: from the config)"),
    out_dir: str = typer.Option("results/dam", help="results root"),
) -> None:
    """SparseBERT: learn attention masks (DAM_u, DAM_s) with MLM, extract them as fixed
    patterns, compare with fixed patterns and dense attention without the diagonal.

    Resumable: finished cells under <out_dir>/<run>/cells/ are skipped."""
    _experiment(
        "dam",
        quick,
        lambdas=tuple(lam) if lam else None,
        variants=tuple(variant) if variant else None,
        baselines=tuple(baseline) if baseline else None,
        seq_len=seq_len,
        warm_steps=warm_steps,
        dam_steps=dam_steps,
        finetune_steps=finetune_steps,
        prob_map=prob_map,
        normalized_penalty=normalized,
        seed=seed,
        threads=threads,
        run=run,
        out_dir=out_dir,
    )


@app.command()
def sparsefinder(
    quick: bool = typer.Option(False, help="smoke run (~2 min): few passages and knobs"),
    teacher_steps: int | None = typer.Option(
        None, help="distillation steps of the entmax teacher (default 150)"
    ),
    train_passages: int | None = typer.Option(None, help="train passages (default: all)"),
    test_passages: int | None = typer.Option(None, help="test passages (default: all)"),
    max_pairs: int | None = typer.Option(
        None, help="triplets per head and epoch for the projections (default: every edge)"
    ),
    downstream: bool = typer.Option(True, help="measure embedding cosine / retrieval"),
    timing: bool = typer.Option(True, help="time prediction + attention vs full entmax"),
    threads: int = typer.Option(1, help="torch threads (1 is fastest on a loaded machine)"),
    run: str | None = typer.Option(None, help="run folder name (default: from the config)"),
    out_dir: str = typer.Option("results/sparsefinder", help="results root"),
) -> None:
    """Sparsefinder (Treviso et al. 2022) on a 1.5-entmax MiniLM: predict each head's attention
    graph, sparsity–recall Pareto curves against window, BigBird, Longformer, strided, Reformer
    and Routing baselines, exact entmax on the predicted graph inside the model, timings.

    Resumable: finished steps (JSON under OUT_DIR/RUN/) are skipped when run again."""
    from dataclasses import replace

    def adjust(config):
        if teacher_steps is not None:
            config = replace(config, teacher=replace(config.teacher, steps=teacher_steps))
        if not downstream:
            config = replace(config, downstream_knobs=())
        return config if timing else replace(config, timing_lengths=())

    _experiment(
        "sparsefinder",
        quick,
        adjust=adjust,
        train_passages=train_passages,
        test_passages=test_passages,
        max_pairs=max_pairs,
        run=run,
        out_dir=out_dir,
        threads=threads,
    )


@app.command("sparsefinder-decoder")
def sparsefinder_decoder(
    quick: bool = typer.Option(False, help="smoke run: a 150-step n = 64 teacher, few knobs"),
    teacher_steps: int | None = typer.Option(
        None, help="training steps of the 1.5-entmax LM teacher (default 4000)"
    ),
    train_windows: int | None = typer.Option(None, help="training windows for the fits"),
    valid_windows: int | None = typer.Option(None, help="validation windows (default: all)"),
    downstream: bool = typer.Option(True, help="measure bits per byte on the predicted graph"),
    threads: int = typer.Option(1, help="torch threads (1 is fastest on a loaded machine)"),
    run: str | None = typer.Option(None, help="run folder name (default: from the config)"),
    out_dir: str = typer.Option("results/sparsefinder", help="results root"),
) -> None:
    """Sparsefinder on a decoder (Treviso et al. §5, decoder self-attention): the byte-level LM
    trained with 1.5-entmax is the teacher; causal gold graphs, predictors and causal
    baselines, recall vs sparsity over pairs j <= i, bits per byte with exact entmax on the
    predicted causal graph.

    Trains the teacher (`sparseattn lm --prob-map entmax15`) first if its weights are missing.
    Resumable: finished steps (JSON under OUT_DIR/RUN/) are skipped when run again."""
    from dataclasses import replace

    def adjust(config):
        if teacher_steps is not None:
            config = replace(config, teacher=replace(config.teacher, steps=teacher_steps))
        return config if downstream else replace(config, downstream_knobs=())

    _experiment(
        "sparsefinder-decoder",
        quick,
        adjust=adjust,
        train_windows=train_windows,
        valid_windows=valid_windows,
        run=run,
        out_dir=out_dir,
        threads=threads,
    )


@app.command()
def bench(
    suite: str = typer.Argument(
        "full",
        help="full or quick (engines on ready graphs), user or user-quick (the user path), "
        "auto or auto-quick (engine='auto' against every engine over a grid of n and batch)",
    ),
    quick: bool = typer.Option(False, "--quick", help="the quick suite (under 2 minutes)"),
    run: str = typer.Option("", help="run name (default: the suite name and the date)"),
    out: str = typer.Option("results/bench", help="parent folder of the run folder"),
    ns: str = typer.Option("", help="comma-separated lengths instead of the suite's"),
    only: str = typer.Option("", help="comma-separated patterns instead of the suite's"),
    device: str = typer.Option(
        "cpu", help="cpu, or cuda: the GPU suite (full → gpu, quick → gpu-quick)"
    ),
) -> None:
    """Time sparseattn against dense baselines measured in the same run; write results.json,
    results.md and a PNG under OUT/RUN (a re-run resumes).

    `user` times what a user calls: the SparseAttention module against nn.MultiheadAttention
    (forward, training step), sparse_attention with a pattern object on projection-layout
    inputs against SDPA with the same mask, the first call on a new length, and a Hugging Face
    BERT with hf.sparsify against its sdpa implementation. `full` and `quick` time the engines
    on ready graphs against SDPA, compiled FlexAttention and the entmax package. `gpu` and
    `gpu-quick` (or --device cuda) time the engines on a CUDA GPU in bf16 and fp32 against SDPA
    (FlashAttention), FlexAttention called directly and the entmax package. `auto` and
    `auto-quick` time forward + backward of sparse_attention with engine='auto' and with every
    engine over lengths, batch sizes and the named patterns, one thread, and list the cells
    where auto is more than 1.3x the fastest."""
    from pathlib import Path

    from .bench.autogrid import AUTO_SUITES, PATTERNS, run_auto_suite
    from .bench.gpu import GPU_SUITES, run_gpu_suite
    from .bench.kernels import SUITES, run_suite
    from .bench.userpath import USER_SUITES, run_user_suite

    if device not in ("cpu", "cuda"):
        raise typer.BadParameter(f"device must be cpu or cuda, got {device!r}")
    name = "quick" if quick else suite
    if device == "cuda":
        name = {"full": "gpu", "quick": "gpu-quick"}.get(name, name)
        if name not in GPU_SUITES:
            raise typer.BadParameter(f"--device cuda runs {sorted(GPU_SUITES)}, not {name!r}")
    known_suites = sorted([*SUITES, *USER_SUITES, *GPU_SUITES, *AUTO_SUITES])
    if name not in known_suites:
        raise typer.BadParameter(f"suite must be one of {known_suites}, got {name!r}")
    if name in GPU_SUITES:
        import torch

        if not torch.cuda.is_available():
            raise typer.BadParameter(f"suite {name!r} needs a CUDA device; torch sees none")
    lengths = _numbers(ns, "ns", int) or None
    if lengths and min(lengths) < 1:
        raise typer.BadParameter(f"ns must be lengths >= 1, got {lengths}")
    patterns_ = tuple(x.strip() for x in only.split(",") if x.strip()) or None
    known = PATTERNS if name in AUTO_SUITES else ("longformer", "bigbird", "strided", "random")
    if patterns_ and (
        name not in (*SUITES, *AUTO_SUITES) or any(p not in known for p in patterns_)
    ):
        raise typer.BadParameter(
            f"only must name patterns among {list(known)} (kernel and auto suites only), "
            f"got {patterns_}"
        )
    run_dir = Path(out) / (run or f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    start = time.perf_counter()
    log = lambda m: console.print(escape(m))  # noqa: E731
    if name in USER_SUITES:
        run_user_suite(USER_SUITES[name], run_dir, log=log, ns=lengths)
        figure = "userpath.png"
    elif name in GPU_SUITES:
        run_gpu_suite(GPU_SUITES[name], run_dir, log=log, ns=lengths)
        figure = "gpu.png"
    elif name in AUTO_SUITES:
        run_auto_suite(AUTO_SUITES[name], run_dir, log=log, ns=lengths, patterns=patterns_)
        figure = "autogrid.png"
    else:
        run_suite(SUITES[name], run_dir, log=log, ns=lengths, patterns=patterns_)
        figure = "bench.png"
    console.print(
        f"wrote {run_dir}/results.json, results.md, {figure} in {time.perf_counter() - start:.0f} s"
    )


@app.command()
def mca(
    alphas: str = typer.Option("0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0", help="α values"),
    max_passages: int = typer.Option(48, help="test passages of the embedded corpus"),
    run: str | None = typer.Option(
        None, help="run name under results/mca/ (default: from the config; --quick differs)"
    ),
    quick: bool = typer.Option(
        False, help="3 α values on 16 passages (replaces --alphas and --max-passages)"
    ),
    sweep: bool = typer.Option(
        True, help="run the α sweep (--no-sweep: only the accounting comparison)"
    ),
    accounting_alphas: str = typer.Option(
        "0.1,0.2,0.5,1.0", help="α values of the accounting comparison ('' to skip it)"
    ),
    seed: int = typer.Option(0, help="seed of MCA's draws (one run name per seed)"),
) -> None:
    """MCA sweep on MiniLM: error vs Theorem 2 bound, fidelity vs value-projection MACs kept;
    then the MCA reference code's cost accounting beside ours, on 8-word passages padded to 128
    tokens as that code runs them."""
    # --quick replaces --alphas and --max-passages
    sizes = {} if quick else {"alphas": _numbers(alphas, "alphas"), "max_passages": max_passages}
    _experiment(
        "mca",
        quick,
        **sizes,
        seed=seed,
        run=run,
        sweep=sweep,
        accounting_alphas=_numbers(accounting_alphas, "accounting_alphas"),
    )


@app.command()
def tour(
    out: str = typer.Option("results/tour", help="folder of index.html, tour.json and the PNGs"),
    quick: bool = typer.Option(False, help="a toy-size version (about a minute), for the tests"),
    threads: int = typer.Option(0, help="torch threads (0: torch's default, one per core)"),
) -> None:
    """The main job (`make demo`): a scaled-down run of every part of the library in one
    self-contained HTML report, OUT/index.html (about 2 minutes on 2 cores).

    Sections: pattern gallery with Assumption 1, speed and memory against dense attention,
    a copying-task table, and one figure each for Sparsefinder, MCA, SparseBERT and d_min.
    Exits with status 1 when a section failed (the report shows the error)."""
    from .tour import TourConfig, quick_config
    from .tour import run as run_tour

    try:
        make = quick_config if quick else TourConfig
        config = make(out=out, **({"threads": threads} if threads else {})).validate()
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    result = run_tour(config, log=lambda m: console.print(escape(m)))
    failed = [k for k, r in result["sections"].items() if r["status"] != "ok"]
    if failed:
        console.print(f"[red]sections failed: {', '.join(failed)} (see {result['index']})")
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
