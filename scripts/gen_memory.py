"""Generation memory with and without the evicting window cache (docs/causal.md).

    python scripts/gen_memory.py 32768 window; python scripts/gen_memory.py 32768 full

A tiny random Llama sparsified with ``sliding_window(64, sinks=4)`` generates T tokens, once with
``hf.window_cache`` and once with a full ``DynamicCache`` (same pattern, no eviction); compare
``tokens_window_<T>.pt`` with ``tokens_full_<T>.pt`` (``torch.equal``). An optional third
argument names a folder for ``<mode>.json``: the numbers, the machine and a SHA-256 of the
tokens (equal hashes: equal tokens), e.g. ``python scripts/gen_memory.py 32768 window
docs/results/causal/gen-memory-32768``.
"""

import hashlib
import resource
import sys
import time

import torch
import transformers
from transformers import DynamicCache

import sparseattn as sa
from sparseattn import hf
from sparseattn.lab.results import machine_facts, write_json


def rss_mib() -> float:
    """The current resident set, MiB."""
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20


def run(model, prompt, cache, T: int):
    before = rss_mib()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            cache=cache,
            do_sample=False,
            max_new_tokens=T,
            min_new_tokens=T,
        )
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB, whole process
    kv_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    return out, dict(
        keys_per_layer=cache.layers[0].keys.shape[-2],
        kv_cache_mib=kv_bytes / 2**20,
        rss_before_mib=before,
        peak_rss_mib=peak,
        seconds=seconds,
    )


def main() -> None:
    T, mode = int(sys.argv[1]), sys.argv[2]  # mode: window | full
    torch.set_num_threads(1)
    config = transformers.LlamaConfig(  # 2 layers, width 64, 4 query heads over 2 kv heads
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=T + 64,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model = hf.sparsify(model, sa.sliding_window(64, sinks=4))
    prompt = torch.randint(3, 100, (1, 16))
    cache = hf.window_cache(model) if mode == "window" else DynamicCache()
    tokens, stats = run(model, prompt, cache, T)
    torch.save(tokens, f"tokens_{mode}_{T}.pt")
    print("T", T, "torch", torch.__version__, "transformers", transformers.__version__)
    print(mode, stats)
    if len(sys.argv) > 3:
        digest = hashlib.sha256(tokens.numpy().tobytes()).hexdigest()
        facts = {"T": T, "mode": mode, "transformers": transformers.__version__}
        write_json(
            f"{sys.argv[3]}/{mode}.json",
            {**facts, **stats, "tokens_sha256": digest, "machine": machine_facts()},
        )


if __name__ == "__main__":
    main()
