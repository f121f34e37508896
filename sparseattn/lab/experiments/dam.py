"""SparseBERT's differentiable attention mask (DAM) on a small MLM encoder, against fixed patterns.

Shi et al. (ICML 2021) learn which attention entries BERT needs (DAM_u: one decision per (head,
i, j); DAM_s: one per head and diagonal offset |i − j|), find the diagonal least important, and
compare the learned masks with fixed sparse patterns at their sparsity. This experiment repeats
that on CPU scale:

0. warm start: ``warm_steps`` of dense MLM from a fresh initialisation of a small pre-LN
   encoder (``models.encoder``) on the embedded corpus (``corpus.load_corpus``) — shared by all
   cells (``warm.pt``). From-scratch MLM on this small corpus stays near the unigram level for
   hundreds of steps, and a mask learned while attention is unused learns nothing;
1. every cell continues from the warm start on the same batches for
   ``dam_steps + finetune_steps`` steps;
2. DAM cells (λ × {DAM_u, DAM_s}): ``dam_steps`` steps that learn the weights and the mask
   (Gumbel-sigmoid, straight-through, loss = MLM + λ‖M‖₁, dense scores + the mask's bias), then
   the mask is extracted (M = 1[ℓ > 0], no noise) and the model trains ``finetune_steps`` more
   steps with the extracted fixed pattern through ``sparse_attention`` ("finetuned"); as a
   control, a fresh copy of the warm start trains all steps with the extracted pattern, exactly
   like the pattern cells ("retrained");
3. pattern cells (dense, dense without the diagonal, strided, fixed, Longformer, BigBird, STAR):
   all steps with the fixed pattern through ``sparse_attention``;
4. each cell ends with the validation MLM loss and accuracy (fixed masking draws, the same for
   every cell) with its final pattern, the pattern's sparsity, and — for DAM cells — the kept
   fraction per diagonal offset, the mean logit per offset during training, and the step from
   which each offset's mean logit stays negative.

Tokens: a word-level vocabulary from the train split (lower-cased words, digit runs and single
punctuation marks; words seen at least ``min_count`` times, others → [UNK]). A sequence is
[CLS] + (n − 2) tokens + [SEP]; training sequences are random windows of the concatenated train
passages, validation sequences consecutive windows of the validation passages. MLM selects
``mask_prob`` of the non-special, non-[UNK] positions; training replaces 80/10/10 % of them by
[MASK] / a random word / themselves (BERT), evaluation replaces all by [MASK].

Writes ``<out_dir>/<run>/config.json``, ``warm.pt`` + ``warm.json``, ``cells/<cell>.json`` (one
per finished cell, atomically: a re-run with the same config skips finished cells),
``metrics.json`` (summary table, machine, corpus fingerprint) and three figures
(``sparsity_quality.png``, ``masks.png``, ``offsets.png``).
Run: ``sparseattn dam`` (``--quick`` for a 1–2 minute version) or ``run(DamConfig())``.

One file per experiment (nanoGPT's rule): config, data, model set-up, the training loop of
each cell, the table and the figure, read top to bottom; what other experiments share lives
in runner.py and models/.
"""

from __future__ import annotations

import base64
import collections
import hashlib
import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ...methods.sparsebert import (
    DifferentiableAttentionMask,
    dense_no_diagonal,
    kept_by_offset,
    offset_means,
)
from ...patterns import Pattern, bigbird, dense, fixed, longformer, star, strided
from ..corpus import load_corpus
from ..models.encoder import Encoder, EncoderConfig
from ..progress import tqdm
from ..results import (
    atomic_write,
    machine_facts,
    run_folder,
    save_figure,
    torch_threads,
    write_json,
)
from .registry import Experiment, SummaryTable, figures_in

#: Fixed patterns, parameters chosen so that at n = 128 their sparsity is near the SparseBERT
#: table (strided 70.4 %, fixed 72.7 %, Longformer 88.7 %, BigBird 93.2 %, Star 96.1 %).
BASELINES: dict[str, Callable[[], Pattern]] = {
    "dense": dense,
    "dense_no_diagonal": dense_no_diagonal,
    "strided": lambda: strided(32),
    "fixed": lambda: fixed(32),
    "longformer": lambda: longformer(12, 1),
    "bigbird": lambda: bigbird(4, 1, 1, 4),
    "star": lambda: star(1),
}
VARIANTS = ("unstructured", "structured")
SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
PAD, UNK, CLS, SEP, MASK = range(len(SPECIALS))
_WORD = re.compile(r"[a-z]+|[0-9]+|[^\sa-z0-9]")
#: The local band of offsets the diagonal is compared with in the summary.
NEAR = 16


@dataclass(frozen=True)
class DamConfig:
    """One DAM study. Fields above ``run`` define the results; the rest only where and how."""

    seq_len: int = 128  # n
    dim: int = 128
    heads: int = 4
    layers: int = 2
    ffn_mult: int = 4
    dropout: float = 0.1
    prob_map: str = "softmax"  # ρ of every cell (any name resolve_prob_map accepts)
    batch_size: int = 8
    warm_steps: int = 1000  # shared dense MLM pre-training from scratch, the start of every cell
    dam_steps: int = 150  # phase 1 of DAM cells (weights + mask)
    finetune_steps: int = 100  # phase 2 of DAM cells (extracted fixed mask)
    lr: float = 1e-3  # AdamW; warm start: linear warm-up, then constant; cells: decay to lr/10
    warmup: int = 50
    weight_decay: float = 0.01
    mask_lr: float = 3e-2  # Adam on the mask logits (constant; high: phase 1 is short)
    tau: float = 1.0  # Gumbel-sigmoid temperature
    lambdas: tuple[float, ...] = (1e-4, 1e-3, 1e-2, 1e-1)
    variants: tuple[str, ...] = VARIANTS  # DAM_u, DAM_s
    symmetric: bool = True  # DAM_u symmetric, as the authors' code
    normalized_penalty: bool = False  # λ·mean(M) instead of the authors' λ·sum(M)
    baselines: tuple[str, ...] = tuple(BASELINES)
    mask_prob: float = 0.15
    min_count: int = 2  # vocabulary: train words seen at least this often
    eval_draws: int = 5  # masking draws over the validation sequences
    log_every: int = 10  # steps between mask snapshots in phase 1
    seed: int = 0
    run: str | None = None
    out_dir: str = "results/dam"
    threads: int = 1  # torch threads (the machine is shared)
    progress: bool = True

    def identity(self) -> dict[str, Any]:
        """The fields that determine the results (a re-run with equal identity resumes)."""
        d = asdict(self)
        for key in ("run", "out_dir", "threads", "progress"):
            d.pop(key)
        for key in ("lambdas", "variants", "baselines"):
            d[key] = list(d[key])
        return d

    def run_name(self) -> str:
        if self.run:
            return self.run
        digest = hashlib.sha1(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()
        steps = f"{self.warm_steps}+{self.dam_steps}+{self.finetune_steps}"
        return f"n{self.seq_len}-s{steps}-{digest[:8]}"

    @property
    def total_steps(self) -> int:
        return self.dam_steps + self.finetune_steps

    def validate(self) -> DamConfig:
        for name in ("dim", "heads", "layers", "batch_size", "eval_draws", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.seq_len < 8:
            raise ValueError(f"seq_len must be >= 8, got {self.seq_len}")
        if self.dam_steps < 1 or self.finetune_steps < 0 or self.warm_steps < 0:
            raise ValueError("dam_steps must be >= 1, finetune_steps and warm_steps >= 0")
        if any(lam < 0 for lam in self.lambdas):
            raise ValueError(f"lambdas must be >= 0, got {self.lambdas}")
        if not self.tau > 0:
            raise ValueError(f"tau must be > 0, got {self.tau}")
        if not 0 < self.mask_prob < 1:
            raise ValueError(f"mask_prob must lie in (0, 1), got {self.mask_prob}")
        bad = [v for v in self.variants if v not in VARIANTS]
        if bad:
            raise ValueError(f"variants must be among {VARIANTS}, got {bad}")
        bad = [b for b in self.baselines if b not in BASELINES]
        if bad:
            raise ValueError(f"baselines must be among {sorted(BASELINES)}, got {bad}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        EncoderConfig(
            vocab_size=len(SPECIALS),
            max_len=self.seq_len,
            dim=self.dim,
            heads=self.heads,
            layers=self.layers,
            ffn_mult=self.ffn_mult,
            dropout=self.dropout,
            prob_map=self.prob_map,
        )
        return self


def quick_config(**overrides: Any) -> DamConfig:
    """A 1–2 minute version: n = 64, 100 warm-start + 40 + 20 steps, λ ∈ {1e-3, 1e-1}."""
    base = DamConfig(
        seq_len=64,
        warm_steps=100,
        dam_steps=40,
        finetune_steps=20,
        warmup=10,
        lambdas=(1e-3, 1e-1),
        eval_draws=2,
        log_every=5,
    )
    return replace(base, **overrides)


# --------------------------------------------------------------------------- data
def tokenize(text: str) -> list[str]:
    """Lower-cased words, digit runs and single punctuation marks."""
    return _WORD.findall(text.lower())


@dataclass(frozen=True)
class Data:
    """Token streams and the vocabulary (``itos[i]`` is token i; specials first)."""

    itos: tuple[str, ...]
    train: Tensor  # LongTensor (T,), the concatenated train passages
    validation: Tensor  # LongTensor (V, n): [CLS] + window + [SEP]
    corpus: dict[str, Any]  # passage counts and a SHA-1 of the passages, for the record


def build_data(seq_len: int, min_count: int) -> Data:
    """Vocabulary from the train split, the train stream and the validation sequences."""
    corpus = load_corpus()
    counts = collections.Counter(t for p in corpus.train for t in tokenize(p.text))
    words = sorted(w for w, c in counts.items() if c >= min_count)
    itos = SPECIALS + tuple(words)
    stoi = {w: i for i, w in enumerate(itos)}

    def stream(passages) -> Tensor:
        return torch.tensor([stoi.get(t, UNK) for p in passages for t in tokenize(p.text)])

    body = seq_len - 2
    val = stream(corpus.validation)
    windows = val[: len(val) // body * body].view(-1, body)
    train = stream(corpus.train)
    digest = hashlib.sha1()
    for p in corpus.train + corpus.validation:
        digest.update(p.text.encode())
    info = {
        "train_passages": len(corpus.train),
        "validation_passages": len(corpus.validation),
        "train_tokens": len(train),
        "validation_tokens": len(val),
        "sha1": digest.hexdigest(),
    }
    return Data(itos, train, _frame(windows), info)


def _frame(body: Tensor) -> Tensor:
    """[CLS] + body + [SEP] for (B, n − 2) → (B, n)."""
    cls = torch.full((body.shape[0], 1), CLS)
    return torch.cat([cls, body, torch.full_like(cls, SEP)], 1)


def train_batch(data: Data, batch: int, seq_len: int, gen: torch.Generator) -> Tensor:
    """(batch, n) random windows of the train stream, framed by [CLS] … [SEP]."""
    body = seq_len - 2
    start = torch.randint(len(data.train) - body, (batch,), generator=gen)
    return _frame(data.train[start[:, None] + torch.arange(body)])


def mask_tokens(
    ids: Tensor, vocab_size: int, prob: float, gen: torch.Generator, bert: bool
) -> tuple[Tensor, Tensor]:
    """MLM corruption: ``(inputs, labels)``; labels are −100 where nothing is predicted.

    Positions: each non-special, non-[UNK] token with probability ``prob``. ``bert``: 80 %
    [MASK], 10 % a random word, 10 % unchanged; otherwise all [MASK].
    """
    pick = (torch.rand(ids.shape, generator=gen) < prob) & (ids >= len(SPECIALS))
    labels = torch.where(pick, ids, -100)
    inputs = ids.clone()
    if not bert:
        return inputs.masked_fill_(pick, MASK), labels
    u = torch.rand(ids.shape, generator=gen)
    rand_words = torch.randint(len(SPECIALS), vocab_size, ids.shape, generator=gen)
    inputs = torch.where(pick & (u < 0.8), MASK, inputs)
    inputs = torch.where(pick & (u >= 0.8) & (u < 0.9), rand_words, inputs)
    return inputs, labels


def mlm_loss(model: Encoder, inputs: Tensor, labels: Tensor, **attn: Any) -> tuple[Tensor, Tensor]:
    """Mean cross-entropy over predicted positions and the number of correct predictions."""
    hidden = model(inputs, **attn)
    pick = labels != -100
    logits = model.mlm_logits(hidden[pick])
    target = labels[pick]
    return F.cross_entropy(logits, target), (logits.argmax(-1) == target).sum()


@torch.no_grad()
def evaluate(model: Encoder, data: Data, config: DamConfig, **attn: Any) -> dict[str, float]:
    """Validation MLM loss (mean per predicted token) and accuracy, fixed masking draws."""
    model.eval()
    gen = torch.Generator().manual_seed(config.seed + 12345)
    total = correct = count = 0.0
    for _ in range(config.eval_draws):
        for ids in data.validation.split(32):
            inputs, labels = mask_tokens(ids, len(data.itos), config.mask_prob, gen, bert=False)
            m = int((labels != -100).sum())
            if m == 0:
                continue
            loss, hits = mlm_loss(model, inputs, labels, **attn)
            total += float(loss) * m
            correct += float(hits)
            count += m
    model.train()
    return {"val_loss": total / count, "val_acc": correct / count, "val_tokens": int(count)}


# --------------------------------------------------------------------------- cells
@dataclass(frozen=True)
class Cell:
    """One trained model: a DAM variant at one λ, or a fixed pattern."""

    kind: str  # "dam" or "pattern"
    name: str  # variant ("unstructured"/"structured") or baseline name
    lam: float | None = None

    @property
    def key(self) -> str:
        if self.kind == "dam":
            return f"dam_{'s' if self.name == 'structured' else 'u'}-lam{self.lam:g}"
        return f"pattern-{self.name}"

    @property
    def label(self) -> str:
        if self.kind == "dam":
            return f"DAM_{'s' if self.name == 'structured' else 'u'} λ={self.lam:g}"
        return self.name


def cells_of(config: DamConfig) -> list[Cell]:
    dams = [Cell("dam", v, lam) for v in config.variants for lam in config.lambdas]
    return dams + [Cell("pattern", b) for b in config.baselines]


def _schedule(warmup: int, total: int | None) -> Callable[[int], float]:
    """LR factor: linear warm-up over ``warmup`` steps, then constant (``total`` None) or a
    linear decay to 1/10 at step ``total``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if total is None:
            return 1.0
        return 1.0 - 0.9 * min(1.0, (step - warmup) / max(1, total - warmup))

    return factor


def _new_model(config: DamConfig, vocab_size: int) -> Encoder:
    torch.manual_seed(config.seed)
    return Encoder(
        EncoderConfig(
            vocab_size=vocab_size,
            max_len=config.seq_len,
            dim=config.dim,
            heads=config.heads,
            layers=config.layers,
            ffn_mult=config.ffn_mult,
            dropout=config.dropout,
            prob_map=config.prob_map,
        )
    )


def _mlm_batch(data: Data, config: DamConfig, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    ids = train_batch(data, config.batch_size, config.seq_len, gen)
    return mask_tokens(ids, len(data.itos), config.mask_prob, gen, bert=True)


def _save_state(state: dict[str, Tensor], path: Path) -> None:
    """torch.save, atomically (temporary file + rename)."""
    atomic_write(path, lambda tmp: torch.save(state, tmp))


def warm_start(
    config: DamConfig, data: Data, folder: Path
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The shared start of every cell: ``warm_steps`` of dense MLM from a fresh initialisation.

    Cached as ``warm.pt`` + ``warm.json`` in the run folder (a re-run loads them).
    """
    path, info_path = folder / "warm.pt", folder / "warm.json"
    if path.exists() and info_path.exists():
        return torch.load(path, weights_only=True), json.loads(info_path.read_text())
    start = time.perf_counter()
    model = _new_model(config, len(data.itos))
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule(config.warmup, None))
    gen = torch.Generator().manual_seed(config.seed + 3)
    curve = []
    for i in tqdm(
        range(config.warm_steps), desc="dense warm start", leave=False, disable=not config.progress
    ):
        inputs, labels = _mlm_batch(data, config, gen)
        loss, _ = mlm_loss(model, inputs, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if i % config.log_every == 0:
            curve.append((i, loss.item()))
    info = {
        "steps": config.warm_steps,
        **evaluate(model, data, config),
        "train_curve": curve,
        "seconds": time.perf_counter() - start,
    }
    _save_state(model.state_dict(), path)
    write_json(info_path, info)
    return model.state_dict(), info


def _pack(mask: Tensor) -> str:
    """Bool tensor → base64 of its packed bits (C order)."""
    return base64.b64encode(np.packbits(mask.cpu().numpy().astype(np.uint8)).tobytes()).decode()


def unpack_mask(text: str, shape: tuple[int, ...]) -> Tensor:
    """Inverse of the packing used for ``mask_bits`` in the cell JSON."""
    bits = np.unpackbits(np.frombuffer(base64.b64decode(text), dtype=np.uint8))
    return torch.from_numpy(bits[: math.prod(shape)].reshape(shape).astype(bool))


def _drop_steps(steps: list[int], mean_logit: list[list[float]]) -> list[int | None]:
    """Per offset d: the first logged step from which the mean logit of offset d stays below 0
    through the end of phase 1 (None: kept on average at the end)."""
    out: list[int | None] = []
    for d in range(len(mean_logit[0]) if mean_logit else 0):
        first = None
        for s, row in zip(reversed(steps), reversed(mean_logit), strict=True):
            if row[d] >= 0:
                break
            first = s
        out.append(first)
    return out


class _Trainer:
    """A model from the warm start, its optimiser, the cell's batch stream and loss curve."""

    def __init__(self, config: DamConfig, data: Data, warm: dict[str, Tensor]) -> None:
        self.config, self.data = config, data
        self.model = _new_model(config, len(data.itos))
        self.model.load_state_dict(warm)
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=config.lr, weight_decay=config.weight_decay
        )
        warmup = 0 if config.warm_steps else config.warmup
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, _schedule(warmup, config.total_steps)
        )
        self.gen = torch.Generator().manual_seed(config.seed + 1)  # same batches in every cell
        self.curve: list[tuple[int, float]] = []

    def loss(self, i: int, **attn: Any) -> Tensor:
        inputs, labels = _mlm_batch(self.data, self.config, self.gen)
        loss, _ = mlm_loss(self.model, inputs, labels, **attn)
        if i % self.config.log_every == 0:
            self.curve.append((i, loss.item()))
        return loss

    def update(self, loss: Tensor, *extra: torch.optim.Optimizer) -> None:
        for o in (self.opt, *extra):
            o.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        for o in (self.opt, *extra):
            o.step()
        self.sched.step()

    def fixed(self, pattern: Pattern, first: int, bar: tqdm) -> None:
        """Steps ``first`` … total − 1 with a fixed pattern through ``sparse_attention``."""
        for i in range(first, self.config.total_steps):
            self.update(self.loss(i, pattern=pattern))
            bar.update()


def _sparsity(pattern: Pattern, n: int) -> tuple[float, list[float]]:
    sparsity = pattern.graph(n).sparsity
    per_head = sparsity.tolist() if isinstance(sparsity, Tensor) else [float(sparsity)]
    return sum(per_head) / len(per_head), per_head


def _learn_mask(
    config: DamConfig, data: Data, cell: Cell, run: _Trainer, bar: tqdm
) -> tuple[Pattern, dict[str, Any]]:
    """Phase 1 of a DAM cell: weights and mask together; returns the extracted pattern."""
    n, model = config.seq_len, run.model
    dam = DifferentiableAttentionMask(
        n,
        config.heads,
        structured=cell.name == "structured",
        symmetric=config.symmetric,
        tau=config.tau,
        lam=cell.lam,
        normalized=config.normalized_penalty,
        seed=config.seed,
    )
    mask_opt = torch.optim.Adam(dam.parameters(), lr=config.mask_lr)
    noise_gen = torch.Generator().manual_seed(config.seed + 2)
    snaps: dict[str, list] = {"step": [], "sparsity": [], "kept": [], "mean_logit": []}
    for i in range(config.dam_steps):
        bias, penalty, _ = dam(n, generator=noise_gen)
        run.update(run.loss(i, attn_bias=bias) + penalty, mask_opt)
        if i % config.log_every == 0 or i == config.dam_steps - 1:
            hard = dam.hard_mask()
            snaps["step"].append(i + 1)
            snaps["sparsity"].append(1.0 - float(hard.float().mean()))
            snaps["kept"].append(kept_by_offset(hard).tolist())
            snaps["mean_logit"].append(offset_means(dam.full_logits().detach()).tolist())
        bar.update()
    dam.eval()
    with torch.no_grad():
        eval_bias = dam.bias(dam.sample(n))
    record: dict[str, Any] = {"dam_eval": evaluate(model, data, config, attn_bias=eval_bias)}
    pattern = dam.extract()
    model.eval()
    with torch.no_grad():  # the extracted pattern reproduces the DAM model exactly
        ids = data.validation[:8]
        diff = (model(ids, attn_bias=eval_bias) - model(ids, pattern=pattern)).abs().max()
    model.train()
    hard = pattern.mask(n)
    record.update(
        variant=dam.variant,
        lam=cell.lam,
        extract_max_abs_diff=float(diff),
        snapshots=snaps,
        drop_step=_drop_steps(snaps["step"], snaps["mean_logit"]),
        kept_by_offset=kept_by_offset(hard).tolist(),
        cls_kept={
            "row": float(hard[:, 0, :].float().mean()),
            "column": float(hard[:, :, 0].float().mean()),
            "sep_column": float(hard[:, :, n - 1].float().mean()),
            "overall": float(hard.float().mean()),
        },
        mask_shape=list(hard.shape),
        mask_bits=_pack(hard),
    )
    return pattern, record


def train_cell(
    config: DamConfig, data: Data, cell: Cell, warm: dict[str, Tensor], position: int = 1
) -> dict[str, Any]:
    """Train (from the warm start) and evaluate one cell; returns its JSON record.

    Pattern cells: all ``total_steps`` with the fixed pattern. DAM cells: phase 1 learns the
    mask, phase 2 ("finetuned") continues the same model with the extracted mask; then, as a
    control with the pattern cells' exact protocol ("retrained"), a fresh copy of the warm start
    trains all ``total_steps`` with the extracted mask.
    """
    start = time.perf_counter()
    n = config.seq_len
    record: dict[str, Any] = {"key": cell.key, "label": cell.label, "kind": cell.kind}
    steps = config.total_steps + (config.total_steps if cell.kind == "dam" else 0)
    bar = tqdm(
        total=steps, desc=cell.label, position=position, leave=False, disable=not config.progress
    )
    run = _Trainer(config, data, warm)
    if cell.kind == "dam":
        pattern, info = _learn_mask(config, data, cell, run, bar)
        record.update(info)
        run.fixed(pattern, config.dam_steps, bar)
        again = _Trainer(config, data, warm)
        again.fixed(pattern, 0, bar)
        record["retrained"] = evaluate(again.model, data, config, pattern=pattern)
    else:
        pattern = BASELINES[cell.name]()
        run.fixed(pattern, 0, bar)
    bar.close()
    sparsity, per_head = _sparsity(pattern, n)
    record.update(
        pattern=repr(pattern),
        sparsity=sparsity,
        sparsity_per_head=per_head,
        **evaluate(run.model, data, config, pattern=pattern),
        train_curve=run.curve,
        seconds=time.perf_counter() - start,
    )
    return record


# --------------------------------------------------------------------------- summary
def summarise(config: DamConfig, records: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The table rows (sparsity, loss, accuracy) and the diagonal findings."""
    rows = []
    for cell in cells_of(config):
        r = records.get(cell.key)
        if r is None:
            continue
        row = {
            "cell": cell.key,
            "label": r["label"],
            "sparsity": r["sparsity"],
            "val_loss": r["val_loss"],
            "val_acc": r["val_acc"],
            "seconds": r["seconds"],
        }
        if cell.kind == "dam":
            kept = r["kept_by_offset"]
            near = kept[1 : NEAR + 1]
            drops = r["drop_step"]
            near_drops = [s for s in drops[1 : NEAR + 1] if s is not None]
            row.update(
                dam_eval_loss=r["dam_eval"]["val_loss"],
                dam_eval_acc=r["dam_eval"]["val_acc"],
                retrained_loss=r["retrained"]["val_loss"],
                retrained_acc=r["retrained"]["val_acc"],
                diag_kept=kept[0],
                offsets_1_4_kept=sum(kept[1:5]) / len(kept[1:5]),
                # how many of the offsets 1 … NEAR are kept less often than the diagonal
                # (0: the diagonal is the least kept of the local band)
                offsets_below_diag=sum(k < kept[0] for k in near),
                diag_drop_step=drops[0],
                near_dropped=f"{len(near_drops)}/{len(near)}",
                cls_column_kept=r["cls_kept"]["column"],
                extract_max_abs_diff=r["extract_max_abs_diff"],
            )
        rows.append(row)
    return {"rows": rows}


def _save_fig(fig, path: Path) -> None:
    save_figure(fig, path, dpi=90)


def plot(config: DamConfig, records: dict[str, dict[str, Any]], folder: Path) -> list[str]:
    """sparsity_quality.png, masks.png, offsets.png; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [c for c in cells_of(config) if c.key in records]
    dams = [c for c in cells if c.kind == "dam"]
    paths = []

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric, name in ((axes[0], "val_acc", "accuracy"), (axes[1], "val_loss", "loss")):
        for variant, marker, color in (("unstructured", "o", "C0"), ("structured", "s", "C1")):
            pts = [records[c.key] for c in dams if c.name == variant]
            if pts:
                xs = [100 * p["sparsity"] for p in pts]
                ax.plot(
                    xs,
                    [p[metric] for p in pts],
                    marker + "-",
                    color=color,
                    ms=5,
                    label=f"{'DAM_u' if variant == 'unstructured' else 'DAM_s'} (finetuned)",
                )
                key = "val_" + metric.split("_")[1]
                ax.plot(
                    xs,
                    [p["retrained"][key] for p in pts],
                    marker + ":",
                    color=color,
                    ms=5,
                    mfc="none",
                    label=f"{'DAM_u' if variant == 'unstructured' else 'DAM_s'} (retrained)",
                )
                for p, x in zip(pts, xs, strict=True):
                    ax.annotate(
                        f"{p['lam']:g}",
                        (x, p[metric]),
                        fontsize=6,
                        color=color,
                        xytext=(2, 2),
                        textcoords="offset points",
                    )
        for c in cells:
            if c.kind == "pattern":
                p = records[c.key]
                ax.plot(100 * p["sparsity"], p[metric], "kx")
                below = c.name in ("dense_no_diagonal", "fixed", "bigbird")
                ax.annotate(
                    c.name,
                    (100 * p["sparsity"], p[metric]),
                    fontsize=6,
                    xytext=(4, -9) if below else (4, 3),
                    textcoords="offset points",
                )
        ax.set_xlabel("sparsity (% of attention entries masked)")
        ax.set_ylabel(f"validation MLM {name}")
        ax.legend(fontsize=7)
    fig.suptitle(f"MLM, n = {config.seq_len}: learned masks vs fixed patterns", fontsize=9)
    fig.tight_layout()
    paths.append(folder / "sparsity_quality.png")
    _save_fig(fig, paths[-1])
    plt.close(fig)

    if dams:
        heads = config.heads
        fig, axes = plt.subplots(
            len(dams), heads, figsize=(1.25 * heads, 1.3 * len(dams)), squeeze=False
        )
        for row, c in enumerate(dams):
            r = records[c.key]
            mask = unpack_mask(r["mask_bits"], tuple(r["mask_shape"]))
            for h in range(heads):
                ax = axes[row][h]
                ax.imshow(mask[h].numpy(), cmap="gray_r", interpolation="nearest", vmin=0, vmax=1)
                ax.set_xticks([])
                ax.set_yticks([])
                if h == 0:
                    ax.set_ylabel(c.label.replace(" ", "\n"), fontsize=6)
                if row == 0:
                    ax.set_title(f"head {h}", fontsize=7)
        fig.suptitle("learned masks (black = kept)", fontsize=8)
        fig.tight_layout()
        paths.append(folder / "masks.png")
        _save_fig(fig, paths[-1])
        plt.close(fig)

        fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
        show = min(config.seq_len, 32)
        for c in dams:
            r = records[c.key]
            style = "-" if c.name == "unstructured" else "--"
            axes[0].plot(
                range(show), r["kept_by_offset"][:show], style, marker=".", ms=3, label=c.label
            )
        axes[0].set_xlabel("diagonal offset |i − j|")
        axes[0].set_ylabel("fraction kept (extracted mask)")
        axes[0].set_ylim(-0.02, 1.35)
        axes[0].legend(fontsize=6, ncol=2, loc="upper right")
        lam = sorted(config.lambdas)[len(config.lambdas) // 2]  # a middle λ: 1e-2 by default
        offsets = [d for d in (0, 1, 2, 4, 16, 64) if d < config.seq_len]
        for ax, variant in zip(axes[1:], VARIANTS, strict=True):
            cell = Cell("dam", variant, lam)
            if cell.key not in records:
                ax.set_axis_off()
                continue
            snaps = records[cell.key]["snapshots"]
            for d in offsets:
                ax.plot(
                    snaps["step"],
                    [row[d] for row in snaps["mean_logit"]],
                    lw=2.2 if d == 0 else 1.0,
                    color="k" if d == 0 else None,
                    label=f"|i − j| = {d}",
                )
            ax.axhline(0, color="0.6", lw=0.6)
            ax.set_xlabel("DAM training step")
            ax.set_ylabel("mean mask logit of the offset (< 0: dropped)")
            ax.set_title(f"{cell.label}: which offsets go first", fontsize=8)
            ax.legend(fontsize=6)
        fig.tight_layout()
        paths.append(folder / "offsets.png")
        _save_fig(fig, paths[-1])
        plt.close(fig)
    return [str(p) for p in paths]


# --------------------------------------------------------------------------- driver
def run(config: DamConfig) -> dict[str, Any]:
    """Run (or resume) the study; returns the metrics dict written to metrics.json."""
    config.validate()
    folder = run_folder(Path(config.out_dir) / config.run_name(), config.identity(), ("cells",))
    cells = cells_of(config)
    records: dict[str, dict[str, Any]] = {}
    for cell in cells:
        path = folder / "cells" / f"{cell.key}.json"
        if path.exists():
            records[cell.key] = json.loads(path.read_text())
    pending = [c for c in cells if c.key not in records]
    with torch_threads(config.threads):
        start = time.perf_counter()
        data = build_data(config.seq_len, config.min_count)
        warm, warm_info = warm_start(config, data, folder)
        bar = tqdm(
            pending,
            total=len(cells),
            initial=len(cells) - len(pending),
            desc="DAM cells",
            position=0,
            disable=not config.progress,
        )
        for cell in bar:
            bar.set_postfix_str(cell.key)
            records[cell.key] = train_cell(config, data, cell, warm)
            write_json(folder / "cells" / f"{cell.key}.json", records[cell.key])
    result = {
        "run": config.run_name(),
        "summary": summarise(config, records),
        "warm_start": {k: v for k, v in warm_info.items() if k != "train_curve"},
        "trained_now": [c.key for c in pending],
        "skipped": [c.key for c in cells if c not in pending],
        "vocab_size": len(data.itos),
        "corpus": data.corpus,
        "validation_sequences": int(data.validation.shape[0]),
        "machine": machine_facts(),
        "seconds_this_call": time.perf_counter() - start,
        "seconds_all_cells": sum(r["seconds"] for r in records.values()) + warm_info["seconds"],
    }
    result["figures"] = plot(config, records, folder)
    write_json(folder / "metrics.json", result)
    result["folder"] = str(folder)
    return result


# --------------------------------------------------------------------------- the registry's view
def summary_tables(config: DamConfig, result: dict[str, Any]) -> list[SummaryTable]:
    """The table ``sparseattn dam`` prints and the tour shows: each cell's sparsity and MLM
    validation loss / accuracy after the same steps; for DAM cells the retrained mask and the
    kept fraction of the diagonal and of the offsets 1–4."""
    warm = result["warm_start"]
    rows = []
    for row in result["summary"]["rows"]:
        dam_row = "diag_kept" in row
        rows.append(
            (
                row["label"],
                f"{row['sparsity']:.1%}",
                f"{row['val_loss']:.3f}",
                f"{row['val_acc']:.3f}",
                f"{row['retrained_loss']:.3f} / {row['retrained_acc']:.3f}" if dam_row else "—",
                f"{row['diag_kept']:.2f}" if dam_row else "—",
                f"{row['offsets_1_4_kept']:.2f}" if dam_row else "—",
            )
        )
    title = (
        f"MLM validation after the same steps ({result['run']}); dense warm start: "
        f"loss {warm['val_loss']:.3f}, acc {warm['val_acc']:.3f}"
    )
    header = (
        "cell",
        "sparsity",
        "val loss",
        "val acc",
        "retrained loss / acc",
        "diag kept",
        "offsets 1–4 kept",
    )
    return [SummaryTable(title, header, rows)]


EXPERIMENT = Experiment(
    name="dam",
    config=DamConfig,
    quick=quick_config,
    run=run,
    summary=summary_tables,
    figures=lambda config, result: figures_in(
        result["folder"], "masks.png", "sparsity_quality.png", "offsets.png"
    ),
    wrote="wrote {folder}: cells/*.json, metrics.json, figures",
)
