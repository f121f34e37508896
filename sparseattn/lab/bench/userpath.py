"""``sparseattn bench user``: speed where users call it, against dense baselines in the same run.

Every comparison is a public call a user writes, timed beside its dense counterpart on the same
inputs (fp32, batch 1, torch's threads; medians of ``repeats`` after a warm-up call):

* **module** — ``SparseAttention(E, H, pattern=longformer(w, g))`` against
  ``nn.MultiheadAttention(E, H)``: forward (no grad) and a training step (forward, backward,
  AdamW step);
* **functional** — ``sparse_attention(q, k, v, pattern)`` with the pattern *object* on q, k, v
  in the layout a fused projection gives (``Linear(E, 3E)(x).view(1, n, 3, H, d).permute``,
  non-contiguous views) against SDPA with the same boolean mask: forward and forward+backward;
* **first call** — a fresh pattern object at a new length (graph, plan and call) against the
  cached call that follows;
* **hf** — a BERT model of all-MiniLM-L6-v2's shape (built from a config, random weights,
  nothing downloaded) with ``hf.sparsify(model, pattern)`` against the same model on its
  ``sdpa`` implementation, and the embedded MiniLM itself at its 512-token limit;
* **prefill** (suite ``prefill``) — a Llama-shaped decoder (8 layers, width 512, 8 heads, 2
  key/value heads) filling its KV cache from an n-token prompt, with
  ``hf.sparsify(model, sliding_window(w, sinks))`` against its causal ``sdpa``.

A dense baseline whose estimated memory passes ``mem_cap_gb``, or whose previous length hit
``time_cap_s``, is reported as skipped with the reason. Results: ``results.json`` (after every
measurement; a re-run with the same run name resumes), ``results.md`` and ``userpath.png``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..measure import measure
from ..results import ResumableRows, machine_facts, save_figure, write_json

__all__ = ["USER_SUITES", "UserSuite", "run_user_suite"]


@dataclasses.dataclass(frozen=True)
class UserSuite:
    """What one user-path run measures (the issue's setting: E = 512, H = 8, window ±256 +
    16 global tokens)."""

    name: str
    ns: tuple[int, ...] = (2048, 4096, 8192, 16384, 32768)
    embed_dim: int = 512
    heads: int = 8
    window: int = 512
    global_tokens: int = 16
    hf_ns: tuple[int, ...] = (2048, 8192)
    minilm: bool = True
    prefill_ns: tuple[int, ...] = ()
    repeats: int = 3
    time_cap_s: float = 60.0
    mem_cap_gb: float = 12.0


USER_SUITES = {
    "user": UserSuite("user"),
    "user-quick": UserSuite(
        "user-quick", ns=(1024, 2048), hf_ns=(1024,), repeats=2, time_cap_s=10.0
    ),
    "prefill": UserSuite(
        "prefill",
        ns=(),
        hf_ns=(),
        minilm=False,
        prefill_ns=(4096, 8192, 16384, 32768),
        repeats=2,
        time_cap_s=120.0,
    ),
}

#: (section, what is timed for sparseattn, what for the dense baseline)
COMPARISONS = {
    "module forward": ("SparseAttention", "nn.MultiheadAttention"),
    "module training step": ("SparseAttention", "nn.MultiheadAttention"),
    "functional forward": ("sparse_attention(pattern)", "SDPA, same mask"),
    "functional forward+backward": ("sparse_attention(pattern)", "SDPA, same mask"),
    "first call": ("first call, new length", "cached call"),
    "hf forward": ("hf.sparsify", "sdpa"),
    "llama prefill": ("hf.sparsify", "sdpa"),
}


def run_user_suite(
    suite: UserSuite,
    out_dir: Path,
    log: Callable[[str], None] = print,
    ns: tuple[int, ...] | None = None,
) -> dict:
    """Run ``suite`` (lengths ``ns`` if given) and write its results into ``out_dir``."""
    if ns:
        if suite.prefill_ns:
            suite = dataclasses.replace(suite, prefill_ns=tuple(ns))
        else:
            suite = dataclasses.replace(suite, ns=tuple(ns), hf_ns=tuple(n for n in ns if n > 512))
    out_dir.mkdir(parents=True, exist_ok=True)
    header = {
        "suite": dataclasses.asdict(suite),
        "machine": machine_facts(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    rec = ResumableRows(out_dir / "results.json", header)
    log(f"machine: {header['machine']}")
    stopped: set[str] = set()  # baselines that hit the time cap: skipped at longer n
    for n in suite.ns:
        _module_section(suite, n, rec, log, stopped)
        _functional_section(suite, n, rec, log, stopped)
    for n in suite.hf_ns:
        _hf_section(suite, n, rec, log, stopped)
    if suite.minilm:
        _hf_section(suite, 512, rec, log, stopped, minilm=True)
    for n in suite.prefill_ns:
        _prefill_section(suite, n, rec, log, stopped)
    rec.data["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    rec.data["load_end"] = machine_facts()["load_average"]
    write_json(out_dir / "results.json", rec.data)
    (out_dir / "results.md").write_text(markdown(rec.data))
    _plot(rec.data, out_dir / "userpath.png")
    return rec.data


# ----------------------------------------------------------------------------- sections
def _time(rec, log, stopped, section, n, who, fn, suite, mem_gb=0.0) -> None:
    """Measure ``fn`` once per (section, n, who), unless done, over the memory cap, or past
    the length where it hit the time cap."""
    if rec.find(section=section, n=n, who=who):
        return
    key = f"{section}/{who}"
    row = {"section": section, "n": n, "who": who}
    if mem_gb > suite.mem_cap_gb:
        row["skipped"] = f"needs ~{mem_gb:.0f} GB > cap {suite.mem_cap_gb:.0f} GB"
    elif key in stopped:
        row["skipped"] = f"over the {suite.time_cap_s:.0f} s cap at a shorter length"
    else:
        row.update(measure(fn, suite.repeats, suite.time_cap_s))
        if row["time_s"] > suite.time_cap_s / 3:
            stopped.add(key)
    rec.add(row)
    shown = row.get("skipped") or f"{row['time_s'] * 1e3:9.1f} ms  peak {row['peak_mb']:7.0f} MiB"
    log(f"n={n:6d} {section:28s} {who:28s} {shown}")


def _pattern(suite: UserSuite):
    import sparseattn as sa

    return sa.longformer(suite.window, suite.global_tokens)


def _module_section(suite, n, rec, log, stopped) -> None:
    import sparseattn as sa

    torch.manual_seed(0)
    e, h = suite.embed_dim, suite.heads
    x = torch.randn(1, n, e)
    layer = sa.SparseAttention(e, h, pattern=_pattern(suite))
    mha = nn.MultiheadAttention(e, h, batch_first=True)
    sparse_fwd = torch.no_grad()(lambda: layer(x))
    dense_fwd = torch.no_grad()(lambda: mha(x, x, x, need_weights=False))
    _time(rec, log, stopped, "module forward", n, "SparseAttention", sparse_fwd, suite)
    _time(rec, log, stopped, "module forward", n, "nn.MultiheadAttention", dense_fwd, suite)
    for who, module, call in (
        ("SparseAttention", layer, lambda: layer(x)),
        ("nn.MultiheadAttention", mha, lambda: mha(x, x, x, need_weights=False)[0]),
    ):
        opt = torch.optim.AdamW(module.parameters(), lr=1e-4)

        def step(module=module, call=call, opt=opt):
            opt.zero_grad(set_to_none=True)
            call().square().mean().backward()
            opt.step()

        _time(rec, log, stopped, "module training step", n, who, step, suite)


def _functional_section(suite, n, rec, log, stopped) -> None:
    import sparseattn as sa

    torch.manual_seed(0)
    e, h = suite.embed_dim, suite.heads
    proj = nn.Linear(e, 3 * e)
    with torch.no_grad():
        qkv = proj(torch.randn(1, n, e))
    base = qkv.view(1, n, 3, h, e // h)

    def inputs(grad: bool):
        t = base.detach().clone().requires_grad_(grad)
        return t.permute(2, 0, 3, 1, 4), t  # q, k, v are strided views, as a projection gives

    pattern = _pattern(suite)
    mask_gb = n * n * 5 / 2**30  # the boolean mask and SDPA's float copy of it
    (q, k, v), _ = inputs(False)
    mask = pattern.graph(n).to_dense() if mask_gb <= suite.mem_cap_gb else None
    with torch.no_grad():
        _time(
            rec,
            log,
            stopped,
            "functional forward",
            n,
            "sparse_attention(pattern)",
            lambda: sa.sparse_attention(q, k, v, pattern),
            suite,
        )
        _time(
            rec,
            log,
            stopped,
            "functional forward",
            n,
            "SDPA, same mask",
            lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
            suite,
            mask_gb,
        )
    (qg, kg, vg), leaf = inputs(True)

    def backward(out):
        leaf.grad = None
        out.square().mean().backward()

    _time(
        rec,
        log,
        stopped,
        "functional forward+backward",
        n,
        "sparse_attention(pattern)",
        lambda: backward(sa.sparse_attention(qg, kg, vg, pattern)),
        suite,
    )
    _time(
        rec,
        log,
        stopped,
        "functional forward+backward",
        n,
        "SDPA, same mask",
        lambda: backward(F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask)),
        suite,
        2 * mask_gb,
    )
    _first_call(suite, n, q, k, v, rec, log, stopped)


def _first_call(suite, n, q, k, v, rec, log, stopped) -> None:
    """A fresh pattern object at this length: the first call builds the graph and the plan."""
    import sparseattn as sa

    if rec.find(section="first call", n=n, who="first call, new length"):
        return
    with torch.no_grad():
        sa.sparse_attention(q[..., :64, :], k[..., :64, :], v[..., :64, :], _pattern(suite))
        times = []
        for _ in range(suite.repeats):  # a new object each time: every first call is cold
            pattern = _pattern(suite)
            start = time.perf_counter()
            sa.sparse_attention(q, k, v, pattern)
            times.append(time.perf_counter() - start)
        first = sorted(times)[len(times) // 2]
        cached = measure(
            lambda: sa.sparse_attention(q, k, v, pattern), suite.repeats, suite.time_cap_s
        )
    for who, t, extra in (
        ("first call, new length", first, {"times_s": times}),
        ("cached call", cached["time_s"], cached),
    ):
        row = {"section": "first call", "n": n, "who": who, **extra, "time_s": t}
        rec.add(row)
        log(f"n={n:6d} {'first call':28s} {who:28s} {t * 1e3:9.1f} ms")


def _bert(n: int):
    """A BERT of all-MiniLM-L6-v2's shape with room for n positions (random weights)."""
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=30522,
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=12,
        intermediate_size=1536,
        max_position_embeddings=n,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return BertModel(config).eval()


def _hf_section(suite, n, rec, log, stopped, minilm: bool = False) -> None:
    import sparseattn as sa
    from sparseattn import hf

    section = "hf forward" if not minilm else "hf forward (MiniLM, 512 max)"
    if all(rec.find(section=section, n=n, who=who) for who in ("hf.sparsify", "sdpa")):
        return
    model = hf.load_minilm()[0] if minilm else _bert(n)
    ids = torch.randint(1000, 20000, (1, n), generator=torch.Generator().manual_seed(n))
    run = torch.no_grad()(lambda: model(input_ids=ids).last_hidden_state)
    _time(rec, log, stopped, section, n, "sdpa", run, suite)
    hf.sparsify(model, pattern=sa.longformer(64, 1) if minilm else _pattern(suite))
    _time(rec, log, stopped, section, n, "hf.sparsify", run, suite)
    hf.restore(model)


def _llama(n: int):
    """A Llama-shaped decoder (8 layers, width 512, 8 heads, 2 key/value heads; random
    weights, built from a config) with room for n positions; no LM head (a prefill computes
    the logits of the last position only)."""
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=n,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaModel(config).eval()


def _prefill_section(suite, n, rec, log, stopped) -> None:
    """Prefill (the prompt's forward pass that fills the KV cache) of the Llama-shaped model:
    ``hf.sparsify(model, sliding_window(w, sinks))`` against its own ``sdpa`` (causal)."""
    import sparseattn as sa
    from sparseattn import hf

    section = "llama prefill"
    if all(rec.find(section=section, n=n, who=who) for who in ("hf.sparsify", "sdpa")):
        return
    model = _llama(n)
    ids = torch.randint(0, 32000, (1, n), generator=torch.Generator().manual_seed(n))
    run = torch.no_grad()(lambda: model(input_ids=ids, use_cache=True).last_hidden_state)
    _time(rec, log, stopped, section, n, "sdpa", run, suite)
    hf.sparsify(model, sa.sliding_window(suite.window, suite.global_tokens))
    _time(rec, log, stopped, section, n, "hf.sparsify", run, suite)


# ----------------------------------------------------------------------------- reporting
def _ms(row: dict | None) -> str:
    if row is None:
        return "—"
    return row["skipped"] if "skipped" in row else f"{row['time_s'] * 1e3:.0f}"


def ratios(data: dict) -> list[dict]:
    """One row per (section, n): both times, the dense/sparse ratio and peak memory."""
    out = []
    sections = sorted(
        {(r["section"], r["n"]) for r in data["rows"]},
        key=lambda s: (list(COMPARISONS).index(s[0]) if s[0] in COMPARISONS else 99, s[1]),
    )
    for section, n in sections:
        ours, theirs = COMPARISONS.get(section, ("hf.sparsify", "sdpa"))
        a = next(
            (r for r in data["rows"] if (r["section"], r["n"], r["who"]) == (section, n, ours)),
            None,
        )
        b = next(
            (r for r in data["rows"] if (r["section"], r["n"], r["who"]) == (section, n, theirs)),
            None,
        )
        ratio = None
        if a and b and "time_s" in a and "time_s" in b:
            ratio = (
                b["time_s"] / a["time_s"] if section != "first call" else a["time_s"] / b["time_s"]
            )
        out.append(
            {
                "section": section,
                "n": n,
                "ours": ours,
                "theirs": theirs,
                "ours_ms": _ms(a),
                "theirs_ms": _ms(b),
                "ratio": ratio,
                "ours_peak_mb": (a or {}).get("peak_mb"),
                "theirs_peak_mb": (b or {}).get("peak_mb"),
            }
        )
    return out


def markdown(data: dict) -> str:
    m = data["machine"]
    lines = [
        f"# sparseattn bench {data['suite']['name']} — the user path",
        "",
        f"{m['cpu']} ({', '.join(m['vector_extensions'])}; torch CPU capability "
        f"{m['torch_cpu_capability']}), {m['torch_threads']} threads, torch {m['torch']}; "
        f"load {m['load_average']} at start, {data.get('load_end')} at the end.",
        "",
        "Ratio: dense time / sparseattn time (first call: first / cached, lower is better).",
        "",
        "| what | n | sparseattn | ms | dense | ms | ratio | peak MiB (ours / dense) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in ratios(data):
        ratio = "—" if r["ratio"] is None else f"{r['ratio']:.2f}×"
        peaks = " / ".join(
            "—" if p is None else f"{p:.0f}" for p in (r["ours_peak_mb"], r["theirs_peak_mb"])
        )
        lines.append(
            f"| {r['section']} | {r['n']} | {r['ours']} | {r['ours_ms']} | "
            f"{r['theirs']} | {r['theirs_ms']} | {ratio} | {peaks} |"
        )
    return "\n".join(lines) + "\n"


def _plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in ratios(data) if r["ratio"] is not None]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for section in dict.fromkeys(r["section"] for r in rows):
        pts = [(r["n"], r["ratio"]) for r in rows if r["section"] == section]
        ax.plot(*zip(*pts, strict=True), marker="o", label=section)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length n")
    ax.set_ylabel("dense time / sparseattn time\n(first call: first / cached)")
    ax.set_title(f"user path, {data['machine']['cpu']}, {data['machine']['torch_threads']} threads")
    ax.legend(fontsize=8)
    save_figure(fig, path)
