"""``sparseattn bench gpu``'s **models** section: Longformer and BigBird at their checkpoints'
sizes, transformers' attention against ``hf.sparsify``'s, on CUDA (issue 40, item 5, the GPU
rows; the CPU side is ``scripts/checkpoint_layers.py``, docs/checkpoints.md).

The models (:mod:`sparseattn.lab.models.checkpoints`; random weights from seed 0, eval mode):

* **Longformer-base size**: ``LongformerModel``, 12 layers, hidden 768, 12 heads (d = 64),
  intermediate 3072, attention window 512 (keys i − 256 … i + 256), positions for the longest
  n; the first 16 tokens global (``global_attention_mask``).
* **BigBird-RoBERTa-base size**: ``BigBirdModel``, the same widths, ``block_sparse``
  attention, blocks of 64, 3 random blocks; in eval mode transformers' layout is the band and
  the global blocks with block 0 weighted r + 1 times, which ``hf.sparsify`` reproduces with
  one extra query/key column (so its attention runs at head dim 65).

Three copies with the same weights: transformers' own (``who`` "transformers"),
``hf.sparsify(copy, engine="flex")`` ("sparseattn flex") and ``hf.sparsify(copy)`` (engine
``auto``: "sparseattn auto"; its rows list the engines ``auto`` picked, ``engines``).

For each model, each dtype — float32 first, then bfloat16 — and each n of
``GpuSuite.models_ns`` (the gpu-models suite: 1024, 4096, 16384), batch 1, forward under
``torch.no_grad``, two parts (``mode``):

* ``layer fwd``: layer 0's self-attention module called directly (projections included) on
  Gaussian hidden states (1, n, 768) with the masks its model would pass it — the attention
  alone, as ``scripts/checkpoint_layers.py`` measures it on the CPU;
* ``model fwd``: the whole model on n random token ids (embeddings, 12 layers, pooler) — what
  a user of the checkpoint waits for. Issue 40's target, "the whole Longformer forward ≥ 3×
  faster with flex", is this row's speed-up, transformers / flex.

Timing (:func:`~.cuda_timing.record_group`): the three calls of one (model, dtype, n, part)
interleaved, CUDA events around back-to-back calls, median of ``samples``, after a warm-up call
(flex compiles there, once per shape and dtype: the layer and the model's layers share the
kernel); peak memory above what was allocated before the call (weights and inputs not
counted). A call that runs out of memory is a row "out of memory" (transformers' BigBird fills
n × n ``attention_probs`` per head, 12.9 GB in float32 at n = 16384 per layer, which an H200
holds). Rows already in results.json are not run again (a re-run resumes).

Exactness: before the timing, one call of each sparsified copy is compared with one call of
transformers': ``max abs diff`` and ``output scale`` (transformers' largest |output|) in the
sparsified rows. float32 is where the two must agree, to float rounding (TF32 is off, torch's
default): ``hf.sparsify`` computes transformers' attention (docs/checkpoints.md), relative
differences of order 1e-6 expected. The bfloat16 rows' differences are bf16 rounding carried
through the layers, recorded, not a check. Where transformers' call fails there is no
reference (``reference`` says why).

Time on an H200, estimated (not yet measured): about 90 s — a dozen flex compiles (two models
× two dtypes × three lengths, a few seconds each, about 60 s), building the models (about
10 s), and the calls (each call about 8 times; the longest, transformers' BigBird at
n = 16384 in float32, some 0.3 s a call), under the issue's 150 s.

Lengths: Longformer's layer needs n a multiple of the window (its model pads, the layer does
not), BigBird's a multiple of the block; BigBird lengths of at most (5 + 2·3)·block tokens are
rows skipped with the reason (transformers' model switches itself to full attention there, for
good). The sizes come from ``GpuSuite.models_*`` (the checkpoints' by default; tests shrink
them).
"""

from __future__ import annotations

import contextlib
import copy
import gc
from collections.abc import Callable, Iterator

import torch

from ..models import checkpoints
from ..models.checkpoints import CheckpointSize
from .cuda_timing import fresh_compiles, fwd, ratio, record_group, table_head

__all__ = ["markdown", "run"]

#: The copies compared, in the order they are timed.
WHO = ("transformers", "sparseattn flex", "sparseattn auto")
#: The parts timed per length.
MODES = ("layer fwd", "model fwd")
DTYPES = (torch.float32, torch.bfloat16)
NAMES = {"longformer": "Longformer", "bigbird": "BigBird"}
RANDOM_BLOCKS = 3


def _size(suite) -> CheckpointSize:
    return CheckpointSize(
        layers=suite.models_layers,
        hidden=suite.models_hidden,
        heads=suite.models_heads,
        intermediate=4 * suite.models_hidden,
        window=suite.models_window,
        block=suite.models_block,
        random_blocks=RANDOM_BLOCKS,
    )


def _config(kind: str, size: CheckpointSize, globals_: int) -> str:
    text = size.describe(kind)
    return f"{text}, {globals_} global tokens" if kind == "longformer" else text


def _keys(suite, kind: str, size: CheckpointSize, dtype: torch.dtype, n: int, mode: str):
    """The rows' keys of one group: {who: key}."""
    base = {
        "section": "models",
        "pattern": kind,
        "config": _config(kind, size, suite.models_globals),
        "dtype": str(dtype).removeprefix("torch."),
        "n": n,
        "mode": mode,
    }
    return {who: {**base, "who": who} for who in WHO}


def run(suite, rows, log) -> None:
    """Add the section's rows to ``rows`` (nothing when ``suite.models_ns`` is empty)."""
    if not suite.models_ns:
        return
    size = _size(suite)
    ns = tuple(sorted(suite.models_ns))
    for kind in checkpoints.KINDS:

        def missing(dtype, kind=kind) -> bool:
            return any(
                not rows.find(**key)
                for n in ns
                for mode in MODES
                for key in _keys(suite, kind, size, dtype, n, mode).values()
            )

        dtypes = [dtype for dtype in DTYPES if missing(dtype)]
        if not dtypes:
            continue
        fresh_compiles()  # each model from fresh compiles, its own specialised kernels
        host = checkpoints.model(kind, ns[-1], size)  # float32 on the CPU, copied per dtype
        for dtype in dtypes:
            _model_rows(suite, rows, log, kind, size, host, dtype, ns)
        del host
        gc.collect()


def _model_rows(suite, rows, log, kind, size, host, dtype, ns) -> None:
    """Every length and part of one model in one dtype: the three copies on the GPU."""
    from ... import hf

    nets = {}
    for who in WHO:
        net = copy.deepcopy(host).to("cuda", dtype)
        if who == "sparseattn flex":
            hf.sparsify(net, engine="flex")
        elif who == "sparseattn auto":
            hf.sparsify(net)
        nets[who] = net
    vocab = host.config.vocab_size
    full_below = (5 + 2 * size.random_blocks) * size.block  # BigBird: full attention up to it
    try:
        for n in ns:
            for mode in MODES:
                keys = _keys(suite, kind, size, dtype, n, mode)
                if kind == "bigbird" and n <= full_below:
                    why = (
                        f"n <= (5 + 2·{size.random_blocks})·{size.block} = {full_below}: "
                        "transformers' BigBird switches to full attention"
                    )
                    for key in keys.values():
                        if not rows.find(**key):
                            rows.add({**key, "skipped": why})
                    continue
                if mode == "layer fwd":
                    args = checkpoints.layer_inputs(
                        kind, n, size, suite.models_globals, device="cuda", dtype=dtype
                    )
                    calls = {who: _layer_call(net, args) for who, net in nets.items()}
                else:
                    inputs = checkpoints.model_inputs(
                        kind, n, vocab, suite.models_globals, device="cuda"
                    )
                    calls = {who: _model_call(net, inputs) for who, net in nets.items()}
                _group(suite, rows, log, keys, calls)
    finally:
        nets.clear()
        gc.collect()
        torch.cuda.empty_cache()


def _layer_call(net, args: tuple) -> Callable[[], torch.Tensor]:
    attn = checkpoints.self_attention(net)
    return lambda: attn(*args)[0]  # BigBird's second output (probabilities) dropped at once


def _model_call(net, inputs: dict) -> Callable[[], torch.Tensor]:
    return lambda: net(**inputs).last_hidden_state


def _group(suite, rows, log, keys: dict, calls: dict) -> None:
    """Check the missing rows' sparsified outputs against transformers', then time them."""
    missing = [who for who in WHO if not rows.find(**keys[who])]
    if not missing:
        return
    found = _check(calls, missing)
    for who, info in found.items():
        key = keys[who]
        shown = (
            f"max abs diff {info['max abs diff']:.3g} (output scale {info['output scale']:.3g})"
            if "max abs diff" in info
            else f"no reference: transformers' call failed ({info['reference']})"
        )
        engines = f", engines {info['engines']}" if "engines" in info else ""
        log(f"models {key['dtype']} n={key['n']:6d} {key['pattern']} {who} {key['mode']}: "
            f"{shown}{engines}")  # fmt: skip
    keyed = [({**keys[who], **found.get(who, {})}, fwd(calls[who])) for who in missing]
    record_group(suite, rows, log, keyed)


def _check(calls: dict, missing: list[str]) -> dict[str, dict]:
    """One call of transformers' copy and of each missing sparsified one: per sparsified copy
    its ``max abs diff`` from transformers' output and that output's ``output scale`` (or
    why there is no reference), and for ``auto`` the ``engines`` it picked. A sparsified call
    that fails gets nothing here: its timing records the failure."""
    ref, why = None, None
    try:
        ref = fwd(calls[WHO[0]])().float()
    except Exception as err:  # noqa: BLE001 - the timing records the failure as its row
        why = "out of memory" if isinstance(err, torch.OutOfMemoryError) else type(err).__name__
    torch.cuda.empty_cache()
    found = {}
    for who in missing:
        if who == WHO[0]:
            continue
        with _engines_chosen() as engines:
            try:
                out = fwd(calls[who])()
            except Exception:  # noqa: BLE001, S112 - recorded by the timing
                continue
        info: dict = {}
        if ref is None:
            info["reference"] = why
        else:
            info["max abs diff"] = float((out.float() - ref).abs().max())
            info["output scale"] = float(ref.abs().max())
        if who.endswith("auto"):
            info["engines"] = sorted(engines)
        found[who] = info
        del out
    del ref
    torch.cuda.empty_cache()
    return found


@contextlib.contextmanager
def _engines_chosen() -> Iterator[set[str]]:
    """The engines that ``engine="auto"`` picks inside the block: ``sparse_attention`` asks
    :func:`sparseattn.engines.capabilities.choose` (every call resolving in full,
    ``attention.KEEP_CALLS`` off), watched here; both put back after."""
    from ... import attention
    from ...engines import capabilities

    choose, chosen, keep = capabilities.choose, set(), attention.KEEP_CALLS
    attention.KEEP_CALLS = False

    def watched(*args, **kwargs):
        engine = choose(*args, **kwargs)
        chosen.add(engine)
        return engine

    capabilities.choose = watched
    try:
        yield chosen
    finally:
        capabilities.choose, attention.KEEP_CALLS = choose, keep


# ----------------------------------------------------------------------------- report
def _cell(row: dict | None, field: str, scale: float = 1.0, digits: int = 2) -> str:
    if row is None:
        return "–"
    if "skipped" in row:
        return "out of memory" if row["skipped"] == "out of memory" else "not run"
    value = row.get(field)
    return "–" if value is None else f"{value * scale:.{digits}f}"


def _ordered(rows: list[dict]) -> list[tuple]:
    """(mode, dtype, n) of the rows: layer before model, float32 before bfloat16, n up."""
    order = {name: i for i, name in enumerate([*MODES, "float32", "bfloat16"])}
    groups = {(r["mode"], r["dtype"], r["n"]) for r in rows}
    return sorted(groups, key=lambda g: (order.get(g[0], 9), order.get(g[1], 9), g[2]))


def markdown(rows: list[dict]) -> list[str]:
    """The section's tables (none without its rows): per model, time, speed-up and peak
    memory of the three copies; then the sparsified outputs' differences from transformers'."""
    mine = [r for r in rows if r.get("section") == "models"]
    if not mine:
        return []
    lines: list[str] = []
    for kind in dict.fromkeys(r["pattern"] for r in mine):
        sel = [r for r in mine if r["pattern"] == kind]
        target = "; target: model fwd ≥ 3× with flex" if kind == "longformer" else ""
        lines += table_head(
            f"{NAMES.get(kind, kind)} ({sel[0]['config']}), transformers against hf.sparsify, "
            f"batch 1, forward: ms, speed-up, peak MiB{target}",
            ["part", "dtype", "n", "transformers", "flex", "auto", "transformers / flex",
             "transformers / auto", "MiB transformers", "MiB flex", "MiB auto"],
        )  # fmt: skip
        for mode, dtype, n in _ordered(sel):
            by = {r["who"]: r for r in sel if (r["mode"], r["dtype"], r["n"]) == (mode, dtype, n)}
            t = {who: r.get("time_s") for who, r in by.items()}
            times = [_cell(by.get(who), "time_s", 1e3) for who in WHO]
            peaks = [_cell(by.get(who), "peak_mb", digits=0) for who in WHO]
            lines.append(
                f"| {mode.removesuffix(' fwd')} | {dtype} | {n} | {' | '.join(times)} | "
                f"{ratio(t, WHO[0], WHO[1], 2)} | {ratio(t, WHO[0], WHO[2], 2)} | "
                f"{' | '.join(peaks)} |"
            )
    lines += table_head(
        "hf.sparsify's outputs against transformers' (max abs diff; float32: float rounding)",
        ["model", "part", "dtype", "n", "flex", "auto", "output scale", "auto's engines"],
    )
    for kind in dict.fromkeys(r["pattern"] for r in mine):
        sel = [r for r in mine if r["pattern"] == kind]
        for mode, dtype, n in _ordered(sel):
            by = {r["who"]: r for r in sel if (r["mode"], r["dtype"], r["n"]) == (mode, dtype, n)}
            diffs = [
                f"{by[who]['max abs diff']:.2e}" if "max abs diff" in by.get(who, {}) else "–"
                for who in WHO[1:]
            ]
            checked = [by[w] for w in WHO[1:] if "output scale" in by.get(w, {})]
            scale = f"{checked[0]['output scale']:.3g}" if checked else "–"
            engines = ", ".join(by.get(WHO[2], {}).get("engines", [])) or "–"
            lines.append(
                f"| {NAMES.get(kind, kind)} | {mode.removesuffix(' fwd')} | {dtype} | {n} | "
                f"{' | '.join(diffs)} | {scale} | {engines} |"
            )
    return lines
