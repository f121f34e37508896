"""CUDA timing for the GPU bench (``sparseattn bench gpu``) and its sections: calls timed by CUDA
events around ``inner`` back-to-back calls (host work overlaps device work, as in a training
loop), median over samples, after a warm-up call that compiles; peak memory by
``torch.cuda.max_memory_allocated`` above what was allocated before; rows recorded into a
:class:`~sparseattn.lab.results.ResumableRows` (a call that cannot run is a row with the reason);
the Markdown helpers the sections' tables share; what the sections compile (fresh compiles
per section, FlexAttention as a user holds it), which the tests' device guard replaces.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch

__all__ = [
    "cuda_time",
    "cuda_times",
    "fresh_compiles",
    "fwd",
    "fwd_bwd",
    "gpu_facts",
    "ratio",
    "record",
    "record_group",
    "sample",
    "table_head",
    "user_block_mask",
    "user_compiled_flex",
]


def cuda_time(fn: Callable[[], object], samples: int, min_sample_s: float) -> dict:
    """Warm-up call (compiles), one call for peak memory, then ``samples`` samples of ``inner``
    back-to-back calls between CUDA events; median seconds per call."""
    result = cuda_times([fn], samples, min_sample_s)[0]
    if isinstance(result, BaseException):
        raise result
    return result


def cuda_times(
    fns: list[Callable[[], object]], samples: int, min_sample_s: float
) -> list[dict | Exception]:
    """:func:`cuda_time` of several calls with their samples interleaved (A B C A B C …): at
    short lengths a call is host-bound (on the H100 host a compiled FlexAttention forward +
    backward costs 0.8–1.0 ms of host time against 0.6 ms of kernels), and a drift in the
    host's speed then reaches every call of a comparison alike. A call that fails gives its
    exception instead of a row."""
    results: list[dict | Exception] = []
    for fn in fns:
        try:
            results.append(_prepare(fn, min_sample_s))
        except Exception as err:  # noqa: PERF203 - a baseline that cannot run is a row
            results.append(err)
        torch.cuda.empty_cache()
    for _ in range(samples):
        for fn, result in zip(fns, results, strict=True):
            if isinstance(result, dict):
                result["times_s"].append(sample(fn, result["inner"]))
    for result in results:
        if isinstance(result, dict):
            result["time_s"] = statistics.median(result["times_s"])
    return results


def _prepare(fn: Callable[[], object], min_sample_s: float) -> dict:
    """Warm-up call, peak memory of one call, and the number of calls per sample."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    warmup = time.perf_counter() - start
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    inner = max(1, min(100, math.ceil(min_sample_s / max(once, 1e-6))))
    return {"times_s": [], "inner": inner, "peak_mb": peak, "warmup_s": warmup}


def sample(fn: Callable[[], object], inner: int) -> float:
    """Seconds per call over ``inner`` back-to-back calls, by CUDA events."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(inner):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3 / inner


def gpu_facts() -> dict:
    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": props.name,
        "gpu_memory_gb": round(props.total_memory / 2**30, 1),
        "multiprocessors": props.multi_processor_count,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
    }


def record(suite, rows, log, key: dict, fn: Callable[[], object]) -> None:
    record_group(suite, rows, log, [(key, fn)])


def record_group(suite, rows, log, keyed: list[tuple[dict, Callable[[], object]]]) -> None:
    """Time the calls whose rows are not in ``rows`` yet, interleaved (:func:`cuda_times`),
    and add a row each (a call that cannot run here is a row with the reason, not a crash)."""
    keyed = [(key, fn) for key, fn in keyed if not rows.find(**key)]
    results = cuda_times([fn for _, fn in keyed], suite.samples, suite.min_sample_s)
    for (key, _), result in zip(keyed, results, strict=True):
        row = dict(key)
        if isinstance(result, torch.OutOfMemoryError):
            row["skipped"] = "out of memory"
        elif isinstance(result, Exception):
            row["skipped"] = f"{type(result).__name__}: {str(result).splitlines()[0][:200]}"
        else:
            row.update(result)
        rows.add(row)
        shown = row.get("skipped") or (
            f"{row['time_s'] * 1e3:10.3f} ms  peak {row['peak_mb']:8.0f} "
            f"MiB  (warm-up {row['warmup_s']:.1f} s)"
        )
        log(
            f"{key.get('section')} {key.get('dtype')} n={key['n']:6d} "
            f"{key.get('pattern', '')} {key['who']:22s} {key['mode']:8s} {shown}"
        )


def fwd(fn):
    def call():
        with torch.no_grad():
            return fn()

    return call


def fwd_bwd(fn, inputs, grad_out):
    return lambda: torch.autograd.grad(fn(), inputs, grad_out)


def ratio(times: dict, a: str, b: str, digits: int) -> str:
    """times[a] / times[b] to ``digits`` decimals for the tables; "–" where either is missing."""
    return f"{times[a] / times[b]:.{digits}f}" if times.get(a) and times.get(b) else "–"


def table_head(title: str, columns: list[str]) -> list[str]:
    """A report section's title and the head of its Markdown table (names, then the rule)."""
    return ["", f"## {title}", "", f"| {' | '.join(columns)} |", "|" + "---|" * len(columns)]


def fresh_compiles() -> None:
    """Drop every compiled kernel (dynamo's caches and the flex engine's record of them)."""
    from ...engines.flex import forget_shapes

    torch._dynamo.reset()
    forget_shapes()


def user_block_mask(create_block_mask, mask_mod, n: int, device) -> object:
    """``create_block_mask`` compiled (``_compile``), as a user at long lengths needs it: block
    by block, without the n × n mask (128 GiB at n = 131072)."""
    return create_block_mask(mask_mod, None, None, n, n, device=device, _compile=True)


_USER_FLEX: list = []


def user_compiled_flex(flex_attention):
    """``torch.compile(flex_attention)`` once per run, as a user would hold it."""
    if not _USER_FLEX:
        _USER_FLEX.append(torch.compile(flex_attention))
    return _USER_FLEX[0]
