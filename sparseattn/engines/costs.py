"""What the engines cost, measured, in one place: the constants ``engine="auto"`` compares
(docs/engines.md, "The `auto` rule"; the measurements: docs/benchmarks.md, "The `auto` grid",
"block size" and "GPU").

The estimates are the ``cost`` of each row of the engine table
(:mod:`sparseattn.engines.capabilities`); the engines and the table read the numbers here. CPU
costs are in scored block entries at b = 64 (ENTRY_COST[64] = 1); on a GPU the measured order
of the fused kernels (:data:`GPU_ORDER`) decides first.
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
#: block entries (docs/benchmarks.md, "The `auto` grid").
BLOCK_MIN_FILL = 1 / 12

#: Largest score matrix (B·H·n_q·n_k entries) for which ``auto`` may pick the dense engine on
#: CPU: a memory cap, not the speed rule; DENSE_LIMIT // 32 where the dense engine materialises
#: the scores (docs/engines.md, "The dense engine's memory").
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

#: On a GPU, the largest score matrix for which ``auto`` picks the dense engine (masked SDPA;
#: faster than the flex engine up to 2²⁵ on an H100, larger sizes not measured;
#: docs/benchmarks.md, "GPU").
GPU_DENSE_LIMIT = 1 << 25
#: On a GPU, the engines in the order measured fastest where they qualify (H100); the others
#: after them, by the CPU estimates.
GPU_ORDER = ("dense", "flex", "triton")
