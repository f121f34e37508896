"""The ``sparseattn`` command line. Each feature adds its subcommand here, importing lazily."""

from __future__ import annotations

import time

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="sparseattn: sparse attention patterns, maps, engines and experiments.",
                  no_args_is_help=True, add_completion=False)
console = Console()


@app.command()
def patterns(n: int = typer.Option(256, help="sequence length for the edge counts")) -> None:
    """List the named patterns with their parameters, edges per query and sparsity at length n."""
    from .patterns import NAMED

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
def demo(n: int = typer.Option(2048, help="sequence length of the attention comparison")) -> None:
    """A first look: the pattern table, then one sparse attention call next to dense attention."""
    import torch

    from . import longformer, sparse_attention, window

    patterns(n=256)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, n, 64) for _ in range(3))
    rows = []
    for label, pattern, engine in (
        ("dense (SDPA, same math)", None, None),
        ("window(256), gather", window(256), "gather"),
        ("longformer(256, 16), gather", longformer(256, 16), "gather"),
    ):
        start = time.perf_counter()
        if pattern is None:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            ref = out
        else:
            pattern.graph(n)  # build (and cache) the graph outside the timing
            start = time.perf_counter()
            out = sparse_attention(q, k, v, pattern, engine=engine)
        ms = (time.perf_counter() - start) * 1e3
        sparsity = 0.0 if pattern is None else pattern.graph(n).sparsity
        err = (out - ref).norm() / ref.norm()
        rows.append((label, f"{sparsity:.1%}", f"{ms:.0f} ms", f"{err:.3f}"))
    table = Table(title=f"one attention call: batch 1, 8 heads, n = {n}, d = 64, fp32")
    for col in ("attention", "sparsity", "time", "rel. diff to dense"):
        table.add_column(col)
    for row in rows:
        table.add_row(*row)
    console.print(table)
    console.print(
        "The difference to dense is the information the pattern leaves out, not an error: "
        "the engines match a dense masked reference to float precision (make test)."
    )


if __name__ == "__main__":
    app()
