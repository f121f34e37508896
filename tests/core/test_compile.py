"""``torch.compile`` of models built from ``SparseAttention`` (docs/engines.md, "torch.compile").

The attention layers are opaque to dynamo (``torch.compiler.disable``): the rest of the
model compiles, the attention runs eagerly. Checked here: the compiled model equals
the eager one (outputs and gradients, including a learned α), a stream of lengths — crossing
from the dense to the block engine — compiles a bounded number of graphs with no other graph
breaks than the attention calls and never reaches dynamo's recompile limit.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import sparseattn as sa
from sparseattn.engines import costs
from sparseattn.engines.flex import flex_available

E, H = 16, 2


class Block(nn.Module):
    """Two attention layers (Longformer with softmax; a window with 1.5-entmax and a learned α
    per head, a custom autograd Function inside) and an MLP, pre-norm residuals."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(E), nn.LayerNorm(E)
        self.att1 = sa.SparseAttention(E, H, pattern=sa.longformer(4, 1))
        self.att2 = sa.SparseAttention(
            E, H, pattern=sa.window(3), prob_map="entmax15", learn_alpha=True
        )
        self.mlp = nn.Sequential(nn.Linear(E, 2 * E), nn.GELU(), nn.Linear(2 * E, E))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.att1(self.ln1(x))
        x = x + self.att2(self.ln2(x))
        return x + self.mlp(x)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return Block()


def _step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    y = model(x)
    y.square().mean().backward()
    return y.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


def _stream(compiled: nn.Module, model: nn.Module, lengths: list[int]) -> list[int]:
    """Compiled against eager on each length; the graph count after each length."""
    graphs = []
    for n in lengths:
        x = torch.randn(2, n, E)
        y_c, g_c = _step(compiled, x)
        y_e, g_e = _step(model, x)
        torch.testing.assert_close(y_c, y_e, rtol=1e-5, atol=1e-5)
        for a, b in zip(g_c, g_e, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        graphs.append(counters["stats"]["unique_graphs"])
    return graphs


def test_compiled_model_equals_eager_with_bounded_graphs(fresh_dynamo, monkeypatch):
    # a small DENSE_LIMIT makes `auto` move from the dense engine to another inside the stream
    monkeypatch.setattr(costs, "DENSE_LIMIT", 2 * H * 48 * 48)
    model = _model()
    compiled = torch.compile(model, backend="aot_eager")
    lengths = [24, 40, 56, 72]
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        graphs = _stream(compiled, model, lengths)
    # one static compile, one dynamic recompile per frame, then nothing new
    assert graphs[-1] == graphs[2], graphs
    assert graphs[-1] <= 16, graphs
    breaks = counters["graph_break"]
    assert breaks and all("torch.compiler.disable" in reason for reason in breaks), dict(breaks)


@pytest.mark.slow
@pytest.mark.skipif(flex_available() is not None, reason="inductor needs a C++ compiler")
def test_inductor_stream_and_flex_inside(fresh_dynamo):
    """The default backend over a stream of lengths; the flex engine (itself compiled
    FlexAttention) inside the opaque call, inference."""
    model = _model()
    compiled = torch.compile(model)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        graphs = _stream(compiled, model, [24, 40, 56, 72])
    assert graphs[-1] == graphs[2], graphs
    flex = sa.SparseAttention(E, H, pattern=sa.longformer(4, 1), engine="flex").eval()
    compiled_flex = torch.compile(flex)
    with torch.no_grad():
        for n in (130, 200):
            x = torch.randn(1, n, E)
            torch.testing.assert_close(compiled_flex(x), flex(x), rtol=1e-5, atol=1e-5)


def test_fullgraph_names_the_opaque_call(fresh_dynamo):
    q = k = v = torch.randn(1, 2, 32, 8)

    def f(q, k, v):
        return sa.sparse_attention(q * 2, k, v, sa.window(4)) + 1

    with pytest.raises(Exception, match="runs the attention call eagerly"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    compiled = torch.compile(f, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v), f(q, k, v))
