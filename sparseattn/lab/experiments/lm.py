"""Language modelling with sparse causal attention, Yun et al. (2020) §5 and Fig. 1a, small.

The paper trains 12-block Transformers (d = 256, 8 heads, n = 256) on the One Billion Word
benchmark for 240K steps and plots validation perplexity against the sparsity level. Here:
byte-level language models on the embedded corpus (:mod:`sparseattn.lab.corpus`, the prose of
Python's reference manual; 117 KB of training text, 13 KB of validation text), 800 steps of
batch 4 per cell by default (the whole default sweep: about 25 CPU-minutes; docs/causal.md).
Each passage split is joined with newlines into one byte stream; training draws
random windows of n + 1 bytes, validation scores every byte of consecutive windows.

Columns (§5.1), each at the segment lengths ``widths`` (one sparsity level per w):

- STRIDED and FIXED as UNION (A¹ ∪ A² in every layer and head), MULTIHEAD (half the heads A¹,
  half A²) and SEQUENTIAL (layer l uses A^{l mod 2 + 1}). ``causal_form="child"`` (default):
  Child et al.'s autoregressive originals, :func:`~sparseattn.patterns.causal_strided` and
  :func:`~sparseattn.patterns.causal_fixed`; ``"tril"``: Yun's eq. (4)/(5) masked to the lower
  triangle, which is what the paper's appendix G.2 describes for its LM runs.
- STAR: eq. (6) masked to the lower triangle (no causal original exists; the relay token is the
  last position, so causally only the previous w tokens remain, as the paper notes in H.1).
- RANDOM: k uniform keys per query (plus the query itself), masked to the lower triangle,
  drawn anew for every head, layer and seed; k is chosen so that its measured sparsity matches
  the mean of the deterministic columns at the same w.
- dense: full causal attention (the reference, sparsity 0).

Sparsity is measured with ``graph(n).sparsity`` (causal denominator n(n + 1)/2); MULTIHEAD and
SEQUENTIAL give the mean over their two parts. The model is :class:`~sparseattn.lab.models.Encoder`
(pre-LN blocks, tied read-out) run with causal patterns: every layer's graph keeps keys j ≤ i
only, so position i predicts byte i + 1 from bytes ≤ i. AdamW, linear warm-up, cosine decay.

Scale-out as in every sweep (:mod:`sparseattn.lab.experiments.runner`): under ``torchrun``
the pending cells are spread over the workers (``parallel="cells"``) or every cell is trained
by all workers with DistributedDataParallel (``parallel="data"``). ``parallel="context"``
(context parallelism, docs/parallel.md): every worker trains every cell on the whole batch
but holds only its contiguous part of each window's positions; the attention layers exchange
the keys their queries read (:func:`sparseattn.sparse_attention` with ``group=``), the loss is
the mean over every position of every worker and the parameter gradients are summed over the
workers, so each step is the single-process step (to rounding; dropout must be 0). Writes
``<out_dir>/<run>/config.json``, ``cells/<column>-w<w>-s<seed>.json`` (atomically; a re-run
skips finished cells), ``table.md``, ``metrics.json`` and ``lm.png``. Run: ``sparseattn lm``
(``--help``), ``torchrun --nproc_per_node 2 -m sparseattn.lab.cli lm``, or ``run(LMConfig())``.

One file per experiment (nanoGPT's rule): data, columns, model, training (single process,
data parallel or with the sequence sharded), scoring, tables and figure, read top to bottom;
what it shares with copying lives in runner.py, the model in models/encoder.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import Tensor, nn

from ...parallel import even_boundaries, shard
from ...patterns import (
    Pattern,
    PatternCycle,
    block_local,
    cycle,
    dense,
    random,
    split_heads,
    star,
    union,
)
from ..corpus import load_corpus
from ..models import Encoder, EncoderConfig
from ..progress import tqdm
from ..results import (
    atomic_write,
    machine_facts,
    save_figure,
    torch_threads,
    write_json,
    write_text,
)
from . import runner
from .registry import Experiment, figures_in
from .runner import COLUMNS, Dist, head_configuration, sparsity

#: What the paper reports from Fig. 1a (§5 "Language modeling" and "Discussion").
PAPER_FINDINGS = (
    "STRIDED and STAR achieve the best performance across all sparsity levels",
    "for STRIDED and FIXED, the UNION configuration performs best",
    "RANDOM performs worse than the deterministic patterns",
)

#: The maps ρ a model may be trained with (``LMConfig.prob_map``).
PROB_MAPS = ("softmax", "entmax15", "sparsemax")

#: Bytes are the tokens: no tokenizer, no unknown symbols.
VOCAB = 256

#: How the workers under torchrun share the work (``LMConfig.parallel``): a cell each, the
#: batch of every cell (DDP), or the positions of every window (context parallelism).
PARALLEL = ("cells", "data", "context")


@dataclass(frozen=True)
class LMConfig:
    """One Fig. 1a sweep. Fields up to ``dtype`` define a cell's result; the rest select cells
    (``widths``, ``seeds``, ``columns``) or say where and how to run."""

    n: int = 256  # context length in bytes (paper: 256 word pieces)
    d: int = 64  # embedding dimension (paper: 256); heads of size d / heads
    heads: int = 4  # attention heads per layer (paper: 8)
    layers: int = 2  # Transformer blocks (paper: 12)
    ffn_mult: int = 4  # feed-forward width r = ffn_mult · d (paper: 1024 = 4d)
    dropout: float = 0.0
    positions: str = "learned"  # "learned" or "sinusoidal" position embeddings
    steps: int = 800  # optimiser steps per cell (paper: 240K)
    batch_size: int = 4  # global batch of windows, sharded over data-parallel workers
    lr: float = 3e-3  # peak learning rate
    warmup: int = 50  # linear warm-up steps (paper: 10K), then cosine decay to 0
    weight_decay: float = 0.01  # AdamW (paper: Adafactor with weight decay)
    clip: float = 1.0  # gradient-norm clipping (0: off)
    causal_form: str = "child"  # STRIDED/FIXED: "child" (Child et al.) or "tril" (Yun G.2)
    prob_map: str = "softmax"  # ρ of every head: "softmax" or e.g. "entmax15" (a teacher)
    dtype: str = "float32"
    widths: tuple[int, ...] = (16, 32, 64)  # segment lengths w: one sparsity level each
    seeds: tuple[int, ...] = (0, 1)  # model init, batch order and RANDOM's draws
    columns: tuple[str, ...] = COLUMNS
    engine: str = "dense"  # attention engine; at n = 256 on this CPU "block" is no faster
    parallel: str = "cells"  # under torchrun: "cells" (one per worker), "data" (DDP), "context"
    device: str = "auto"  # "auto": cuda:<LOCAL_RANK> when CUDA is available, else cpu
    eval_batch: int = 32
    run: str | None = None  # run folder name; default derived from the result-defining fields
    out_dir: str = "results/lm"
    save_model: bool = False  # also write cells/<cell>.pt (the trained weights)
    threads: int = 1  # torch threads per process (the machine is shared)
    progress: bool = True

    def identity(self) -> dict[str, Any]:
        """The fields that determine a cell's result (a re-run with equal identity resumes).
        ``prob_map`` only when it is not softmax, so runs from before the field keep their
        identity (and run folder)."""
        names = [f.name for f in dataclasses.fields(self)]
        out = {k: getattr(self, k) for k in names[: names.index("dtype") + 1]}
        if out["prob_map"] == "softmax":
            del out["prob_map"]
        return out

    def run_name(self) -> str:
        if self.run:
            return self.run
        rho = "" if self.prob_map == "softmax" else f"-{self.prob_map}"
        digest = runner.run_name_digest(self.identity())
        return f"n{self.n}-d{self.d}-L{self.layers}-{self.steps}steps{rho}-{digest}"

    def validate(self) -> LMConfig:
        """Check every field; raises ValueError naming the field and what was expected."""
        if self.n < 8:
            raise ValueError(f"n must be >= 8, got {self.n}")
        if self.d < 1 or self.heads < 2 or self.d % self.heads:
            raise ValueError(
                f"d ({self.d}) must be a positive multiple of heads ({self.heads} >= 2)"
            )
        for name in ("layers", "ffn_mult", "steps", "batch_size", "eval_batch", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0 or self.lr <= 0 or self.weight_decay < 0 or self.clip < 0:
            raise ValueError("warmup, weight_decay and clip must be >= 0 and lr > 0")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must lie in [0, 1), got {self.dropout}")
        if self.positions not in ("learned", "sinusoidal"):
            raise ValueError(f"positions must be 'learned' or 'sinusoidal', got {self.positions!r}")
        if self.causal_form not in ("child", "tril"):
            raise ValueError(f"causal_form must be 'child' or 'tril', got {self.causal_form!r}")
        if self.prob_map not in PROB_MAPS:
            raise ValueError(f"prob_map must be one of {PROB_MAPS}, got {self.prob_map!r}")
        if not self.widths or not all(1 <= w < self.n for w in self.widths):
            raise ValueError(f"widths must be a non-empty list of w in [1, n), got {self.widths}")
        if not self.seeds or min(self.seeds) < 0:
            raise ValueError(f"seeds must be a non-empty list of integers >= 0, got {self.seeds}")
        runner.check_sweep_fields(self, PARALLEL)
        if self.parallel == "context" and self.dropout:
            raise ValueError(
                f"dropout must be 0 with parallel='context', got {self.dropout}: each worker "
                "would draw its own masks, and the run would no longer be one process's"
            )
        return self


def quick_config(**overrides: Any) -> LMConfig:
    """A smoke-test sweep: every column at two widths, n = 64, one seed (seconds)."""
    base = dict(n=64, d=32, steps=20, warmup=5, batch_size=8, widths=(4, 8), seeds=(0,))
    return replace(LMConfig(), **{**base, **overrides})


# ---------------------------------------------------------------------------- data
def byte_stream(split: str) -> Tensor:
    """LongTensor[T]: the UTF-8 bytes of a corpus split, passages joined by newlines."""
    passages = load_corpus().split(split)
    data = "\n".join(p.text for p in passages).encode("utf-8")
    return torch.tensor(list(data), dtype=torch.long)


def train_windows(stream: Tensor, n: int, count: int, generator: torch.Generator) -> Tensor:
    """LongTensor[count, n + 1]: windows of the stream at uniform random starts."""
    if stream.numel() < n + 1:
        raise ValueError(f"the training text ({stream.numel()} bytes) is shorter than n + 1")
    starts = torch.randint(stream.numel() - n, (count,), generator=generator)
    return stream[starts[:, None] + torch.arange(n + 1)]


def eval_windows(stream: Tensor, n: int) -> Tensor:
    """LongTensor[m, n + 1]: consecutive windows overlapping by one byte, so that every byte
    after the first of the first ``m · n + 1`` is predicted exactly once."""
    m = (stream.numel() - 1) // n
    if m < 1:
        raise ValueError(f"the validation text ({stream.numel()} bytes) is shorter than n + 1")
    return stream[torch.arange(m)[:, None] * n + torch.arange(n + 1)]


def ngram_perplexity(
    train: Tensor, valid: Tensor, n: int, order: int, alpha: float = 0.01
) -> float:
    """Perplexity of an add-α smoothed byte n-gram model, a reference level for the LMs.

    P(b | c) = (count(c b) + α) / (count(c) + 256 α) with c the previous ``order`` − 1 bytes,
    counted on ``train`` (LongTensor[T]) and scored on the bytes the LMs predict
    (``valid[1 : m·n + 1]``, :func:`eval_windows`) that have a full context. order 1: unigram.
    """
    scored = (valid.numel() - 1) // n * n + 1
    t, v = train.tolist(), valid[:scored].tolist()
    k = order - 1
    context, joint = Counter(), Counter()
    for i in range(k, len(t)):
        context[tuple(t[i - k : i])] += 1
        joint[tuple(t[i - k : i + 1])] += 1
    nll = 0.0
    for i in range(max(1, k), len(v)):
        c = tuple(v[i - k : i])
        nll -= math.log((joint[(*c, v[i])] + alpha) / (context[c] + VOCAB * alpha))
    return math.exp(nll / (len(v) - max(1, k)))


# ---------------------------------------------------------------------------- patterns
def column_pattern(column: str, w: int, config: LMConfig, seed: int = 0) -> Pattern | PatternCycle:
    """The causal pattern (or SEQUENTIAL cycle) of one Fig. 1a curve at segment length w."""
    family, _, heads = column.partition("-")
    if family in ("strided", "fixed"):
        return head_configuration(family, heads, w, config.causal_form)
    if column == "star":
        return star(w).causal()
    if column == "random":
        return random_pattern(random_keys(w, config), config, seed)
    if column == "dense":
        return dense().causal()
    raise ValueError(f"column must be one of {COLUMNS}, got {column!r}")


def random_pattern(k: int, config: LMConfig, seed: int, layers: int | None = None) -> PatternCycle:
    """RANDOM: per head (a MULTIHEAD split) and per layer (a SEQUENTIAL cycle over ``layers``,
    default ``config.layers``) k uniform keys per query among all n, masked to j ≤ i, plus the
    query itself (a causal row could otherwise be empty). Head h of layer l is seeded by
    (seed, l, h)."""
    layers = config.layers if layers is None else layers
    h = config.heads

    def one(s: int) -> Pattern:
        return union(random(k=k, seed=s), block_local(1)).causal()

    return cycle(
        *(
            split_heads(*(one(seed * 10_007 + layer * h + i) for i in range(h)))
            for layer in range(layers)
        )
    )


@functools.lru_cache(maxsize=64)
def random_target(w: int, config: LMConfig) -> float:
    """The sparsity RANDOM is matched to at segment length w: the mean over the deterministic
    sparse columns (STRIDED, FIXED in all three configurations, STAR)."""
    others = [c for c in COLUMNS if c not in ("random", "dense")]
    levels = [sparsity(column_pattern(c, w, config), config.n, config.heads) for c in others]
    return sum(levels) / len(levels)


def random_keys(w: int, config: LMConfig) -> int:
    """Keys per query k whose expected RANDOM sparsity is closest to :func:`random_target`.

    Row i keeps the drawn keys j <= i, k(i + 1)/n of them on average, plus the query itself
    when it was not drawn (probability 1 − k/n), so the expected edge count is
    E(k) = k(n + 1)/2 + n − k and the sparsity 1 − E(k) / (n(n + 1)/2); solved for k and
    rounded. The measured sparsity of the drawn graphs is what the results report.
    """
    n = config.n
    edges = (1 - random_target(w, config)) * n * (n + 1) / 2
    return min(n, max(1, round((edges - n) / ((n - 1) / 2))))


def layer_patterns(pattern: Pattern | PatternCycle, layers: int) -> list[Pattern]:
    """The pattern each of ``layers`` layers uses (a cycle: layer l gets pattern l mod p)."""
    return [pattern[l] if isinstance(pattern, PatternCycle) else pattern for l in range(layers)]


# ---------------------------------------------------------------------------- training
def make_model(config: LMConfig) -> Encoder:
    """The byte-level model: ``Encoder`` with n learned positions and a tied read-out."""
    return Encoder(
        EncoderConfig(
            vocab_size=VOCAB,
            max_len=config.n,
            dim=config.d,
            heads=config.heads,
            layers=config.layers,
            ffn_mult=config.ffn_mult,
            dropout=config.dropout,
            prob_map=config.prob_map,
            engine=config.engine,
            positions=config.positions,
        )
    )


def context_group(config: LMConfig, dist: Dist) -> object:
    """The process group the sequence is sharded over: the default group with
    ``parallel="context"`` and several workers, else None (each worker holds whole windows)."""
    return tdist.group.WORLD if config.parallel == "context" and dist.world > 1 else None


def local_part(windows: Tensor, group: object = None) -> tuple[Tensor, Tensor, int]:
    """(ids, targets, start) of ``windows`` (LongTensor[B, n + 1]): the input bytes
    ``windows[:, :n]``, the bytes they predict ``windows[:, 1:]`` and the global position of
    the first; with ``group``, this rank's contiguous part of both (near-equal parts,
    :func:`sparseattn.parallel.shard`) and where it begins."""
    ids, targets = windows[:, :-1], windows[:, 1:]
    if group is None:
        return ids, targets, 0
    start = even_boundaries(ids.shape[1], tdist.get_world_size(group))[tdist.get_rank(group)]
    return shard(ids, group, dim=-1), shard(targets, group, dim=-1), start


def next_byte_logits(
    net: nn.Module, windows: Tensor, pattern: Pattern | PatternCycle, group: object = None
) -> Tensor:
    """FloatTensor[B, n, 256]: the scores of byte i + 1 at every position i of
    ``windows[:, :n]`` (LongTensor[B, n + 1]). ``net`` is the Encoder or its DDP wrapper.
    With ``group`` (context parallelism): the scores at this rank's positions only,
    FloatTensor[B, n_r, 256] (:func:`local_part`)."""
    ids, _, start = local_part(windows, group)
    model = net.module if isinstance(net, nn.parallel.DistributedDataParallel) else net
    return model.mlm_logits(net(ids, pattern, start=start, group=group))


def summed_loss(
    net: nn.Module, windows: Tensor, pattern: Pattern | PatternCycle, group: object = None
) -> tuple[Tensor, int]:
    """(Σ next-byte cross-entropy, count) over the predicted bytes of ``windows``; with
    ``group``, over this rank's positions (the sums over the ranks are the whole's)."""
    _, targets, _ = local_part(windows, group)
    logits = next_byte_logits(net, windows, pattern, group)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="sum")
    return loss, targets.numel()


def sum_gradients(model: nn.Module, group: object) -> None:
    """Sum every parameter's gradient over ``group`` in one all-reduce. With the sequence
    sharded, rank r's gradient is what flows through its positions (the attention's backward
    has sent the gradients of the keys other ranks read back to r), so the sum is the
    gradient of the whole loss, the same on every rank."""
    params = [p for p in model.parameters() if p.requires_grad]
    flat = torch.cat(
        [(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1) for p in params]
    )
    tdist.all_reduce(flat, group=group)
    for p, grad in zip(params, flat.split([p.numel() for p in params]), strict=True):
        p.grad = grad.view_as(p)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    pattern: Pattern | PatternCycle,
    windows: Tensor,
    config: LMConfig,
    dist: Dist | None = None,
) -> dict[str, float]:
    """Mean next-byte cross-entropy (nats), perplexity and bits per byte on ``windows``
    (LongTensor[m, n + 1]); workers split the windows (with ``parallel="context"``: the
    positions of every window) and sum their losses and byte counts."""
    dist = dist or Dist()
    group = context_group(config, dist)
    model.eval()
    device = next(model.parameters()).device
    total = torch.zeros(2, dtype=torch.float64, device=device)  # (summed loss, bytes)
    mine = windows if group is not None else windows[dist.rank :: dist.world]
    for start in range(0, mine.shape[0], config.eval_batch):
        batch = mine[start : start + config.eval_batch].to(device)
        loss, count = summed_loss(model, batch, pattern, group)
        total += torch.stack([loss.double(), torch.tensor(float(count), device=device)])
    if dist.world > 1:
        tdist.all_reduce(total)
    model.train()
    nats = (total[0] / total[1]).item()
    return {
        "loss": nats,
        "perplexity": math.exp(nats),
        "bits_per_byte": nats / math.log(2),
        "eval_bytes": int(total[1].item()),
    }


def train(
    config: LMConfig,
    column: str,
    w: int | None,
    seed: int,
    dist: Dist | None = None,
    data: tuple[Tensor, Tensor] | None = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """Train one cell (column × w × seed) and evaluate it on the validation windows.

    ``w`` is None for dense. With ``dist.world > 1`` (an initialised process group) every worker
    draws the same global batch, and then

    - by default (``parallel`` "cells" or "data") keeps its slice ``rank::world`` and
      DistributedDataParallel averages the gradients;
    - with ``parallel="context"`` keeps every window but only its contiguous part of the
      positions (:func:`local_part`): position embeddings at the global positions, every
      attention layer with ``group=`` (exact: each rank receives the keys its queries read
      and sends their gradients back), the loss Σ over its positions / (batch · n) — whose
      all-reduce is the mean over all positions, what is recorded — and the parameter
      gradients summed over the workers (:func:`sum_gradients`).

    Either way each step is the update of one process on the whole batch (to rounding).
    The metrics hold ``train_losses``, the loss of every step (under DDP: this worker's
    slice's). Returns the (unwrapped) model and the cell's metrics.
    """
    config.validate()
    dist = dist or Dist()
    group = context_group(config, dist)
    if group is None and config.batch_size % dist.world:
        raise ValueError(
            f"batch_size ({config.batch_size}) must be divisible by the workers ({dist.world})"
        )
    if group is not None and config.n < dist.world:
        raise ValueError(f"n ({config.n}) must be >= the workers ({dist.world}) to shard it")
    device = runner.pick_device(config.device)
    train_stream, val_windows = data if data is not None else datasets(config)
    pattern = column_pattern(column, w or 1, config, seed)
    torch.manual_seed(seed)
    model = make_model(config).to(device=device, dtype=getattr(torch, config.dtype))
    net: nn.Module = model
    if dist.world > 1 and group is None:
        ids = [device.index] if device.type == "cuda" else None
        net = nn.parallel.DistributedDataParallel(model, device_ids=ids)
    opt = runner.adamw(model, config.lr, config.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: runner.warmup_cosine(s, config.warmup, config.steps)
    )
    batches = torch.Generator().manual_seed(seed + 1)
    curve: list[dict[str, float]] = []
    losses = torch.zeros(config.steps, dtype=torch.float64, device=device)
    every = max(1, config.steps // 20)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    bar = tqdm(
        range(config.steps),
        desc=cell_name(column, w, seed) + (f" [rank {dist.rank}]" if dist.world > 1 else ""),
        leave=False,
        disable=not config.progress or dist.rank != 0,
    )
    for step in bar:
        windows = train_windows(train_stream, config.n, config.batch_size, batches)
        if group is None:
            batch = windows[dist.rank :: dist.world].to(device)
            logits = next_byte_logits(net, batch, pattern)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
            shown = loss.detach()
        else:
            summed, _ = summed_loss(model, windows.to(device), pattern, group)
            loss = summed / (config.batch_size * config.n)
            shown = loss.detach().clone()
            tdist.all_reduce(shown, group=group)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if group is not None:
            sum_gradients(model, group)
        if config.clip:
            nn.utils.clip_grad_norm_(model.parameters(), config.clip)
        opt.step()
        sched.step()
        losses[step] = shown
        if step % every == 0 or step == config.steps - 1:
            curve.append({"step": step, "loss": shown.item()})
            bar.set_postfix(loss=f"{shown.item():.3f}")
    metrics: dict[str, Any] = {
        "column": column,
        "w": w,
        "seed": seed,
        "sparsity": sparsity(pattern, config.n, config.heads),
        "sparsity_layers": [
            sparsity(p, config.n, config.heads) for p in layer_patterns(pattern, config.layers)
        ],
        "pattern": repr(pattern) if isinstance(pattern, Pattern) else repr(list(pattern)),
        "parameters": sum(p.numel() for p in model.parameters()),
        "final_train_loss": curve[-1]["loss"],
        "curve": curve,
        "train_losses": losses.tolist(),
        "train_seconds": time.perf_counter() - wall0,
        "train_cpu_seconds": time.process_time() - cpu0,
        "steps": config.steps,
        "workers": dist.world,
        "parallel": config.parallel if dist.world > 1 else None,
    }
    if column == "random":
        metrics["random_keys_per_query"] = random_keys(w, config)
        metrics["random_target_sparsity"] = random_target(w, config)
    metrics.update(evaluate(model, pattern, val_windows, config, dist))
    return model, metrics


def datasets(config: LMConfig) -> tuple[Tensor, Tensor]:
    """(training byte stream LongTensor[T], validation windows LongTensor[m, n + 1])."""
    return byte_stream("train"), eval_windows(byte_stream("validation"), config.n)


# ---------------------------------------------------------------------------- sweep
def cell_name(column: str, w: int | None, seed: int) -> str:
    """``<column>-w<w>-s<seed>``; dense has no w: ``dense-s<seed>``."""
    return f"{column}-s{seed}" if w is None else f"{column}-w{w}-s{seed}"


def cell_keys(config: LMConfig) -> list[tuple[str, int | None, int]]:
    """Every (column, w, seed) the config asks for; dense once per seed."""
    keys = []
    for seed in config.seeds:
        for column in config.columns:
            widths = [None] if column == "dense" else sorted(config.widths)
            keys += [(column, w, seed) for w in widths]
    return keys


def summarise(cells: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Seeds pooled per (column, w): mean / min / max perplexity, sparsity and seed count,
    keyed ``<column>-w<w>`` (``dense`` for dense)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for cell in cells.values():
        key = cell["column"] if cell["w"] is None else f"{cell['column']}-w{cell['w']}"
        groups.setdefault(key, []).append(cell)
    out = {}
    for key, group in groups.items():
        ppl = [c["perplexity"] for c in group]
        out[key] = {
            "column": group[0]["column"],
            "w": group[0]["w"],
            "sparsity": sum(c["sparsity"] for c in group) / len(group),
            "perplexity": sum(ppl) / len(ppl),
            "perplexity_min": min(ppl),
            "perplexity_max": max(ppl),
            "seeds": sorted(c["seed"] for c in group),
        }
    return out


def _label(column: str) -> str:
    family, _, heads = column.partition("-")
    return f"{family.upper()} {heads.upper()}" if heads else family.upper()


def table_markdown(
    config: LMConfig, summary: dict[str, dict[str, Any]], ngram: dict[str, float]
) -> str:
    """One row per column, one column per w: mean validation perplexity over seeds (± half
    the min–max spread) and the measured sparsity in parentheses; "—" where nothing ran.
    ``ngram``: reference perplexities of byte n-gram models, named in the caption."""
    widths = sorted({s["w"] for s in summary.values() if s["w"] is not None})
    lines = [
        "| pattern | " + " | ".join(f"w = {w}" for w in widths) + " |",
        "|---|" + "---:|" * len(widths),
    ]
    for column in COLUMNS:
        if column == "dense" and "dense" in summary:
            lines.append(f"| DENSE | {_entry(summary['dense'])} |" + " |" * (len(widths) - 1))
            continue
        row = [summary.get(f"{column}-w{w}") for w in widths]
        if any(row):
            lines.append(f"| {_label(column)} | " + " | ".join(_entry(s) for s in row) + " |")
    seeds = sorted({seed for s in summary.values() for seed in s["seeds"]})
    lines += [
        "",
        f"Validation perplexity per byte (mean over seeds {seeds}, ± half the spread), byte-level "
        f"LM, n = {config.n}, d = {config.d}, {config.layers} layers × {config.heads} heads, "
        f"{config.steps} steps of batch {config.batch_size}, causal form {config.causal_form!r}"
        f"{'' if config.prob_map == 'softmax' else ', ρ = ' + config.prob_map}."
        " Percentages: measured sparsity (causal denominator n(n + 1)/2). Byte n-gram models "
        "on the same bytes: " + ", ".join(f"{k} {v:.2f}" for k, v in ngram.items()) + ".",
    ]
    return "\n".join(lines) + "\n"


def _entry(s: dict[str, Any] | None) -> str:
    if s is None:
        return "—"
    spread = (s["perplexity_max"] - s["perplexity_min"]) / 2
    return f"{s['perplexity']:.3f} ± {spread:.3f} ({s['sparsity']:.1%})"


def findings(summary: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The three Fig. 1a claims checked per w on this run: the best column, the best head
    configuration of STRIDED and of FIXED, and RANDOM's rank among the sparse columns (1 =
    best). Same w is not same sparsity (UNION is denser): read with the sparsity levels."""
    out: dict[str, Any] = {}
    widths = sorted({s["w"] for s in summary.values() if s["w"] is not None})
    for w in widths:
        at = {s["column"]: s["perplexity"] for s in summary.values() if s["w"] == w}
        ranked = sorted(at, key=at.get)
        entry: dict[str, Any] = {"ranking": ranked}
        for family in ("strided", "fixed"):
            configs = {c: p for c, p in at.items() if c.startswith(family + "-")}
            if configs:
                entry[f"best_{family}_configuration"] = min(configs, key=configs.get)
        if "random" in at:
            entry["random_rank"] = ranked.index("random") + 1
            entry["sparse_columns"] = len(ranked)
        out[f"w{w}"] = entry
    return out


def plot(
    config: LMConfig, summary: dict[str, dict[str, Any]], ngram: dict[str, float], path: Path
) -> None:
    """Fig. 1a's axes: validation perplexity against sparsity, one curve per column (the mean
    over seeds, bars from min to max), dense as a horizontal line, the bigram and trigram
    levels (``ngram``) as grey dotted lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {"union": "-", "multihead": "--", "sequential": ":"}
    colours = {
        "strided": "tab:blue",
        "fixed": "tab:orange",
        "star": "tab:green",
        "random": "tab:red",
    }
    for column in COLUMNS[:-1]:
        points = sorted(
            (s for s in summary.values() if s["column"] == column), key=lambda s: s["sparsity"]
        )
        if not points:
            continue
        x = [s["sparsity"] for s in points]
        y = [s["perplexity"] for s in points]
        err = [
            [s["perplexity"] - s["perplexity_min"] for s in points],
            [s["perplexity_max"] - s["perplexity"] for s in points],
        ]
        family, _, heads = column.partition("-")
        ax.errorbar(
            x,
            y,
            yerr=err,
            marker="o",
            ms=4,
            capsize=2,
            label=_label(column),
            color=colours[family],
            linestyle=styles.get(heads, "-"),
        )
    if "dense" in summary:
        ax.axhline(summary["dense"]["perplexity"], color="black", lw=1, label="DENSE")
    for name in ("bigram", "trigram"):
        ax.axhline(ngram[name], color="grey", lw=1, ls=":")
        ax.annotate(
            f"byte {name}",
            (0, ngram[name]),
            xycoords=("axes fraction", "data"),
            xytext=(3, 3),
            textcoords="offset points",
            fontsize=7,
            color="grey",
        )
    ax.set_xlabel("sparsity level (causal)")
    ax.set_ylabel("validation perplexity per byte")
    ax.set_title(
        f"byte-level LM, n = {config.n}, {config.layers}×{config.heads} heads, "
        f"d = {config.d}, {config.steps} steps ({config.causal_form})"
    )
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    save_figure(fig, path)


def run(config: LMConfig, dist: Dist | None = None) -> dict[str, Any]:
    """Run (or resume) a sweep; returns the metrics written to ``metrics.json``.

    Cells whose JSON exists are skipped. Under torchrun rank 0 lists the pending cells and
    broadcasts the list; ``parallel="cells"`` gives pending cell j to worker j mod world,
    ``parallel="data"`` trains each pending cell with all workers (DDP). Rank 0 writes the
    table, metrics and figure at the end; a process group this call started is destroyed.
    """
    config.validate()
    todo = cell_keys(config)
    sweep = runner.start_sweep(
        config, todo, lambda folder, key: _cell_done(folder, cell_name(*key), config), dist
    )
    dist, folder = sweep.dist, sweep.folder
    with torch_threads(config.threads):
        machine = machine_facts()
        data = datasets(config)
        bar = sweep.progress("lm", config.progress)
        for column, w, seed in bar:
            model, metrics = train(config, column, w, seed, sweep.worker, data)
            metrics.update(machine=machine, rank=dist.rank, config=config.identity())
            if dist.rank == 0 or config.parallel == "cells":  # one writer per cell
                name = cell_name(column, w, seed)
                if config.save_model:  # the weights first: a cell is done once its JSON is
                    path = model_path(config, column, w, seed)
                    atomic_write(path, lambda tmp, m=model: torch.save(m.state_dict(), tmp))
                write_json(folder / "cells" / f"{name}.json", metrics)
                bar.write(
                    f"{name}: perplexity {metrics['perplexity']:.3f} "
                    f"({metrics['train_cpu_seconds']:.0f} s CPU)"
                )
    sweep.finish()
    result = _report(config, folder, todo, machine, dist)
    sweep.close()
    return result


def model_path(config: LMConfig, column: str, w: int | None, seed: int) -> Path:
    """Where ``save_model`` puts a cell's weights: ``<out_dir>/<run>/cells/<cell>.pt``."""
    return Path(config.out_dir) / config.run_name() / "cells" / f"{cell_name(column, w, seed)}.pt"


def load_model(config: LMConfig, column: str, w: int | None, seed: int) -> Encoder:
    """The trained model of a cell saved with ``save_model`` (in eval mode, on the CPU)."""
    path = model_path(config, column, w, seed)
    if not path.exists():
        raise ValueError(f"no saved weights at {path}: run the cell with save_model=True")
    model = make_model(config).to(dtype=getattr(torch, config.dtype))
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return model.eval()


def _cell_done(folder: Path, name: str, config: LMConfig) -> bool:
    """A cell is done when its JSON exists (and, with ``save_model``, its weights)."""
    cells = folder / "cells"
    return (cells / f"{name}.json").exists() and (
        not config.save_model or (cells / f"{name}.pt").exists()
    )


def ngram_levels(config: LMConfig) -> dict[str, float]:
    """Byte unigram / bigram / trigram perplexities on the validation bytes (reference levels)."""
    train_stream, valid = byte_stream("train"), byte_stream("validation")
    names = {1: "unigram", 2: "bigram", 3: "trigram"}
    return {name: ngram_perplexity(train_stream, valid, config.n, k) for k, name in names.items()}


def _report(config: LMConfig, folder: Path, todo: list, machine: dict, dist: Dist) -> dict:
    """metrics.json / table.md / lm.png from the finished cells (written by rank 0)."""
    cells = runner.load_cells(folder)
    summary = summarise(cells)
    ngram = ngram_levels(config)
    result = {
        "run": config.run_name(),
        "folder": str(folder),
        "summary": summary,
        "findings": findings(summary),
        "paper_findings": list(PAPER_FINDINGS),
        "ngram_perplexity": ngram,
        "complete": all(cell_name(*k) in cells for k in todo),
        "train_seconds_total": sum(v["train_seconds"] for v in cells.values()),
        "train_cpu_seconds_total": sum(v["train_cpu_seconds"] for v in cells.values()),
        "machine": machine,
        "workers": dist.world,
        "table": table_markdown(config, summary, ngram),
    }
    if dist.rank == 0:
        write_text(folder / "table.md", result["table"])
        write_json(folder / "metrics.json", result)
        plot(config, summary, ngram, folder / "lm.png")
    return result


EXPERIMENT = Experiment(
    name="lm",
    config=LMConfig,
    quick=quick_config,
    run=run,
    summary=lambda config, result: [result["table"]],  # table.md, as the run wrote it
    figures=lambda config, result: figures_in(result["folder"], "lm.png"),
    wrote="wrote {folder}/table.md, metrics.json, lm.png, cells/*.json",
    markdown=True,
    distributed=True,
)
