"""The ``decode`` section of ``sparseattn bench gpu`` (suite ``gpu-decode``, issue 43 item 4):
decoding on the GPU, one step against a long KV cache and ``generate`` with the evicting cache.
What it answers: whether the library's decode step, as a user calls it, beats exact attention
at long caches and how far it stays from FlexAttention's decoding kernel and from hand-written
SDPA over the window (its host work weighs most at one query); what serving the step from the
evicting cache's few keys and replaying it from a CUDA graph save; what ``hf.window_cache``
gives ``generate`` in tokens per second and memory, with the same tokens.

**decode** — for each cache length n of ``suite.decode_ns`` and t of ``suite.decode_queries``:
q of shape (1, 32, t, 128), the t newest tokens, at the end of k, v of shape (1, 8, n, 128)
(grouped-query attention: 4 query heads share a key/value head, Llama-3-8B's attention shape),
bf16, forward only, pattern ``sliding_window(w, s)`` (``suite.decode_window``,
``decode_sinks``; 4096 and 4 in the suite): query i sees keys i − w + 1 … i and the first s.
Rows, interleaved in one group per (n, t) (:func:`~.cuda_timing.record_group`):

* ``sdpa, whole cache`` — SDPA over all n keys, ``enable_gqa=True``, no mask (at t > 1 the
  t − 1 keys a causal mask would hide are the same work): what exact attention costs per step.
* ``flex decode`` — what FlexAttention offers without this library: ``torch.compile``-d
  ``flex_attention`` with a ``create_block_mask`` of the window and sinks for t queries against
  n keys (made once, outside the timing), ``enable_gqa=True``; inductor serves short query
  lengths with its decoding kernel. Automatic dynamic shapes are off in this section, so each
  (n, t) gets a kernel specialised to it (its fastest, as the main section's "flex direct").
* ``sdpa, sinks + window`` — the hand-written alternative: the s sink keys and the last
  w + t − 1 keys cut out of the cache (``torch.cat`` on every call) and SDPA over them, with a
  band mask when t > 1.
* ``sparseattn auto`` and ``sparseattn flex`` — ``sa.sparse_attention(q, k, v, pattern,
  enable_gqa=True)`` as a user calls it: the queries shorter than the keys get the pattern's
  rows at the end (docs/causal.md, "Queries at an offset"); engine ``auto`` (the engine it
  picked is the row's ``engine``) and ``flex``.
* ``sdpa, evicting cache`` and ``sparseattn auto, evicting cache`` — the same step on what
  ``hf.window_cache`` hands the attention kernel (sparseattn/hf/kvcache.py): the s sinks, the
  last w − 1 keys and the t new ones, s + w − 1 + t keys whatever n (``keys``), the library's
  call unchanged (the queries at the end of the kept keys select the same keys) and SDPA over
  them with the band mask.
* ``sparseattn auto, CUDA graph`` and ``sparseattn auto, evicting cache, CUDA graph``
  (``suite.decode_cuda_graph``) — the library's step captured once in a CUDA graph
  (:class:`CudaGraphed`) and replayed: its kernels without the host's work (checks, graph
  look-up, launches). A graph has fixed shapes: it serves every step of a generation with the
  evicting cache once that is full, but a growing full cache would need a capture per length.
  A failed capture is a row with the reason (on the device guard: no real CUDA device).

Every row but SDPA over the whole cache carries ``max_abs_err``, its output's largest
difference from a float32 reference (softmax over the allowed keys, written out here), read on
its warm-up call. The decode step's BlockMask, graph and plan are made in the warm-up and reused:
the timed calls are one step at one fixed cache length.

**generate** (``suite.generate_tokens`` T > 0): what a user of ``hf.window_cache`` gains
end to end. A Llama-shaped decoder built from a ``transformers.LlamaConfig``
(``generate_layers`` layers, 8 in the suite; width 512, 8 heads of 64, 2 key/value heads, MLP
1408, vocabulary 32000; random weights from seed 0; bf16), batch 1, a random prompt of each
length n of ``decode_ns`` up to ``generate_max_prompt`` (longer ones: a skipped row), greedy
``model.generate(..., max_new_tokens=T, min_new_tokens=T, do_sample=False)``: the model as
built (transformers' SDPA, full ``DynamicCache``), then after ``hf.sparsify(model,
sliding_window(w, s))`` with a full ``DynamicCache`` and with ``hf.window_cache(model)``. Per
model and cache a warm-up run of :data:`WARMUP_TOKENS` tokens (it compiles the sparsified
prefill's kernels for the prompt's length), then ``generate_samples`` runs of T tokens,
medians. Prefill is timed apart: a logits processor synchronises and reads the clock when the
first new token's logits arrive, so ``prefill_s`` is the prompt's forward pass and the first
logits, and ``decode_tok_s`` is (T − 1) over the rest, the T − 1 later steps (sampling and
``generate``'s own work included). ``peak_mb``: ``torch.cuda.max_memory_allocated`` during a
run above what was allocated before it (model and prompt), prefill included;
``keys_per_layer``: the cache's length at the end; ``tokens_equal`` (evicting cache):
``torch.equal`` of its new tokens with the full cache's (their SHA-256 when the full cache's
row comes from an earlier run), ``first_difference`` where they differ. The compiled kernels
of the decode rows are dropped first, so generate compiles as a fresh process would.

GPU time on an H200 (estimated, not measured: no GPU was at hand when this was written), for
the ``gpu-decode`` suite (caches 8k, 32k, 128k; t = 1, 4; T = 256; 5 samples of 20 ms):
decode about 90 s (12 FlexAttention compiles of about 5 s, the first slower; 54 rows of about
0.4 s); generate about 55 s (prompts 8k and 32k; 3 models × (a warm-up + 2 runs of 256 steps
of an estimated 7–15 ms, host-bound) + 2 prefill compiles); about 145 s in all.
``generate_samples=1`` saves about 20 s; ``generate_max_prompt=131072`` adds about 30 s.
"""

from __future__ import annotations

import hashlib
import math
import statistics
import time
import traceback
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..results import write_json
from . import cuda_timing
from .cuda_timing import fwd, ratio, record_group, table_head

__all__ = ["CudaGraphed", "markdown", "run"]

#: The decode step's shapes: query heads, key/value heads, head dim.
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128

SDPA_WHOLE, FLEX_DECODE = "sdpa, whole cache", "flex decode"
DENSE, FULL, EVICTING = "dense model (sdpa)", "sparsified, full cache", "sparsified, evicting cache"
#: Tokens of generate's warm-up run: enough to compile the prefill's kernels for the prompt's
#: length (``auto`` sends the decode steps' graphs to the dense engine, which compiles nothing).
WARMUP_TOKENS = 16
#: The generate section's Llama (its layers: ``suite.generate_layers``): width, heads,
#: key/value heads, MLP width, vocabulary.
LLAMA = {
    "hidden_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 1408,
    "vocab_size": 32000,
}


def run(suite, rows, log) -> None:
    """Add the section's rows to ``rows`` (a ResumableRows; rows already there are kept)."""
    if suite.decode_ns and suite.decode_queries:
        with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
            for n in suite.decode_ns:
                _decode(suite, rows, log, n)
    if suite.decode_ns and suite.generate_tokens:
        cuda_timing.fresh_compiles()
        _generate(suite, rows, log)


# ----------------------------------------------------------------------------- decode step
class CudaGraphed:
    """``fn()`` captured in a CUDA graph on the first call and replayed on every call.

    ``fn`` takes no arguments and reads fixed tensors (static inputs): to run it on new
    values, copy them into those tensors (``q.copy_(new_q)``) and call again. Before the
    capture: one eager call, whose output must really be on a CUDA device (not on a GPU
    simulated on the CPU), then ``warmup`` eager calls on a side stream (PyTorch's recipe:
    lazy initialisation, compiles and the library's caches happen outside the graph);
    everything runs without autograd. Returns the graph's output tensor, overwritten by each
    replay. A capture that fails raises a RuntimeError naming the first error inside it and
    the innermost line of the library it came from.
    """

    def __init__(self, fn: Callable[[], Tensor], warmup: int = 3) -> None:
        self.fn, self.warmup = fn, warmup
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: Tensor | None = None

    def __call__(self) -> Tensor:
        if self.graph is None:
            self.capture()
        self.graph.replay()
        return self.out

    def capture(self) -> None:
        simulated = "(a GPU simulated on the CPU, as the tests' device guard)"
        if not torch.backends.cuda.is_built():
            raise RuntimeError(f"no CUDA graph: this torch is built without CUDA {simulated}")
        with torch.no_grad():
            out = self.fn()
        with torch._C.DisableTorchFunction():  # where the output really is, past any mode
            real = out.is_cuda
        if not real:
            raise RuntimeError(f"no CUDA graph: the output is not on a CUDA device {simulated}")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(self.warmup):
                self.fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        failure: Exception | None = None
        try:
            with torch.no_grad(), torch.cuda.graph(graph):
                try:
                    out = self.fn()
                except Exception as err:
                    failure = err
                    raise
        except Exception as err:  # say what broke the capture, not how capture_end failed
            raise RuntimeError(f"CUDA graph capture failed: {_where(failure or err)}") from err
        self.graph, self.out = graph, out


def _where(err: Exception) -> str:
    """``err``'s first line and the innermost line of sparseattn's code it passed through."""
    text = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:160]}"
    frames = [f for f in traceback.extract_tb(err.__traceback__) if "sparseattn" in f.filename]
    frames = [f for f in frames if "lab/bench" not in f.filename] or frames
    if frames:
        last = frames[-1]
        text += f" (at {last.filename.rsplit('sparseattn/', 1)[-1]}:{last.lineno})"
    return text


def _decode(suite, rows, log, n: int) -> None:
    """The decode-step rows of cache length ``n`` (every t of the suite)."""
    import sparseattn as sa

    w, s = suite.decode_window, suite.decode_sinks
    pattern = sa.sliding_window(w, s)
    gen = torch.Generator(device="cuda").manual_seed(n)

    def randn(*shape: int) -> Tensor:
        return torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)

    k, v = randn(1, KV_HEADS, n, HEAD_DIM), randn(1, KV_HEADS, n, HEAD_DIM)
    for t in suite.decode_queries:
        q = randn(1, HEADS, t, HEAD_DIM)
        base = {
            "section": "decode",
            "dtype": "bfloat16",
            "n": n,
            "t": t,
            "pattern": f"sliding_window({w}, {s})",
            "mode": "fwd",
        }
        if all(rows.find(**base, who=who) for who in _decode_rows(suite)):
            continue
        _decode_group(suite, rows, lambda line, t=t: log(f"{line}  t={t}"), base, pattern, q, k, v)
        torch.cuda.empty_cache()


def _decode_rows(suite) -> list[str]:
    rows = [
        SDPA_WHOLE,
        FLEX_DECODE,
        "sdpa, sinks + window",
        "sparseattn auto",
        "sparseattn flex",
        "sdpa, evicting cache",
        "sparseattn auto, evicting cache",
    ]
    if suite.decode_cuda_graph:
        rows += ["sparseattn auto, CUDA graph", "sparseattn auto, evicting cache, CUDA graph"]
    return rows


def _decode_group(suite, rows, log, base: dict, pattern, q: Tensor, k: Tensor, v: Tensor) -> None:
    import sparseattn as sa

    from ...attention import choose_engine, resolve_graph

    w, s = suite.decode_window, suite.decode_sinks
    n, t = k.shape[-2], q.shape[-2]
    scale = HEAD_DIM**-0.5
    # the keys a query may see: the sinks and the last w + t − 1 (hf.window_cache's s sinks,
    # w − 1 kept and the t new); the same start cuts the hand-written call's keys
    start = max(s, n - (w - 1) - t)
    pos = torch.cat([torch.arange(s, device=q.device), torch.arange(start, n, device=q.device)])
    kept_k, kept_v = (torch.cat([x[:, :, :s], x[:, :, start:]], 2) for x in (k, v))
    band = _band(pos, n, t, w, s)
    reference = _reference(q, kept_k, kept_v, band, scale)
    # every kept key allowed (t = 1 with a full cache): SDPA without a mask
    band = None if bool(band.all()) else band[None, None]

    def by_hand():
        ks, vs = (torch.cat([x[:, :, :s], x[:, :, start:]], 2) for x in (k, v))
        return F.scaled_dot_product_attention(q, ks, vs, attn_mask=band, enable_gqa=True)

    def ours(keys: Tensor, values: Tensor, engine: str = "auto") -> Callable[[], Tensor]:
        return fwd(
            lambda: sa.sparse_attention(q, keys, values, pattern, engine=engine, enable_gqa=True)
        )

    with torch.no_grad():
        softmax = sa.maps.softmax()
        engines = {
            "sparseattn auto": choose_engine(resolve_graph(pattern, q, k), q, k, softmax),
            "sparseattn auto, evicting cache": choose_engine(
                resolve_graph(pattern, q, kept_k), q, kept_k, softmax
            ),
        }
    calls = {
        SDPA_WHOLE: fwd(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)),
        FLEX_DECODE: _made(lambda: _flex_decode(q, k, v, w, s, scale)),
        "sdpa, sinks + window": fwd(by_hand),
        "sparseattn auto": ours(k, v),
        "sparseattn flex": ours(k, v, "flex"),
        "sdpa, evicting cache": fwd(
            lambda: F.scaled_dot_product_attention(
                q, kept_k, kept_v, attn_mask=band, enable_gqa=True
            )
        ),
        "sparseattn auto, evicting cache": ours(kept_k, kept_v),
    }
    graphed = {}
    if suite.decode_cuda_graph:
        graphed = {
            "sparseattn auto, CUDA graph": CudaGraphed(calls["sparseattn auto"]),
            "sparseattn auto, evicting cache, CUDA graph": CudaGraphed(
                calls["sparseattn auto, evicting cache"]
            ),
        }
    errors: dict[str, float] = {}
    # the graphs in a group of their own: a failed capture cannot stop the eager rows' samples
    for group in (calls, graphed):
        keyed = [
            (
                {**base, "who": who},
                fn if who == SDPA_WHOLE else _checked(fn, reference, who, errors),
            )
            for who, fn in group.items()
        ]
        record_group(suite, rows, log, keyed)
    for who in calls.keys() | graphed.keys():
        row = rows.find(**base, who=who)
        if row is None:
            continue
        if who in errors and "skipped" not in row:
            row["max_abs_err"] = errors[who]
        if "evicting" in who:
            row["keys"] = kept_k.shape[-2]
        engine = engines.get(who.removesuffix(", CUDA graph"))
        if engine:
            row["engine"] = engine
    write_json(rows.path, rows.data)


def _made(make: Callable[[], Callable[[], Tensor]]) -> Callable[[], Tensor]:
    """The call ``make()`` sets up; where the set-up fails, a call raising its error (so
    that :func:`~.cuda_timing.record_group` makes it a row with the reason)."""
    try:
        return make()
    except Exception as err:  # noqa: BLE001 - a baseline that cannot be set up is a row

        def fail(err: Exception = err) -> Tensor:
            raise err

        return fail


def _band(pos: Tensor, n: int, t: int, w: int, s: int) -> Tensor:
    """(t, len(pos)) bool: query n − t + r may see the key at position pos[c] (the pattern's
    definition: j ≤ i and (i − j < w or j < s))."""
    i = torch.arange(n - t, n, device=pos.device)[:, None]
    return (pos <= i) & ((i - pos < w) | (pos < s))


def _reference(q: Tensor, keys: Tensor, values: Tensor, allowed: Tensor, scale: float) -> Tensor:
    """float32 softmax attention of q over ``keys`` where ``allowed`` (t, m), written out: each
    key/value head repeated for its query heads, scores, softmax, weights times values."""
    groups = q.shape[1] // keys.shape[1]
    kf, vf = (x.float().repeat_interleave(groups, 1) for x in (keys, values))
    scores = (q.float() @ kf.transpose(-1, -2)) * scale
    return scores.masked_fill(~allowed, -math.inf).softmax(-1) @ vf


def _checked(fn: Callable[[], Tensor], reference: Tensor, who: str, errors: dict):
    """``fn`` that, on its first call, keeps its output's largest difference from
    ``reference`` in ``errors[who]``."""

    def call() -> Tensor:
        out = fn()
        if who not in errors:
            errors[who] = float((out.float() - reference).abs().max())
        return out

    return call


def _flex_decode(q: Tensor, k: Tensor, v: Tensor, w: int, s: int, scale: float):
    """Compiled ``flex_attention`` with a BlockMask of t queries at the end of n keys, its
    ``mask_mod`` the window and sinks in absolute positions (q_idx counts from the first new
    query), as a user of FlexAttention alone writes the decode step."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    t, n = q.shape[-2], k.shape[-2]
    offset = n - t

    def window_and_sinks(b, h, q_idx, kv_idx):
        i = q_idx + offset
        return (kv_idx <= i) & ((i - kv_idx < w) | (kv_idx < s))

    block_mask = create_block_mask(window_and_sinks, None, None, t, n, device=q.device)
    compiled = cuda_timing.user_compiled_flex(flex_attention)
    return fwd(lambda: compiled(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True))


# ----------------------------------------------------------------------------- generate
class _FirstLogits:
    """A logits processor that reads the clock (after synchronising) when the first new
    token's logits arrive, i.e. when the prefill is done."""

    def __init__(self) -> None:
        self.at: float | None = None

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if self.at is None:
            torch.cuda.synchronize()
            self.at = time.perf_counter()
        return scores


def _llama(layers: int, positions: int):
    """The Llama-shaped decoder with an LM head (:data:`LLAMA`, ``layers`` layers), random
    weights from seed 0, bf16 on the GPU, with room for ``positions`` positions."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **LLAMA,
        num_hidden_layers=layers,
        max_position_embeddings=positions,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval().to("cuda", torch.bfloat16)


def _generate_once(model, prompt: Tensor, cache, tokens: int) -> tuple[Tensor, float, float, float]:
    """New tokens, prefill seconds, decode seconds (the tokens after the first), peak MiB."""
    from transformers import LogitsProcessorList

    first = _FirstLogits()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    out = model.generate(
        input_ids=prompt,
        attention_mask=torch.ones_like(prompt),
        cache=cache,
        max_new_tokens=tokens,
        min_new_tokens=tokens,
        do_sample=False,
        logits_processor=LogitsProcessorList([first]),
    )
    torch.cuda.synchronize()
    end = time.perf_counter()
    peak = (torch.cuda.max_memory_allocated() - before) / 2**20
    return out[:, prompt.shape[1] :], first.at - start, end - first.at, peak


def _time_generate(model, prompt: Tensor, make_cache, suite) -> tuple[dict, Tensor]:
    """A warm-up run (:data:`WARMUP_TOKENS`), then ``generate_samples`` runs of
    ``generate_tokens``: the row's numbers and the new tokens."""
    tokens = suite.generate_tokens
    _generate_once(model, prompt, make_cache(), min(tokens, WARMUP_TOKENS))
    prefill, decode, peaks = [], [], []
    for _ in range(max(1, suite.generate_samples)):
        cache = make_cache()
        ids, pre, dec, peak = _generate_once(model, prompt, cache, tokens)
        prefill.append(pre)
        decode.append(dec)
        peaks.append(peak)
    decode_s = statistics.median(decode)
    row = {
        "prefill_s": statistics.median(prefill),
        "decode_s": decode_s,
        "decode_tok_s": (tokens - 1) / decode_s if tokens > 1 and decode_s > 0 else None,
        "prefill_times_s": prefill,
        "decode_times_s": decode,
        "peak_mb": max(peaks),
        "keys_per_layer": int(cache.layers[0].keys.shape[-2]),
        "tokens_sha256": hashlib.sha256(ids.cpu().numpy().tobytes()).hexdigest(),
    }
    return row, ids


def _generate(suite, rows, log) -> None:
    import sparseattn as sa

    w, s, tokens = suite.decode_window, suite.decode_sinks, suite.generate_tokens
    common = {
        "section": "generate",
        "dtype": "bfloat16",
        "pattern": f"sliding_window({w}, {s})",
        "tokens": tokens,
        "layers": suite.generate_layers,
        "mode": "generate",
    }
    todo = []
    for n in suite.decode_ns:
        missing = [who for who in (DENSE, FULL, EVICTING) if not rows.find(**common, n=n, who=who)]
        if n > suite.generate_max_prompt:
            why = f"prompt > generate_max_prompt = {suite.generate_max_prompt}"
            for who in missing:
                rows.add({**common, "n": n, "who": who, "skipped": why})
                log(_generate_line(rows.find(**common, n=n, who=who)))
        elif missing:
            todo.append((n, missing))
    if not todo:
        return
    try:
        from transformers import DynamicCache

        from ... import hf

        model = _llama(suite.generate_layers, max(n for n, _ in todo) + tokens)
    except Exception as err:  # noqa: BLE001 - no model: rows that say why
        for n, missing in todo:
            for who in missing:
                rows.add({**common, "n": n, "who": who, "skipped": _reason(err)})
        return
    pattern = sa.sliding_window(w, s)
    for n, missing in todo:
        gen = torch.Generator(device="cuda").manual_seed(n)
        prompt = torch.randint(3, LLAMA["vocab_size"], (1, n), generator=gen, device="cuda")
        new_tokens: dict[str, Tensor] = {}
        for who in missing:
            key = {**common, "n": n, "who": who}
            try:
                if who == DENSE:
                    hf.restore(model)
                else:
                    hf.sparsify(model, pattern)
                make_cache = (lambda: hf.window_cache(model)) if who == EVICTING else DynamicCache
                row, new_tokens[who] = _time_generate(model, prompt, make_cache, suite)
            except Exception as err:  # noqa: BLE001 - a run that fails is a row with the reason
                row = {"skipped": _reason(err)}
            row = {**key, **row}
            if who == EVICTING and "skipped" not in row:
                row["tokens_equal"] = _same_tokens(rows, common, n, new_tokens)
                if FULL in new_tokens and not row["tokens_equal"]:
                    differ = new_tokens[EVICTING] != new_tokens[FULL]
                    row["first_difference"] = int(differ.int().argmax())
            rows.add(row)
            log(_generate_line(row))
            torch.cuda.empty_cache()
    hf.restore(model)


def _same_tokens(rows, common: dict, n: int, new_tokens: dict[str, Tensor]) -> bool | None:
    """Whether the evicting cache's new tokens equal the full cache's (``torch.equal``; by
    SHA-256 when the full cache's row comes from an earlier run); None without that row."""
    if FULL in new_tokens:
        return torch.equal(new_tokens[EVICTING], new_tokens[FULL])
    full = rows.find(**common, n=n, who=FULL)
    if full is None or "tokens_sha256" not in full:
        return None
    ids = new_tokens[EVICTING]
    return hashlib.sha256(ids.cpu().numpy().tobytes()).hexdigest() == full["tokens_sha256"]


def _reason(err: Exception) -> str:
    if isinstance(err, torch.OutOfMemoryError):
        return "out of memory"
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"


def _generate_line(row: dict) -> str:
    head = f"generate bfloat16 n={row['n']:6d} {row['who']:28s}"
    if "skipped" in row:
        return f"{head} {row['skipped']}"
    rate = row["decode_tok_s"]
    equal = f"  tokens equal {row['tokens_equal']}" if "tokens_equal" in row else ""
    return (
        f"{head} {rate or float('nan'):8.1f} tok/s  prefill {row['prefill_s'] * 1e3:8.1f} ms  "
        f"peak {row['peak_mb']:8.0f} MiB  keys {row['keys_per_layer']}{equal}"
    )


# ----------------------------------------------------------------------------- report
def markdown(rows: list[dict]) -> list[str]:
    """The section's tables: the decode step (ms, error, ratios to SDPA over the whole cache
    and to flex decode) and generate (tokens/s, evicting / full, equal tokens, peak MiB)."""
    lines: list[str] = []
    decode = [r for r in rows if r.get("section") == "decode"]
    if decode:
        lines += table_head(
            f"Decode step (bf16, q (1, {HEADS}, t, {HEAD_DIM}) at the end of k, v (1, {KV_HEADS}, "
            f"n, {HEAD_DIM}), {decode[0]['pattern']}), ms",
            ["n", "t", "who", "keys", "ms", "max abs err", "/ SDPA whole cache", "/ flex decode"],
        )
        for n, t in sorted({(r["n"], r["t"]) for r in decode}):
            sel = [r for r in decode if (r["n"], r["t"]) == (n, t)]
            times = {r["who"]: r.get("time_s") for r in sel}
            for r in sel:
                who = r["who"] + (f" ({r['engine']})" if r.get("engine") else "")
                ms = _cell(r.get("skipped")) or f"{r['time_s'] * 1e3:.3f}"
                err = f"{r['max_abs_err']:.1e}" if r.get("max_abs_err") is not None else "–"
                lines.append(
                    f"| {n} | {t} | {who} | {r.get('keys', n)} | {ms} | {err} | "
                    f"{ratio(times, r['who'], SDPA_WHOLE, 3)} | "
                    f"{ratio(times, r['who'], FLEX_DECODE, 3)} |"
                )
    generate = [r for r in rows if r.get("section") == "generate"]
    if generate:
        first = generate[0]
        lines += table_head(
            f"generate ({first['tokens']} new tokens, greedy, batch 1; Llama-shaped, "
            f"layers {first['layers']}, width {LLAMA['hidden_size']}, "
            f"{LLAMA['num_attention_heads']} heads, {LLAMA['num_key_value_heads']} key/value "
            f"heads, random bf16 weights; sparsified with {first['pattern']}; decode tok/s: the "
            "steps after the first token, prefill apart)",
            ["prompt", "model, cache", "decode tok/s", "prefill ms", "evicting / full",
             "tokens equal", "peak MiB", "keys per layer"],
        )  # fmt: skip
        for n in sorted({r["n"] for r in generate}):
            sel = [r for r in generate if r["n"] == n]
            rates = {r["who"]: r.get("decode_tok_s") for r in sel}
            for r in sel:
                if "skipped" in r:
                    lines.append(f"| {n} | {r['who']} | {_cell(r['skipped'])} | | | | | |")
                    continue
                rate = r.get("decode_tok_s")
                equal = {True: "yes", False: "**no**", None: "–"}[r.get("tokens_equal")]
                lines.append(
                    f"| {n} | {r['who']} | {f'{rate:.1f}' if rate else '–'} | "
                    f"{r['prefill_s'] * 1e3:.1f} | "
                    f"{ratio(rates, EVICTING, FULL, 2) if r['who'] == EVICTING else ''} | "
                    f"{equal if r['who'] == EVICTING else ''} | {r['peak_mb']:.0f} | "
                    f"{r['keys_per_layer']} |"
                )
    return lines


def _cell(text: str | None) -> str | None:
    """A skip reason fit for a table cell."""
    return None if text is None else text.replace("|", "\\|")
