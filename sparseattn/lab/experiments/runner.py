"""What the experiments share: run names, the sweep over cells, workers, schedules, Yun's columns.

Each experiment stays one file (``copying.py``, ``lm.py``, ``sparsefinder.py``, …) with its
config dataclass, its ``train``/``run`` and its tables; what more than one of them needs lives
here, so that experiments import this module and :mod:`sparseattn.lab.results`, never each other.

- Run folders: :func:`run_name_digest` names a run by the hash of its result-defining fields;
  :func:`load_cells` reads a sweep's finished ``cells/*.json``.
- Sweeps under ``torchrun``: :class:`Dist`, :func:`init_distributed`, :func:`start_sweep`
  (rank 0 pins the run folder and lists the pending cells; ``parallel="cells"`` gives pending
  cell j to worker j mod world, ``parallel="data"`` trains every cell with all workers, as
  does ``parallel="context"`` where an experiment offers it (the LM: the sequence sharded);
  the returned :class:`Sweep` gives the progress bar and the final barrier),
  :func:`check_sweep_fields` (dtype, columns, parallel), :func:`pick_device`.
- Training: :func:`warmup_cosine` (linear warm-up, cosine decay to 0) and :func:`adamw` (weight
  decay on matrices only).
- Yun et al. (2020) §5.1's columns, the same in the copying tables and the LM sweep:
  :data:`COLUMNS`, :func:`head_configuration`, :func:`sparsity`.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from ...patterns import (
    HeadSplit,
    Pattern,
    PatternCycle,
    causal_fixed,
    causal_strided,
    cycle,
    fixed,
    split_heads,
    strided,
)
from ..progress import tqdm
from ..results import run_folder

__all__ = [
    "COLUMNS",
    "Dist",
    "Sweep",
    "adamw",
    "check_sweep_fields",
    "head_configuration",
    "init_distributed",
    "load_cells",
    "pick_device",
    "run_name_digest",
    "sparsity",
    "start_sweep",
    "warmup_cosine",
]


# ---------------------------------------------------------------------------- run folders
def run_name_digest(identity: dict[str, Any]) -> str:
    """The first 8 hex digits of the SHA-1 of ``identity`` as sorted JSON: the part of a run
    folder's name that changes whenever a result-defining field does."""
    return hashlib.sha1(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:8]


def load_cells(folder: Path) -> dict[str, dict[str, Any]]:
    """The finished cells of a run folder (``cells/*.json``), by cell name."""
    return {p.stem: json.loads(p.read_text()) for p in sorted((folder / "cells").glob("*.json"))}


# ---------------------------------------------------------------------------- workers
@dataclass(frozen=True)
class Dist:
    """This process's place among the workers that train one model together."""

    rank: int = 0
    world: int = 1


def init_distributed() -> Dist:
    """Join the torchrun process group when RANK / WORLD_SIZE say there are several workers.

    Backend nccl when CUDA is available, gloo otherwise; the rendezvous comes from torchrun's
    MASTER_ADDR / MASTER_PORT. Returns Dist(0, 1) outside torchrun.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    if not tdist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        # cells may take hours on some workers while others wait at the final barrier
        tdist.init_process_group(backend, timeout=datetime.timedelta(hours=72))
    return Dist(tdist.get_rank(), tdist.get_world_size())


def pick_device(spec: str) -> torch.device:
    """``spec`` itself, or for ``"auto"`` ``cuda:<LOCAL_RANK>`` when CUDA is available, else cpu."""
    if spec != "auto":
        return torch.device(spec)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


@dataclass(frozen=True)
class Sweep:
    """A started sweep: the run ``folder``, the workers (``dist``), whether this call created
    the process group (``owns_group``), this worker's pending cells (``mine``) and the group
    that trains each of them (``worker``: alone, or every worker under DDP)."""

    folder: Path
    dist: Dist
    owns_group: bool
    mine: list
    worker: Dist

    def progress(self, experiment: str, enabled: bool) -> tqdm:
        """A progress bar over this worker's cells, tagged with its rank under torchrun."""
        rank = f" [rank {self.dist.rank}]" if self.dist.world > 1 else ""
        return tqdm(self.mine, desc=f"{experiment} cells{rank}", disable=not enabled)

    def finish(self) -> None:
        """Wait until every worker has written its cells."""
        if self.dist.world > 1:
            tdist.barrier()

    def close(self) -> None:
        """Destroy the process group if this sweep created it (after the report is written)."""
        if self.owns_group and self.dist.world > 1:
            tdist.destroy_process_group()


def start_sweep(
    config: Any, todo: list, done: Callable[[Path, Any], bool], dist: Dist | None = None
) -> Sweep:
    """Join the workers, pin the run folder to the config and share out the pending cells.

    ``config`` is an experiment's config: its run folder is ``<out_dir>/<run_name()>``, pinned
    to ``identity()``, and ``parallel`` says how the workers split the work. Rank 0 creates the
    folder (refusing one with another identity) and lists the keys of ``todo`` for which
    ``done(folder, key)`` is False; the list is broadcast so every worker agrees.
    ``parallel="cells"``: pending cell j goes to worker j mod world, trained alone;
    ``"data"``: every worker takes every cell (DistributedDataParallel); ``"context"``: every
    worker takes every cell, each holding its part of every sequence (the experiment shards).
    """
    owns_group = dist is None and not (tdist.is_available() and tdist.is_initialized())
    dist = init_distributed() if dist is None else dist
    folder = Path(config.out_dir) / config.run_name()
    if dist.rank == 0:
        run_folder(folder, config.identity(), ("cells",))
    if dist.world > 1:
        tdist.barrier()  # the folder and config.json exist before anyone looks at them
    pending = [[key for key in todo if not done(folder, key)]]
    if dist.world > 1:
        tdist.broadcast_object_list(pending, src=0)
    if config.parallel == "cells":
        return Sweep(folder, dist, owns_group, pending[0][dist.rank :: dist.world], Dist())
    return Sweep(folder, dist, owns_group, pending[0], dist)


def check_sweep_fields(config: Any, parallel: tuple[str, ...] = ("cells", "data")) -> None:
    """The fields every sweep config shares: ``dtype`` float32 or float64, ``columns`` a
    non-empty subset of :data:`COLUMNS`, ``parallel`` one of ``parallel`` (the modes the
    experiment implements: "cells" and "data" by default); ValueError naming the field
    otherwise."""
    if config.dtype not in ("float32", "float64"):
        raise ValueError(f"dtype must be 'float32' or 'float64', got {config.dtype!r}")
    unknown = [c for c in config.columns if c not in COLUMNS]
    if unknown or not config.columns:
        raise ValueError(f"columns must be a non-empty subset of {COLUMNS}, got {unknown}")
    if config.parallel not in parallel:
        modes = ", ".join(repr(m) for m in parallel[:-1]) + f" or {parallel[-1]!r}"
        raise ValueError(f"parallel must be {modes}, got {config.parallel!r}")


# ---------------------------------------------------------------------------- training
def warmup_cosine(step: int, warmup: int, steps: int) -> float:
    """Learning-rate factor: (step + 1)/warmup during warm-up, then ½(1 + cos(π t)) with
    t = (step − warmup)/(steps − warmup) clipped to 1."""
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


def adamw(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW with weight decay on the matrices only (not on biases, norms or ``pos``)."""
    decay = [p for name, p in model.named_parameters() if p.dim() >= 2 and name != "pos"]
    rest = [p for name, p in model.named_parameters() if p.dim() < 2 or name == "pos"]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest}]
    return torch.optim.AdamW(groups, lr=lr, weight_decay=0.0)


# ---------------------------------------------------------------------------- Yun's columns
#: The columns of Yun et al.'s Tables 1–2 and the curves of Fig. 1a (plus dense attention as a
#: reference), in table order.
COLUMNS = (
    "strided-union",
    "strided-multihead",
    "strided-sequential",
    "fixed-union",
    "fixed-multihead",
    "fixed-sequential",
    "star",
    "random",
    "dense",
)


def head_configuration(
    family: str, heads: str, w: int, causal_form: str | None = None
) -> Pattern | PatternCycle:
    """STRIDED or FIXED (eq. 4 / 5) in one of §5.1's head configurations: ``union`` (A¹ ∪ A²
    in every head), ``multihead`` (half the heads A¹, half A²) or ``sequential`` (layer l uses
    A^(l mod 2 + 1)). ``causal_form``: None (bidirectional), ``"child"`` (Child et al.'s
    autoregressive originals) or ``"tril"`` (eq. 4 / 5 intersected with j ≤ i)."""
    if causal_form == "child":
        make = causal_strided if family == "strided" else causal_fixed
    else:
        base = strided if family == "strided" else fixed
        make = (lambda *a: base(*a).causal()) if causal_form == "tril" else base
    if heads == "union":
        return make(w)
    if heads == "multihead":
        return split_heads(make(w, 1), make(w, 2))
    return cycle(make(w, 1), make(w, 2))


def sparsity(pattern: Pattern | PatternCycle, n: int, heads: int) -> float:
    """Sparsity 1 − |G| / possible edges of ``pattern.graph(n)``; a MULTIHEAD split is averaged
    over its heads and a SEQUENTIAL cycle over its patterns (the paper's table headers)."""
    if isinstance(pattern, PatternCycle):
        return sum(sparsity(p, n, heads) for p in pattern) / len(pattern)
    if isinstance(pattern, HeadSplit):
        return float(pattern.graph(n, num_heads=heads).sparsity.mean())
    return float(pattern.graph(n).sparsity)
