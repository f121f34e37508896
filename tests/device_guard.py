"""A second device simulated on the CPU: catches library paths that leave their inputs' device.

``pytest --device guard`` (tests/conftest.py) runs the device-aware test modules under
:class:`DeviceGuard`, a ``TorchFunctionMode`` that sees every torch call made from Python
(functions, methods, property reads) and keeps, per tensor, where it "lives":

* **on the device** ("cuda:0"): the tests' inputs (moved with ``.to(device)`` by the
  conftest's factory mode), results of ``.to("cuda")`` / ``.cuda()``, factory calls with a
  CUDA ``device=`` (``torch.arange``, ``zeros``, ``tensor``, …), and every output of an op with
  an input on the device (``new_*``, ``*_like`` and views included);
* **on the host**: results of factory calls without a device (or with ``device="cpu"``),
  ``.cpu()`` and ``.to("cpu")``, and outputs of ops whose tensor inputs are all on the host;
* **unknown**: tensors made outside Python-level torch calls (autograd's gradients and saved
  tensors, tensors made before the guard was entered or with torch-function modes disabled);
  they never raise and take no side. ``.grad`` is read as on its tensor's device, and an
  ``nn.Parameter`` takes the side of its data (so a model never moved to the device is on the
  host, and ``module.to("cuda")`` moves it).

Everything really runs on the CPU. What the library *sees* is a GPU: ``t.device`` is
``cuda:0`` and ``t.is_cuda`` is True for tensors on the device, so its CUDA branches run. An op
that mixes a tensor on the device with a host tensor of one or more dims raises
``RuntimeError("Expected all tensors to be on the same device … (device guard)")`` as CUDA
does (host 0-dim tensors are allowed, as CUDA's CPU scalars are; cross-device ``copy_`` too),
and so does ``.numpy()`` of a device tensor. Host→device copies (``.to``, ``.cuda``,
``copy_``, ``torch.tensor(…, device="cuda")``) are counted in :attr:`DeviceGuard.copies`.

CUDA-only APIs that the library calls are replaced while the guard is active: the CUDA RNG
state (the CPU one stands in), ``torch.Generator(device="cuda")`` (a CPU generator that
remembers its device), the memory, event and synchronisation calls of ``torch.cuda``
(no-ops and host timers), and compiled ``flex_attention`` (eager ``flex_attention``, which
checks that q, k, v and the BlockMask share a device through ``.device`` like the kernel).

What it cannot see: the kernels themselves (a Triton or CUDA kernel's behaviour, TF32, memory
and speed), device-side asserts, ops run from C++ without a Python call, and tensors made by
code that runs with torch-function modes disabled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import time
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

__all__ = ["CUDA", "DeviceGuard", "on_device"]

#: The device the guard simulates.
CUDA = torch.device("cuda", 0)
_TAG = "_device_guard_on"  # True: on the device; False: on the host; absent: unknown

#: Factories whose data comes from the host (a copy when made on the device).
_FROM_HOST = {torch.tensor, torch.as_tensor}
#: Calls that take tensors of different devices by design.
_CROSS = {torch.Tensor.copy_, torch.Tensor.__setitem__}
#: Views of their inputs, one output per input (or of the first input): each output stays
#: where its own input is, as on CUDA, where broadcasting a 0-d host tensor against a device
#: tensor gives a host view of the broadcast shape (which the next op then refuses).
_VIEWS_OF_INPUTS = {torch.broadcast_tensors, torch.Tensor.expand_as}
#: Calls that only compare metadata (``module.to`` asks this of a parameter and its copy).
_METADATA = {torch._has_compatible_shallow_copy_type}
_REAL_GENERATOR = torch.Generator


def on_device(t: torch.Tensor) -> bool | None:
    """True if the guard holds ``t`` on the device, False on the host, None if unknown."""
    tag = t.__dict__.get(_TAG)
    if tag is None and torch._C._functorch.is_batchedtensor(t):
        return on_device(torch._C._functorch.get_unwrapped(t))
    return tag


def _set(t: torch.Tensor, where: bool | None) -> torch.Tensor:
    if where is not None:
        t.__dict__[_TAG] = where
    return t


def _is_cuda(device) -> bool | None:
    """True for a CUDA device spec, False for CPU, None for anything else (or none)."""
    if device is None:
        return None
    if isinstance(device, int):
        return True
    device = torch.device(device)
    return {"cuda": True, "cpu": False}.get(device.type)


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _traced(func) -> bool:
    """A higher-order op (compiled FlexAttention's HOP): its captured buffers were traced while
    this mode let dynamo see plain calls, so their sides are not known; the Python-level
    checks before it (flex_attention's own device check) ran under the mode."""
    return isinstance(func, torch._ops.HigherOrderOperator)


def _name(func) -> str:
    owner = getattr(func, "__self__", None)
    if getattr(owner, "__name__", "") == "_VariableFunctionsClass" or owner is torch:
        return f"torch.{getattr(func, '__name__', func)}"
    if owner is not None and hasattr(owner, "__name__"):
        return f"{owner.__name__}.{getattr(func, '__name__', func)}"
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func))


class DeviceGuard(TorchFunctionMode):
    """The simulated device (see the module docstring). Use as a context manager.

    Attributes:
        copies: list of (function name, numel) for every host→device copy seen.
    """

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[str, int]] = []
        self._patches = contextlib.ExitStack()

    # ------------------------------------------------------------------ context
    def __enter__(self):
        self._patch_cuda_apis()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._patches.close()

    @contextlib.contextmanager
    def no_copies(self, what: str = "this call") -> Iterator[None]:
        """Assert that the block copies nothing from the host to the device."""
        before = len(self.copies)
        yield
        new = self.copies[before:]
        if new:
            raise AssertionError(f"{what} copied {len(new)} tensor(s) host → device: {new[:8]}")

    def _patch_cuda_apis(self) -> None:
        import sparseattn.engines.flex as flex
        import sparseattn.lab.bench.cuda_timing as bench_timing
        from sparseattn.engines import SPECS

        stack = self._patches
        cuda = torch.cuda

        def patch(obj, name, value):
            stack.callback(setattr, obj, name, inspect.getattr_static(obj, name))
            setattr(obj, name, value)

        patch(cuda, "is_available", lambda: True)
        patch(cuda, "device_count", lambda: 1)
        patch(cuda, "current_device", lambda: 0)
        patch(cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state())
        patch(cuda, "set_rng_state", lambda state, device="cuda": torch.set_rng_state(state))
        patch(cuda, "manual_seed", lambda seed: None)
        patch(cuda, "synchronize", lambda device=None: None)
        patch(cuda, "empty_cache", lambda: None)
        patch(cuda, "reset_peak_memory_stats", lambda device=None: None)
        patch(cuda, "memory_allocated", lambda device=None: 0)
        patch(cuda, "max_memory_allocated", lambda device=None: 0)
        patch(cuda, "get_device_name", lambda device=None: "device guard (CPU)")
        patch(cuda, "get_device_properties", lambda device=None: _Props())
        patch(cuda, "Event", _Event)
        patch(torch, "Generator", _generator_class())
        patch(torch, "vmap", _guarded_vmap(torch.vmap))
        patch(torch.func, "vmap", _guarded_vmap(torch.func.vmap))
        parameter = torch.nn.Parameter
        new = parameter.__new__

        def tagged_parameter(cls, data=None, requires_grad=True):
            param = new(cls, data, requires_grad)
            where = None if data is None else on_device(data)
            return _set(param, False if where is None else where)

        patch(parameter, "__new__", staticmethod(tagged_parameter))
        # compiled FlexAttention on a CPU that poses as a GPU: the eager implementation
        patch(flex, "_compiled", lambda dynamic: _eager_flex)
        patch(bench_timing, "user_compiled_flex", lambda flex_attention: _eager_flex)
        patch(
            bench_timing,
            "user_block_mask",
            lambda create, mask_mod, n, device: create(mask_mod, None, None, n, n, device=device),
        )
        # the Triton kernels would launch on the CPU memory behind the simulated GPU
        triton = SPECS["triton"]
        stack.callback(SPECS.__setitem__, "triton", triton)
        SPECS["triton"] = dataclasses.replace(
            triton, available=lambda: "no Triton kernels under the device guard"
        )

    # ------------------------------------------------------------------ the mode
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():  # dynamo traces this mode: let it see plain calls
            return func(*args, **kwargs)
        owner = getattr(func, "__self__", None)
        if owner is torch.Tensor.device:  # property read: where the library thinks t is
            return CUDA if on_device(args[0]) else func(*args, **kwargs)
        if owner is torch.Tensor.is_cuda:
            return bool(on_device(args[0]))
        if owner is torch.Tensor.data and func.__name__ == "__set__":
            func(*args, **kwargs)
            _set(args[0], on_device(args[1]))
            return None
        if owner is torch.Tensor.grad and func.__name__ == "__get__":
            grad = func(*args, **kwargs)  # made by autograd in C++: on its tensor's device
            if grad is not None and on_device(grad) is None:
                _set(grad, on_device(args[0]))
            return grad
        if func is torch.Tensor.get_device:
            return 0 if on_device(args[0]) else func(*args, **kwargs)
        if func is torch.Tensor.to:
            return self._to(args[0], args[1:], kwargs)
        if func is torch.Tensor.cuda:
            return self._move(args[0], True, "cuda")
        if func is torch.Tensor.cpu:
            return self._move(args[0], False, "cpu")
        if func is torch.Tensor.numpy and on_device(args[0]):
            raise TypeError(
                "can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy "
                "the tensor to host memory first. (device guard)"
            )
        if func is torch._C._nn._parse_to:  # Module.to's parsing of its arguments: as given
            return func(*args, **kwargs)
        target = None
        if kwargs.get("device") is not None:
            target = _is_cuda(kwargs["device"])
            if target:
                kwargs = {**kwargs, "device": "cpu"}
                self._check_generator(func, kwargs)
        inputs = _tensors((args, kwargs))
        where = [on_device(t) for t in inputs]
        if func in _VIEWS_OF_INPUTS:
            out = func(*args, **kwargs)
            outs = [out] if isinstance(out, torch.Tensor) else list(out)
            for view, w in zip(outs, where, strict=False):
                _set(view, w)
            return out
        if func in _CROSS:
            self._cross(func, args)
        elif True in where and func not in _METADATA and not _traced(func):
            for t, w in zip(inputs, where, strict=True):
                if w is False and t.dim() > 0:
                    raise RuntimeError(
                        f"Expected all tensors to be on the same device, but found at least "
                        f"two devices, cuda:0 and cpu! (device guard: {_name(func)} got a "
                        f"host tensor of shape {tuple(t.shape)})"
                    )
        out = func(*args, **kwargs)
        if target is None:
            target = True if True in where else (False if (False in where or not inputs) else None)
        if target and func in _FROM_HOST:
            data = args[0] if args else kwargs.get("data")
            if not (isinstance(data, torch.Tensor) and on_device(data)):
                self.copies.append((_name(func), out.numel()))
        if target is not None:
            seen = {id(t) for t in inputs}
            for t in _tensors(out):
                if id(t) not in seen:
                    _set(t, target)
        return out

    # ------------------------------------------------------------------ helpers
    def _cross(self, func, args) -> None:
        """copy_ and __setitem__: any devices, but a host→device transfer is a copy."""
        dst_on = on_device(args[0])
        if func is torch.Tensor.__setitem__:
            index = _tensors(args[1])
            if dst_on and any(on_device(i) is False and i.dim() > 0 for i in index):
                raise RuntimeError(
                    "Expected all tensors to be on the same device (device guard: "
                    "__setitem__ on a device tensor with a host index tensor)"
                )
            src = args[2] if isinstance(args[2], torch.Tensor) else None
        else:
            src = args[1]
        if dst_on and src is not None and not on_device(src) and src.dim() > 0:
            self.copies.append((_name(func), src.numel()))

    def _to(self, t: torch.Tensor, rest: tuple, kwargs: dict) -> torch.Tensor:
        other = next((a for a in rest if isinstance(a, torch.Tensor)), kwargs.get("other"))
        if other is not None:
            where, dtype = on_device(other), other.dtype
        else:
            parse = {k: w for k, w in kwargs.items() if k != "copy"}
            device, dtype, _, _ = torch._C._nn._parse_to(*rest[:3], **parse)
            where = _is_cuda(device)
            if device is not None and where is None:  # meta and other devices: real
                return t.to(*rest, **kwargs)
        out = t.to(dtype) if dtype is not None and dtype != t.dtype else t
        if kwargs.get("copy", False) and out is t:
            out = t.clone()
        if where is None:  # no device named: stays where it is
            return out if out is t else _set(out, on_device(t))
        return self._move(out, where, "to", fresh=out is not t)

    def _move(self, t: torch.Tensor, where: bool, name: str, fresh: bool = False):
        """``t`` on the device (``where``) or the host: ``t`` itself when it is there already
        (or ``fresh``, a new tensor made by the call), else a copy; host → device counted."""
        now = on_device(t)
        if bool(now) != where:
            if where:
                self.copies.append((f"Tensor.{name}", t.numel()))
            if not fresh:
                t = t.clone()
        return _set(t, where)

    @staticmethod
    def _check_generator(func, kwargs) -> None:
        gen = kwargs.get("generator")
        if gen is not None and getattr(gen, "_guard_device", "cpu") != "cuda":
            raise RuntimeError(
                f"Expected a 'cuda' device type for generator but found 'cpu' (device guard: "
                f"{_name(func)})"
            )


class _Props:
    name = "device guard (CPU)"
    total_memory = 1 << 30
    multi_processor_count = 1
    major, minor = 9, 0


class _Event:
    """``torch.cuda.Event`` on the host clock."""

    def __init__(self, enable_timing: bool = False, **_: object) -> None:
        self.t = 0.0

    def record(self, stream=None) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _Event) -> float:
        return (end.t - self.t) * 1e3


def _guarded_vmap(vmap):
    """``torch.vmap`` whose outputs (unwrapped in C++, unseen by the mode) are on the device
    of its inputs (``create_block_mask`` vmaps the ``mask_mod``)."""

    def guarded(func, *vmap_args, **vmap_kwargs):
        inner = vmap(func, *vmap_args, **vmap_kwargs)

        def call(*args, **kwargs):
            out = inner(*args, **kwargs)
            where = [on_device(t) for t in _tensors((args, kwargs))]
            side = True if True in where else (False if False in where else None)
            for t in _tensors(out):
                if on_device(t) is None:
                    _set(t, side)
            return out

        return call

    return guarded


def _generator_class():
    class Generator(_REAL_GENERATOR):
        """A CPU generator that remembers the device it was asked for."""

        def __new__(cls, device="cpu"):
            gen = super().__new__(cls, "cpu")
            gen._guard_device = torch.device(device).type
            return gen

    return Generator


def _eager_flex(q, k, v, score_mod=None, block_mask=None, scale=None, enable_gqa=False):
    """``flex_attention`` as the guard runs it: the kernel's device check (q, k, v and the
    BlockMask's tensors on one device, read through ``.device``), then the same softmax
    attention computed densely (the block lists and the ``mask_mod`` make the element mask;
    ``score_mod`` modifies the scores; rows without a key give zeros), differentiable on the
    CPU where FlexAttention is not."""
    import math

    from torch.nn.attention.flex_attention import create_mask

    tensors = [block_mask.kv_num_blocks, block_mask.kv_indices]
    tensors += [
        t for t in (block_mask.full_kv_num_blocks, block_mask.full_kv_indices) if t is not None
    ]
    for t in (q, k, v, *tensors):
        if t.device != q.device:
            raise ValueError(
                f"Expect q/k/v and block_mask to be on the same device but got {q.device} and "
                f"{t.device} (device guard)"
            )
    n_q, n_k = q.shape[-2], k.shape[-2]
    with torch._C.DisableTorchFunction():
        if enable_gqa and k.shape[1] != q.shape[1]:  # FlexAttention's grouped heads
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (k, v))
        bq, bk = block_mask.BLOCK_SIZE
        listed = block_mask.to_dense().bool()  # (B, H, q blocks, k blocks), full and partial
        listed = listed.repeat_interleave(bq, -2).repeat_interleave(bk, -1)[..., :n_q, :n_k]
        # the mask_mod sees q's batch item and head (size-1 block lists broadcast)
        b, h = q.shape[:2]
        mask = listed & create_mask(block_mask.mask_mod, b, h, n_q, n_k, device="cpu")
        scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
        s = (q @ k.transpose(-1, -2)).float() * scale
        if score_mod is not None:
            idx = (torch.arange(q.shape[0]).view(-1, 1, 1, 1), torch.arange(q.shape[1]))
            idx = (idx[0], idx[1].view(1, -1, 1, 1), torch.arange(n_q)[:, None], torch.arange(n_k))
            s = score_mod(s, *idx)
        p = s.masked_fill(~mask, -math.inf).softmax(-1).nan_to_num(0.0)
        out = (p.to(v.dtype) @ v).to(q.dtype)
    return _set(out, True)
