"""MCA sweep on the embedded model: error vs the Theorem 2 bound, fidelity vs MACs kept.

For α ∈ {0, 0.1, …, 1.0}: every layer of MiniLM gets Monte-Carlo value projections
(``MCAMethod``), exact scores and softmax; measured on the test passages of the embedded corpus:
value-projection MACs kept, wall-clock of the sampled vs exact projection, the mean
‖Ỹ_i − Y_i‖ per layer against α·β·‖W‖_F, and the shared fidelity metrics (embedding cosine,
retrieval accuracy). One JSON per α under ``results/mca/<run>/cells/`` (a re-run skips them),
then ``metrics.json`` and two figures.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tqdm import tqdm

from ..results import machine_facts, read_json, save_figure, write_json
from ..validate import check_finite_float, check_int, check_positive

__all__ = ["MCAConfig", "run"]


@dataclasses.dataclass(frozen=True)
class MCAConfig:
    alphas: tuple[float, ...] = tuple(round(0.1 * i, 1) for i in range(11))
    max_passages: int = 48
    batch_size: int = 8
    max_length: int = 256
    seed: int = 0
    run: str = "default"
    out: str = "results/mca"

    def validate(self) -> MCAConfig:
        """Check every field (before any folder is written or the model loaded)."""
        if not self.alphas:
            raise ValueError("alphas must hold at least one α >= 0")
        for alpha in self.alphas:
            check_finite_float("alphas[i] (an α)", alpha, 0.0)
        check_int("max_passages", self.max_passages, 2)
        check_positive("batch_size", self.batch_size)
        check_int("max_length", self.max_length, 8)
        check_int("seed", self.seed)
        if not isinstance(self.run, str) or not self.run.strip() or "/" in self.run:
            raise ValueError(f"run must be a non-empty folder name, got {self.run!r}")
        return self


def run(config: MCAConfig = MCAConfig()) -> dict:
    """Run (or resume) the sweep; returns the metrics written to ``metrics.json``."""
    from .. import hf
    from ..corpus import load_corpus
    from ..fidelity import AttentionConfig, evaluate, num_batches, reference
    from ..montecarlo import MCAMethod

    config.validate()
    folder = Path(config.out) / config.run
    # the cells of a run are reused per α: everything else must match the saved run
    identity = {k: v for k, v in dataclasses.asdict(config).items() if k not in ("alphas", "out")}
    saved = read_json(folder / "config.json")
    if saved is not None and {k: saved.get(k) for k in identity} != identity:
        raise ValueError(
            f"{folder} holds a run with another configuration ({saved}); choose another run name"
        )
    write_json(folder / "config.json", dataclasses.asdict(config))
    model, tokenizer = hf.load_minilm()
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
    write_json(folder / "metrics.json", result)
    _plot(cells, ref.retrieval_accuracy, folder)
    return result


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
