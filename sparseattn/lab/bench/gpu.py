"""``sparseattn bench gpu``: the engines on a CUDA GPU against SDPA, FlexAttention and entmax.

One run times, on q, k, v of shape (1, H, n, d) (H = 8, d = 64; bf16 and fp32), against
baselines measured in the same run:

* **main** — the Longformer pattern (window ±256 + 16 sink tokens, ``longformer(512, 16)``):
  ``sparse_attention(q, k, v, pattern)`` with ``engine="flex"``, ``"auto"`` and ``"block"``
  (softmax) and with ρ = 1.5-entmax (block engine), against SDPA dense and causal (the
  FlashAttention backend for bf16), compiled ``flex_attention`` called directly ("flex
  direct", below), and ``entmax.entmax15`` over the full masked n×n scores where it fits
  (else "out of memory"); forward and forward+backward.
  "flex direct" is what a user writes without the library: compiled ``flex_attention`` with a
  hand-written mask_mod and ``create_block_mask``.
* **entmax** — sparse maps against their anchors (bf16, n = 4096 … 131072): 1.5-entmax by the
  Triton kernels on the Longformer pattern beside softmax (flex) on the same pattern; causal and
  dense 1.5-entmax over all keys beside SDPA and AdaSplash (when its wheel is installed); the
  entmax package on the full causal scores where they fit.
* **tiles** — the Triton α-entmax kernels' knobs (``triton_entmax.TritonOptions``, set by
  ``triton_entmax.tuning``), first ``block`` and ``skip_tiles``: tiles of 32, 64 and 128 rows,
  with the threshold passes skipping the tiles below every open row's threshold or visiting
  all; bf16 1.5-entmax, causal over all keys and Longformer.
* **module** — one training step (forward + backward) of ``SparseAttention(512, 8,
  pattern=longformer(512, 16))`` against ``nn.MultiheadAttention(512, 8)`` on (1, n, 512), bf16.
* **calibrate** — the ``auto`` rule's evidence: dense (masked SDPA), block, gather and flex for
  softmax and dense/block/gather for 1.5-entmax on Longformer, BigBird and random graphs at
  short n, forward+backward.
* **decode** (:mod:`.gpu_decode`) and **models** (:mod:`.gpu_models`), sections of their own
  files: decoding against long caches, and the checkpoint-size Longformer and BigBird.

Timing (:mod:`.cuda_timing`): CUDA events around ``inner`` back-to-back calls (so that host
work overlaps device work, as in a training loop), median over ``samples``, after a warm-up
call that compiles; peak memory is ``torch.cuda.max_memory_allocated`` above the inputs.
Results: results.json (after every row; a re-run resumes), results.md and gpu.png.

One file for the suites and the sections on q, k, v (their cases, the JSON and the tables),
read top to bottom; the CPU suite is kernels.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from ...attention import choose_engine
from ...score_mods import alibi, softcap
from ..results import ResumableRows, machine_facts, save_figure, write_json
from . import cuda_timing, gpu_decode, gpu_models
from .cuda_timing import (
    fwd,
    fwd_bwd,
    gpu_facts,
    ratio,
    record,
    record_group,
    table_head,
)

__all__ = ["GPU_SUITES", "GpuSuite", "run_gpu_suite", "with_locality"]


@dataclasses.dataclass(frozen=True)
class GpuSuite:
    """What one GPU run measures."""

    name: str
    ns: tuple[int, ...] = (8192, 32768, 131072)
    fp32_ns: tuple[int, ...] = (8192, 32768)
    heads: int = 8
    head_dim: int = 64
    window: int = 512
    sinks: int = 16
    package_max_n: int = 32768
    calibrate_ns: tuple[int, ...] = (1024, 4096, 16384)
    entmax_ns: tuple[int, ...] = (4096, 8192, 16384, 32768, 65536, 131072)
    tiles_ns: tuple[int, ...] = (8192, 32768)
    module_ns: tuple[int, ...] = (8192, 32768)
    stream_ns: tuple[int, ...] = (4096, 8192, 16384, 32768)
    embed_dim: int = 512
    tile_blocks: tuple[int, ...] = (32, 64, 128)
    tile_warps: tuple[int, ...] = (4, 8)
    tile_stages: tuple[int, ...] = (2, 3)
    #: the per-tile maxima kept per row for the threshold's start (``TritonOptions.topk``)
    tile_topks: tuple[int, ...] = (16, 32)
    #: split the query blocks above this many times the mean key blocks
    #: (``TritonOptions.split_long``; Longformer's global tokens' block)
    tile_splits: tuple[float, ...] = (4.0,)
    #: also time every head's query blocks launched longest first (``longest_first``)
    tile_longest_first: bool = True
    #: strength of the positional locality of the tiles section's peaked case
    locality: float = 1.5
    # decode (gpu_decode.py): cache lengths of the decode step; tokens that ``generate`` makes
    # (0: no generate rows)
    decode_ns: tuple[int, ...] = ()
    generate_tokens: int = 0
    #: the decode step's and generate's pattern, ``sliding_window(decode_window, decode_sinks)``
    decode_window: int = 4096
    decode_sinks: int = 4
    #: new queries per decode step (one token, or a few: speculative decoding's drafts)
    decode_queries: tuple[int, ...] = (1, 4)
    #: also time the library's decode step replayed from a CUDA graph
    decode_cuda_graph: bool = True
    #: generate's prompt lengths: the decode_ns up to this (longer ones get a skipped row)
    generate_max_prompt: int = 32768
    #: timed generate runs per model and cache, after one warm-up run
    generate_samples: int = 2
    #: decoder layers of generate's Llama-shaped model
    generate_layers: int = 8
    # models (gpu_models.py): sequence lengths of the checkpoint-size Longformer and BigBird
    models_ns: tuple[int, ...] = ()
    #: their sizes (``lab.models.checkpoints.CheckpointSize``; intermediate 4 × hidden, BigBird
    #: 3 random blocks): the checkpoints' by default, tests shrink them
    models_layers: int = 12
    models_hidden: int = 768
    models_heads: int = 12
    models_window: int = 512
    models_block: int = 64
    #: Longformer's global tokens (the first ones)
    models_globals: int = 16
    samples: int = 5
    min_sample_s: float = 0.02

    @classmethod
    def only(cls, name: str, **fields) -> GpuSuite:
        """A suite that runs the sections ``fields`` give lengths to and no other (every
        section's lengths empty unless given)."""
        none = dict.fromkeys(
            ("ns", "fp32_ns", "calibrate_ns", "entmax_ns", "tiles_ns", "module_ns", "stream_ns"),
            (),
        )
        return cls(name, **{**none, **fields})


GPU_SUITES = {
    "gpu": GpuSuite("gpu"),
    "gpu-quick": GpuSuite(
        "gpu-quick",
        fp32_ns=(),
        package_max_n=8192,
        calibrate_ns=(2048,),
        entmax_ns=(8192, 32768),
        tiles_ns=(32768,),
        samples=3,
    ),
    # issue 43's α-entmax targets: the sparse-map section at 32768 and 131072, then the
    # Triton kernels' options (TOPK 8, the default, against 16, 32; split; longest first)
    "gpu-entmax": GpuSuite.only(
        "gpu-entmax",
        package_max_n=8192,
        entmax_ns=(32768, 131072),
        tiles_ns=(32768,),
        tile_blocks=(),
        tile_warps=(),
        tile_stages=(),
        tile_topks=(8, 16, 32),
        samples=3,
    ),
    # the host's share at short lengths: main and module at 4096 and 8192, and the stream
    "gpu-overhead": GpuSuite.only(
        "gpu-overhead",
        ns=(4096, 8192),
        module_ns=(4096, 8192),
        stream_ns=GpuSuite.stream_ns,
    ),
    # issue 43's decoding: the decode step against SDPA and flex at caches of 8k, 32k and 128k,
    # and generate() with the evicting cache against the full one
    "gpu-decode": GpuSuite.only("gpu-decode", decode_ns=(8192, 32768, 131072), generate_tokens=256),
    # issue 40's GPU rows: Longformer- and BigBird-base-size models, transformers' against
    # hf.sparsify's (flex)
    "gpu-models": GpuSuite.only("gpu-models", models_ns=(1024, 4096, 16384)),
}


def run_gpu_suite(
    suite: GpuSuite,
    out_dir: Path,
    log: Callable[[str], None] = print,
    ns: tuple[int, ...] | None = None,
) -> dict:
    """Run ``suite`` (main lengths ``ns`` if given) on ``cuda:0``; write into ``out_dir``."""
    if not torch.cuda.is_available():
        raise RuntimeError("sparseattn bench gpu needs a CUDA device; torch sees none")
    if ns:
        suite = dataclasses.replace(suite, ns=tuple(ns), fp32_ns=tuple(ns))
    out_dir.mkdir(parents=True, exist_ok=True)
    header = {
        "suite": dataclasses.asdict(suite),
        "machine": {**machine_facts(), **gpu_facts()},
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    rows = ResumableRows(out_dir / "results.json", header)
    log(f"machine: {header['machine']}")
    # dynamo counts recompiles per code object, and past its limit runs that code eagerly
    # (unfused: n² scores) from then on; each section starts from fresh compiles instead
    limit = max(64, torch._dynamo.config.recompile_limit)
    with torch._dynamo.config.patch(recompile_limit=limit):
        for dtype in (torch.bfloat16, torch.float32):
            for n in suite.ns if dtype == torch.bfloat16 else suite.fp32_ns:
                cuda_timing.fresh_compiles()
                _main(suite, rows, log, n, dtype)
        for n in suite.module_ns:
            cuda_timing.fresh_compiles()
            _module(suite, rows, log, n)
        if suite.stream_ns:
            cuda_timing.fresh_compiles()
            _stream(suite, rows, log, suite.stream_ns)
        for n in suite.entmax_ns:
            cuda_timing.fresh_compiles()
            _entmax(suite, rows, log, n)
        for n in suite.calibrate_ns:
            cuda_timing.fresh_compiles()
            _calibrate(suite, rows, log, n)
        for section in (gpu_decode, gpu_models):
            cuda_timing.fresh_compiles()
            section.run(suite, rows, log)
        # last: the kernels' free choices, a sweep of compiles (about 2 s each) that a timeout
        # may cut
        for n in suite.tiles_ns:
            _tiles(suite, rows, log, n)
    rows.data["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    write_json(out_dir / "results.json", rows.data)
    (out_dir / "results.md").write_text(markdown(rows.data))
    _plot(rows.data, out_dir / "gpu.png")
    return rows.data


def _inputs(suite: GpuSuite, n: int, dtype: torch.dtype, grad: bool):
    gen = torch.Generator(device="cuda").manual_seed(n)
    shape = (1, suite.heads, n, suite.head_dim)
    qkv = [
        torch.randn(shape, generator=gen, device="cuda", dtype=dtype).requires_grad_(grad)
        for _ in range(3)
    ]
    return qkv, torch.randn(shape, generator=gen, device="cuda", dtype=dtype)


def _main(suite: GpuSuite, rows: ResumableRows, log, n: int, dtype: torch.dtype) -> None:
    import sparseattn as sa

    pattern = sa.longformer(suite.window, suite.sinks)
    (q, k, v), g = _inputs(suite, n, dtype, grad=True)
    base = {
        "section": "main",
        "dtype": str(dtype).removeprefix("torch."),
        "n": n,
        "pattern": f"longformer({suite.window}, {suite.sinks})",
    }
    flash = [torch.nn.attention.SDPBackend.FLASH_ATTENTION] if dtype != torch.float32 else None

    def sdpa(causal: bool):
        def call():
            if flash is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            with torch.nn.attention.sdpa_kernel(flash):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        return call

    def ours(engine: str, rho: str = "softmax"):
        return lambda: sa.sparse_attention(q, k, v, pattern, prob_map=rho, engine=engine)

    graph = pattern.graph(n)
    scale = 1 / math.sqrt(suite.head_dim)
    flex_direct = _flex_by_hand(suite, q, k, v, scale)

    with torch.no_grad():
        chosen = choose_engine(graph, q, k, sa.maps.softmax())
    timed = {
        "sdpa dense": sdpa(False),
        "sdpa causal": sdpa(True),
        "flex direct": flex_direct,
        "sparseattn flex": ours("flex"),
        f"sparseattn auto ({chosen})": ours("auto"),
        "sparseattn block": ours("block"),
        "sparseattn entmax15": ours("auto", "entmax15"),
    }
    for mode, wrap in (("fwd", fwd), ("fwd+bwd", lambda fn: fwd_bwd(fn, (q, k, v), g))):
        keyed = [({**base, "who": who, "mode": mode}, wrap(fn)) for who, fn in timed.items()]
        record_group(suite, rows, log, keyed)
    if dtype == torch.float32:
        _package(suite, rows, log, base, graph, q, k, v, scale)


def _stream(suite: GpuSuite, rows: ResumableRows, log, ns: tuple[int, ...]) -> None:
    """The flex engine over a stream of lengths, as a model meets them: every length of ``ns``
    called (forward, then forward + backward) from fresh compiles, the last one timed, beside
    compiled ``flex_attention`` by hand over the same stream (torch's default: a kernel
    specialised to the first length, one length-generic kernel from the second on)."""
    import sparseattn as sa

    pattern = sa.longformer(suite.window, suite.sinks)

    def calls_at(n: int) -> dict:
        (q, k, v), g = _inputs(suite, n, torch.bfloat16, grad=True)
        ours = lambda: sa.sparse_attention(q, k, v, pattern, engine="flex")  # noqa: E731
        hand = _flex_by_hand(suite, q, k, v, suite.head_dim**-0.5)
        return {
            (who, mode): call
            for who, fn in (("sparseattn flex", ours), ("flex direct", hand))
            for mode, call in (("fwd", fwd(fn)), ("fwd+bwd", fwd_bwd(fn, (q, k, v), g)))
        }

    for n in ns[:-1]:
        for call in calls_at(n).values():
            call()
    base = {"section": "stream", "dtype": "bfloat16", "n": ns[-1], "after": list(ns[:-1])}
    calls = calls_at(ns[-1])
    for mode in ("fwd", "fwd+bwd"):
        keyed = [({**base, "who": w, "mode": m}, fn) for (w, m), fn in calls.items() if m == mode]
        record_group(suite, rows, log, keyed)


def _flex_by_hand(suite: GpuSuite, q, k, v, scale: float) -> Callable[[], object]:
    """What a user writes without this library: compiled ``flex_attention`` with a hand-written
    mask_mod of the Longformer pattern (|i − j| ≤ w/2, or a sink row or column) and
    ``create_block_mask`` — the baseline of the flex engine's ≤ 1.10 target."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    half, sinks, n = suite.window // 2, suite.sinks, q.shape[-2]

    def longformer(b, h, i, j):
        return ((i - j).abs() <= half) | (i < sinks) | (j < sinks)

    block_mask = cuda_timing.user_block_mask(create_block_mask, longformer, n, q.device)
    compiled = cuda_timing.user_compiled_flex(flex_attention)
    return lambda: compiled(q, k, v, block_mask=block_mask, scale=scale)


def _package(suite, rows, log, base, graph, q, k, v, scale) -> None:
    """entmax 1.3's entmax15 over the full masked (1, H, n, n) scores (all heads at once)."""
    key = {**base, "who": "entmax package (full)", "mode": "fwd"}
    if base["n"] > suite.package_max_n:
        if not rows.find(**key):
            rows.add({**key, "skipped": f"n > package_max_n = {suite.package_max_n}"})
        return
    try:
        import entmax as package
    except ImportError:
        rows.add({**key, "skipped": "the entmax package is not installed"})
        return
    mask = graph.to_dense().to(q.device)

    def full():
        s = (q @ k.transpose(-1, -2)) * scale
        return package.entmax15(s.masked_fill_(~mask, -math.inf), dim=-1) @ v

    record(suite, rows, log, key, fwd(full))


def _entmax(suite: GpuSuite, rows: ResumableRows, log, n: int) -> None:
    """Sparse maps against their anchors, bf16: 1.5-entmax by the Triton kernels on the
    Longformer pattern beside softmax (flex engine) on the same pattern, both also with ALiBi
    and with a softcap (the score modifiers the Triton kernels compile in), and both on its
    window alone (whose query blocks all visit about as many key blocks); causal 1.5-entmax over
    all keys (``dense().causal()``, no graph) beside SDPA causal and AdaSplash (its wheel, when
    installed); dense 1.5-entmax beside SDPA dense and AdaSplash; the entmax package on the
    full scores where they fit."""
    import sparseattn as sa

    (q, k, v), g = _inputs(suite, n, torch.bfloat16, grad=True)
    longformer = sa.longformer(suite.window, suite.sinks)
    base = {"section": "entmax", "dtype": "bfloat16", "n": n}
    flash = [torch.nn.attention.SDPBackend.FLASH_ATTENTION]

    def sdpa(causal: bool):
        def call():
            with torch.nn.attention.sdpa_kernel(flash):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        return call

    def ours(pattern, rho: str, engine: str = "auto", mod=None):
        return lambda: sa.sparse_attention(
            q, k, v, pattern, prob_map=rho, engine=engine, score_mod=mod
        )

    with torch.no_grad():  # on a GPU with triton: the Triton kernels
        chosen = choose_engine(longformer.graph(n), q, k, sa.maps.resolve_prob_map("entmax15"))
    base["entmax engine"] = chosen
    timed = {
        "longformer entmax15": ours(longformer, "entmax15"),
        "longformer softmax (flex)": ours(longformer, "softmax", "flex"),
        # the same window without the global tokens: no query block visits every key block
        "window entmax15": ours(sa.window(suite.window), "entmax15"),
        "window softmax (flex)": ours(sa.window(suite.window), "softmax", "flex"),
        "causal entmax15 (ours)": ours(sa.dense().causal(), "entmax15"),
        "causal sdpa": sdpa(True),
        "dense entmax15 (ours)": ours(sa.dense(), "entmax15"),
        "dense sdpa": sdpa(False),
    }
    # score modifiers compiled into the Triton kernels, beside flex with the same modifier
    for name, mod in (("alibi", alibi(suite.heads)), ("softcap", softcap(30.0))):
        timed[f"longformer entmax15 + {name}"] = ours(longformer, "entmax15", mod=mod)
        timed[f"longformer softmax (flex) + {name}"] = ours(longformer, "softmax", "flex", mod)
    try:
        from adasplash import adasplash

        timed["causal adasplash"] = lambda: adasplash(q, k, v, alpha=1.5, is_causal=True)
        timed["dense adasplash"] = lambda: adasplash(q, k, v, alpha=1.5, is_causal=False)
    except ImportError:
        for who in ("causal adasplash", "dense adasplash"):
            if not rows.find(**base, who=who, mode="fwd"):
                rows.add({**base, "who": who, "mode": "fwd", "skipped": "adasplash missing"})
    if n <= suite.package_max_n:
        try:
            import entmax as package

            scale = 1 / math.sqrt(suite.head_dim)
            timed["causal entmax package (full)"] = lambda: (
                package.entmax15(
                    ((q @ k.transpose(-1, -2)) * scale).masked_fill_(
                        torch.ones(n, n, dtype=torch.bool, device=q.device).triu_(1), -math.inf
                    ),
                    dim=-1,
                )
                @ v
            )
        except ImportError:
            pass
    for who, fn in timed.items():
        record(suite, rows, log, {**base, "who": who, "mode": "fwd"}, fwd(fn))
        record(suite, rows, log, {**base, "who": who, "mode": "fwd+bwd"}, fwd_bwd(fn, (q, k, v), g))


class _SelfAttention(torch.nn.Module):
    """``nn.MultiheadAttention`` as self-attention of one input (what
    ``torch.cuda.make_graphed_callables`` takes: a module called on its sample arguments)."""

    def __init__(self, mha: torch.nn.MultiheadAttention):
        super().__init__()
        self.mha = mha

    def forward(self, x: Tensor) -> Tensor:
        return self.mha(x, x, x, need_weights=False)[0]


def _module(suite: GpuSuite, rows: ResumableRows, log, n: int) -> None:
    """One training step (forward + backward, no optimizer) of the layer against
    ``nn.MultiheadAttention`` of the same width and heads, bf16, x of shape (1, n, E); each
    also as ``torch.cuda.make_graphed_callables`` makes it (forward and backward replayed from
    CUDA graphs: no host work per call but the copy of x into the graph's input; the graphs
    are captured on the step's first call, after the warm-up calls that fill sparseattn's
    caches). A layer that cannot be captured is a row with the reason."""
    import sparseattn as sa

    e, h = suite.embed_dim, suite.heads
    gen = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(1, n, e, generator=gen, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(1, n, e, generator=gen, device="cuda", dtype=torch.bfloat16)
    pattern = sa.longformer(suite.window, suite.sinks)
    ours = sa.SparseAttention(e, h, pattern=pattern).to("cuda", torch.bfloat16)
    mha = _SelfAttention(torch.nn.MultiheadAttention(e, h, batch_first=True))
    mha.to("cuda", torch.bfloat16)

    def step(layer, graphed: bool):
        run = []  # the layer as called: made on the first call (capture errors become rows)

        def call():
            if not run:
                run.append(torch.cuda.make_graphed_callables(layer, (x,)) if graphed else layer)
            x.grad = None
            layer.zero_grad(set_to_none=True)
            run[0](x).backward(grad)

        return call

    x.requires_grad_(True)
    base = {"section": "module", "dtype": "bfloat16", "n": n, "mode": "train step"}
    keyed = [
        ({**base, "who": who + (" (CUDA graph)" if graphed else "")}, step(layer, graphed))
        for graphed in (False, True)
        for who, layer in (("SparseAttention", ours), ("nn.MultiheadAttention", mha))
    ]
    record_group(suite, rows, log, keyed)


def _tiles(suite: GpuSuite, rows: ResumableRows, log, n: int) -> None:
    """1.5-entmax (bf16) by the Triton kernels with each tile size and with and without tile
    skipping in the threshold passes, then at block 64 with each number of warps and pipeline
    stages, ``topk`` and split of the suite (set by ``triton_entmax.tuning``): causal over all
    keys, on Gaussian q, k and on q, k with locality (peaked rows, :func:`with_locality`), on
    the Longformer pattern, and one token decoded against the n keys (causal)."""
    import sparseattn as sa

    from ...engines import triton_entmax as te

    (q, k, v), g = _inputs(suite, n, torch.bfloat16, grad=True)
    ql, kl = (x.detach().requires_grad_(True) for x in with_locality(q, k, suite.locality))
    q1 = q[:, :, -1:].detach().requires_grad_(True)  # one token against the whole cache
    causal = sa.dense().causal()
    cases = {
        "causal": (causal, (q, k, v), g),
        "causal, local": (causal, (ql, kl, v), g),
        "longformer": (sa.longformer(suite.window, suite.sinks), (q, k, v), g),
        "causal, decode": (causal, (q1, k, v), g[:, :, -1:]),
    }
    # the tile rows keep the default warps and stages; the sweep sets both kernels' stages
    knobs = (
        [
            (
                f"block {block}, {'skip' if skip else 'visit all'}",
                {"block": block, "skip_tiles": skip},
            )
            for block in suite.tile_blocks
            for skip in (True, False)
        ]
        + [
            (
                f"block 64, warps {warps}, stages {stages}",
                {"block": 64, "warps": warps, "stages": stages},
            )
            for warps in suite.tile_warps
            for stages in suite.tile_stages
        ]
        + [(f"block 64, top {topk}", {"block": 64, "topk": topk}) for topk in suite.tile_topks]
        + [
            (f"block 64, split long x{factor:g}", {"block": 64, "split_long": factor})
            for factor in suite.tile_splits
        ]
        + [("block 64, longest first", {"block": 64, "longest_first": True})]
        * suite.tile_longest_first
    )
    for name, (pattern, inputs, grad) in cases.items():
        fn = lambda p=pattern, i=inputs: sa.sparse_attention(*i, p, prob_map="entmax15")  # noqa: E731
        for who, knob in knobs:
            key = {"section": "tiles", "dtype": "bfloat16", "n": n, "pattern": name}
            with te.tuning(**knob):
                for mode, call in (("fwd", fwd(fn)), ("fwd+bwd", fwd_bwd(fn, inputs, grad))):
                    record(suite, rows, log, {**key, "who": who, "mode": mode}, call)


def with_locality(q: Tensor, k: Tensor, strength: float) -> tuple[Tensor, Tensor]:
    """q and k plus ``strength``·sqrt(d)·e(i), e(i) sinusoids of d/2 frequencies from 1 to 1/n
    with e(i)·e(j) = mean_f cos(ω_f (i − j)): scores that favour nearby keys, as attention
    with locality does (most far tiles then hold no weight). q, k: (..., n, d), d even."""
    n, d = q.shape[-2], q.shape[-1]
    freq = torch.logspace(0, -math.log10(n), d // 2, device=q.device)
    angle = torch.arange(n, device=q.device)[:, None] * freq
    pos = torch.cat([angle.cos(), angle.sin()], 1) * (2 / d) ** 0.5
    pos = (strength * d**0.5 * pos).to(q.dtype)
    return q.detach() + pos, k.detach() + pos


def _calibrate(suite: GpuSuite, rows: ResumableRows, log, n: int) -> None:
    import sparseattn as sa

    patterns = {
        "longformer": sa.longformer(suite.window, suite.sinks),
        "bigbird": sa.bigbird(192, 16, 3, 64),
        "random": sa.random(k=64, seed=0),
    }
    (q, k, v), g = _inputs(suite, n, torch.bfloat16, grad=True)
    for name, pattern in patterns.items():
        graph = pattern.graph(n)
        auto = {
            rho: choose_engine(graph, q, k, sa.maps.resolve_prob_map(rho))
            for rho in ("softmax", "entmax15")
        }
        for rho, engines in (
            ("softmax", ("dense", "block", "gather", "flex")),
            ("entmax15", ("dense", "block", "gather")),
        ):
            for engine in engines:
                key = {
                    "section": "calibrate",
                    "dtype": "bfloat16",
                    "n": n,
                    "pattern": name,
                    "map": rho,
                    "who": engine,
                    "mode": "fwd+bwd",
                    "auto": auto[rho],
                    "fill": graph.col.numel() / (n * n),
                }
                fn = lambda e=engine, r=rho, gr=graph: (  # noqa: E731
                    sa.sparse_attention(q, k, v, gr, prob_map=r, engine=e)
                )
                record(suite, rows, log, key, fwd_bwd(fn, (q, k, v), g))


# ----------------------------------------------------------------------------- report
def markdown(data: dict) -> str:
    """The run as Markdown tables: main (ms and the ratios that the targets name), calibrate."""
    m = data["machine"]
    lines = [
        f"# sparseattn bench {data['suite']['name']}",
        "",
        f"GPU: {m['gpu']} ({m['gpu_memory_gb']} GiB, {m['multiprocessors']} SMs), CUDA "
        f"{m['cuda']}, torch {m['torch']}; started {data['started']}.",
    ]
    main = [r for r in data["rows"] if r["section"] == "main"]
    lines += table_head(
        "Longformer (window ±256 + 16 sinks), (1, 8, n, 64)",
        ["dtype", "n", "who", "mode", "ms", "peak MiB"],
    )
    for r in main:
        t = r.get("skipped") or f"{r['time_s'] * 1e3:.3f}"
        lines.append(
            f"| {r['dtype']} | {r['n']} | {r['who']} | {r['mode']} | {t} | "
            f"{r.get('peak_mb', float('nan')):.0f} |"
        )
    lines += table_head(
        "Ratios",
        ["dtype", "n", "mode", "flex engine / flex direct", "SDPA dense / flex engine",
         "entmax15 / flex engine", "package / entmax15"],
    )  # fmt: skip
    for dtype, n, mode in sorted({(r["dtype"], r["n"], r["mode"]) for r in main}):
        t = {
            r["who"].split(" (")[0]: r.get("time_s")
            for r in main
            if (r["dtype"], r["n"], r["mode"]) == (dtype, n, mode)
        }
        of = functools.partial(ratio, t, digits=3)
        lines.append(
            f"| {dtype} | {n} | {mode} | {of('sparseattn flex', 'flex direct')} | "
            f"{of('sdpa dense', 'sparseattn flex')} | "
            f"{of('sparseattn entmax15', 'sparseattn flex')} | "
            f"{of('entmax package', 'sparseattn entmax15')} |"
        )
    ent = [r for r in data["rows"] if r["section"] == "entmax"]
    if ent:
        lines += table_head(
            "Sparse maps (bf16, (1, 8, n, 64), ms; targets at n = 32768, fwd+bwd)",
            ["n", "mode", "longformer entmax15 (auto)", "/ softmax flex (≤ 2)", "window entmax15",
             "/ window flex", "causal entmax15", "/ SDPA causal (≤ 1.2)",
             "/ AdaSplash causal (< 1)", "dense entmax15", "/ SDPA dense", "/ AdaSplash dense"],
        )  # fmt: skip
        for n, mode in sorted({(r["n"], r["mode"]) for r in ent}):
            t = {r["who"]: r.get("time_s") for r in ent if (r["n"], r["mode"]) == (n, mode)}

            def ms(a, t=t):
                return f"{t[a] * 1e3:.2f}" if t.get(a) else "–"

            of = functools.partial(ratio, t, digits=2)
            lines.append(
                f"| {n} | {mode} | {ms('longformer entmax15')} | "
                f"{of('longformer entmax15', 'longformer softmax (flex)')} | "
                f"{ms('window entmax15')} | "
                f"{of('window entmax15', 'window softmax (flex)')} | "
                f"{ms('causal entmax15 (ours)')} | "
                f"{of('causal entmax15 (ours)', 'causal sdpa')} | "
                f"{of('causal entmax15 (ours)', 'causal adasplash')} | "
                f"{ms('dense entmax15 (ours)')} | {of('dense entmax15 (ours)', 'dense sdpa')} | "
                f"{of('dense entmax15 (ours)', 'dense adasplash')} |"
            )
    modded = [r for r in ent if " + " in r["who"]]
    if modded:
        lines += table_head(
            "Score modifiers in the kernels (Longformer, bf16, ms)",
            ["n", "mode", "modifier", "entmax15 (Triton)", "softmax (flex)", "entmax15 / flex",
             "entmax15 / without modifier"],
        )  # fmt: skip
        cases = {(r["n"], r["mode"], r["who"].split(" + ")[1]) for r in modded}
        for n, mode, name in sorted(cases):
            t = {r["who"]: r.get("time_s") for r in ent if (r["n"], r["mode"]) == (n, mode)}
            a, b = f"longformer entmax15 + {name}", f"longformer softmax (flex) + {name}"
            cells = [f"{t[w] * 1e3:.2f}" if t.get(w) else "–" for w in (a, b)]
            lines.append(
                f"| {n} | {mode} | {name} | {' | '.join(cells)} | {ratio(t, a, b, 2)} | "
                f"{ratio(t, a, 'longformer entmax15', 2)} |"
            )
    stream = [r for r in data["rows"] if r["section"] == "stream"]
    if stream:
        after = ", ".join(str(n) for n in stream[0]["after"])
        lines += table_head(
            f"Over a stream of lengths (bf16, Longformer; timed at n after calls at {after}), ms",
            ["n", "mode", "flex engine", "flex direct", "engine / direct"],
        )
        for n, mode in sorted({(r["n"], r["mode"]) for r in stream}):
            t = {r["who"]: r.get("time_s") for r in stream if (r["n"], r["mode"]) == (n, mode)}
            ms = {who: f"{t[who] * 1e3:.3f}" if t.get(who) else "–" for who in t}
            lines.append(
                f"| {n} | {mode} | {ms.get('sparseattn flex', '–')} | "
                f"{ms.get('flex direct', '–')} | "
                f"{ratio(t, 'sparseattn flex', 'flex direct', 3)} |"
            )
    module = {(r["n"], r["who"]): r.get("time_s") for r in data["rows"] if r["section"] == "module"}
    if module:
        lines += table_head(
            "Training step (forward + backward), bf16, (1, n, 512), 8 heads, ms",
            ["n", "graphs", "SparseAttention (longformer)", "nn.MultiheadAttention", "speed-up"],
        )
        for n, tail in sorted({(n, w.endswith(" (CUDA graph)")) for n, w in module}):
            suffix = " (CUDA graph)" if tail else ""
            whos = [w + suffix for w in ("SparseAttention", "nn.MultiheadAttention")]
            t = {who: module.get((n, who)) for who in whos}
            cells = [f"{v * 1e3:.2f}" if v else "–" for v in t.values()]
            speedup = ratio(t, whos[1], whos[0], 2)
            lines.append(f"| {n} | {'CUDA' if tail else 'no'} | {' | '.join(cells)} | {speedup} |")
    tiles = [r for r in data["rows"] if r["section"] == "tiles"]
    if tiles:
        lines += table_head(
            "Triton 1.5-entmax kernels: tile, skipping, warps, stages (bf16, (1, 8, n, 64), ms)",
            ["n", "pattern", "choice", "fwd", "fwd+bwd"],
        )
        for n, pat, who in dict.fromkeys((r["n"], r["pattern"], r["who"]) for r in tiles):
            sel = {r["mode"]: r for r in tiles if (r["n"], r["pattern"], r["who"]) == (n, pat, who)}
            cells = [
                f"{sel[m]['time_s'] * 1e3:.2f}" if "time_s" in sel.get(m, {}) else "–"
                for m in ("fwd", "fwd+bwd")
            ]
            lines.append(f"| {n} | {pat} | {who} | {' | '.join(cells)} |")
    cal = [r for r in data["rows"] if r["section"] == "calibrate"]
    if cal:
        lines += table_head(
            "Calibration of `auto` (bf16, forward+backward, ms)",
            ["n", "pattern", "map", "fill", "dense", "block", "gather", "flex", "auto picks",
             "fastest"],
        )  # fmt: skip
        for n, pat, rho in sorted({(r["n"], r["pattern"], r["map"]) for r in cal}):
            sel = {r["who"]: r for r in cal if (r["n"], r["pattern"], r["map"]) == (n, pat, rho)}
            ms = {e: r["time_s"] * 1e3 for e, r in sel.items() if "time_s" in r}
            cells = [
                f"{ms[e]:.2f}" if e in ms else ("–" if e not in sel else "skip")
                for e in ("dense", "block", "gather", "flex")
            ]
            one = next(iter(sel.values()))
            fastest = min(ms, key=ms.get) if ms else "–"
            lines.append(
                f"| {n} | {pat} | {rho} | {one['fill']:.4f} | {' | '.join(cells)} | "
                f"{one['auto']} | {fastest} |"
            )
    lines += gpu_decode.markdown(data["rows"]) + gpu_models.markdown(data["rows"])
    return "\n".join(lines) + "\n"


def _plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main = [r for r in data["rows"] if r["section"] == "main" and "time_s" in r]
    dtypes = sorted({r["dtype"] for r in main})
    if not dtypes:
        return
    fig, axes = plt.subplots(len(dtypes), 2, figsize=(11, 4 * len(dtypes)), squeeze=False)
    for i, dtype in enumerate(dtypes):
        for j, mode in enumerate(("fwd", "fwd+bwd")):
            ax = axes[i][j]
            sel = [r for r in main if r["dtype"] == dtype and r["mode"] == mode]
            for who in dict.fromkeys(r["who"] for r in sel):
                pts = sorted((r["n"], r["time_s"] * 1e3) for r in sel if r["who"] == who)
                ax.plot(*zip(*pts, strict=True), marker="o", label=who)
            ax.set(xscale="log", yscale="log", xlabel="n", ylabel="ms", title=f"{dtype}, {mode}")
            ax.legend(fontsize=7)
    fig.suptitle(f"sparseattn bench gpu ({data['machine']['gpu']})")
    save_figure(fig, path)
