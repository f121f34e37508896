"""Score modifiers: a function of each scaled score and its position, applied before ρ
(docs/engines.md, "Score modifiers").

FlexAttention's convention: ``score_mod(score, b, h, q_idx, kv_idx)`` gets scaled scores
s_ij = scale · q_i·k_j and integer tensors broadcasting against them (the batch item, the
*query* head, the indices in q and in k) and returns the modified scores, element-wise:
out_i = Σ_{j ∈ A_i} ρ(score_mod(s_i·))_j · v_j, Yun et al. eq. (3) on the pattern's edges.

The models' modifiers: :func:`bias` (T5), :func:`alibi` (−m_h·|i − j|, Press et al. 2022),
:func:`softcap` (c·tanh(s / c), Gemma 2) and :func:`chain`. The engines that recompute scores
in backward return gradients to a :class:`ScoreMod`'s ``tensors``, an ``nn.Module`` modifier's
parameters and tensors in a plain function's closure (:func:`lifted_tensors`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = [
    "ScoreMod",
    "alibi",
    "alibi_slopes",
    "bias",
    "chain",
    "check_score_mod",
    "lifted_tensors",
    "softcap",
    "steps",
]


class ScoreMod:
    """A named score modifier: callable as ``(score, b, h, q_idx, kv_idx) → score``.

    ``tensors``: the tensors it reads (every engine returns their gradients); ``kind``: "bias",
    "alibi" or "softcap" for the library's elementary modifiers (:func:`steps`), else None.
    """

    tensors: tuple[Tensor, ...] = ()
    kind: str | None = None

    def __call__(self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor):
        raise NotImplementedError


class _Bias(ScoreMod):
    """s + t[b, h, i, j]; ``t`` 4-D (size-1 dims broadcast)."""

    kind = "bias"

    def __init__(self, t: Tensor) -> None:
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise TypeError(f"bias must be a floating-point tensor, got {_what(t)}")
        if not 1 <= t.dim() <= 4:
            raise ValueError(f"bias must have 1 to 4 dims (batch, heads, n_q, n_k), got {t.dim()}")
        self.t = t.reshape((1,) * (4 - t.dim()) + t.shape)
        self.tensors = (self.t,)

    def __call__(self, score, b, h, q_idx, kv_idx):
        pairs = zip((b, h, q_idx, kv_idx), self.t.shape, strict=True)
        idx = tuple(i if size > 1 else 0 for i, size in pairs)
        return score + self.t[idx].to(score.dtype)

    def check(self, shape: tuple[int, int, int, int]) -> None:
        """Raise unless the bias broadcasts to the scores' (batch, heads, n_q, n_k)."""
        if any(s not in (1, want) for s, want in zip(self.t.shape, shape, strict=True)):
            raise ValueError(
                f"bias of shape {tuple(self.t.shape)} does not broadcast to (batch, heads, "
                f"n_q, n_k) = {shape}"
            )

    def __repr__(self) -> str:
        return f"bias({tuple(self.t.shape)})"


def bias(t: Tensor) -> ScoreMod:
    """An additive bias: s_ij + t[b, h, i, j].

    ``t``: FloatTensor broadcasting to (batch, heads, n_q, n_k) (fewer dims are trailing
    ones), e.g. T5's position bias (1, heads, n_q, n_k); a learned ``t`` gets its gradient
    (zero off the pattern's edges).
    """
    return _Bias(t)


class _ALiBi(ScoreMod):
    """s − m_h·|i − j|; ``slopes`` the m_h given, or None: the paper's, computed from h
    for a model of ``heads`` heads."""

    kind = "alibi"

    def __init__(self, slopes: Tensor | None, heads: int) -> None:
        self.slopes, self.heads = slopes, heads
        self.tensors = () if slopes is None else (slopes,)

    def computed_slopes(self, heads: int, device: torch.device | str = "cpu") -> Tensor:
        """m_h for h = 0 … ``heads`` − 1, float32 (heads,), as :meth:`__call__` computes them
        without a slopes tensor (the paper's, continued past its head count)."""
        h = torch.arange(heads, device=device, dtype=torch.float64)
        low = 2 ** math.floor(math.log2(self.heads))
        exponent = torch.where(h < low, 8.0 * (h + 1.0), 4.0 * (2.0 * (h - low) + 1.0))
        return torch.exp2(-exponent / low).float()

    def __call__(self, score, b, h, q_idx, kv_idx):
        distance = (q_idx - kv_idx).abs().to(score.dtype)
        if self.slopes is not None:
            return score - self.slopes[h].to(score.dtype) * distance
        # the paper's slopes computed from h (no tensor to keep on a device):
        # 2^(−8(h+1)/L) for h < L, then 2^(−4(2(h−L)+1)/L), L the power of two <= heads
        low = 2 ** math.floor(math.log2(self.heads))
        hf = h.to(score.dtype)
        exponent = torch.where(h < low, 8.0 * (hf + 1.0), 4.0 * (2.0 * (hf - low) + 1.0))
        return score - torch.exp2(-exponent / low) * distance

    def __repr__(self) -> str:
        return f"alibi(heads={self.heads})"


def alibi_slopes(heads: int) -> Tensor:
    """ALiBi's head slopes m_h (Press et al., 2022, §3): the geometric sequence 2^(−8h/H),
    h = 1…H, for H a power of two; otherwise those of the next lower power of two followed by
    every other slope of the next higher one. (H,) float32."""
    if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
        raise ValueError(f"heads must be a positive int, got {heads!r}")

    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    low = 2 ** math.floor(math.log2(heads))
    slopes = geometric(low) + geometric(2 * low)[0::2][: heads - low]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi(slopes: Tensor | int) -> ScoreMod:
    """ALiBi: s_ij − m_h·|i − j| (causal patterns: the paper's −m_h·(i − j)). ``slopes``:
    (heads,) per-head slopes m_h on the inputs' device, or the number of heads (the paper's
    slopes, :func:`alibi_slopes`, computed from h). i, j index q and k: for queries at an
    offset (a KV cache), pass a bias."""
    if isinstance(slopes, int) and not isinstance(slopes, bool):
        alibi_slopes(slopes)  # checks the count
        return _ALiBi(None, slopes)
    if not isinstance(slopes, Tensor) or slopes.dim() != 1 or not slopes.is_floating_point():
        raise TypeError(f"slopes must be a 1-D float tensor or a head count, got {_what(slopes)}")
    return _ALiBi(slopes, slopes.numel())


class _SoftCap(ScoreMod):
    """cap·tanh(s / cap)."""

    kind = "softcap"

    def __init__(self, cap: float) -> None:
        self.cap = cap

    def __call__(self, score, b, h, q_idx, kv_idx):
        return torch.tanh(score / self.cap) * self.cap

    def __repr__(self) -> str:
        return f"softcap({self.cap})"


def softcap(cap: float) -> ScoreMod:
    """Logit soft-capping: c·tanh(s_ij / c), as Gemma 2's ``attn_logit_softcapping``."""
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < math.inf:
        raise ValueError(f"cap must be a positive finite number, got {cap!r}")
    return _SoftCap(float(cap))


class _Chain(ScoreMod):
    def __init__(self, mods: tuple[Callable, ...]) -> None:
        self.mods = mods
        self.tensors = tuple(t for mod in mods for t in lifted_tensors(mod, all_=True))

    def __call__(self, score, b, h, q_idx, kv_idx):
        for mod in self.mods:
            score = mod(score, b, h, q_idx, kv_idx)
        return score

    def __repr__(self) -> str:
        return f"chain({', '.join(map(repr, self.mods))})"


def chain(*mods: Callable) -> ScoreMod:
    """The modifiers applied in order: chain(f, g)(s) = g(f(s)) at every entry."""
    if not mods:
        raise ValueError("chain needs at least one score modifier")
    for mod in mods:
        check_score_mod(mod)
    return _Chain(mods)


#: The library's elementary modifiers, by exact type (a subclass may compute anything).
_ELEMENTARY = (_Bias, _ALiBi, _SoftCap)


def steps(score_mod: Callable) -> tuple[ScoreMod, ...] | None:
    """The library's elementary modifiers that ``score_mod`` applies, in order — :func:`bias`,
    :func:`alibi` and :func:`softcap` (``kind`` "bias", "alibi", "softcap"), chains flattened —
    or None when any part of it is another callable: what a kernel that cannot call Python
    takes instead."""
    if type(score_mod) in _ELEMENTARY:
        return (score_mod,)
    if type(score_mod) is _Chain:
        found: list[ScoreMod] = []
        for mod in score_mod.mods:
            inner = steps(mod)
            if inner is None:
                return None
            found.extend(inner)
        return tuple(found)
    return None


def lifted_tensors(score_mod: Callable, all_: bool = False) -> tuple[Tensor, ...]:
    """The tensors ``score_mod`` reads that need a gradient (``all_``: every one): a
    :class:`ScoreMod`'s ``tensors``, or the tensors in a plain function's closure cells."""
    if isinstance(score_mod, ScoreMod):
        found = score_mod.tensors
    elif isinstance(score_mod, torch.nn.Module):
        found = tuple(score_mod.parameters()) + tuple(score_mod.buffers())
    else:
        cells = getattr(score_mod, "__closure__", None) or ()
        found = tuple(c.cell_contents for c in cells if isinstance(_content(c), Tensor))
    return tuple(t for t in found if all_ or t.requires_grad)


def _content(cell) -> object:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def check_score_mod(score_mod: object) -> None:
    """Raise TypeError unless ``score_mod`` is callable with FlexAttention's five arguments."""
    if not callable(score_mod):
        raise TypeError(
            "score_mod must be callable as score_mod(score, b, h, q_idx, kv_idx), got "
            f"{_what(score_mod)}"
        )


def _what(x: object) -> str:
    if isinstance(x, Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__
