"""The collectives context parallelism uses, on ``torch.distributed`` (gloo on CPU, NCCL on
GPU), with a byte count per kind of traffic, and the fingerprint the ranks compare first.

Every collective here is entered by every rank of the group in the same order; which ones
run depends only on values all ranks share (the plan, the fingerprint, all-reduced values),
so ranks never wait on a collective another rank skips.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import struct
from collections.abc import Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from ..graph import AttentionGraph

__all__ = [
    "count_traffic",
    "describe",
    "digest",
    "group_rank",
    "group_size",
]

_RECORDERS: list[collections.Counter] = []


@contextlib.contextmanager
def count_traffic() -> Iterator[collections.Counter]:
    """Count the bytes this process moves inside the block, by kind:

    ``halo_send`` / ``halo_recv`` (keys and values, forward), ``halo_grad_send`` /
    ``halo_grad_recv`` (their gradients, backward), ``global_forward`` / ``global_step`` /
    ``global_backward`` (the all-reduces that merge global rows; ``steps`` counts threshold
    steps), ``control`` (fingerprints, padding checks, loop flags). Point-to-point traffic
    counts what leaves for / arrives from other ranks; an all-reduce counts its input once.
    """
    record: collections.Counter = collections.Counter()
    _RECORDERS.append(record)
    try:
        yield record
    finally:
        _RECORDERS.remove(record)


def _add(kind: str, amount: int) -> None:
    for record in _RECORDERS:
        record[kind] += amount


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def group_size(group: object) -> int:
    """Ranks in ``group`` (None: the default group), 1 without an initialised default group."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def group_rank(group: object) -> int:
    """This process's rank within ``group`` (0 without an initialised default group)."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def all_to_all(
    send: Tensor, send_rows: Sequence[int], recv_rows: Sequence[int], group, kind: str
) -> Tensor:
    """Rows of ``send`` (m, w), ``send_rows[j]`` of them to rank j in order; returns the rows
    received, ``recv_rows[j]`` from rank j in rank order."""
    width = send.shape[1]
    recv = send.new_empty(sum(recv_rows), width)
    dist.all_to_all_single(recv, send.contiguous(), list(recv_rows), list(send_rows), group=group)
    row = width * send.element_size()
    _add(f"{kind}_send", sum(send_rows) * row)
    _add(f"{kind}_recv", sum(recv_rows) * row)
    return recv


def all_reduce(t: Tensor, group, kind: str, op=dist.ReduceOp.SUM) -> Tensor:
    """``t`` reduced over the group, in place (and returned)."""
    dist.all_reduce(t, op=op, group=group)
    _add(kind, _nbytes(t))
    return t


def all_gather_rows(t: Tensor, group, kind: str = "control") -> Tensor:
    """(P, *t.shape): every rank's ``t`` (same shape on every rank)."""
    out = [torch.empty_like(t) for _ in range(group_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    _add(kind, _nbytes(t))
    return torch.stack(out)


def any_left(active: Tensor, group) -> bool:
    """Whether any rank still has an active row (one MAX all-reduce of one flag)."""
    flag = torch.tensor([int(bool(active.any()))], dtype=torch.int64, device=active.device)
    return bool(all_reduce(flag, group, "control", dist.ReduceOp.MAX).item())


# ------------------------------------------------------------------ fingerprints
def describe(obj: object) -> str:
    """A text that identifies a pattern, map or graph by value, the same in every process
    (tensors by a hash of their bytes; no ``id`` or ``hash()``, which differ per process)."""
    if isinstance(obj, Tensor):
        data = obj.detach().cpu().contiguous()
        raw = data.view(torch.uint8).numpy().tobytes() if data.numel() else b""
        return f"tensor({data.dtype},{tuple(data.shape)},{hashlib.sha256(raw).hexdigest()})"
    if isinstance(obj, AttentionGraph):
        return (
            f"graph({obj.n_q},{obj.n_k},{obj.batch_shape},{describe(obj.crow)},{describe(obj.col)})"
        )
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = ",".join(
            f"{f.name}={describe(getattr(obj, f.name))}" for f in dataclasses.fields(obj)
        )
        return f"{type(obj).__module__}.{type(obj).__qualname__}({fields})"
    if isinstance(obj, (tuple, list)):
        return "(" + ",".join(describe(x) for x in obj) + ")"
    if isinstance(obj, np.ndarray):
        return describe(torch.from_numpy(np.ascontiguousarray(obj)))
    return repr(obj)


def digest(text: str) -> int:
    """A 63-bit integer from a text (sha256), for an int64 fingerprint slot."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def float_bits(x: float) -> int:
    """The bits of a float64 as a signed int64."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]
