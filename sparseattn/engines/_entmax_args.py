"""A request as the Triton α-entmax kernels (:mod:`sparseattn.engines.triton_entmax`) take it:
whether they can compute it (the map's α, dropout, dtypes, shapes, the score modifier), the
library's score modifiers (``bias``, ``alibi``, ``softcap``, chains with at most one of each) as
a description, :class:`KernelMod` (docs/engines.md, "Score modifiers in the kernels"), and the
kernel arguments that depend on the call only. Plain torch: no triton needed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..graph import AttentionGraph
from ..maps import ProbabilityMap
from ..score_mods import alibi, steps

__all__ = ["KernelMod", "kernel_mod", "triton_map_reason", "triton_mod_reason"]

#: For α − 1 below this the maps compute in float64 (``maps._WIDEN_BELOW``); the kernels
#: compute in float32, so they refuse such α.
MIN_ALPHA_GAP = 1e-3
#: Largest head dim (registers of one tile).
MAX_HEAD_DIM = 256


def _alpha_of(prob_map: ProbabilityMap) -> float | str:
    """α of an entmax/sparsemax map, or why the kernels cannot compute the map."""
    if prob_map.name == "sparsemax":
        return 2.0
    if prob_map.name != "entmax":
        return f"the Triton entmax kernels compute α-entmax and sparsemax only, not {prob_map!r}"
    if prob_map.alpha is not None:
        return "the Triton entmax kernels take a fixed α, not a tensor (learnable) α"
    alpha = float(prob_map.params.get("alpha", 1.5))
    if alpha == 1.0:
        return "entmax(1) is softmax: the Triton entmax kernels need α > 1"
    if alpha - 1.0 < MIN_ALPHA_GAP:
        return f"α − 1 < {MIN_ALPHA_GAP} needs float64 thresholds; the Triton kernels use float32"
    return alpha


def triton_map_reason(prob_map: ProbabilityMap | None) -> str | None:
    """None if the kernels compute ``prob_map`` (α-entmax with a fixed α > 1, sparsemax),
    else why not (the engine table's map check)."""
    if prob_map is None:
        return "the probability map is unknown (the Triton kernels compute entmax/sparsemax)"
    alpha = _alpha_of(prob_map)
    return alpha if isinstance(alpha, str) else None


def triton_mod_reason(kinds: tuple[str, ...] | None) -> str | None:
    """None if the kernels apply a score modifier made of these elementary modifiers
    (``score_mods.steps``' kinds, in order; None: another callable), else why not (the engine
    table's modifier check)."""
    if kinds is None:
        return (
            "the Triton kernels apply the library's score modifiers only (score_mods.bias, "
            "alibi, softcap and chains of them), which they take as a description: another "
            "function cannot run inside them"
        )
    repeated = sorted({kind for kind in kinds if kinds.count(kind) > 1})
    if repeated:
        return (
            "the Triton kernels take at most one bias, one alibi and one softcap in a chain, "
            f"not {', '.join(f'{kinds.count(kind)} × {kind}' for kind in repeated)}"
        )
    return None


def _score_mod_reason(score_mod: Any, q: Tensor, k: Tensor) -> str | None:
    """Why the kernels cannot apply ``score_mod`` to scores of q and k (None if they can)."""
    found = steps(score_mod)
    why = triton_mod_reason(None if found is None else tuple(mod.kind for mod in found))
    if why is not None or found is None:
        return why
    heads = q.shape[1]
    for mod in found:
        tensor = getattr(mod, "t" if mod.kind == "bias" else "slopes", None)
        if tensor is not None and tensor.device != q.device:
            return f"score_mod {mod!r} reads a tensor on {tensor.device}, inputs on {q.device}"
        if mod.kind == "bias":
            try:
                mod.check((q.shape[0], heads, q.shape[2], k.shape[2]))
            except ValueError as err:
                return str(err)
        if mod.kind == "alibi" and tensor is not None and tensor.numel() < heads:
            return f"alibi has {tensor.numel()} slopes for {heads} query heads"
    return None


def _request_reason(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    prob_map: ProbabilityMap | None,
    dropout_p: float,
    graph: AttentionGraph | None,
    score_mod: Any,
) -> str | None:
    """Why the kernels cannot compute this request, whatever the device (None if they can):
    the map, dropout, dtypes, shapes and the score modifier."""
    wrong_map = triton_map_reason(prob_map)
    if wrong_map is not None:
        return wrong_map
    if dropout_p:
        return "the Triton entmax kernels have no attention dropout"
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"the Triton entmax kernels take float32/bfloat16/float16, not {q.dtype}"
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        return "q, k and v must share one dtype and one device"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "q, k, v must be (batch, heads, n, d)"
    if q.shape[0] != k.shape[0] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        return (
            f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit: "
            "one batch, k and v one length, q and k one head dim"
        )
    if k.shape[1] != v.shape[1] or q.shape[1] % k.shape[1]:
        return (
            f"query heads ({q.shape[1]}) must be a multiple of the key/value heads "
            f"({k.shape[1]}, {v.shape[1]})"
        )
    if max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        return f"head dims above {MAX_HEAD_DIM} are not supported"
    if graph is not None and (graph.n_q, graph.n_k) != (q.shape[2], k.shape[2]):
        return f"graph is {graph.n_q} × {graph.n_k}, inputs {q.shape[2]} × {k.shape[2]}"
    if score_mod is not None:
        wrong_mod = _score_mod_reason(score_mod, q, k)
        if wrong_mod is not None:
            return wrong_mod
    return None


@dataclass
class KernelMod:
    """A score modifier as the kernels take it (:func:`kernel_mod`).

    Attributes:
        code: the kernels' compile-time ``MOD`` (:mod:`._entmax_tiles`); 0 is no modifier.
        bias: the bias as the modifier holds it, 4-D (size-1 dims broadcast), or None.
        slopes: ALiBi's slopes m_h, one per query head at least, or None.
        cap: the softcap's c (1.0 without one).
    """

    code: int
    bias: Tensor | None = None
    slopes: Tensor | None = None
    cap: float = 1.0


def kernel_mod(score_mod: Any, heads: int, device: torch.device) -> KernelMod | str:
    """``score_mod`` as the kernels take it for ``heads`` query heads on ``device``, or why
    they cannot (:func:`triton_mod_reason`)."""
    found = steps(score_mod)
    why = triton_mod_reason(None if found is None else tuple(mod.kind for mod in found))
    if why is not None or found is None:
        return why or ""
    out = KernelMod(0)
    at = 1  # 2 once the softcap has been applied
    for mod in found:
        if mod.kind == "bias":
            out.code |= at
            out.bias = mod.t
        elif mod.kind == "alibi":
            out.code |= at << 2
            out.slopes = mod.slopes
            if out.slopes is None:
                out.slopes = _paper_slopes(mod.heads, heads, device)
        else:
            out.code |= 16
            out.cap, at = mod.cap, 2
    return out


@functools.lru_cache(maxsize=32)
def _paper_slopes(model_heads: int, heads: int, device: torch.device) -> Tensor:
    """``alibi(model_heads)``'s slopes of query heads 0 … heads − 1, on ``device`` (made once)."""
    return alibi(model_heads).computed_slopes(heads, device)


@functools.lru_cache(maxsize=8)
def _placeholder(device: torch.device) -> Tensor:
    """A float32 tensor of one element on ``device``, made once: the pointer the kernels take
    for a modifier's tensor they do not read (no allocation per call)."""
    return torch.zeros(1, dtype=torch.float32, device=device)


def _strides(t: Tensor) -> list[int]:
    """t's strides, 0 along its size-1 dims (they broadcast)."""
    return [0 if size == 1 else stride for size, stride in zip(t.shape, t.stride(), strict=True)]


def _mod_args(
    mod: KernelMod | None, q: Tensor, scale: float, alpha: float, grads: tuple = (None, None)
) -> tuple:
    """The kernels' score-modifier arguments (``MB, mb_b, mb_h, mb_i, mb_j, MSL, m_cap,
    m_scale, m_am1, MDB, MDSL``): bias and strides, slopes, cap, scale, α − 1 and the
    gradients' buffers ``grads`` (bias, slopes; None: none). Placeholders without ``mod``
    (never read or written: ``MOD`` = 0 compiles them out)."""
    dummy = _placeholder(q.device)
    if mod is None:
        return (dummy, 0, 0, 0, 0, dummy, 1.0, 1.0, 1.0, dummy, dummy)
    bias = dummy if mod.bias is None else mod.bias
    strides = [0, 0, 0, 0] if mod.bias is None else _strides(bias)
    slopes = dummy if mod.slopes is None else mod.slopes
    d_bias, d_slopes = (dummy if g is None else g for g in grads)
    return (bias, *strides, slopes, mod.cap, scale, alpha - 1.0, d_bias, d_slopes)


def _mod_grad_code(mod: KernelMod | None, sizes: tuple[int, ...], bias: bool, slopes: bool) -> int:
    """The dq kernels' ``MOD_GRAD`` for scores of ``sizes`` (B, H, n_q, n_k): bits 0-1 the
    bias's gradient (``bias``: wanted) — 1 stored, each entry one program's; 2 added
    atomically, where the bias broadcasts over batch, heads or keys; 3 summed over the tile's
    rows, then added, where it broadcasts over the queries —, bit 2 the slopes'."""
    code = 4 if slopes else 0
    if bias and mod is not None and mod.bias is not None:
        (bb, hb, nq, nk), (b, h, n_q, n_k) = mod.bias.shape, sizes
        if nq == 1 and n_q > 1:
            code |= 3
        elif (bb == 1 and b > 1) or (hb == 1 and h > 1) or (nk == 1 and n_k > 1):
            code |= 2
        else:
            code |= 1
    return code


def _mode(alpha: float) -> int:
    return 2 if alpha == 2.0 else 1 if alpha == 1.5 else 0


def _sizes(q: Tensor, k: Tensor) -> tuple[int, int, int, int]:
    """The kernels' size arguments n_q, n_k, H, HKV."""
    return q.shape[2], k.shape[2], q.shape[1], k.shape[1]


def _pow2(x: int) -> int:
    return max(16, 1 << (x - 1).bit_length())
