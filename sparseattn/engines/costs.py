"""What the engines cost, measured, in one place: the constants ``engine="auto"`` compares
(docs/engines.md, "The `auto` rule"; the measurements: docs/benchmarks.md, "The `auto` grid",
"block size" and "GPU").

The estimates themselves are the ``cost`` of each row of the engine table
(:mod:`sparseattn.engines.capabilities`); this module holds their numbers only, so that the
engines (the block engine's choice of block size) and the table read the same ones. CPU costs
are in scored block entries at b = 64 (ENTRY_COST[64] = 1); on a GPU the measured order of the
fused kernels decides first (:data:`GPU_ORDER`), then the same estimates.
"""

from __future__ import annotations

__all__ = [
    "BLOCK_MIN_FILL",
    "DENSE_ENTRY_COST",
    "DENSE_ENTRY_COST_TRAIN",
    "DENSE_LIMIT",
    "ENTRY_COST",
    "ENTRY_COST_TRAIN",
    "FLEX_ENTRY_COST",
    "GPU_DENSE_LIMIT",
    "GPU_ORDER",
]

#: Relative cost of one scored entry of the block engine at each block size (matrix-product
#: efficiency and per-chunk overhead, measured on CPU; docs/benchmarks.md, "block size").
ENTRY_COST = {16: 1.6, 32: 1.1, 64: 1.0, 128: 0.92}
#: The same for forward + backward (the backward's small per-row-block matrix products make
#: small blocks relatively dearer when training).
ENTRY_COST_TRAIN = {16: 2.2, 32: 1.2, 64: 1.0, 128: 0.85}

#: Below this fraction of useful entries in the block layout (weighted by ``ENTRY_COST``)
#: ``engine="auto"`` gathers instead: a gathered edge costs about 1 / BLOCK_MIN_FILL = 12 scored
#: block entries (~60–110 ns against ~4–8 ns forward at d = 64 on both measured CPUs; 9–14
#: forward + backward at d = 16–64 on the AMD EPYC; docs/benchmarks.md, "The `auto` grid").
BLOCK_MIN_FILL = 1 / 12

#: Largest score matrix (B·H·n_q·n_k entries) for which ``auto`` may pick the dense engine on
#: CPU: a memory cap, not the speed rule. For softmax without dropout the dense engine runs
#: SDPA's fused CPU kernel, which holds the graph's n_q × n_k mask and not the scores; where it
#: materialises the scores (other maps, dropout, key padding, a score modifier) the cap is
#: DENSE_LIMIT // 32 = 2²² entries (16 MiB of fp32).
DENSE_LIMIT = 1 << 27
#: Cost of one score entry of the dense engine (SDPA's fused kernel) in scored block entries at
#: b = 64, forward: 0.6–0.9 on the AMD EPYC, 0.5–0.8 on the Intel Xeon (d = 64).
DENSE_ENTRY_COST = 0.7
#: The same for forward + backward (units of ``ENTRY_COST_TRAIN``): 0.3–0.9, mostly near 0.45,
#: over the grid of ``sparseattn bench auto``.
DENSE_ENTRY_COST_TRAIN = 0.45

#: Cost of one scored entry of compiled FlexAttention at block 128 relative to one entry of
#: the block engine at block 64, measured on CPU: it is never the cheapest there.
FLEX_ENTRY_COST = 5.0

#: On a GPU, the largest score matrix for which ``auto`` picks the dense engine (masked SDPA):
#: at B·H·n² = 2²⁵ (8 heads, n = 2048; H100, bf16, forward + backward) it took 0.25–0.72 ms on
#: Longformer, BigBird and random graphs against 0.96–1.81 ms for the flex engine, whose
#: compiled call costs the host ~1 ms there (docs/benchmarks.md, "GPU"). Larger sizes are not
#: measured: there the fused sparse kernels are the rule.
GPU_DENSE_LIMIT = 1 << 25
#: On a GPU, the engines in the order measured fastest where they qualify (H100): masked SDPA
#: below :data:`GPU_DENSE_LIMIT`, then FlexAttention (softmax: one fused kernel forward and
#: backward), then the Triton kernels (α-entmax, sparsemax); the others after them, by the
#: CPU estimates.
GPU_ORDER = ("dense", "flex", "triton")
