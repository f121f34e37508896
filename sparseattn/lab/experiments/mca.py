"""MCA sweep on the embedded model: error vs the Theorem 2 bound, fidelity vs MACs kept.

For α ∈ {0, 0.1, …, 1.0}: every layer of MiniLM gets Monte-Carlo value projections
(``MCAMethod``), exact scores and softmax; measured on the test passages of the embedded corpus:
value-projection MACs kept, wall-clock of the sampled vs exact projection, the mean
‖Ỹ_i − Y_i‖ per layer against α·β·‖W‖_F, and the shared fidelity metrics (embedding cosine,
retrieval accuracy). One JSON per α under ``results/mca/<run>/cells/`` (a re-run skips them),
then ``metrics.json`` and two figures.

Then the two cost accountings side by side (``accounting.json``, issue 16 item 10): short
passages (``accounting_words`` words) padded to ``accounting_length`` tokens as the MCA reference
code runs them, with its metric (r_j from the padded length, averaged over every position,
padding included) and with ours (r_j from the real length, averaged over real tokens); and ours
again on the same passages unpadded (one per batch).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch

from ...validate import check_finite_float, check_int, check_positive
from ..progress import tqdm
from ..results import machine_facts, read_json, save_figure, write_json
from .registry import Experiment, SummaryTable, figures_in

__all__ = ["EXPERIMENT", "MCAConfig", "quick_config", "run", "summary_tables"]

#: Config fields of the accounting comparison (kept out of the run identity).
ACCOUNTING_FIELDS = ("accounting_alphas", "accounting_words", "accounting_length")


@dataclasses.dataclass(frozen=True)
class MCAConfig:
    alphas: tuple[float, ...] = tuple(round(0.1 * i, 1) for i in range(11))
    max_passages: int = 48
    batch_size: int = 8
    max_length: int = 256
    seed: int = 0
    run: str | None = None  # run folder name; default derived from the result-defining fields
    out: str = "results/mca"
    sweep: bool = True  # False: only the accounting comparison
    # the accounting comparison (not part of the run identity: accounting.json records them);
    # no α: not run (``sparseattn mca`` runs it at 0.1, 0.2, 0.5, 1.0)
    accounting_alphas: tuple[float, ...] = ()
    accounting_words: int = 8
    accounting_length: int = 128

    def identity(self) -> dict:
        """The fields a run folder is pinned to (its cells are reused per α, so not ``alphas``)."""
        skip = ("alphas", "run", "out", "sweep", *ACCOUNTING_FIELDS)
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in skip}

    def run_name(self) -> str:
        """``run``, or a name derived from :meth:`identity`: a ``--quick`` run and a full one
        never share a folder."""
        if self.run:
            return self.run
        digest = hashlib.sha1(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()
        return f"p{self.max_passages}-L{self.max_length}-seed{self.seed}-{digest[:8]}"

    def validate(self) -> MCAConfig:
        """Check every field (before any folder is written or the model loaded)."""
        if self.sweep and not self.alphas:
            raise ValueError("alphas must hold at least one α >= 0")
        for alpha in self.alphas:
            check_finite_float("alphas[i] (an α)", alpha, 0.0)
        check_int("max_passages", self.max_passages, 2)
        check_positive("batch_size", self.batch_size)
        check_int("max_length", self.max_length, 8)
        check_int("seed", self.seed)
        for alpha in self.accounting_alphas:
            check_finite_float("accounting_alphas[i] (an α)", alpha, 0.0)
        check_int("accounting_words", self.accounting_words, 8)
        check_int("accounting_length", self.accounting_length, 8)
        if not self.sweep and not self.accounting_alphas:
            raise ValueError("nothing to run: sweep is off and accounting_alphas is empty")
        if self.run is not None and (
            not isinstance(self.run, str) or not self.run.strip() or "/" in self.run
        ):
            raise ValueError(f"run must be None or a non-empty folder name, got {self.run!r}")
        return self


def quick_config(**overrides) -> MCAConfig:
    """The smoke run: α ∈ {0, 0.2, 1.0} on 16 passages (its own run folder)."""
    return MCAConfig(**{"alphas": (0.0, 0.2, 1.0), "max_passages": 16, **overrides})


def run(config: MCAConfig = MCAConfig()) -> dict:
    """Run (or resume) the sweep (unless ``sweep`` is False) and the accounting comparison;
    returns the metrics written to ``metrics.json`` (``accounting`` holds the comparison)."""
    from ... import hf

    config.validate()
    folder = Path(config.out) / config.run_name()
    # the cells of a run are reused per α: everything else must match the saved run
    identity = config.identity()
    saved = read_json(folder / "config.json")
    if saved is not None and {k: saved.get(k) for k in identity} != identity:
        raise ValueError(
            f"{folder} holds a run with another configuration ({saved}); choose another run name"
        )
    write_json(folder / "config.json", dataclasses.asdict(config))
    model, tokenizer = hf.load_minilm()
    result = read_json(folder / "metrics.json") or {}
    if config.sweep:
        result = _sweep(config, folder, model, tokenizer)
    if config.accounting_alphas:
        result["accounting"] = _accounting_step(config, folder, model, tokenizer)
    write_json(folder / "metrics.json", result)
    return result


def _sweep(config: MCAConfig, folder: Path, model, tokenizer) -> dict:
    """The α sweep on the test passages (one cell per α, reused when present)."""
    from ...methods.mca import MCAMethod
    from ..corpus import load_corpus
    from ..fidelity import AttentionConfig, evaluate, num_batches, reference

    passages = load_corpus().test[: config.max_passages]
    steps = num_batches(passages, config.batch_size)
    args = (config.batch_size, config.max_length)
    with tqdm(total=steps * (1 + len(config.alphas)), desc="mca sweep") as bar:
        ref = reference(model, tokenizer, passages, *args, progress=bar.update)
        cells = []
        for alpha in config.alphas:
            path = folder / "cells" / f"alpha_{alpha:.2f}.json"
            cell = read_json(path)
            if cell is None:
                hook = MCAMethod(alpha, seed=config.seed, track_error=True)
                name = f"mca(alpha={alpha})"
                metrics = evaluate(
                    model,
                    tokenizer,
                    passages,
                    AttentionConfig(name, method=hook),
                    ref,
                    *args,
                    progress=bar.update,
                )
                cell = {
                    "alpha": alpha,
                    "macs_kept": hook.macs_kept,
                    "macs_kept_reference": hook.macs_kept_reference,
                    "macs_kept_reference_real": hook.macs_kept_reference_real,
                    "projection_seconds": hook.seconds,
                    "error_vs_bound": {
                        str(layer): {
                            "mean_error": sum(e for e, _ in v) / len(v),
                            "bound": sum(b for _, b in v) / len(v),
                        }
                        for layer, v in sorted(hook.errors.items())
                    },
                    **{
                        k: metrics[k]
                        for k in (
                            "embedding_cosine_mean",
                            "embedding_cosine_min",
                            "retrieval_accuracy",
                            "retrieval_agreement",
                        )
                    },
                }
                write_json(path, cell)
            else:
                bar.update(steps)
            cells.append(cell)
    result = {
        "machine": machine_facts(),
        "passages": len(passages),
        "exact_retrieval_accuracy": ref.retrieval_accuracy,
        "cells": cells,
    }
    _plot(cells, ref.retrieval_accuracy, folder)
    return result


def _accounting_step(config: MCAConfig, folder: Path, model, tokenizer) -> dict:
    """``accounting.json``, measured again when its settings change."""
    settings = {k: getattr(config, k) for k in ACCOUNTING_FIELDS}
    settings = json.loads(
        json.dumps(
            settings
            | {
                "max_passages": config.max_passages,
                "batch_size": config.batch_size,
                "seed": config.seed,
            }
        )
    )
    path = folder / "accounting.json"
    saved = read_json(path)
    if saved is not None and saved.get("settings") == settings:
        return saved
    out = {
        "settings": settings,
        **_accounting(config, model, tokenizer),
        "machine": machine_facts(),
    }
    write_json(path, out)
    return out


def _accounting(config: MCAConfig, model, tokenizer) -> dict:
    """Issue 16 item 10: the reference code's cost metric and ours on the same short passages.

    Per α: ``reference_padded`` — the reference code's metric on passages padded to
    ``accounting_length`` (r_j with n = that length, averaged over every position);
    ``reference_real_tokens`` — the same r_j averaged over real tokens only; ``ours_padded`` —
    our r_j (n = real tokens) averaged over real tokens, same padded batches; ``ours_unpadded``
    — ours on each passage alone (no padding at all); ``reference_unpadded`` — the reference
    formula there (n = the passage's own length).
    """
    from ... import hf
    from ...methods.mca import MCAMethod
    from ..corpus import load_corpus

    texts = [p.text for p in load_corpus(config.accounting_words).test[: config.max_passages]]
    size, length = config.batch_size, config.accounting_length
    padded = [
        tokenizer(
            texts[i : i + size],
            padding="max_length",
            truncation=True,
            max_length=length,
            return_tensors="pt",
        )
        for i in range(0, len(texts), size)
    ]
    alone = [tokenizer([t], truncation=True, max_length=length, return_tensors="pt") for t in texts]
    real_tokens = sum(int(b["attention_mask"].sum()) for b in padded)
    rows = []
    for alpha in tqdm(config.accounting_alphas, desc="mca accounting"):
        hooks = {}
        for name, batches in (("padded", padded), ("unpadded", alone)):
            hook = hooks[name] = MCAMethod(alpha, seed=config.seed)
            hf.sparsify(model, method=hook)
            try:
                with torch.no_grad():
                    for batch in batches:
                        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            finally:
                hf.restore(model)
        rows.append(
            {
                "alpha": alpha,
                "reference_padded": hooks["padded"].macs_kept_reference,
                "reference_real_tokens": hooks["padded"].macs_kept_reference_real,
                "ours_padded": hooks["padded"].macs_kept,
                "ours_unpadded": hooks["unpadded"].macs_kept,
                "reference_unpadded": hooks["unpadded"].macs_kept_reference,
            }
        )
    return {
        "passages": len(texts),
        "padded_length": length,
        "mean_real_tokens": real_tokens / len(texts),
        "real_share_of_positions": real_tokens / (len(texts) * length),
        "rows": rows,
    }


def _plot(cells: list[dict], exact_retrieval: float, folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4))
    layers = sorted(cells[0]["error_vs_bound"], key=int)
    for layer in layers:
        xs = [c["alpha"] for c in cells]
        ax.plot(
            xs,
            [c["error_vs_bound"][layer]["mean_error"] for c in cells],
            "o-",
            ms=3,
            label=f"layer {layer}: E‖Ỹᵢ − Yᵢ‖",
        )
    ax.plot(
        xs,
        [sum(c["error_vs_bound"][la]["bound"] for la in layers) / len(layers) for c in cells],
        "k--",
        label="Theorem 2 bound αβ‖W‖_F (mean)",
    )
    ax.set_xlabel("α")
    ax.set_ylabel("error per token")
    ax.set_yscale("symlog", linthresh=1e-2)
    ax.legend(fontsize=7)
    ax.set_title("MCA on MiniLM: empirical error vs bound")
    save_figure(fig, folder / "error_vs_bound.png")

    fig, ax1 = plt.subplots(figsize=(5.5, 4))
    kept = [c["macs_kept"] for c in cells]
    ax1.plot(kept, [c["embedding_cosine_mean"] for c in cells], "o-", label="embedding cosine")
    ax1.plot(kept, [c["retrieval_accuracy"] for c in cells], "s-", label="retrieval accuracy")
    ax1.axhline(exact_retrieval, color="grey", ls=":", label="exact retrieval accuracy")
    for c in cells:
        ax1.annotate(
            f"α={c['alpha']}",
            (c["macs_kept"], c["embedding_cosine_mean"]),
            fontsize=6,
            xytext=(2, 2),
            textcoords="offset points",
        )
    ax1.set_xlabel("fraction of value-projection MACs kept")
    ax1.set_ylabel("fidelity")
    ax1.legend(fontsize=7)
    ax1.set_title("MCA on MiniLM: fidelity vs cost")
    save_figure(fig, folder / "fidelity_vs_macs.png")


# --------------------------------------------------------------------------- the registry's view
def _alpha(a: float) -> str:
    """α as the tables write it: one decimal on the default grid, every digit off it."""
    return f"{a:.1f}" if round(a, 1) == a else f"{a:g}"


def summary_tables(config: MCAConfig, result: dict) -> list[SummaryTable]:
    """What ``sparseattn mca`` prints and the tour shows: the α sweep (MACs kept, sampled /
    exact projection time, fidelity) unless ``sweep`` is off, then the two cost accountings
    when they ran."""
    tables = []
    if config.sweep:
        rows = []
        for c in result["cells"]:
            t = c["projection_seconds"]
            ratio = t["sampled"] / t["exact"] if t["exact"] else float("nan")
            rows.append(
                (
                    _alpha(c["alpha"]),
                    f"{c['macs_kept']:.1%}",
                    f"{ratio:.1f}×",
                    f"{c['embedding_cosine_mean']:.4f}",
                    f"{c['retrieval_accuracy']:.3f}",
                )
            )
        header = (
            "α",
            "MACs kept",
            "sampled / exact projection time",
            "embedding cosine",
            "retrieval acc.",
        )
        note = f"exact retrieval accuracy {result['exact_retrieval_accuracy']:.3f}"
        title = f"MCA on MiniLM ({result['passages']} test passages)"
        tables.append(SummaryTable(title, header, rows, (note,)))
    if "accounting" in result:
        acc = result["accounting"]
        rows = [
            (
                _alpha(r["alpha"]),
                f"{r['reference_padded']:.1%}",
                f"{r['reference_real_tokens']:.1%}",
                f"{r['ours_padded']:.1%}",
                f"{r['ours_unpadded']:.1%}",
            )
            for r in acc["rows"]
        ]
        header = (
            "α",
            "reference code (all positions)",
            "reference r, real tokens",
            "ours (real tokens)",
            "ours, unpadded",
        )
        title = (
            f"MACs kept, two accountings: {acc['passages']} passages of "
            f"{acc['mean_real_tokens']:.1f} tokens padded to {acc['padded_length']}"
        )
        tables.append(SummaryTable(title, header, rows))
    return tables


EXPERIMENT = Experiment(
    name="mca",
    config=MCAConfig,
    quick=quick_config,
    run=run,
    summary=summary_tables,
    figures=lambda config, result: figures_in(
        Path(config.out) / config.run_name(), "error_vs_bound.png", "fidelity_vs_macs.png"
    ),
    wrote="results in results/mca/{run}/",
)
