"""The ``SparseAttention`` layer: multi-head sparse self-attention over (batch, n, embed_dim),
a drop-in for ``nn.MultiheadAttention``, computed by :func:`sparseattn.attention.sparse_attention`.

A pattern learned from data keeps its tensors as buffers, so the state dict carries them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from .attention import _OPAQUE, _autocasting, sparse_attention
from .engines import ENGINES
from .graph import AttentionGraph
from .maps import ProbabilityMap, entmax, resolve_prob_map
from .patterns import HeadSplit, Pattern, PatternCycle, as_cycle, dense
from .score_mods import check_score_mod
from .validate import check_bool, check_choice, check_int, check_positive, check_probability

__all__ = ["SparseAttention"]


class SparseAttention(nn.Module):
    """Multi-head sparse self-attention (Yun eq. 3), a drop-in layer for (batch, n, embed_dim).

    Head configurations (Yun §5.1): a pattern or ``union(...)`` (UNION), ``split_heads(A1, A2)``
    (MULTIHEAD), ``cycle(A1, A2)``: layer ``layer_index`` uses pattern ``layer_index mod p``.

    Args:
        embed_dim, num_heads: model width E and H (dividing E).
        pattern: Pattern, HeadSplit, PatternCycle or AttentionGraph.
        prob_map, engine: ρ and the engine (see ``sparse_attention``).
        dropout, bias: dropout on attention weights in training; biases in the projections.
        layer_index: this layer's place in a stack (used by a cycle).
        learn_alpha: learn one α per head (Correia et al. 2019) from ``prob_map``'s α > 1:
            α_h = 1 + softplus(θ_h) with θ the parameter ``alpha_logit`` (H,) (:attr:`alpha`).
        score_mod: a score modifier applied in every call, e.g. ``score_mods.alibi(H)``; an
            ``nn.Module`` modifier becomes a submodule (its parameters train with the layer).
        group, boundaries: context parallelism (``sparse_attention(group=)``): x is this
            rank's part of the sequence; not with dropout, score_mod or ``learn_alpha``.

    Dtypes: x must have the layer's dtype, except under ``torch.autocast``, where the
    projections and the attention run in the autocast dtype, as in ``nn.MultiheadAttention``.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        pattern: Pattern | PatternCycle | AttentionGraph | None = None,
        prob_map: str | ProbabilityMap = "softmax",
        engine: str = "auto",
        dropout: float = 0.0,
        bias: bool = True,
        layer_index: int = 0,
        learn_alpha: bool = False,
        score_mod: Callable | None = None,
        group: object = None,
        boundaries: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        if group is not None and (dropout or score_mod is not None or learn_alpha):
            raise ValueError(
                "group= (context parallelism) does not take dropout, score_mod or learn_alpha"
            )
        check_positive("embed_dim", embed_dim)
        check_positive("num_heads", num_heads)
        check_choice("engine", engine, ["auto", *ENGINES])
        check_probability("dropout", dropout, allow_one=False)
        check_bool("bias", bias)
        check_int("layer_index", layer_index, 0)
        if score_mod is not None:
            check_score_mod(score_mod)
        if embed_dim % num_heads:
            raise ValueError(
                f"embed_dim ({embed_dim}) must be a positive multiple of num_heads ({num_heads})"
            )
        pattern = dense() if pattern is None else pattern
        if not isinstance(pattern, (Pattern, PatternCycle, AttentionGraph, list, tuple)):
            raise TypeError(
                "pattern must be a Pattern (e.g. sparseattn.window(16)), a cycle or sequence "
                f"of patterns, an AttentionGraph or None, got {type(pattern).__name__} "
                f"{pattern!r}"
            )
        if not isinstance(pattern, AttentionGraph):
            pattern = as_cycle(pattern)[layer_index]
        if isinstance(pattern, HeadSplit):
            pattern.head_sizes(num_heads)  # validate now, not at the first forward
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.pattern = pattern
        # a pattern learned from data (SparseBERT's mask logits, ...) is state: its tensors are
        # buffers, so the state dict carries them and loading one rebuilds the pattern
        self._pattern_tensors = _tensor_fields(pattern)
        for name in self._pattern_tensors:
            self.register_buffer(f"pattern_{name}", getattr(pattern, name))
        if self._pattern_tensors:
            self.register_load_state_dict_post_hook(_rebuild_pattern)
        self.prob_map = resolve_prob_map(prob_map)
        self.engine = engine
        self.dropout = dropout
        self.score_mod = score_mod
        self.group, self.boundaries = group, boundaries
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim, bias=bias)
        self.out = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.alpha_logit = None
        if check_bool("learn_alpha", learn_alpha):
            is_sparsemax = self.prob_map.name == "sparsemax"
            alpha = 2.0 if is_sparsemax else self.prob_map.params.get("alpha", 0.0)
            if not (is_sparsemax or self.prob_map.name == "entmax") or not alpha > 1.0:
                raise ValueError(
                    f"learn_alpha needs prob_map α-entmax with α > 1, got {self.prob_map!r}"
                )
            theta = math.log(math.expm1(alpha - 1.0))  # softplus⁻¹(α − 1)
            self.alpha_logit = nn.Parameter(torch.full((num_heads,), theta))

    @property
    def alpha(self) -> Tensor | None:
        """The heads' α (H,) = 1 + softplus(alpha_logit) with ``learn_alpha``, else None."""
        if self.alpha_logit is None:
            return None
        return 1.0 + nn.functional.softplus(self.alpha_logit)

    @torch.compiler.disable(reason=_OPAQUE)
    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        """x: (batch, n, embed_dim) → (batch, n, embed_dim).

        ``key_padding_mask``: optional bool (batch, n), True for tokens to ignore as keys, as in
        ``nn.MultiheadAttention`` (padding queries still get an output). Under
        ``torch.compile`` the whole layer runs eagerly (one graph break).
        """
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.device.type == "meta":
            raise ValueError("x is on the meta device; attention needs tensors with data")
        if x.device != self.qkv.weight.device:
            raise ValueError(
                f"x is on {x.device} but the layer's parameters are on "
                f"{self.qkv.weight.device}; move one of them (layer.to(device) or x.to(...))"
            )
        if x.dtype != self.qkv.weight.dtype and not _autocasting(x):
            raise TypeError(f"x must have the layer's dtype {self.qkv.weight.dtype}, got {x.dtype}")
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(
                f"x must have shape (batch, n, {self.embed_dim}), got {tuple(x.shape)}"
            )
        bsz, n, _ = x.shape
        head_dim = self.embed_dim // self.num_heads
        q, k, v = self.qkv(x).view(bsz, n, 3, self.num_heads, head_dim).permute(2, 0, 3, 1, 4)
        out = sparse_attention(
            q,
            k,
            v,
            self.pattern,
            prob_map=self.prob_map
            if self.alpha_logit is None
            else entmax(self.alpha.view(-1, 1, 1)),
            engine=self.engine,
            key_padding_mask=key_padding_mask,
            dropout_p=self.dropout if self.training else 0.0,
            score_mod=self.score_mod,
            group=self.group,
            boundaries=self.boundaries,
        )
        return self.out(out.transpose(1, 2).reshape(bsz, n, self.embed_dim))

    def extra_repr(self) -> str:
        mod = "" if self.score_mod is None else f", score_mod={self.score_mod!r}"
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, pattern={self.pattern!r}, "
            f"prob_map={self.prob_map!r}, engine={self.engine!r}{mod}"
        )


def _tensor_fields(pattern: object) -> list[str]:
    """The fields of a dataclass pattern that hold tensors (a learned mask's logits)."""
    if not dataclasses.is_dataclass(pattern):
        return []
    return [
        f.name for f in dataclasses.fields(pattern) if isinstance(getattr(pattern, f.name), Tensor)
    ]


def _rebuild_pattern(module: SparseAttention, _incompatible) -> None:
    """After ``load_state_dict``: the pattern made again from the loaded buffers (on the host,
    where patterns build their graphs)."""
    tensors = {
        name: getattr(module, f"pattern_{name}").detach().cpu() for name in module._pattern_tensors
    }
    module.pattern = dataclasses.replace(module.pattern, **tensors)
