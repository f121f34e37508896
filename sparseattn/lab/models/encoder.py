"""A small pre-LN Transformer encoder with a masked-language-model head, for experiments.

Attention in every block is either

* ``sparse_attention(q, k, v, pattern, ρ)`` for a Pattern / cycle of patterns / AttentionGraph
  (the library's data path; ``pattern=None`` is dense), or
* ρ(QKᵀ/√d + bias) · V on dense scores with an additive bias (H, n, n) per layer — the path a
  learned mask (SparseBERT's DAM) takes while it is being trained.

Block l (pre-LN, Xiong et al. 2020): x ← x + Drop(Attn(LN(x))), x ← x + Drop(FFN(LN(x))), with
FFN = Linear → GELU → Linear. The MLM head is LN → Linear → GELU → LN → (tied embedding)ᵀ + b.

Context parallelism (docs/parallel.md): ``forward(ids, pattern, start=s, group=g)`` takes this
rank's contiguous part of the sequence, positions s … s + n_r − 1; the position embeddings are
those of the global positions and every block's attention runs with ``group=g`` (each rank
receives the keys its queries read). Everything else in a block acts per position, so the
hidden states are this rank's rows of the single-process ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...attention import sparse_attention
from ...graph import AttentionGraph
from ...maps import resolve_prob_map
from ...patterns import Pattern, PatternCycle, as_cycle, dense

__all__ = ["Encoder", "EncoderConfig"]


@dataclass(frozen=True)
class EncoderConfig:
    """Sizes of the encoder. ``prob_map`` is ρ, any name ``resolve_prob_map`` accepts."""

    vocab_size: int
    max_len: int = 128
    dim: int = 128
    heads: int = 4
    layers: int = 2
    ffn_mult: int = 4
    dropout: float = 0.1
    prob_map: str = "softmax"
    engine: str = "auto"
    positions: str = "learned"  # or "sinusoidal"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_len", "dim", "heads", "layers", "ffn_mult"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.dim % self.heads:
            raise ValueError(f"dim ({self.dim}) must be a multiple of heads ({self.heads})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must lie in [0, 1), got {self.dropout}")
        resolve_prob_map(self.prob_map)
        if self.positions not in ("sinusoidal", "learned"):
            raise ValueError(f"positions must be 'sinusoidal' or 'learned', got {self.positions!r}")


def _sinusoids(n: int, dim: int) -> Tensor:
    """Vaswani et al. (2017) §3.5: PE(p, 2i) = sin(p / 10000^(2i/d)), PE(p, 2i+1) = cos(…)."""
    pos = torch.arange(n, dtype=torch.float32)[:, None]
    freq = torch.exp(-math.log(10000.0) * torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    out = torch.zeros(n, dim)
    out[:, 0::2] = torch.sin(pos * freq)
    out[:, 1::2] = torch.cos(pos * freq)[:, : dim // 2]
    return out


class _Block(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1, self.ln2 = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ffn = nn.Sequential(
            nn.Linear(cfg.dim, cfg.ffn_mult * cfg.dim),
            nn.GELU(),
            nn.Linear(cfg.ffn_mult * cfg.dim, cfg.dim),
        )
        self.drop = nn.Dropout(cfg.dropout)
        self.rho = resolve_prob_map(cfg.prob_map)
        self.engine = cfg.engine

    def attend(
        self,
        x: Tensor,
        pattern: Pattern | AttentionGraph | None,
        bias: Tensor | None,
        key_padding_mask: Tensor | None,
        group: object = None,
    ) -> Tensor:
        bsz, n, dim = x.shape
        q, k, v = self.qkv(x).view(bsz, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if bias is not None:  # dense scores + additive bias (H, n, n), then ρ
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1]) + bias
            valid = None if key_padding_mask is None else ~key_padding_mask[:, None, None, :]
            out = self.rho(scores, valid) @ v
        else:
            out = sparse_attention(
                q,
                k,
                v,
                pattern,
                prob_map=self.rho,
                engine=self.engine,
                key_padding_mask=key_padding_mask,
                group=group,
            )
        return self.proj(out.transpose(1, 2).reshape(bsz, n, dim))

    def forward(self, x, pattern, bias, key_padding_mask, group=None):
        x = x + self.drop(self.attend(self.ln1(x), pattern, bias, key_padding_mask, group))
        return x + self.drop(self.ffn(self.ln2(x)))


class Encoder(nn.Module):
    """Token + learned position embeddings, ``layers`` pre-LN blocks, final LN, MLM head.

    ``forward(ids)`` gives hidden states (B, n, dim); ``mlm_logits(hidden)`` the vocabulary
    scores (..., vocab_size).
    """

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim)
        if cfg.positions == "learned":
            self.pos = nn.Parameter(torch.randn(cfg.max_len, cfg.dim) * 0.02)
        else:
            self.register_buffer("pos", _sinusoids(cfg.max_len, cfg.dim), persistent=False)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.dim)
        self.head = nn.Sequential(nn.Linear(cfg.dim, cfg.dim), nn.GELU(), nn.LayerNorm(cfg.dim))
        self.head_bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        self.apply(self._init)
        # sinusoids have amplitude 1; scale the tokens (std 0.02 for the tied head) to match
        self.emb_scale = 1.0 if cfg.positions == "learned" else math.sqrt(cfg.dim) * 0.5

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(
        self,
        ids: Tensor,
        pattern: Pattern | PatternCycle | AttentionGraph | None = None,
        attn_bias: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        *,
        start: int = 0,
        group: object = None,
    ) -> Tensor:
        """Hidden states (B, n, dim) for token ids (B, n).

        Args:
            pattern: the attention pattern of every block (a cycle: block l uses pattern
                l mod p); None = dense. Ignored where ``attn_bias`` is given.
            attn_bias: FloatTensor (L, H, n, n); block l adds ``attn_bias[l mod L]`` to its
                scores and applies ρ on dense scores (the DAM training path).
            key_padding_mask: BoolTensor (B, n), True for padding tokens (ignored as keys),
                as in ``nn.MultiheadAttention`` (with ``group``: this rank's part).
            start: the global position of ``ids[:, 0]`` (its position embedding is
                ``pos[start]``); with ``group``, where this rank's part begins.
            group: a ``torch.distributed`` process group over which the sequence is sharded:
                ``ids`` is this rank's contiguous part, every block attends with ``group=``
                and the result is this rank's rows of the single-process hidden states
                (:func:`sparseattn.sparse_attention`; not with ``attn_bias``, and dropout
                masks are drawn per rank, so they are not the single-process ones).
        """
        if ids.dim() != 2:
            raise ValueError(f"ids must have shape (batch, n), got {tuple(ids.shape)}")
        n = ids.shape[1]
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"start must be an int >= 0, got {start!r}")
        if start + n > self.cfg.max_len:
            at = f" from position {start}" if start else ""
            raise ValueError(f"sequence length {n}{at} exceeds max_len={self.cfg.max_len}")
        if group is not None and attn_bias is not None:
            raise ValueError("attn_bias (dense scores) cannot be used with a sharded sequence")
        if attn_bias is not None and (attn_bias.dim() != 4 or attn_bias.shape[-2:] != (n, n)):
            raise ValueError(f"attn_bias must be (L, H, {n}, {n}), got {tuple(attn_bias.shape)}")
        x = self.drop(self.tok(ids) * self.emb_scale + self.pos[start : start + n])
        cyc = None if pattern is None or isinstance(pattern, AttentionGraph) else as_cycle(pattern)
        for layer, block in enumerate(self.blocks):
            bias = None if attn_bias is None else attn_bias[layer % attn_bias.shape[0]]
            layer_pattern = pattern if cyc is None else cyc[layer]
            if layer_pattern is None and bias is None:
                layer_pattern = dense()
            x = block(x, layer_pattern, bias, key_padding_mask, group)
        return self.ln(x)

    def mlm_logits(self, hidden: Tensor) -> Tensor:
        """Vocabulary scores (..., vocab_size) for hidden states (..., dim); tied embeddings."""
        return F.linear(self.head(hidden), self.tok.weight, self.head_bias)
