"""The CPU ``auto`` rule's decisions over a grid of requests, without timing anything: one
letter per cell (b = block, d = dense, g = gather, f = flex, r = rows, t = triton), in the grid's
order, so that two trees (before and after a change to the rule) can be compared with ``cmp``.

    python scripts/auto_decisions.py > docs/results/auto/decisions-cpu.txt

Grid: 8 patterns × n ∈ {64, 256, 1024, 4096} × batch {1, 32} × d {16, 64} × grad {no, yes} ×
map {softmax, 1.5-entmax, sparsemax} × dropout {0, 0.1} × key padding × score modifier
(6144 cells; 4 heads; the decision reads shapes, not values).
"""

from __future__ import annotations

import itertools

import torch

import sparseattn as sa
from sparseattn.attention import choose_engine, resolve_graph
from sparseattn.maps import entmax, softmax, sparsemax

PATTERNS = {
    "window32": sa.window(32),
    "window256": sa.window(256),
    "longformer": sa.longformer(64, 4),
    "bigbird": sa.bigbird(16, 2, 2),
    "strided": sa.strided(16),
    "fixed": sa.fixed(32),
    "random": sa.random(k=16),
    "full": sa.window(1 << 20),
}
MAPS = {"softmax": softmax(), "entmax15": entmax(1.5), "sparsemax": sparsemax()}


def main() -> None:
    torch.set_num_threads(1)
    letters = []
    for (_, pattern), n in itertools.product(PATTERNS.items(), (64, 256, 1024, 4096)):
        cells = itertools.product((1, 32), (16, 64), (False, True), MAPS, (0.0, 0.1), *[(0, 1)] * 2)
        for batch, d, grad, name, dropout, padding, modded in cells:
            q = torch.zeros(batch, 4, n, d, requires_grad=grad)
            graph = resolve_graph(pattern, q, q)
            rho = MAPS[name]
            letters.append(choose_engine(graph, q, q, rho, dropout, bool(modded), bool(padding))[0])
    text = "".join(letters)
    for i in range(0, len(text), 96):
        print(text[i : i + 96])


if __name__ == "__main__":
    main()
