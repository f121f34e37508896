"""What each engine can compute, declared in one place.

Each engine states the devices, dtypes, probability maps, training (backward), dropout,
per-row α and grouped-query attention it supports, as an :class:`EngineSpec`;
:meth:`EngineSpec.not_supported_reasons` names, one sentence each, why it cannot run a
:class:`Request`. ``sparse_attention(engine=...)`` refuses an engine with reasons (and says
them); ``engine="auto"`` (``choose_engine``) only considers the engines without reasons, then
picks among them by the cost measurements of the input's device.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..maps import ProbabilityMap
from .block import block_attention
from .dense import dense_attention
from .flex import flex_attention_engine, flex_available, flex_refuses
from .gather import gather_attention
from .rows import rows_attention
from .triton_entmax import triton_entmax_attention, triton_entmax_unsupported, triton_map_reason

__all__ = ["ENGINES", "EngineSpec", "Request", "SPECS", "reasons", "unsupported"]

_FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_HALF_AND_FLOAT = frozenset({torch.float16, torch.bfloat16, torch.float32})
_ANY = frozenset({"cpu", "cuda"})


def _any_map(prob_map: ProbabilityMap | None) -> str | None:
    return None


def _softmax_only(prob_map: ProbabilityMap | None) -> str | None:
    if prob_map is not None and prob_map.is_softmax:
        return None
    what = "an unknown map" if prob_map is None else repr(prob_map)
    return f"it computes softmax only, not {what}"


def _triton_available() -> str | None:
    return None if importlib.util.find_spec("triton") else "triton is not installed"


@dataclasses.dataclass(frozen=True)
class Request:
    """What one call asks of an engine.

    Attributes:
        device: the inputs' device type ("cpu", "cuda", ...).
        dtype: the inputs' dtype.
        prob_map: ρ, or None when not known (then only engines that take any map qualify).
        train: autograd will ask for a backward (grad enabled and an input requires grad).
        dropout: dropout on the attention weights (p > 0).
        row_alpha: ρ is α-entmax with a tensor α (one per head or row).
        gqa: k and v have fewer heads than q (grouped-query attention).
        score_mod: a score modifier (``sparseattn.score_mods``) applies to the scores.
    """

    device: str
    dtype: torch.dtype
    prob_map: ProbabilityMap | None
    train: bool = False
    dropout: bool = False
    row_alpha: bool = False
    gqa: bool = False
    score_mod: bool = False

    @classmethod
    def of(
        cls,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        prob_map: ProbabilityMap | None,
        dropout_p: float = 0.0,
        score_mod: bool = False,
    ) -> Request:
        """The request of a call with q (B, H, n_q, d), k (B, H_kv, n_k, d), v like k."""
        return cls(
            device=q.device.type,
            dtype=q.dtype,
            prob_map=prob_map,
            train=torch.is_grad_enabled()
            and (q.requires_grad or k.requires_grad or v.requires_grad),
            dropout=dropout_p > 0,
            row_alpha=prob_map is not None and prob_map.alpha is not None,
            gqa=k.shape[1] != q.shape[1],
            score_mod=score_mod,
        )


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """One engine and what it supports (the model: xformers' fmha operators).

    Attributes:
        name: the ``engine=`` name.
        run: the engine, ``run(q, k, v, graph, prob_map, scale, key_valid, dropout_p)``,
            called on requests this spec accepts (it need not check them again).
        why: one sentence on what the engine is for.
        devices: device types it runs on.
        dtypes: input dtypes it takes.
        maps: why it cannot compute a map (None when it can; the map may be None: unknown).
        backward_devices: device types on which it has a backward.
        dropout: it applies dropout to the attention weights.
        row_alpha: it takes α-entmax with a tensor α.
        gqa: it takes k, v with fewer heads than q itself (else they are repeated first).
        score_mod: it applies a score modifier (keyword ``score_mod`` of ``run``).
        available: None when what it needs is here (a compiler, a package), else why not.
        refuses: a finer check on the tensors themselves (head dims, shapes), consulted once
            the declared capabilities allow the call: None, or why not.
    """

    name: str
    run: Callable[..., Tensor]
    why: str
    devices: frozenset[str] = _ANY
    dtypes: frozenset[torch.dtype] = _FLOATS
    maps: Callable[[ProbabilityMap | None], str | None] = _any_map
    backward_devices: frozenset[str] = _ANY
    dropout: bool = True
    row_alpha: bool = False
    gqa: bool = False
    score_mod: bool = True
    available: Callable[[], str | None] = lambda: None
    refuses: Callable[..., str | None] | None = None

    def not_supported_reasons(self, req: Request) -> list[str]:
        """Why this engine cannot compute ``req``, one sentence each; empty if it can."""
        reasons = []
        if req.device not in self.devices:
            reasons.append(f"it runs on {sorted(self.devices)}, not on {req.device}")
        if req.dtype not in self.dtypes:
            reasons.append(f"it takes {sorted(str(d) for d in self.dtypes)}, not {req.dtype}")
        wrong_map = self.maps(req.prob_map)
        if wrong_map is not None:
            reasons.append(wrong_map)
        if req.train and req.device not in self.backward_devices:
            reasons.append(f"it has no backward on {req.device} (inputs require grad)")
        if req.dropout and not self.dropout:
            reasons.append("it has no attention dropout")
        if req.row_alpha and not self.row_alpha:
            reasons.append("it does not take a tensor α (alpha: one per head or row)")
        if req.score_mod and not self.score_mod:
            reasons.append("it does not apply score modifiers (score_mod)")
        missing = self.available()
        if missing is not None:
            reasons.append(missing)
        return reasons


SPECS: dict[str, EngineSpec] = {
    spec.name: spec
    for spec in (
        EngineSpec(
            "dense",
            dense_attention,
            "the masked n_q × n_k reference: O(n²) memory, fastest for small score matrices",
            row_alpha=True,
        ),
        EngineSpec(
            "rows",
            rows_attention,
            "full (or wide) rows a chunk of queries at a time: sparse maps on the dense pattern",
            row_alpha=True,
        ),
        EngineSpec(
            "block",
            block_attention,
            "block-sparse matrix products over the graph's non-empty blocks: any map",
            row_alpha=True,
        ),
        EngineSpec(
            "gather",
            gather_attention,
            "neighbour lists chunked by degree: graphs too scattered for blocks",
        ),
        EngineSpec(
            "flex",
            functools.partial(flex_attention_engine, check=False),
            "torch's compiled FlexAttention on the graph's BlockMask: softmax",
            dtypes=_HALF_AND_FLOAT,
            maps=_softmax_only,
            backward_devices=frozenset({"cuda"}),
            dropout=False,
            gqa=True,
            available=flex_available,
            refuses=flex_refuses,
        ),
        EngineSpec(
            "triton",
            functools.partial(triton_entmax_attention, check=False),
            "fused Triton kernels for α-entmax and sparsemax on the graph's block layout",
            devices=frozenset({"cuda"}),
            dtypes=_HALF_AND_FLOAT,
            maps=triton_map_reason,
            dropout=False,
            gqa=True,
            score_mod=False,
            available=_triton_available,
            refuses=triton_entmax_unsupported,
        ),
    )
}

#: The engines by name, as callables (what ``sparse_attention`` runs).
ENGINES: dict[str, Callable[..., Tensor]] = {name: spec.run for name, spec in SPECS.items()}


def reasons(engine: str, *call: Any) -> list[str]:
    """Why ``engine`` cannot compute this call — (q, k, v, prob_map[, dropout_p[, score_mod]]),
    as :meth:`Request.of` takes them —: its declared reasons, then (if none) its finer check on
    the tensors; empty when it can."""
    spec = SPECS[engine]
    found = spec.not_supported_reasons(Request.of(*call))
    if not found and spec.refuses is not None:
        finer = spec.refuses(*call[:5])
        found = [] if finer is None else [finer]
    return found


def unsupported(engine: str, *call: Any) -> str | None:
    """None if ``engine`` can compute this call (as :func:`reasons` takes it), else why not
    (its reasons, joined)."""
    return "; ".join(reasons(engine, *call)) or None
