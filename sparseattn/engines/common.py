"""Helpers shared by the engines: dropout RNG replay and the masked exponential.

:func:`keep_mask`, :func:`rng_state`, :func:`replayed_rng` (dropout masks, drawn again in
backward), :func:`masked_exp`, :func:`grid_indices` and :func:`mod_grads` (a score modifier's
indices and backward in the engines that recompute scores) and :func:`squeezed` (a graph
without its size-1 batch dims, the same object every call).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ..graph import AttentionGraph

__all__ = [
    "grid_indices",
    "keep_mask",
    "masked_exp",
    "mod_grads",
    "replayed_rng",
    "rng_state",
    "squeezed",
]


def rng_state(device: torch.device) -> Tensor:
    """The RNG state that ``device``'s random draws use now, for :func:`replayed_rng`."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


@contextlib.contextmanager
def replayed_rng(device: torch.device, state: Tensor | None):
    """Backward's dropout masks drawn again as in forward: the RNG of ``device`` set to
    ``state`` (saved by :func:`rng_state` before the forward's draws) inside, and restored
    after; ``state`` None (no dropout) does nothing."""
    cuda = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda, enabled=state is not None):
        if state is not None and cuda:
            torch.cuda.set_rng_state(state, device)
        elif state is not None:
            torch.set_rng_state(state)
        yield


def keep_mask(p: Tensor, dropout_p: float) -> Tensor | None:
    """Dropout's keep-mask like ``p``, scaled by 1/(1 − dropout_p), drawn from the global RNG
    (backward replays it, :func:`replayed_rng`); None without dropout."""
    if not dropout_p:
        return None
    return torch.empty_like(p).bernoulli_(1 - dropout_p).div_(1 - dropout_p)


#: exp(x) for x below this is replaced by exp(_FLOOR) (< 1e-34 of the row max's weight):
#: torch's exp is 10-100x slower on −inf and on arguments whose result underflows.
_FLOOR = -80.0


def masked_exp(s: Tensor, masks: list[Tensor], lse: Tensor | None, dim: int = -1):
    """exp(s − shift) ⊙ masks (0/1 floats broadcasting to s), in place on s: masked entries
    pushed far down by an additive bias and zeroed by the product (no −inf, no underflowing
    exp, no bool ops). With ``lse`` the shift is ``lse``; else the row max, returned with the
    row sum (a row without any entry gets max −big and sum 0). A row runs along ``dim``."""
    big = torch.finfo(s.dtype).max / 4
    for m in masks:
        s.add_(m.sub(1.0).mul_(big))
    if lse is not None:
        s.sub_(lse.unsqueeze(dim))
        mx = None
    else:
        mx = s.amax(dim, keepdim=True)
        s.sub_(mx)
    p = s.clamp_min_(_FLOOR).exp_()
    for m in masks:
        p.mul_(m)
    if mx is None:
        return p, None, None
    return p, mx.squeeze(dim), p.sum(dim)


def grid_indices(
    bsz: int, heads: int, q_idx: Tensor, n_k: int, device: torch.device
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A score modifier's (b, h, q_idx, kv_idx) for scores (B, H, m, n_k) of the queries
    ``q_idx`` (m,) against keys 0…n_k − 1: (B, 1, 1, 1), (1, H, 1, 1), (m, 1), (n_k,)."""
    b = torch.arange(bsz, device=device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    return b, h, q_idx.view(-1, 1), torch.arange(n_k, device=device)


def mod_grads(
    out: Tensor, s: Tensor, tensors: tuple[Tensor, ...], grad: Tensor, extra: tuple = ()
) -> tuple[Tensor, ...]:
    """Backward through a recomputed chunk whose scores ``s`` (requiring grad) went through a
    score modifier to ``out``: (d s, *d extra, *d tensors) for the upstream ``grad`` of
    ``out``; the modifier's tensors (:func:`sparseattn.score_mods.lifted_tensors`) the
    modifier did not read get zeros."""
    inputs = (s, *extra, *tensors)
    grads = torch.autograd.grad(out, inputs, grad, allow_unused=True)
    pairs = zip(grads, inputs, strict=True)
    return tuple(torch.zeros_like(x) if g is None else g for g, x in pairs)


def squeezed(graph: AttentionGraph, dims: int) -> AttentionGraph:
    """``graph`` without its ``dims`` leading size-1 batch dims; the same object on every call
    (cached on the graph), so that what an engine keeps on it (a block plan, gather chunks and
    their index arrays on the device) is built once."""
    if not dims:
        return graph
    return graph.cached(("squeezed", dims), lambda: graph[(0,) * dims])
