"""Context parallelism: sparse attention on a sequence sharded over a process group, each
rank receiving only the keys its queries read (issue 42; docs/parallel.md).

- :func:`plan` — which keys each rank needs from which rank, which rows merge across ranks,
  the bytes moved and the peak key/value memory, for any pattern at any length, without
  building the pattern's graph (:mod:`.plan`, :mod:`.rules`);
- :func:`even_boundaries` / :func:`balanced_boundaries` — contiguous shards of equal length
  or of equal work;
- :func:`shard` / :func:`gather` — this rank's part of a full tensor along the sequence, and
  the full tensor back (autograd-aware);
- :func:`sparse_attention` — attention on the local shards, exact against
  :func:`sparseattn.sparse_attention` on the whole sequence (:mod:`.attention`);
- :func:`count_traffic` — the bytes a block of code moves, by kind (:mod:`.comm`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .. import attention as _attention
from . import comm
from .attention import map_kind, sparse_attention
from .comm import count_traffic
from .plan import (
    Plan,
    RankPlan,
    balanced_boundaries,
    check_boundaries,
    even_boundaries,
    plan,
    work_profile,
)

__all__ = [
    "Plan",
    "RankPlan",
    "balanced_boundaries",
    "count_traffic",
    "even_boundaries",
    "gather",
    "map_kind",
    "plan",
    "shard",
    "sparse_attention",
    "work_profile",
]


def _bounds(n: int, size: int, boundaries: Sequence[int] | None) -> tuple[int, ...]:
    if boundaries is None:
        return even_boundaries(n, size)
    bounds = check_boundaries(boundaries, n)
    if len(bounds) != size + 1:
        raise ValueError(f"boundaries has {len(bounds) - 1} shards but the group {size} ranks")
    return bounds


def shard(
    x: Tensor, group: object = None, dim: int = -2, boundaries: Sequence[int] | None = None
) -> Tensor:
    """This rank's part of ``x`` along ``dim`` (the sequence; −2 for (batch, heads, n, d)):
    positions boundaries[r] … boundaries[r + 1] − 1, near-equal contiguous parts by default
    (:func:`even_boundaries`, any n). A view of ``x``; gradients flow back into ``x``."""
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    size, rank = comm.group_size(group), comm.group_rank(group)
    bounds = _bounds(x.shape[dim], size, boundaries)
    return x.narrow(dim, bounds[rank], bounds[rank + 1] - bounds[rank])


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group, dim: int) -> Tensor:
        sizes = comm.all_gather_rows(torch.tensor([x.shape[dim]]), group).view(-1).tolist()
        longest = max(sizes)
        pad = list(x.shape)
        pad[dim] = longest - x.shape[dim]
        padded = torch.cat([x, x.new_zeros(pad)], dim) if pad[dim] else x
        parts = comm.all_gather_rows(padded, group, "gather").unbind(0)
        rank = comm.group_rank(group)
        ctx.dim, ctx.start, ctx.length = dim, sum(sizes[:rank]), x.shape[dim]
        return torch.cat([p.narrow(dim, 0, s) for p, s in zip(parts, sizes, strict=True)], dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad.narrow(ctx.dim, ctx.start, ctx.length), None, None


def gather(x: Tensor, group: object = None, dim: int = -2) -> Tensor:
    """The full tensor from every rank's part along ``dim`` (any part lengths), on every
    rank. Autograd: the gathered tensor is taken to be used the same way on every rank (a
    replicated loss, as after :func:`shard`), so its backward keeps this rank's slice of the
    gradient and communicates nothing — the gradient of one process's run on the whole
    tensor. With one rank (or no process group), ``x`` itself."""
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if comm.group_size(group) == 1:
        return x
    dim = dim % x.dim()
    return _Gather.apply(x, group, dim)


_attention.register_sharded(sparse_attention)
