"""A sparsified Longformer's ``output_attentions``: its attention weights in the layout of
transformers' ``LongformerSelfAttention`` (and LED's encoder), formed apart from the forward,
whose engine never forms them.

* :func:`local_weights` — ``attn_probs`` (B, n, H, g + 2w + 1): row i's weights on the item's
  g global keys (ascending; the slots an item with fewer global tokens leaves empty hold 0),
  then on keys i − w … i + w (0 outside the sequence and on padding or global keys, which
  are in the global columns or nowhere); the rows of padding and of global tokens 0.
* :func:`global_weights` — ``global_attn_probs`` (B, H, g, n): global token s's weights on the
  n keys (0 on padding), computed with the global projections; an empty slot's row is
  transformers' filler, 1/n everywhere (its scores are all the dtype's minimum there).

Both apply the layer's ρ to the layer's rows (with softmax, transformers' weights to float
rounding) in float32, as transformers does, and return the scores' dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..maps import ProbabilityMap

__all__ = ["global_weights", "local_weights"]

#: Queries per chunk of the band's scores: a chunk's (c, c + 2w) products bound the memory.
_CHUNK = 256


def _band_scores(q: Tensor, k: Tensor, w: int) -> Tensor:
    """(B, H, n, 2w + 1): q_i · k_{i − w + t} for t = 0 … 2w (keys outside the sequence score
    0 here; the caller masks them); q, k (B, H, n, d). Each chunk of c queries is one product
    against its c + 2w keys, whose band is read as a strided view (row r: columns r … r + 2w)."""
    bsz, heads, n, _ = q.shape
    keys = F.pad(k, (0, 0, w, w))  # (B, H, n + 2w, d)
    out = q.new_empty(bsz, heads, n, 2 * w + 1)
    for start in range(0, n, _CHUNK):
        stop = min(n, start + _CHUNK)
        c = stop - start
        full = (q[:, :, start:stop] @ keys[:, :, start : stop + 2 * w].mT).contiguous()
        stride = full.stride()
        band = full.as_strided((bsz, heads, c, 2 * w + 1), (*stride[:2], stride[2] + 1, 1))
        out[:, :, start:stop] = band
    return out


def local_weights(
    q: Tensor,
    k: Tensor,
    pos: Tensor,
    counts: Tensor,
    is_global: Tensor,
    is_padding: Tensor,
    w: int,
    prob_map: ProbabilityMap,
) -> Tensor:
    """The local rows' weights as transformers' ``attn_probs`` (B, n, H, g + 2w + 1) (module
    docstring). q (B, H, n, d) already divided by √d, k (B, H, n, d): the layer's regular
    projections; ``pos`` (B, g), ``counts`` (B,): the items' global positions ascending in
    their first counts[b] slots; is_global, is_padding (B, n) bool; w the one-sided window."""
    bsz, heads, n, _ = q.shape
    g = pos.shape[1]
    q, k = q.float(), k.float()
    picked = k.gather(2, pos[:, None, :, None].expand(bsz, heads, g, k.shape[-1]))
    scores = torch.cat((q @ picked.mT, _band_scores(q, k, w)), -1)  # (B, H, n, g + 2w + 1)
    local_key = F.pad(~(is_global | is_padding), (w, w), value=False)  # (B, n + 2w)
    band_valid = local_key.unfold(1, 2 * w + 1, 1)  # (B, n, 2w + 1): key i − w + t is local
    slot_valid = (torch.arange(g, device=q.device) < counts[:, None])[:, None, :]
    valid = torch.cat((slot_valid.expand(bsz, n, g), band_valid), -1)[:, None]
    probs = prob_map(scores, valid.expand_as(scores))
    probs = probs.masked_fill((is_global | is_padding)[:, None, :, None], 0.0)
    return probs.transpose(1, 2)


def global_weights(
    q_global: Tensor, k_global: Tensor, counts: Tensor, is_padding: Tensor, prob_map: ProbabilityMap
) -> Tensor:
    """The global rows' weights as transformers' ``global_attn_probs`` (B, H, g, n) (module
    docstring): q_global (B, H, g, d) the global tokens' ``query_global`` divided by √d,
    k_global (B, H, n, d) every token's ``key_global``; ``counts`` (B,) the items' global
    tokens; is_padding (B, n) bool (an item of padding only: every key, as transformers)."""
    g, n = q_global.shape[2], k_global.shape[2]
    scores = q_global.float() @ k_global.float().mT
    real = ~is_padding | is_padding.all(-1, keepdim=True)
    probs = prob_map(scores, real[:, None, None, :].expand_as(scores))
    empty = torch.arange(g, device=scores.device) >= counts[:, None]  # (B, g)
    return probs.masked_fill(empty[:, None, :, None], 1.0 / n)
