"""The copying task of Yun et al. (2020), §5.2 and appendix G.1 / H.1 (Tables 1 and 2).

Every input has the form ``0 s 0 s``: a separator token 0, a string s of n/2 − 1 symbols drawn
uniformly from {1, …, vocab − 1}, then the same again. The model has to copy the second s.

- bidirectional (Table 1, masked-LM style as in G.1): the whole second half ``0 s`` is replaced
  by a mask token, every masked symbol of s is predicted independently;
- autoregressive (Table 2, ``causal=True``): causal patterns, position i predicts token i + 1
  with teacher forcing; scored on the positions that predict the second s.

Accuracy is the token accuracy on the symbols of the second s (the separator, trivially known
from its position, is not scored) over a held-out test set; chance is 1/(vocab − 1).

The model is the paper's "one sparse Transformer block with varying numbers of attention layers
with 4 attention heads" (G.1): token embedding + trainable positional embedding E (§2.2), then
``depth`` multi-head sparse attention layers with identity skip connections (eq. 1a), then one
token-wise feed-forward layer of width r = 2d with a skip connection (eq. 1b), then a linear
read-out. AdamW with weight decay, no dropout, linear warm-up (G.1). Not stated in the paper and
chosen here: pre-LayerNorm before each sub-layer and the read-out (the Tensor2Tensor default the
authors used for their other tasks), a cosine decay after warm-up, gradient clipping at 1.

Columns (§5.1): STRIDED and FIXED as UNION (A¹ ∪ A² in every layer and head), MULTIHEAD (half
the heads A¹, half A²) and SEQUENTIAL (layer l uses A^{l mod 2 + 1}); STAR; RANDOM with its
sparsity matched to the mean of the others (the paper: 90% next to 87–93%); dense as reference.
The sparsity shown under each column is measured with ``graph(n).sparsity`` (causal graphs use
the n(n + 1)/2 denominator); MULTIHEAD and SEQUENTIAL show the mean over their two parts.

Scale-out: under ``torchrun`` (RANK / WORLD_SIZE in the environment) a sweep either spreads its
cells over the workers (``parallel="cells"``, the default: cell j of the pending list goes to
worker j mod world) or trains every cell with all workers together (``parallel="data"``: each
global batch is sharded across workers and the model is wrapped in DistributedDataParallel;
gloo on CPU, nccl on GPU).

Writes ``<out_dir>/<run>/config.json``, ``cells/<column>-L<depth>.json`` (one per finished cell,
atomically; a re-run skips finished cells), ``table.md``, ``metrics.json`` and ``copying.png``
(:func:`seeds_figure` of the run: accuracy against depth per column, beside the paper's).
Run: ``sparseattn copying`` (see ``--help``), ``torchrun --nproc_per_node 2 -m sparseattn.lab.cli
copying``, or ``run(CopyConfig())``.

One file per experiment (nanoGPT's rule): the task's data, the config, training and scoring,
the tables and the figure, read top to bottom; what it shares with lm lives in runner.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import Tensor, nn

from ...module import SparseAttention
from ...patterns import (
    HeadSplit,
    Pattern,
    PatternCycle,
    as_cycle,
    block_local,
    cycle,
    dense,
    random,
    split_heads,
    star,
    union,
)
from ..progress import tqdm
from ..results import machine_facts, save_figure, torch_threads, write_json, write_text
from .registry import Experiment, SummaryTable, figures_in, markdown
from .runner import (
    COLUMNS,
    Dist,
    adamw,
    check_sweep_fields,
    head_configuration,
    load_cells,
    pick_device,
    run_name_digest,
    sparsity,
    start_sweep,
    warmup_cosine,
)

#: The paper's Table 1 (bidirectional, n = 256, w = 16): accuracy in % per depth 1–4, and the
#: sparsity level printed under each column. Copied for side-by-side reports.
PAPER_TABLE1 = {
    "strided-union": (87, [0.82, 100.00, 100.00, 100.00]),
    "strided-multihead": (93, [0.82, 100.00, 100.00, 100.00]),
    "strided-sequential": (93, [0.80, 81.24, 100.00, 100.00]),
    "fixed-union": (87, [7.04, 69.26, 99.98, 100.00]),
    "fixed-multihead": (93, [0.76, 56.45, 99.08, 99.64]),
    "fixed-sequential": (93, [0.80, 96.01, 98.58, 100.00]),
    "star": (87, [1.53, 29.70, 42.18, 83.57]),
    "random": (90, [33.14, 63.41, 70.29, 95.49]),
}

#: The paper's Table 2 (autoregressive), same layout.
PAPER_TABLE2 = {
    "strided-union": (87, [0.79, 12.40, 94.50, 100.00]),
    "strided-multihead": (93, [0.78, 8.26, 65.58, 100.00]),
    "strided-sequential": (93, [0.78, 1.57, 60.88, 98.40]),
    "fixed-union": (87, [7.02, 73.43, 99.87, 99.97]),
    "fixed-multihead": (93, [7.04, 13.24, 70.82, 99.16]),
    "fixed-sequential": (93, [0.81, 92.10, 99.84, 99.97]),
    "star": (87, [0.77, 12.32, 14.03, 31.19]),
    "random": (90, [33.13, 67.30, 89.50, 95.88]),
}


@dataclass(frozen=True)
class CopyConfig:
    """One copying sweep. Fields up to ``dtype`` define the results; the rest select cells or
    say where and how to run."""

    n: int = 64  # sequence length; s has n/2 − 1 symbols (paper: 256)
    w: int | None = None  # segment length of STRIDED/FIXED/STAR; None: round(√n) (paper: 16)
    d: int = 64  # embedding dimension (paper: 256); heads of size d / heads
    heads: int = 4  # attention heads per layer (paper: 4)
    ffn: int | None = None  # feed-forward width r; None: 2d (paper: 512 = 2d)
    vocab: int = 128  # token 0 is the separator, symbols are 1 … vocab − 1 (paper: [0, 127])
    causal: bool = False  # autoregressive variant (Table 2) instead of bidirectional (Table 1)
    causal_form: str = "child"  # causal STRIDED/FIXED: "child" (Child et al.) or "tril"
    steps: int = 1000  # optimiser steps per cell (paper: 500K)
    batch_size: int = 64  # global batch, sharded over data-parallel workers (paper: 1024)
    lr: float = 3e-3  # peak learning rate (paper: 1e-4 over 500K steps)
    warmup: int = 100  # linear warm-up steps (paper: 3000), then cosine decay to 0
    weight_decay: float = 0.01  # AdamW
    clip: float = 1.0  # gradient-norm clipping (0: off)
    stop_accuracy: float | None = None  # stop a cell once two checks in a row reach it
    train_size: int = 100_000  # training sequences (paper: 100K)
    test_size: int = 2_000  # held-out sequences (paper: 10K)
    random_sparsity: float | None = None  # RANDOM sparsity; None: mean of the other columns
    layer_norm: bool = True  # pre-LayerNorm (not stated in the paper)
    seed: int = 0
    dtype: str = "float32"  # "float32" or "float64"
    depths: tuple[int, ...] = (1, 2, 3, 4)
    columns: tuple[str, ...] = COLUMNS
    engine: str = "dense"  # attention engine; the masked dense one is fastest at n <= 256
    parallel: str = "cells"  # under torchrun: "cells" (one cell per worker) or "data" (DDP)
    device: str = "auto"  # "auto": cuda:<LOCAL_RANK> when CUDA is available, else cpu
    eval_batch: int = 500
    run: str | None = None  # run folder name; default derived from the result-defining fields
    out_dir: str = "results/copying"
    threads: int = 1  # torch threads per process (the machine is shared)
    progress: bool = True

    @property
    def segment(self) -> int:
        return self.w if self.w is not None else max(1, round(math.sqrt(self.n)))

    @property
    def ffn_width(self) -> int:
        return self.ffn if self.ffn is not None else 2 * self.d

    def identity(self) -> dict[str, Any]:
        """The fields that determine a cell's result (a re-run with equal identity resumes).

        Fields at their value from before they existed (:data:`LEGACY`) are left out, and so
        is ``causal_form`` of a bidirectional run, so earlier run folders keep their names."""
        keep = [f.name for f in dataclasses.fields(self)]
        keep = keep[: keep.index("dtype") + 1]
        out = {k: getattr(self, k) for k in keep}
        out["w"], out["ffn"] = self.segment, self.ffn_width
        for name, value in LEGACY.items():
            if out[name] == value or (name == "causal_form" and not self.causal):
                del out[name]
        return out

    def run_name(self) -> str:
        if self.run:
            return self.run
        kind = "causal" if self.causal else "bidir"
        return f"{kind}-n{self.n}-d{self.d}-w{self.segment}-{run_name_digest(self.identity())}"

    def validate(self) -> CopyConfig:
        if self.n < 4 or self.n % 2:
            raise ValueError(f"n must be an even length >= 4, got {self.n}")
        if not 1 <= self.segment <= self.n:
            raise ValueError(f"w must lie in [1, n = {self.n}], got {self.segment}")
        if self.d < 1 or self.heads < 2 or self.d % self.heads:
            raise ValueError(
                f"d ({self.d}) must be a positive multiple of heads ({self.heads} >= 2)"
            )
        if self.vocab < 3:
            raise ValueError(f"vocab must be >= 3 (separator + 2 symbols), got {self.vocab}")
        for name in ("steps", "batch_size", "train_size", "test_size", "eval_batch", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0 or self.lr <= 0 or self.weight_decay < 0 or self.clip < 0:
            raise ValueError("warmup, weight_decay and clip must be >= 0 and lr > 0")
        if self.random_sparsity is not None and not 0 <= self.random_sparsity < 1:
            raise ValueError(f"random_sparsity must lie in [0, 1), got {self.random_sparsity}")
        if not self.depths or min(self.depths) < 1:
            raise ValueError(f"depths must be a non-empty list of integers >= 1, got {self.depths}")
        check_sweep_fields(self)
        if self.causal_form not in ("child", "tril"):
            raise ValueError(f"causal_form must be 'child' or 'tril', got {self.causal_form!r}")
        if self.stop_accuracy is not None and not 0 < self.stop_accuracy <= 1:
            raise ValueError(f"stop_accuracy must lie in (0, 1], got {self.stop_accuracy}")
        return self


#: Identity fields added after runs existed, with the value those runs used.
LEGACY = {"causal_form": "tril", "stop_accuracy": None}

#: Steps between the early-stopping checks of ``stop_accuracy``.
STOP_CHECK_EVERY = 25


def quick_config(**overrides: Any) -> CopyConfig:
    """A smoke-test sweep: a few hundred steps on short sequences (about a minute in all)."""
    base = dict(n=32, d=32, steps=200, warmup=20, test_size=500, train_size=20_000, depths=(1, 2))
    return replace(CopyConfig(), **{**base, **overrides})


def paper_config(**overrides: Any) -> CopyConfig:
    """The paper's sizes (G.1): n = 256, d = 256, w = 16, r = 512, 10K test sequences. Training
    stays far shorter than the paper's 500K steps of batch 1024; raise ``steps`` on a GPU."""
    base = dict(n=256, d=256, w=16, ffn=512, test_size=10_000, steps=20_000, batch_size=128)
    return replace(CopyConfig(), **{**base, **overrides})


# ---------------------------------------------------------------------------- data
def copy_sequences(num: int, n: int, vocab: int, generator: torch.Generator) -> Tensor:
    """LongTensor[num, n] of sequences ``0 s 0 s``, s uniform over {1, …, vocab − 1}^(n/2 − 1)."""
    s = torch.randint(1, vocab, (num, n // 2 - 1), generator=generator)
    sep = torch.zeros(num, 1, dtype=torch.long)
    return torch.cat([sep, s, sep, s], 1)


def task_tensors(seqs: Tensor, vocab: int, causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    """What the model sees and what it must predict.

    Args:
        seqs: LongTensor[B, n] from :func:`copy_sequences`.
        vocab: symbol count; the mask token is ``vocab``.
        causal: autoregressive (next-token) instead of masked prediction.
    Returns:
        inputs: LongTensor[B, n] — bidirectional: the second half replaced by the mask token;
            causal: the sequence itself.
        positions: LongTensor[n/2 − 1] — output positions that are scored.
        targets: LongTensor[B, n/2 − 1] — the symbols those positions must predict (the second s).
    """
    n = seqs.shape[1]
    half = n // 2
    targets = seqs[:, half + 1 :]
    if causal:
        return seqs, torch.arange(half, n - 1), targets
    inputs = seqs.clone()
    inputs[:, half:] = vocab
    return inputs, torch.arange(half + 1, n), targets


# ---------------------------------------------------------------------------- patterns
def column_pattern(column: str, config: CopyConfig) -> Pattern | PatternCycle:
    """The pattern (or SEQUENTIAL cycle) of one table column at the config's n, w, causality."""
    w, causal = config.segment, config.causal

    def c(p: Pattern) -> Pattern:
        return p.causal() if causal else p

    family, _, heads = column.partition("-")
    if family in ("strided", "fixed") and heads in ("union", "multihead", "sequential"):
        return head_configuration(family, heads, w, config.causal_form if causal else None)
    if column == "star":
        return c(star(w))
    if column == "dense":
        return c(dense())
    if column == "random":
        return random_pattern(random_keys(config), config)
    raise ValueError(f"column must be one of {COLUMNS}, got {column!r}")


#: RANDOM draws a fresh graph for every head of every layer; the cycle covers at least 4 layers.
RANDOM_LAYERS = 4


def random_pattern(k: int, config: CopyConfig, layers: int | None = None) -> PatternCycle:
    """RANDOM with k uniform keys per query, drawn independently for every head (a MULTIHEAD
    split of ``heads`` random graphs) and every layer (a SEQUENTIAL cycle over ``layers``).

    Per-head draws are what the paper's one-layer RANDOM accuracy implies: 33% ≈ 1 − 0.9⁴, the
    chance that one of 4 heads at 90% sparsity sees the source token. The graph of head h in
    layer l is seeded by (seed, l, h), so it does not depend on ``layers``. The causal variant
    keeps the keys at or before the query and adds the query itself (a causal row could
    otherwise be empty).
    """
    layers = max(RANDOM_LAYERS, *config.depths) if layers is None else layers

    def one(seed: int) -> Pattern:
        p = random(k=k, seed=seed)
        return union(p, block_local(1)).causal() if config.causal else p

    h = config.heads
    return cycle(
        *(
            split_heads(*(one(config.seed * 10_007 + layer * h + i) for i in range(h)))
            for layer in range(layers)
        )
    )


@functools.lru_cache(maxsize=32)
def random_target(config: CopyConfig) -> float:
    """The sparsity RANDOM is matched to: the mean over the deterministic sparse columns."""
    if config.random_sparsity is not None:
        return config.random_sparsity
    others = [c for c in COLUMNS if c not in ("random", "dense")]
    levels = [sparsity(column_pattern(c, config), config.n, config.heads) for c in others]
    return sum(levels) / len(levels)


@functools.lru_cache(maxsize=32)
def random_keys(config: CopyConfig) -> int:
    """Keys per query k for which RANDOM's measured sparsity (the heads of its first layer)
    is closest to the target: 1 − k/n exactly when bidirectional, else bisection (the causal
    sparsity falls with k)."""
    target, n = random_target(config), config.n
    if not config.causal:
        return min(n, max(1, round((1 - target) * n)))

    def level(k: int) -> float:
        return sparsity(random_pattern(k, config, 1), n, config.heads)

    lo, hi = 1, n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if level(mid) >= target else (lo, mid)
    return min((lo, hi), key=lambda k: abs(level(k) - target))


def reachable_fraction(column: str, depth: int, config: CopyConfig) -> float:
    """Share of the scored positions whose source symbol can reach them through ``depth``
    layers of the column's graphs (a head-union per layer, plus the skip connection).

    The connectivity ceiling of a cell: a symbol whose source never reaches its position can
    only be guessed. Reaching is necessary, not sufficient — STAR reaches everything through
    its relay in two layers, but one relay vector has to carry the whole string.
    Shapes: per layer a BoolTensor (n, n), reach[q, s] = "s reaches q".
    """
    n, half = config.n, config.n // 2
    layers = as_cycle(column_pattern(column, config))
    eye = torch.eye(n, dtype=torch.bool)
    reach = eye
    for layer in range(depth):
        p = layers[layer]
        graph = p.graph(n, num_heads=config.heads) if isinstance(p, HeadSplit) else p.graph(n)
        step = graph.to_dense()
        step = (step.any(0) if step.dim() == 3 else step) | eye
        reach = (step.double() @ reach.double()) > 0
    _, positions, _ = task_tensors(torch.zeros(1, n, dtype=torch.long), config.vocab, config.causal)
    sources = positions + 1 - half if config.causal else positions - half
    return reach[positions, sources].double().mean().item()


# ---------------------------------------------------------------------------- model
class CopyModel(nn.Module):
    """One sparse Transformer block with ``depth`` attention layers (Yun eq. 1, G.1).

    x = Emb(tokens) + E;  x ← x + Attn_l(LN(x)) for l < depth;  x ← x + W₂ ReLU(W₁ LN(x));
    logits = W_out LN(x).  Shapes: tokens (B, n) → logits (B, n, vocab).
    """

    def __init__(self, config: CopyConfig, pattern: Pattern | PatternCycle, depth: int) -> None:
        super().__init__()
        d = config.d

        def norm() -> nn.Module:
            return nn.LayerNorm(d) if config.layer_norm else nn.Identity()

        self.tok = nn.Embedding(config.vocab + 1, d)  # + the mask token
        self.pos = nn.Parameter(torch.randn(config.n, d))  # same scale as nn.Embedding
        self.attn = nn.ModuleList(
            SparseAttention(d, config.heads, pattern, engine=config.engine, layer_index=layer)
            for layer in range(depth)
        )
        self.attn_norms = nn.ModuleList(norm() for _ in range(depth))
        self.ffn_norm, self.out_norm = norm(), norm()
        self.ffn = nn.Sequential(
            nn.Linear(d, config.ffn_width), nn.ReLU(), nn.Linear(config.ffn_width, d)
        )
        self.out = nn.Linear(d, config.vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.tok(tokens) + self.pos
        for norm, attn in zip(self.attn_norms, self.attn, strict=True):
            x = x + attn(norm(x))
        x = x + self.ffn(self.ffn_norm(x))
        return self.out(self.out_norm(x))

    def layer_sparsity(self) -> list[float]:
        """Measured sparsity of each attention layer's graph at length n (mean over heads)."""
        n, heads = self.pos.shape[0], self.attn[0].num_heads
        return [sparsity(a.pattern, n, heads) for a in self.attn]


# ---------------------------------------------------------------------------- training
def _datasets(config: CopyConfig) -> tuple[Tensor, Tensor]:
    train = copy_sequences(
        config.train_size, config.n, config.vocab, torch.Generator().manual_seed(config.seed)
    )
    test = copy_sequences(
        config.test_size, config.n, config.vocab, torch.Generator().manual_seed(config.seed + 1)
    )
    return train, test


@torch.no_grad()
def evaluate(model: nn.Module, seqs: Tensor, config: CopyConfig, dist: Dist | None = None) -> dict:
    """Token accuracy on the second s of ``seqs`` (LongTensor[N, n]); workers split the set."""
    dist = dist or Dist()
    model.eval()
    device = next(model.parameters()).device
    correct = torch.zeros((), dtype=torch.long, device=device)
    total = torch.zeros((), dtype=torch.long, device=device)
    mine = seqs[dist.rank :: dist.world]
    for start in range(0, mine.shape[0], config.eval_batch):
        inputs, pos, targets = task_tensors(
            mine[start : start + config.eval_batch], config.vocab, config.causal
        )
        logits = model(inputs.to(device))[:, pos.to(device)]
        correct += (logits.argmax(-1) == targets.to(device)).sum()
        total += targets.numel()
    if dist.world > 1:
        stats = torch.stack([correct, total])
        tdist.all_reduce(stats)
        correct, total = stats[0], stats[1]
    model.train()
    return {"accuracy": correct.item() / total.item(), "test_tokens": total.item()}


def train(
    config: CopyConfig,
    column: str,
    depth: int,
    dist: Dist | None = None,
    data: tuple[Tensor, Tensor] | None = None,
    evaluate_test: bool = True,
) -> tuple[nn.Module, dict[str, Any]]:
    """Train one cell (column × depth) and evaluate it on the held-out set.

    With ``dist.world > 1`` (an initialised process group) every worker draws the same global
    batch of ``config.batch_size`` sequences, keeps its slice ``rank::world`` of it, and
    DistributedDataParallel averages the gradients — the same update as one process on the
    whole batch. Returns the (unwrapped) model and the cell's metrics.
    """
    config.validate()
    dist = dist or Dist()
    if config.batch_size % dist.world:
        raise ValueError(
            f"batch_size ({config.batch_size}) must be divisible by the workers ({dist.world})"
        )
    dtype = getattr(torch, config.dtype)
    device = pick_device(config.device)
    train_set, test_set = data if data is not None else _datasets(config)
    pattern = column_pattern(column, config)
    torch.manual_seed(config.seed)
    model = CopyModel(config, pattern, depth).to(device=device, dtype=dtype)
    net: nn.Module = model
    if dist.world > 1:
        ids = [device.index] if device.type == "cuda" else None
        net = nn.parallel.DistributedDataParallel(model, device_ids=ids)
    opt = adamw(model, config.lr, config.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: warmup_cosine(s, config.warmup, config.steps)
    )
    batches = torch.Generator().manual_seed(config.seed + 2)
    curve: list[dict[str, float]] = []
    every = max(1, config.steps // 20)
    hits, stopped_at = 0, None  # consecutive checks at stop_accuracy; the step training ended
    start = time.perf_counter()
    bar = tqdm(
        range(config.steps),
        desc=f"{column} L{depth}" + (f" [rank {dist.rank}]" if dist.world > 1 else ""),
        leave=False,
        disable=not config.progress or dist.rank != 0,
    )
    for step in bar:
        idx = torch.randint(config.train_size, (config.batch_size,), generator=batches)
        inputs, pos, targets = task_tensors(
            train_set[idx[dist.rank :: dist.world]], config.vocab, config.causal
        )
        logits = net(inputs.to(device))[:, pos.to(device)]
        loss = F.cross_entropy(logits.reshape(-1, config.vocab), targets.to(device).reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if config.clip:
            nn.utils.clip_grad_norm_(model.parameters(), config.clip)
        opt.step()
        sched.step()
        check = config.stop_accuracy is not None and step % STOP_CHECK_EVERY == 0
        if check or step % every == 0 or step == config.steps - 1:
            acc = (logits.argmax(-1) == targets.to(device)).double().mean().item()
            if check and dist.world > 1:  # every worker takes the same decision
                mean = torch.tensor(acc / dist.world, dtype=torch.float64, device=device)
                tdist.all_reduce(mean)
                acc = mean.item()
            if check:
                hits = hits + 1 if acc >= config.stop_accuracy else 0
                stopped_at = step if hits == 2 else None
            if step % every == 0 or stopped_at is not None or step == config.steps - 1:
                curve.append({"step": step, "loss": loss.item(), "batch_accuracy": acc})
                bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{acc:.3f}")
            if stopped_at is not None:
                break
    seconds = time.perf_counter() - start
    metrics: dict[str, Any] = {
        "column": column,
        "depth": depth,
        "causal": config.causal,
        "n": config.n,
        "w": config.segment,
        "pattern": repr(pattern) if isinstance(pattern, Pattern) else repr(list(pattern)),
        "sparsity": sparsity(pattern, config.n, config.heads),
        "sparsity_layers": model.layer_sparsity(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "final_loss": curve[-1]["loss"],
        "curve": curve,
        "train_seconds": seconds,
        "steps": config.steps,
        "steps_trained": curve[-1]["step"] + 1,
        "workers": dist.world,
    }
    if column == "random":
        metrics["random_keys_per_query"] = random_keys(config)
        metrics["random_target_sparsity"] = random_target(config)
    if evaluate_test:
        metrics.update(evaluate(model, test_set, config, dist))
    metrics["chance"] = 1 / (config.vocab - 1)
    return model, metrics


# ---------------------------------------------------------------------------- sweep
def cell_name(column: str, depth: int) -> str:
    return f"{column}-L{depth}"


def column_header(column: str, config: CopyConfig) -> str:
    family, _, heads = column.partition("-")
    level = sparsity(column_pattern(column, config), config.n, config.heads)
    name = f"{family.upper()} {heads.upper()}" if heads else family.upper()
    return f"{name} ({level:.1%})"


def summary_tables(config: CopyConfig, cells: dict[str, dict[str, Any]]) -> list[SummaryTable]:
    """Tables 1 / 2: one row per depth, one column per pattern; sparsity in the header, test
    token accuracy in the cells ("—" where a cell has not run). A second table gives each
    cell's connectivity ceiling (:func:`reachable_fraction`)."""
    columns = [c for c in COLUMNS if any(v["column"] == c for v in cells.values())]
    depths = sorted({v["depth"] for v in cells.values()})
    header = ("depth", *(column_header(c, config) for c in columns))
    rows, ceiling = [], []
    for depth in depths:
        row = []
        for c in columns:
            cell = cells.get(cell_name(c, depth))
            row.append(f"{cell['accuracy']:.2%}" if cell else "—")
        rows.append((f"{depth}-layer", *row))
        row = [f"{reachable_fraction(c, depth, config):.1%}" for c in columns]
        ceiling.append((f"{depth}-layer", *row))
    kind = "autoregressive" if config.causal else "bidirectional"
    note = (
        f"Token accuracy on {config.test_size} held-out sequences ({kind}, n = {config.n}, "
        f"w = {config.segment}, d = {config.d}, {config.heads} heads, {config.steps} steps of "
        f"batch {config.batch_size}); chance {1 / (config.vocab - 1):.2%}. "
        "Percentages in parentheses: measured sparsity."
    )
    reach = "Share of copied symbols whose source can reach them through the graphs:"
    return [SummaryTable("", header, rows, (note,)), SummaryTable(reach, header, ceiling)]


def table_markdown(config: CopyConfig, cells: dict[str, dict[str, Any]]) -> str:
    """:func:`summary_tables` in markdown (``table.md``)."""
    return markdown(summary_tables(config, cells))


def seeds_table(configs: Sequence[CopyConfig]) -> str:
    """Table 1 or 2 over several seeds (one run folder per config, equal but for the seed):
    each cell reads "seed accuracies (the paper's number; connectivity ceiling)", with "—"
    where a cell has not run and one ceiling per seed where they differ (RANDOM's graphs
    depend on the seed)."""
    base = configs[0]
    cells = [load_cells(Path(c.out_dir) / c.run_name()) for c in configs]
    paper = PAPER_TABLE2 if base.causal else PAPER_TABLE1
    found = [v for run_cells in cells for v in run_cells.values()]
    columns = [c for c in COLUMNS if any(v["column"] == c for v in found)]
    lines = [
        "| depth | " + " | ".join(column_header(c, base) for c in columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for depth in sorted({v["depth"] for v in found}):
        row = []
        for c in columns:
            runs = [run_cells.get(cell_name(c, depth)) for run_cells in cells]
            accuracy = " / ".join(f"{r['accuracy']:.1%}" if r else "—" for r in runs)
            ref = f"{paper[c][1][depth - 1]:.1f}" if c in paper and depth <= 4 else "—"
            ceiling = dict.fromkeys(f"{reachable_fraction(c, depth, k):.0%}" for k in configs)
            row.append(f"{accuracy} ({ref}; {' / '.join(ceiling)})")
        lines.append(f"| {depth}-layer | " + " | ".join(row) + " |")
    stop = f", stopped at batch accuracy {base.stop_accuracy:g}" if base.stop_accuracy else ""
    lines += [
        "",
        f"Seeds {', '.join(str(c.seed) for c in configs)}: test token accuracy per seed (the "
        "paper's % ; the share of copied symbols whose source reaches them). "
        f"n = {base.n}, w = {base.segment}, d = {base.d}, up to {base.steps} steps of batch "
        f"{base.batch_size}{stop}.",
    ]
    return "\n".join(lines) + "\n"


def seeds_figure(configs: Sequence[CopyConfig], path: Path) -> None:
    """The seeds table as a picture: one panel per column, test accuracy against depth for
    every seed (dots) beside the paper's number (black line) and the connectivity ceiling
    (grey steps; the first seed's for RANDOM, whose graphs depend on the seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = configs[0]
    cells = [load_cells(Path(c.out_dir) / c.run_name()) for c in configs]
    paper = PAPER_TABLE2 if base.causal else PAPER_TABLE1
    found = [v for run_cells in cells for v in run_cells.values()]
    columns = [c for c in COLUMNS if any(v["column"] == c for v in found)]
    depths = sorted({v["depth"] for v in found})
    cols = 3
    rows = -(-len(columns) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.1 * cols, 2.3 * rows), squeeze=False)
    for ax, column in zip(axes.flat, columns, strict=False):
        ceiling = [100 * reachable_fraction(column, dep, base) for dep in depths]
        ax.step(depths, ceiling, where="mid", color="grey", lw=4, alpha=0.35, label="ceiling")
        if column in paper:
            ref = [paper[column][1][dep - 1] for dep in depths if dep <= 4]
            ax.plot(depths[: len(ref)], ref, "k-", marker="s", ms=3, lw=1, label="paper")
        for k, run_cells in enumerate(cells):
            pts = [(dep, run_cells.get(cell_name(column, dep))) for dep in depths]
            shift = 0.06 * (k - (len(cells) - 1) / 2)  # seeds side by side
            x = [dep + shift for dep, r in pts if r]
            y = [100 * r["accuracy"] for _, r in pts if r]
            ax.plot(x, y, "o", ms=4, label=f"seed {configs[k].seed}")
        ax.set_title(column_header(column, base), fontsize=8)
        ax.set_xticks(depths)
        ax.set_ylim(-5, 105)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(columns) :]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("test accuracy %")
    for ax in axes[-1]:
        ax.set_xlabel("layers")
    axes[0, 0].legend(fontsize=6, loc="center right")
    table = "Table 2 (autoregressive)" if base.causal else "Table 1 (bidirectional)"
    fig.suptitle(
        f"Copying, {table}: n = {base.n}, w = {base.segment}, d = {base.d}, "
        f"≤ {base.steps} steps of batch {base.batch_size}",
        fontsize=9,
    )
    fig.tight_layout()
    save_figure(fig, path, dpi=80)


def run(config: CopyConfig, dist: Dist | None = None) -> dict[str, Any]:
    """Run (or resume) a sweep; returns the metrics written to ``metrics.json``.

    Cells whose JSON exists are skipped. Under torchrun (or with ``dist`` given and a process
    group initialised) rank 0 lists the pending cells and broadcasts the list;
    ``parallel="cells"`` gives pending cell j to worker j mod world, ``parallel="data"`` trains
    each pending cell with all workers (DDP). Rank 0 writes the table at the end; a process
    group that this call started is destroyed before it returns.
    """
    config.validate()
    todo = [cell_name(c, d) for d in sorted(config.depths) for c in config.columns]
    sweep = start_sweep(
        config, todo, lambda folder, key: (folder / f"cells/{key}.json").exists(), dist
    )
    dist, folder = sweep.dist, sweep.folder
    with torch_threads(config.threads):
        machine = machine_facts()
        data = _datasets(config)
        bar = sweep.progress("copying", config.progress)
        for key in bar:
            column, _, depth = key.rpartition("-L")
            _, metrics = train(config, column, int(depth), sweep.worker, data)
            metrics["machine"] = machine
            metrics["rank"] = dist.rank
            metrics["config"] = config.identity()
            if dist.rank == 0 or config.parallel == "cells":  # one writer per cell
                write_json(folder / "cells" / f"{key}.json", metrics)
                bar.write(
                    f"{key}: accuracy {metrics['accuracy']:.2%} ({metrics['train_seconds']:.0f} s)"
                )
    sweep.finish()
    cells = load_cells(folder)
    result = {
        "run": config.run_name(),
        "folder": str(folder),
        "cells": {
            k: {"accuracy": v["accuracy"], "sparsity": v["sparsity"]} for k, v in cells.items()
        },
        "complete": all(k in cells for k in todo),
        "train_seconds_total": sum(v["train_seconds"] for v in cells.values()),
        "machine": machine,
        "workers": dist.world,
    }
    result["table"] = table_markdown(config, cells)
    if dist.rank == 0:
        write_text(folder / "table.md", result["table"])
        write_json(folder / "metrics.json", result)
        if cells:
            seeds_figure([config], folder / "copying.png")
    sweep.close()
    return result


EXPERIMENT = Experiment(
    name="copying",
    config=CopyConfig,
    quick=quick_config,
    run=run,
    summary=lambda config, result: summary_tables(config, load_cells(Path(result["folder"]))),
    figures=lambda config, result: figures_in(result["folder"], "copying.png"),
    wrote="wrote {folder}/table.md, copying.png and cells/*.json",
    markdown=True,
    distributed=True,
)
