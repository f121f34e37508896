"""Tiny Hugging Face models for the tests: built from a config (nothing is downloaded), random
weights drawn from seed 0 (the global RNG continues from their initialisation), eval mode, on
the CPU. transformers is imported on first use."""

from __future__ import annotations

import torch

#: A 2-layer BERT of width 32 (4 heads, feed-forward 37), 99 tokens, 64 positions.
BERT = dict(
    vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    intermediate_size=37, max_position_embeddings=64,
)  # fmt: skip
#: :data:`BERT` at width 64 (feed-forward 128), 100 tokens, 128 positions.
WIDE_BERT = dict(
    BERT, vocab_size=100, hidden_size=64, intermediate_size=128, max_position_embeddings=128
)
#: A 2-layer Llama-shaped decoder of width 64: 4 query heads over 2 key/value heads (GQA: 2
#: query heads per key/value head), 100 tokens, 128 positions.
LLAMA = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=100, max_position_embeddings=128,
)  # fmt: skip


def tiny_model(config: str, model: str, **options):
    """``transformers.<model>(transformers.<config>(**options))`` with seed-0 weights, in eval
    mode."""
    import transformers

    torch.manual_seed(0)
    return getattr(transformers, model)(getattr(transformers, config)(**options)).eval()


def tiny_bert(model: str = "BertModel", **overrides):
    """:data:`BERT` (with ``overrides``), SDPA attention unless overridden."""
    return tiny_model("BertConfig", model, **{**BERT, "attn_implementation": "sdpa", **overrides})


def tiny_llama(model: str = "LlamaForCausalLM", **overrides):
    """:data:`LLAMA` (with ``overrides``)."""
    return tiny_model("LlamaConfig", model, **{**LLAMA, **overrides})


#: Tiny models that modify their scores: Gemma 2 (logit soft-capping 2.0 — small, so that it
#: changes the scores —, layer 0 sliding over 12 keys, GQA), T5 (relative position bias, no
#: dropout) and BART (encoder–decoder with cross-attention); width 64, 4 heads, 100 tokens.
GEMMA2 = dict(
    LLAMA, head_dim=16, sliding_window=12, attn_logit_softcapping=2.0,
    final_logit_softcapping=None, query_pre_attn_scalar=16, bos_token_id=1, eos_token_id=2,
    pad_token_id=0,
)  # fmt: skip
T5 = dict(
    vocab_size=100, d_model=64, d_kv=16, d_ff=96, num_layers=2, num_decoder_layers=2,
    num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=20,
    dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
)  # fmt: skip
BART = dict(
    vocab_size=100, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
    decoder_attention_heads=4, encoder_ffn_dim=96, decoder_ffn_dim=96,
    max_position_embeddings=128, pad_token_id=1, bos_token_id=0, eos_token_id=2,
    decoder_start_token_id=2,
)  # fmt: skip
