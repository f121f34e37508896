"""The real-token counts behind :func:`~sparseattn.hf.attention_sparsity`: per layer call, the
pairs the model's own mask allows, the edges of the layer's graph among them, and the non-zero
weights of a sparse map (added to the model's :class:`~sparseattn.hf.state.State`).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from ..attention import sparse_attention
from ..engines.layout import block_pairs
from ..graph import AttentionGraph
from ..maps import support
from .mask import MaskView
from .state import LayerSpec, State

__all__ = ["account", "nonzero_weights"]


#: The block size at which :func:`_real_key_counts` reads a graph: whole block pairs are
#: counted per block, only the edges of partial pairs one by one.
COUNT_BLOCK = 64


def _real_key_counts(graph: AttentionGraph, key_valid: Tensor | None, bsz: int) -> Tensor:
    """(batch, graph heads, n_q) float64: how many real keys each query may attend to.

    From the graph's block pairs at :data:`COUNT_BLOCK` (found once per graph, cached on it):
    a whole pair adds its key block's real keys to each of its rows, a partial pair its edges
    to real keys — O(pairs + partial edges) per call instead of O(B·E) (BigBird's training
    layout at n = 4096: 30.6 M edges, all in whole pairs)."""
    shape = graph.batch_shape
    if len(shape) > 2:
        raise ValueError(f"graph batch_shape {shape} has more than (batch, heads) dims")
    g_b, g_h = (1,) * (2 - len(shape)) + shape
    n_q, n_k = graph.n_q, graph.n_k
    if key_valid is None:
        return graph.degrees.double().reshape(g_b, g_h, n_q).expand(bsz, g_h, n_q)
    b = COUNT_BLOCK
    pairs = graph.cached(("real_key_pairs", b), lambda: block_pairs(graph, b, partial=True))
    nbq, nbk = -(-n_q // b), -(-n_k // b)
    valid = key_valid.to(graph.device).double()  # (B, n_k)
    items = valid.shape[0] if g_b == 1 else 1  # a graph per item: its own item's keys
    valid = valid.view(items, g_b, n_k)
    per_block = torch.nn.functional.pad(valid, (0, nbk * b - n_k)).view(items, g_b, nbk, b)
    per_block = per_block.sum(-1)
    graphs = g_b * g_h
    g, rb, kb = pairs.keys // (nbq * nbk), (pairs.keys // nbk) % nbq, pairs.keys % nbk
    whole = pairs.full
    counts = torch.zeros(items, graphs * nbq, dtype=torch.float64, device=graph.device)
    rows = (g * nbq + rb)[whole]
    counts.index_add_(1, rows, per_block[:, (g // g_h)[whole], kb[whole]])
    counts = counts.view(items, graphs, nbq).repeat_interleave(b, -1)[..., :n_q].contiguous()
    pair = pairs.e_pair
    if pair.numel():  # the partial pairs' edges, one by one
        e_g = g[pair]
        row, key = rb[pair] * b + pairs.e_q, kb[pair] * b + pairs.e_k
        flat = counts.view(items, graphs * n_q)
        flat.index_add_(1, e_g * n_q + row, valid[:, e_g // g_h, key])
    return counts.view(-1, g_h, n_q).expand(bsz, g_h, n_q).cpu()


def _possible_keys(view: MaskView, real: Tensor, n_q: int) -> Tensor:
    """(batch, n_q) float64: the real keys the model's own mask lets each query see (all real
    keys; j ≤ i in a causal layer; the model's structure where it has one). real: (batch, n_k)."""
    if view.structure is not None:
        return (view.structure[:, 0].cpu() & real[:, None, :]).sum(-1).double()
    if view.causal:
        return real.double().cumsum(-1)[:, real.shape[-1] - n_q :]
    return real.double().sum(-1, keepdim=True).expand(-1, n_q)


def _edges_without_padding(graph: AttentionGraph, bsz: int, heads: int) -> float:
    """Edges of a graph broadcast over (batch, heads) when every key is real."""
    g_b, g_h = (1,) * (2 - len(graph.batch_shape)) + graph.batch_shape
    return float(graph.col.numel()) * (bsz // g_b) * (heads // g_h)


def account(
    state: State,
    layer: int,
    graph: AttentionGraph | None,
    q: Tensor,
    k: Tensor,
    view: MaskView,
    spec: LayerSpec,
) -> float:
    """Check every real query keeps a real key; add the layer's real-token edge counts (the
    pairs counted are those the model's own mask allows: j ≤ i in a decoder); return the
    edges counted."""
    bsz, heads, n_q = q.shape[:3]
    n_k = k.shape[-2]
    if view.key_valid is None and view.structure is None:  # every token real: closed forms
        per_item = n_q * (n_k - n_q) + n_q * (n_q + 1) // 2 if view.causal else n_q * n_k
        pairs = float(per_item * bsz * heads)
        edges = pairs if graph is None else _edges_without_padding(graph, bsz, heads)
        state.edges[layer] = state.edges.get(layer, 0.0) + edges
        state.pairs[layer] = state.pairs.get(layer, 0.0) + pairs
        return edges
    real = (
        torch.ones(bsz, n_k, dtype=torch.bool) if view.key_valid is None else view.key_valid.cpu()
    )
    real_q = real[:, n_k - n_q :]
    pairs = float((_possible_keys(view, real, n_q) * real_q).sum()) * heads
    if graph is None:  # exact attention
        edges = pairs
    else:
        # the host copy where the graph lives on the host: one read back per call, not two
        key_valid = real if graph.device.type == "cpu" else view.key_valid
        counts = _real_key_counts(graph, None if view.key_valid is None else key_valid, bsz)
        starved = (counts == 0) & real_q[:, None, :]
        if starved.any():
            b, h, i = (int(x) for x in starved.nonzero()[0])
            raise ValueError(
                f"layer {layer}: pattern {spec.pattern!r} leaves real query {i} (batch item {b}, "
                f"head group {h}) with no real key among its allowed keys; choose a pattern in "
                "which every token sees at least one non-padding token (e.g. include the token "
                "itself)"
            )
        edges = float((counts * real_q[:, None, :]).sum()) * heads / counts.shape[1]
    state.edges[layer] = state.edges.get(layer, 0.0) + edges
    state.pairs[layer] = state.pairs.get(layer, 0.0) + pairs
    return edges


def nonzero_weights(
    spec: LayerSpec,
    q: Tensor,
    k: Tensor,
    target,
    view: MaskView,
    scale: float,
    n_q: int,
    enable_gqa: bool = False,
    score_mod=None,
) -> float:
    """How many weights of a sparse map are non-zero among real queries: the layer's engine
    run once more under no_grad with ρ's support indicator and values of ones, (B, ·, n_k, 1),
    so that each query's output is its count (in float32: exact up to 2²⁴). q, k and
    ``target`` (pattern or graph) as the layer's call passes them (``enable_gqa`` where k has
    fewer heads); n_q the layer's query length; ``score_mod`` the model's score modifier.
    Autocast is switched off: the counts stay
    float32."""
    device = q.device.type
    no_autocast = (
        torch.autocast(device, enabled=False)
        if torch.amp.is_autocast_available(device)
        else contextlib.nullcontext()
    )
    with torch.no_grad(), no_autocast:
        q32, k32 = q.detach().float(), k.detach().float()
        counts = sparse_attention(
            q32,
            k32,
            k32.new_ones(*k32.shape[:-1], 1),
            target,
            prob_map=support(spec.prob_map),
            engine=spec.engine,
            scale=scale,
            key_padding_mask=None if view.key_valid is None else ~view.key_valid,
            enable_gqa=enable_gqa,
            score_mod=score_mod,
        )
    counts = counts.reshape(counts.shape[0], -1, n_q)
    if view.key_valid is not None:
        counts = counts * view.key_valid[:, None, view.key_valid.shape[-1] - n_q :].to(counts.dtype)
    return float(counts.double().sum())
