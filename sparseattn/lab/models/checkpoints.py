"""Random-weight models of the sizes of two sparse-attention checkpoints, and their inputs.

* **Longformer-base** (``allenai/longformer-base-4096``): transformers' ``LongformerModel``,
  12 layers, hidden 768, 12 heads, intermediate 3072, attention window 512 (keys
  i − 256 … i + 256), global tokens given per call by ``global_attention_mask``.
* **BigBird-RoBERTa-base** (``google/bigbird-roberta-base``): ``BigBirdModel``, the same
  widths, ``attention_type="block_sparse"``, blocks of 64 tokens, 3 random blocks.

The weights are transformers' own random initialisation from a fixed seed: the time, the
memory and the agreement of transformers' attention with ``hf.sparsify``'s depend on the
shapes, not on trained values, and nothing is downloaded. The vocabularies are the configs'
defaults (Longformer 30522 tokens where the checkpoint has 50265; BigBird 50358, as its
checkpoint): an embedding look-up costs the same either way. :class:`CheckpointSize` holds the
sizes (:data:`BASE`: the checkpoints'; tests shrink them). One place builds them for the
benchmarks that compare the two implementations: ``scripts/checkpoint_layers.py`` (one
attention layer on the CPU, :func:`build`) and the GPU bench's models section
(:mod:`sparseattn.lab.bench.gpu_models`: :func:`model`, :func:`layer_inputs`,
:func:`model_inputs`). transformers is imported when a function is called.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

__all__ = [
    "BASE",
    "KINDS",
    "CheckpointSize",
    "build",
    "layer_inputs",
    "max_positions",
    "model",
    "model_inputs",
    "self_attention",
]

#: The two models: transformers' Longformer and BigBird.
KINDS = ("longformer", "bigbird")


@dataclasses.dataclass(frozen=True)
class CheckpointSize:
    """The sizes of a model of :data:`KINDS`: ``window`` is Longformer's
    ``attention_window`` (2·w₁ tokens), ``block`` and ``random_blocks`` BigBird's
    ``block_size`` and ``num_random_blocks``; the other fields are both models'."""

    layers: int = 12
    hidden: int = 768
    heads: int = 12
    intermediate: int = 3072
    window: int = 512
    block: int = 64
    random_blocks: int = 3

    def describe(self, kind: str) -> str:
        """The size in words, e.g. "12 layers, hidden 768, 12 heads, window 512"."""
        own = f"window {self.window}"
        if kind == "bigbird":
            own = f"block {self.block}, {self.random_blocks} random blocks"
        layers = f"{self.layers} layer" + "s" * (self.layers != 1)
        return f"{layers}, hidden {self.hidden}, {self.heads} heads, {own}"


#: Longformer-base's and BigBird-RoBERTa-base's sizes.
BASE = CheckpointSize()


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def max_positions(kind: str, n: int) -> int:
    """``max_position_embeddings`` for inputs of up to n tokens: Longformer numbers the tokens
    from ``pad_token_id + 1`` = 2, so n + 2; BigBird at least the checkpoint's 4096 (its
    training-mode random draw depends on this value)."""
    _check_kind(kind)
    return n + 2 if kind == "longformer" else max(4096, n)


def model(
    kind: str,
    max_n: int,
    size: CheckpointSize = BASE,
    *,
    mode: str = "eval",
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> nn.Module:
    """A random-weight ``LongformerModel`` or ``BigBirdModel`` (``kind``) of ``size`` for
    inputs of up to ``max_n`` tokens, its weights drawn in float32 on the CPU from ``seed``
    (so every device and dtype gets the same values), then moved to ``device`` and ``dtype``;
    in training mode for ``mode="train"`` (BigBird's layers then use their random draw, and
    the configs' default dropout of 0.1 applies outside BigBird's block-sparse attention, which
    has none), else eval mode.
    """
    import transformers

    _check_kind(kind)
    common = dict(
        hidden_size=size.hidden, num_attention_heads=size.heads,
        num_hidden_layers=size.layers, intermediate_size=size.intermediate,
        max_position_embeddings=max_positions(kind, max_n),
    )  # fmt: skip
    torch.manual_seed(seed)
    if kind == "longformer":
        config = transformers.LongformerConfig(attention_window=size.window, **common)
        net = transformers.LongformerModel(config)
    else:
        config = transformers.BigBirdConfig(
            block_size=size.block, num_random_blocks=size.random_blocks,
            attention_type="block_sparse", **common,
        )  # fmt: skip
        net = transformers.BigBirdModel(config)
    net = net.train(mode == "train")
    if torch.device(device) != torch.device("cpu") or dtype != torch.float32:
        net = net.to(device, dtype)
    return net


def self_attention(net: nn.Module, layer: int = 0) -> nn.Module:
    """Layer ``layer``'s self-attention module: ``LongformerSelfAttention`` or
    ``BigBirdBlockSparseAttention`` (or its replacement after ``hf.sparsify``'s patch: the
    same module, its ``forward`` replaced)."""
    return net.encoder.layer[layer].attention.self


def layer_inputs(
    kind: str,
    n: int,
    size: CheckpointSize = BASE,
    globals_: int = 16,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple:
    """The positional arguments of :func:`self_attention`'s module for n tokens, batch 1, as
    its model passes them: Gaussian hidden states (1, n, hidden) (float32 on the CPU from
    seed 1, then moved to ``device`` and ``dtype``) and

    * Longformer: the extended mask (1, n) in ``dtype`` (> 0 for the first ``globals_``
      tokens: global; 0: local; no padding), the derived padding and global masks and whether
      any token is global — n must be a multiple of ``window`` (the model pads, the layer
      does not);
    * BigBird: transformers' block-sparse masks of n real tokens: band, from and to in
      ``dtype`` (``BigBirdAttention`` casts them to the hidden states' dtype), blocked (twice)
      in float32, as the model makes it — n a multiple of ``block``.
    """
    _check_kind(kind)
    hidden = torch.randn(1, n, size.hidden, generator=torch.Generator().manual_seed(1))
    if torch.device(device) != torch.device("cpu") or dtype != torch.float32:
        hidden = hidden.to(device, dtype)
    if kind == "longformer":
        mask = torch.zeros(1, n, device=device, dtype=dtype)
        mask[:, :globals_] = 1.0  # > 0: global (transformers' extended mask), 0: local
        return hidden, mask, mask < 0, mask > 0, globals_ > 0
    import transformers

    masks = transformers.BigBirdModel.create_masks_for_block_sparse_attn(
        torch.ones(1, n, device=device), size.block
    )
    blocked, band, from_mask, to_mask = masks
    band, from_mask, to_mask = (m.to(dtype) for m in (band, from_mask, to_mask))
    return hidden, band, from_mask, to_mask, blocked, blocked


def model_inputs(
    kind: str, n: int, vocab_size: int, globals_: int = 16, *, device: torch.device | str = "cpu"
) -> dict:
    """The keyword arguments of the model's forward for n tokens, batch 1: random token ids
    (seed 2) that are not special tokens (ids ≥ 5, so no padding: Longformer numbers its
    positions by the non-padding ids), and for Longformer a ``global_attention_mask`` with
    the first ``globals_`` tokens global."""
    _check_kind(kind)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(5, vocab_size, (1, n), generator=gen).to(device)
    if kind == "bigbird":
        return {"input_ids": ids}
    glob = torch.zeros(1, n, dtype=torch.long, device=device)
    glob[:, :globals_] = 1
    return {"input_ids": ids, "global_attention_mask": glob}


def build(
    kind: str,
    n: int,
    sparse: bool,
    mode: str = "eval",
    globals_: int = 16,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[nn.Module, tuple]:
    """One layer of the checkpoint's width for n tokens: (its self-attention module, the
    module's positional arguments) — a one-layer :func:`model` (positions for n tokens) of
    :data:`BASE`'s widths, ``hf.sparsify``'d (its own configuration, engine ``auto``) when
    ``sparse``, and :func:`layer_inputs`. ``scripts/checkpoint_layers.py`` times these."""
    size = dataclasses.replace(BASE, layers=1)
    net = model(kind, n, size, mode=mode, device=device, dtype=dtype)
    if sparse:
        from ... import hf

        hf.sparsify(net)
    return self_attention(net), layer_inputs(kind, n, size, globals_, device=device, dtype=dtype)
