"""Writing experiment results: atomic files, JSON, figures, machine facts.

Every experiment writes ``results/<experiment>/<run>/`` through these helpers, so a crash or an
interrupt never leaves a half-written file (temp file in the same folder + ``os.replace``).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from .._extras import require

__all__ = [
    "atomic_write",
    "write_json",
    "write_text",
    "read_json",
    "save_figure",
    "machine_facts",
    "timing_record",
    "cpu_name",
    "timing_facts",
    "run_folder",
    "torch_threads",
    "StepClock",
    "interleaved",
    "interleaved_medians",
]


def atomic_write(path: str | Path, write: Callable[[str], None]) -> None:
    """Create ``path`` atomically: ``write(tmp_name)`` fills a temp file that then replaces it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600 files; results are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: str | Path, obj: object) -> None:
    """Atomically write ``obj`` as indented JSON."""

    def dump(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=False, default=str)
            f.write("\n")

    atomic_write(path, dump)


def write_text(path: str | Path, text: str) -> None:
    """Atomically write ``text`` (a table, a report) to ``path``."""
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def read_json(path: str | Path) -> object | None:
    """The JSON at ``path``, or None when it does not exist."""
    path = Path(path)
    return json.loads(path.read_text()) if path.exists() else None


def run_folder(folder: str | Path, identity: dict, subfolders: tuple[str, ...] = ()) -> Path:
    """Create ``folder`` (and its ``subfolders``) and pin it to ``identity``: the first run writes
    ``config.json``; a later run with the same identity resumes there, another one is refused."""
    folder = Path(folder)
    for sub in ("", *subfolders):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    identity = json.loads(json.dumps(identity, default=str))  # as it reads back from the file
    saved = read_json(path)
    if saved is None:
        write_json(path, identity)
    elif saved != identity:
        raise ValueError(f"run folder {folder} holds a different config; choose another run name")
    return folder


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(threads)``; the old count is restored after."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(old)


class StepClock:
    """Wall-clock and CPU seconds (all threads of this process) of a run's named steps, kept in
    ``path`` as JSON and rewritten after each step; a resumed run keeps the earlier steps."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.steps: dict = read_json(self.path) or {}

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        wall, cpu = time.perf_counter(), time.process_time()
        yield
        self.steps[name] = {
            "wall_seconds": time.perf_counter() - wall,
            "cpu_seconds": time.process_time() - cpu,
        }
        write_json(self.path, self.steps)

    def total(self, skip: tuple[str, ...] = ()) -> dict:
        """Summed wall and CPU seconds over the steps not in ``skip``."""
        return {
            key: sum(v[key] for name, v in self.steps.items() if name not in skip)
            for key in ("wall_seconds", "cpu_seconds")
        }


def save_figure(fig, path: str | Path, dpi: int = 110) -> None:
    """Atomically save a matplotlib figure (format from the suffix) and close it."""
    plt = require("matplotlib.pyplot", "experiments", "saving a figure")

    suffix = Path(path).suffix.lstrip(".") or "png"
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=dpi, bbox_inches="tight", format=suffix))
    plt.close(fig)


#: CPU flags that decide which kernels torch runs (vector width, bf16/int8 dot products, AMX).
_VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "amx_tile")


def _cpuinfo() -> tuple[str, list[str]]:
    """The CPU model (/proc/cpuinfo's, else what :mod:`platform` says) and which of
    :data:`_VECTOR_FLAGS` it has."""
    cpu, flags = platform.processor() or platform.machine(), []
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:  # the first processor's block: its model name, then its flags
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            cpu = value.strip()
        elif key.strip() == "flags":
            flags = [f for f in _VECTOR_FLAGS if f in value.split()]
            break
    return cpu, flags


def cpu_name() -> str:
    """The CPU model, e.g. ``AMD EPYC 7B13`` (/proc/cpuinfo's "model name", else what
    :mod:`platform` says)."""
    return _cpuinfo()[0]


def interleaved(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each of ``repeats`` calls per entry of ``calls``, after one warm-up call
    each, the calls interleaved (a drift of the machine's speed reaches all of them alike)."""
    for call in calls.values():
        call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return times


def interleaved_medians(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """The median of :func:`interleaved`'s seconds per entry."""
    times = interleaved(calls, repeats)
    return {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}


def timing_facts(threads: int) -> dict:
    """What a timing script records before its first measurement: the CPU model, its torch
    threads, the torch version and the 1-minute load average (``load before``; the script adds
    ``load after``)."""
    return {
        "cpu": cpu_name(),
        "threads": threads,
        "torch": torch.__version__,
        "load before": os.getloadavg()[0],
    }


def timing_record(script: str, load_before: float, **fields) -> dict:
    """What a timing script writes when its runs are done: its name, :func:`machine_facts`, the
    1-minute load average before its runs and now, then ``fields`` (its settings and rows)."""
    return {
        "script": script,
        **machine_facts(),
        "load before": load_before,
        "load after": os.getloadavg()[0],
        **fields,
    }


def machine_facts() -> dict:
    """CPU model and vector extensions, threads and versions, recorded next to every number
    (the same kernel ran 2.5x slower on an AVX2 machine than on an AVX-512 one)."""
    cpu, flags = _cpuinfo()
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: None)()
    return {
        "cpu": cpu,
        "vector_extensions": flags,
        "torch_cpu_capability": capability,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


class ResumableRows:
    """A run's result rows, rewritten to ``path`` as JSON after each one; a re-run with the same
    ``header["suite"]`` starts from the rows already there (the benchmark suites resume)."""

    def __init__(self, path: Path, header: dict) -> None:
        self.path, self.data = path, {**header, "rows": []}
        if path.exists():
            old = json.loads(path.read_text())
            if old.get("suite") == json.loads(json.dumps(header["suite"], default=str)):
                self.data["rows"] = old.get("rows", [])

    def find(self, **key) -> dict | None:
        """The first row holding every ``key`` item, or None."""
        return next(
            (r for r in self.data["rows"] if all(r.get(k) == v for k, v in key.items())), None
        )

    def add(self, row: dict) -> None:
        self.data["rows"].append(row)
        write_json(self.path, self.data)
