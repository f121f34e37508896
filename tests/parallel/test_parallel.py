"""Context parallelism on several processes (sparseattn.parallel, issue 42 items 2–5).

One world of 4 processes (gloo on 127.0.0.1, spawned once per module) runs every case on
process groups of 1, 2, 3 and 4 ranks. Reference: ``sparseattn.sparse_attention`` on the
whole sequence in one process, same dtype — outputs and the gradients of q, k, v to 1e-10
in float64 and 1e-5 in float32, α-entmax / sparsemax supports identical (the support map
through both paths), and the bytes each rank moved equal to its plan's. Bad inputs must raise
on every rank and leave the group usable (the next cases run on it).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import socket
import time
import traceback
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import sparseattn as sa
from sparseattn import parallel as cp
from sparseattn.maps import support
from sparseattn.patterns.blocks import BSLongformerSparsityConfig

pytestmark = pytest.mark.timeout(420)

WORLD = 4
#: Seconds the whole world may take before the module fails as hung.
DEADLINE = 360


def _graph_pattern(n: int) -> sa.AttentionGraph:
    gen = torch.Generator().manual_seed(7)
    mask = (torch.rand(n, n, generator=gen) < 0.15) | torch.eye(n, dtype=torch.bool)
    return sa.AttentionGraph.from_dense(mask)


PATTERNS = {
    "window4": lambda n: sa.window(4),
    "window12": lambda n: sa.window(12),
    "window16": lambda n: sa.window(16),
    "window30": lambda n: sa.window(30),
    "window60": lambda n: sa.window(60),
    "window_causal": lambda n: sa.window(7).causal(),
    "sliding_window": lambda n: sa.sliding_window(5, 2),
    "sliding_late_sink": lambda n: sa.sliding_window(5, [15]),
    "longformer": lambda n: sa.longformer(6, 2),
    "longformer_positions": lambda n: sa.longformer(6, [3, 17]),
    "longformer_causal": lambda n: sa.longformer(6, 2).causal(),
    "bigbird": lambda n: sa.bigbird(4, 2, 1, 4, seed=1),
    "causal_bigbird": lambda n: sa.causal_bigbird(4, 1, 1, 4, seed=2),
    "bigbird_blocks": lambda n: sa.bigbird_blocks(4, 1, seed=3),
    "bigbird_blocks_heads": lambda n: sa.bigbird_blocks(4, 1, heads=2, seed=4),
    "strided": lambda n: sa.strided(5),
    "causal_strided": lambda n: sa.causal_strided(4),
    "fixed": lambda n: sa.fixed(5),
    "causal_fixed": lambda n: sa.causal_fixed(5, c=2),
    "star": lambda n: sa.star(2),
    "dense": lambda n: sa.dense(),
    "dense_causal": lambda n: sa.dense().causal(),
    "dense_no_diagonal": lambda n: sa.dense_no_diagonal(),
    "random": lambda n: sa.random(k=3, seed=5),
    "random_blocks": lambda n: sa.random_blocks(1, 4, seed=6),
    "block_local": lambda n: sa.block_local(5),
    "split_heads": lambda n: sa.split_heads(sa.window(4), sa.strided(6)),
    "bslongformer": lambda n: BSLongformerSparsityConfig(num_heads=2, block=4).pattern(),
    "graph": _graph_pattern,
    "no_diagonal": lambda n: sa.no_diagonal(sa.window(4)),
    "topk": lambda n: sa.topk(3),
    "empty_row": lambda n: sa.no_diagonal(sa.window(2).causal()),
}

MAPS = {
    "softmax": lambda: sa.softmax(),
    "entmax15": lambda: sa.entmax(1.5),
    "sparsemax": lambda: sa.sparsemax(),
    "entmax13": lambda: sa.entmax(1.3),
    "entmax3": lambda: sa.entmax(3.0),
    "hardmax": lambda: sa.hardmax(),
    "sparselin": lambda: sa.sparselin_gen(0.3),
    "alpha_tensor": lambda: sa.entmax(torch.tensor([1.2, 1.6]).view(2, 1, 1)),
    "alpha_learned": lambda: sa.entmax(torch.tensor([1.2, 1.6]).view(2, 1, 1).requires_grad_()),
}


@dataclasses.dataclass(frozen=True)
class Case:
    parts: int
    pattern: str
    prob_map: str = "softmax"
    dtype: str = "float64"
    n: int = 23
    gqa: bool = False
    padding: bool = False
    engine: str = "auto"
    block: int = 1
    boundaries: tuple[int, ...] | None = None
    error: str | None = None  # a bad input, and the text every rank's error must hold

    @property
    def id(self) -> str:
        extra = [self.dtype]
        extra += ["gqa"] * self.gqa + ["padding"] * self.padding
        extra += [f"engine={self.engine}"] * (self.engine != "auto")
        extra += [f"block={self.block}"] * (self.block != 1)
        if self.boundaries:
            extra.append(f"bounds={'-'.join(map(str, self.boundaries))}")
        extra += [f"bad={self.error}"] * bool(self.error)
        return f"P{self.parts}-{self.pattern}-{self.prob_map}-n{self.n}-" + "-".join(extra)


def _cases() -> list[Case]:
    cases: list[Case] = []
    cycle = ["softmax", "entmax15", "sparsemax", "entmax13"]
    for p in (1, 2, 3, 4):
        # windows narrower than, equal to, wider than a shard (several hops), and ≥ n
        for i, name in enumerate(["window4", "window12", "window16", "window30", "window60"]):
            cases.append(Case(p, name, cycle[(i + p) % 4]))
        cases += [
            Case(p, "window12", "softmax", "float32"),
            Case(p, "window16", "entmax15", "float32"),
            Case(p, "window_causal", "entmax15", "float32"),
            Case(p, "sliding_window", "softmax", padding=True),
            Case(p, "sliding_late_sink", "sparsemax"),
            Case(p, "longformer_positions", "softmax", gqa=True, padding=True),
            Case(p, "longformer_causal", "entmax13"),
            Case(p, "bigbird", "entmax15"),
            Case(p, "causal_bigbird", "softmax", "float32"),
            Case(p, "bigbird_blocks", "sparsemax", n=32),
            Case(p, "bigbird_blocks_heads", "softmax", n=32),
            Case(p, "strided", "softmax"),
            Case(p, "causal_strided", "entmax15"),
            Case(p, "fixed", "sparsemax"),
            Case(p, "causal_fixed", "softmax"),
            Case(p, "star", cycle[p % 4]),
            Case(p, "dense", "entmax15"),
            Case(p, "dense_causal", "softmax", "float32"),
            Case(p, "dense_no_diagonal", "sparsemax"),
            Case(p, "random", "softmax"),
            Case(p, "random_blocks", "entmax13"),
            Case(p, "block_local", "entmax15"),
            Case(p, "split_heads", "softmax"),
            Case(p, "bslongformer", "entmax15", n=24),
            Case(p, "graph", "sparsemax"),
            Case(p, "no_diagonal", "softmax"),
            Case(p, "window12", "entmax15", gqa=True),
            Case(p, "window16", "softmax", padding=True),
            Case(p, "longformer", "entmax15", padding=True, gqa=True),
        ]
        for m in [
            "softmax",
            "entmax15",
            "sparsemax",
            "entmax13",
            "entmax3",
            "hardmax",
            "sparselin",
        ]:
            cases.append(Case(p, "longformer", m))
        cases += [Case(p, "longformer", m, "float32") for m in ["softmax", "entmax15"]]
        cases += [Case(p, "longformer", "softmax", engine=e) for e in ["dense", "block", "gather"]]
        cases.append(Case(p, "longformer", "sparsemax", block=4))
    cases += [
        Case(2, "longformer", "entmax15", boundaries=(0, 19, 23)),
        Case(3, "window12", "softmax", boundaries=(0, 4, 15, 23)),
        Case(4, "sliding_window", "sparsemax", boundaries=(0, 2, 3, 20, 23)),
        Case(3, "longformer", "entmax15", boundaries=(0, 0, 12, 23)),  # an empty shard
        Case(
            3,
            "dense_causal",
            "softmax",
            boundaries=cp.balanced_boundaries(sa.dense().causal(), 23, 3),
        ),
        Case(
            4,
            "sliding_window",
            "entmax15",
            boundaries=cp.balanced_boundaries(sa.sliding_window(5, 2), 23, 4),
        ),
    ]
    for p in (2, 3, 4):  # bad inputs: every rank raises, and the group stays usable
        cases += [
            Case(p, "window4", error="mismatched shard lengths"),
            Case(p, "window4", error="disagree on the pattern"),
            Case(p, "window4", error="disagree on the prob_map"),
            Case(p, "window4", error="disagree on the dtype"),
            Case(p, "window4", error="disagree on boundaries"),
            Case(p, "window4", error="contains NaN"),
            Case(p, "longformer", error="max_kv_bytes"),
            Case(p, "topk", error="data-dependent"),
            Case(p, "longformer", "alpha_tensor", error="cannot merge global rows"),
            Case(p, "window4", "alpha_learned", error="learnable α"),
            Case(p, "window4", padding=True, error="ignores every key"),
            Case(p, "empty_row", error="no allowed key"),
            Case(p, "window4", "entmax15"),  # the group still works
        ]
    return cases


CASES = _cases()
TOL = {"float64": (1e-10, 1e-10), "float32": (1e-5, 1e-5)}


def _inputs(case: Case):
    dtype = getattr(torch, case.dtype)
    gen = torch.Generator().manual_seed(zlib.crc32(case.id.encode()))  # the same on every rank
    bsz, heads, kv_heads, d, d_v = 2, 2, 1 if case.gqa else 2, 4, 3
    q = torch.randn(bsz, heads, case.n, d, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(bsz, kv_heads, case.n, d, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(bsz, kv_heads, case.n, d_v, generator=gen, dtype=torch.float64).to(dtype)
    weights = torch.randn(bsz, heads, case.n, d_v, generator=gen, dtype=torch.float64)
    mask = None
    if case.padding:  # item 1: its last 6 keys and key 3 are padding
        mask = torch.zeros(bsz, case.n, dtype=torch.bool)
        mask[1, -6:] = True
        mask[1, 3] = True
    return q, k, v, weights.to(dtype), mask


def _compare(name: str, got: torch.Tensor, want: torch.Tensor, dtype: str) -> str | None:
    atol, rtol = TOL[dtype]
    if got.shape != want.shape:
        return f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if not torch.allclose(got, want, atol=atol, rtol=rtol):
        return f"{name}: max error {(got - want).abs().max().item():.3g}"
    return None


def _run_case(case: Case, group, rank: int) -> str | None:
    """None when this rank saw what the case expects, else what went wrong."""
    if case.error is not None:
        return _run_bad(case, group, rank)
    n = case.n
    pattern, rho = PATTERNS[case.pattern](n), MAPS[case.prob_map]()
    q, k, v, weights, mask = _inputs(case)
    kw = {"prob_map": rho, "enable_gqa": case.gqa, "engine": case.engine}
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    want = sa.sparse_attention(*ref, pattern, key_padding_mask=mask, **kw)
    (want * weights).sum().backward()
    bounds = case.boundaries

    def local(t: torch.Tensor) -> torch.Tensor:
        return cp.shard(t, group, boundaries=bounds).detach().clone()

    mine = [local(t).requires_grad_() for t in (q, k, v)]
    mask_l = None if mask is None else cp.shard(mask, group, dim=-1, boundaries=bounds)
    with cp.count_traffic() as moved:
        out = cp.sparse_attention(
            *mine, pattern, group=group, key_padding_mask=mask_l, block=case.block,
            boundaries=bounds, **kw,
        )  # fmt: skip
    got = cp.gather(out, group)
    (got * weights).sum().backward()
    problems = [_compare("out", got, want, case.dtype)]
    for name, a, b in zip("qkv", mine, ref, strict=True):
        problems.append(_compare(f"d{name}", cp.gather(a.grad, group), b.grad, case.dtype))
    if rho.sparse:  # the same support, entry for entry
        ones = torch.ones(*k.shape[:3], 1, dtype=q.dtype)
        with torch.no_grad():
            count = sa.sparse_attention(q, k, ones, pattern, key_padding_mask=mask,
                                        **{**kw, "prob_map": support(rho)})  # fmt: skip
            got_count = cp.sparse_attention(
                local(q), local(k), local(ones), pattern, group=group, key_padding_mask=mask_l,
                boundaries=bounds, **{**kw, "prob_map": support(rho)},
            )  # fmt: skip
        if not torch.equal(cp.gather(got_count, group), count):
            problems.append("supports differ")
    size = dist.get_world_size(group)
    if size == 1:
        if moved:
            problems.append(f"communication at P = 1: {dict(moved)}")
    else:
        p = cp.plan(pattern, n, size, boundaries=bounds, block=case.block)
        want_bytes = p.traffic(
            rank, batch=q.shape[0], heads=q.shape[1], kv_heads=k.shape[1], d=q.shape[-1],
            d_v=v.shape[-1], dtype=q.dtype, key_padding=mask is not None,
            prob_map=cp.map_kind(rho),
        )  # fmt: skip
        kinds = ["halo_send", "halo_recv", "global_forward"]
        for kind in kinds:
            if moved[kind] != want_bytes[kind]:
                problems.append(f"{kind}: moved {moved[kind]}, plan {want_bytes[kind]}")
        if moved["global_step"] != moved["steps"] * want_bytes["global_step"]:
            problems.append(f"global_step: {moved['global_step']} for {moved['steps']} steps")
        with cp.count_traffic() as back:
            out2 = cp.sparse_attention(
                *mine, pattern, group=group, key_padding_mask=mask_l, block=case.block,
                boundaries=bounds, **kw,
            )  # fmt: skip
            out2.backward(torch.ones_like(out2))
        for kind in ["halo_grad_send", "halo_grad_recv", "global_backward"]:
            if back[kind] != want_bytes[kind]:
                problems.append(f"{kind}: moved {back[kind]}, plan {want_bytes[kind]}")
    problems = [x for x in problems if x]
    return "; ".join(problems) or None


def _run_bad(case: Case, group, rank: int) -> str | None:
    n, size = case.n, dist.get_world_size(group)
    pattern, rho = PATTERNS[case.pattern](n), MAPS[case.prob_map]()
    q, k, v, _, mask = _inputs(case)
    q_l, k_l, v_l = (cp.shard(t, group) for t in (q, k, v))
    kw: dict = {"prob_map": rho}
    if case.error == "mismatched shard lengths" and rank == size - 1:
        q_l, k_l, v_l = (t[..., :-1, :] for t in (q_l, k_l, v_l))
    elif case.error == "disagree on the pattern" and rank == 0:
        pattern = sa.window(6)
    elif case.error == "disagree on the prob_map" and rank == size - 1:
        kw["prob_map"] = "sparsemax"
    elif case.error == "disagree on the dtype" and rank == 1:
        q_l, k_l, v_l = (t.float() for t in (q_l, k_l, v_l))
    elif case.error == "disagree on boundaries":
        kw["boundaries"] = cp.even_boundaries(n, size) if rank else (0, *range(1, size), n)
    elif case.error == "contains NaN" and rank == 1:
        q_l = q_l.clone()
        q_l[0, 0, 0, 0] = float("nan")
    elif case.error == "max_kv_bytes":
        kw["max_kv_bytes"] = 100
    elif case.error == "ignores every key":
        mask = torch.zeros(q.shape[0], n, dtype=torch.bool)
        mask[1] = True
        kw["key_padding_mask"] = cp.shard(mask, group, dim=-1)
    try:
        cp.sparse_attention(q_l, k_l, v_l, pattern, group=group, **kw)
    except (ValueError, TypeError) as err:
        expected = case.error
        if case.error == "contains NaN" and rank != 1:
            expected = "refused their inputs"
        if expected not in str(err):
            return f"rank {rank} raised {err!r}, expected {expected!r}"
        return None
    return f"rank {rank} did not raise"


#: Group sizes on which the public spelling is checked.
PUBLIC_PARTS = (2, 3)


def _run_public(group, rank: int) -> str | None:
    """The issue's spelling: ``sa.sparse_attention(q_l, k_l, v_l, pattern, group=)`` and
    ``sa.SparseAttention(..., group=)`` on this rank's shard, gathered, equal the
    single-process call and layer (outputs and gradients, float64)."""
    torch.manual_seed(0)  # the same tensors and weights on every rank
    n, pattern = 29, sa.longformer(6, 2)
    q, k, v = (torch.randn(2, 4, n, 8, dtype=torch.float64) for _ in range(3))
    want = sa.sparse_attention(q, k, v, pattern, prob_map="entmax15")
    mine = [cp.shard(t, group) for t in (q, k, v)]
    got = cp.gather(sa.sparse_attention(*mine, pattern, prob_map="entmax15", group=group), group)
    problems = [_compare("function", got, want, "float64")]
    layer = sa.SparseAttention(32, 4, pattern=pattern, prob_map="sparsemax").double()
    sharded = sa.SparseAttention(32, 4, pattern=pattern, prob_map="sparsemax", group=group)
    sharded.double().load_state_dict(layer.state_dict())
    x = torch.randn(2, n, 32, dtype=torch.float64)
    layer(x).square().sum().backward()
    out = cp.gather(sharded(cp.shard(x, group, dim=1)), group, dim=1)
    out.square().sum().backward()
    problems.append(_compare("layer", out, layer(x), "float64"))
    for (name, a), b in zip(sharded.named_parameters(), layer.parameters(), strict=True):
        # each rank holds its shard's part of the weight gradient: their sum is the whole
        grad = a.grad.clone()
        dist.all_reduce(grad, group=group)
        problems.append(_compare(f"d{name}", grad, b.grad, "float64"))
    return "; ".join(x for x in problems if x) or None


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    groups = {p: dist.new_group(list(range(p))) for p in range(1, world + 1)}
    with open(os.path.join(out_dir, f"rank{rank}.jsonl"), "w") as log:
        for case in CASES:  # one line per case as it ends: a hang shows where it happened
            if rank >= case.parts:
                continue
            try:
                result = _run_case(case, groups[case.parts], rank)
            except Exception:  # noqa: BLE001 — reported by the test of this case
                result = traceback.format_exc()
            log.write(json.dumps([case.id, result]) + "\n")
            log.flush()
        for parts in PUBLIC_PARTS:
            if rank < parts:
                try:
                    result = _run_public(groups[parts], rank)
                except Exception:  # noqa: BLE001 — reported by the test
                    result = traceback.format_exc()
                log.write(json.dumps([f"public-{parts}", result]) + "\n")
                log.flush()
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, dict[int, str | None]]:
    """Every case's result on every rank that ran it."""
    out = tmp_path_factory.mktemp("context_parallel")
    ctx = mp.start_processes(
        _worker, args=(WORLD, _free_port(), str(out)), nprocs=WORLD, join=False,
        start_method="spawn",
    )  # fmt: skip
    start = time.monotonic()
    while not ctx.join(timeout=2):
        if time.monotonic() - start > DEADLINE:
            for proc in ctx.processes:
                proc.kill()
            last = {r: _read(out, r)[-1:] for r in range(WORLD)}
            pytest.fail(f"the world did not finish in {DEADLINE} s (a hang); last cases: {last}")
    merged: dict[str, dict[int, str | None]] = {}
    for rank in range(WORLD):
        for key, value in _read(out, rank):
            merged.setdefault(key, {})[rank] = value
    return merged


def _read(out, rank: int) -> list:
    path = out / f"rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_context_parallel_equals_one_process(world, case):
    results = world[case.id]
    assert sorted(results) == list(range(case.parts))
    failures = {rank: r for rank, r in results.items() if r}
    assert not failures, failures


@pytest.mark.parametrize("parts", PUBLIC_PARTS)
def test_the_public_spelling_equals_one_process(world, parts):
    results = world[f"public-{parts}"]
    assert sorted(results) == list(range(parts))
    failures = {rank: r for rank, r in results.items() if r}
    assert not failures, failures
