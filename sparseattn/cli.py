"""The ``sparseattn`` command line. Each feature adds its subcommand here, importing lazily."""

from __future__ import annotations

import time

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

app = typer.Typer(
    help="sparseattn: sparse attention patterns, maps, engines and experiments.",
    no_args_is_help=True,
    add_completion=False,
)
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
    """A first look: the pattern table, then sparse attention next to dense attention."""
    import torch

    from . import longformer, sparse_attention

    patterns(n=256)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, n, 64) for _ in range(3))
    pattern = longformer(256, 16)
    graph = pattern.graph(n)

    def timed(fn):
        start = time.perf_counter()
        out = fn()
        return out, (time.perf_counter() - start) * 1e3

    _, t_sdpa = timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
    ref, t_dense = timed(lambda: sparse_attention(q, k, v, graph, engine="dense"))
    table = Table(title=escape(f"{pattern!r}: batch 1, 8 heads, n = {n}, d = 64, fp32"))
    for col in ("computation", "time", "max |out − masked dense|"):
        table.add_column(col)
    table.add_row("full attention (SDPA, no mask)", f"{t_sdpa:.0f} ms", "—")
    table.add_row("masked dense reference (engine='dense')", f"{t_dense:.0f} ms", "0")
    for engine in ("gather",):
        out, ms = timed(lambda engine=engine: sparse_attention(q, k, v, graph, engine=engine))
        table.add_row(
            f"sparse (engine='{engine}')", f"{ms:.0f} ms", f"{(out - ref).abs().max():.1e}"
        )
    console.print(table)
    console.print(
        f"The pattern keeps {graph.density:.1%} of the n² connections "
        f"({graph.num_edges / n:.0f} keys per query on average)."
    )


if __name__ == "__main__":
    app()
