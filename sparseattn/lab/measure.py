"""Measuring a call: median time, peak heap memory, and the machine's dense matmul rate.

Shared by ``sparseattn bench`` (sparseattn/lab/bench/) and ``sparseattn tour``. Peak memory is the
largest increase of the C heap in use (glibc ``mallinfo2``, resident set size elsewhere),
sampled every 0.5 ms by a thread while the call runs, the call's output included; a kernel that
holds the GIL is seen only before and after it runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import statistics
import threading
import time
from collections.abc import Callable

import torch

__all__ = ["HEAP", "matmul_gflops", "measure", "peak_memory"]


class _Heap:
    """Bytes of C heap in use (glibc mallinfo2), or resident set size where unavailable."""

    def __init__(self) -> None:
        self._mallinfo = None
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL("libc.so.6")

            class MallInfo2(ctypes.Structure):
                _fields_ = [
                    (f, ctypes.c_size_t)
                    for f in (
                        "arena",
                        "ordblks",
                        "smblks",
                        "hblks",
                        "hblkhd",
                        "usmblks",
                        "fsmblks",
                        "uordblks",
                        "fordblks",
                        "keepcost",
                    )
                ]

            libc.mallinfo2.restype = MallInfo2
            libc.mallinfo2()
            self._mallinfo = libc.mallinfo2
        self.kind = "heap in use (mallinfo2)" if self._mallinfo else "resident set size"

    def __call__(self) -> int:
        if self._mallinfo is not None:
            info = self._mallinfo()
            return info.uordblks + info.hblkhd
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


HEAP = _Heap()


@contextlib.contextmanager
def peak_memory():
    """Yields a dict whose ``"mb"`` is, on exit, the peak heap increase in MiB."""
    result = {"mb": 0.0}
    base = HEAP()
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], HEAP())
            time.sleep(0.0005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield result
    finally:
        stop.set()
        thread.join()
        peak[0] = max(peak[0], HEAP())
        result["mb"] = (peak[0] - base) / 2**20


def measure(fn: Callable[[], object], repeats: int, time_cap: float) -> dict:
    """Warm-up call, one call under the memory sampler, then ``repeats`` timed calls (fewer
    when a call is slow). Returns time (median, s), all times, peak MiB and warm-up seconds."""
    start = time.perf_counter()
    fn()
    warm = time.perf_counter() - start
    with peak_memory() as mem:
        start = time.perf_counter()
        result = fn()  # kept alive until the sampler stops: the output is part of the peak
        first = time.perf_counter() - start
    del result
    times = [first]
    if first * repeats < time_cap:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return {
        "time_s": statistics.median(times),
        "times_s": times,
        "peak_mb": mem["mb"],
        "warmup_s": warm,
    }


def matmul_gflops(size: int = 2048, repeats: int = 5) -> float:
    """Dense fp32 matmul rate of this machine (median of ``repeats``), GFLOP/s."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times) / 1e9
