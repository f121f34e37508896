"""Flex engine: a graph handed to torch's FlexAttention as a BlockMask (docs/engines.md,
"Flex engine").

The BlockMask is built from the graph's block layout in O(E) (no n² scan, unlike
``create_block_mask``), its ``mask_mod`` the pattern's element-wise predicate where it has one,
else a look-up of the partial blocks' masks in a table. Softmax only; on CPU forward only,
compiled with ``torch.compile`` (a C++ compiler is needed); no dropout.
"""

from __future__ import annotations

import functools
import inspect
import math
import shutil
import threading
from collections.abc import Callable

import torch
from torch import Tensor

from ..graph import AttentionGraph
from ..maps import NonFiniteScoresError, ProbabilityMap
from ..validate import all_finite
from .layout import block_pairs

__all__ = [
    "bind_flex",
    "cached_block_mask",
    "flex_engine",
    "flex_available",
    "flex_refuses",
    "forget_shapes",
    "graph_block_mask",
]

#: FlexAttention's default (and on CPU, fastest) block size.
FLEX_BLOCK = 128
#: Inductor's CPU FlexAttention kernel (torch 2.13) scores keys in micro-GEMM tiles of 16; its
#: tail tile, where the head dim is a multiple of the vector width below 24 and the tail a
#: multiple of the vector width, reads and writes a whole tile past the block: wrong rows
#: (docs/engines.md, "Results that depend on the CPU's vector width").
_TILE_KEYS, _TILE_HEAD_DIM_LIMIT = 16, 24


@functools.cache
def flex_available() -> str | None:
    """None if FlexAttention can be compiled here, else the reason it cannot (cached)."""
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError as err:  # pragma: no cover - torch < 2.5
        return f"this torch ({torch.__version__}) has no FlexAttention: {err}"
    from torch._inductor import config as inductor_config

    cxx = inductor_config.cpp.cxx
    names = [c for c in (cxx if isinstance(cxx, tuple) else (cxx,)) if c] or ["g++"]
    if not any(shutil.which(c) for c in names):
        return f"torch.compile needs a C++ compiler on CPU; none of {names} was found"
    return None


def flex_refuses(
    q: Tensor, k: Tensor, v: Tensor, *_: object, score_mod: object = None
) -> str | None:
    """Why FlexAttention cannot take these tensors (None if it can): its GPU kernels need
    head dims of at least 16 (torch 2.11: "NYI: embedding dimension … must be at least 16")."""
    if q.device.type == "cuda" and min(q.shape[-1], v.shape[-1]) < 16:
        return f"on a GPU it needs head dims >= 16, got d = {q.shape[-1]}, d_v = {v.shape[-1]}"
    return None


@functools.cache
def _cpu_vector_bits() -> int | None:
    """The width in bits of the vectors in the code Inductor emits on this CPU: 512 with
    AVX-512, 256 with AVX2; None without a vector ISA. The engine compiles with it as
    ``cpp.simdlen``, a key of Inductor's on-disk cache, which torch 2.13 does not key by the
    CPU: else code made for one width is served on the other, with wrong results."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    return isa.bit_width() if isa else None


def _cpu_vector_floats() -> int:
    """Floats per vector in the code Inductor emits on this CPU: 16 with AVX-512, 8 with AVX2,
    8 without a vector ISA (ATen's scalar ``Vectorized<float>`` is 32 bytes wide)."""
    return (_cpu_vector_bits() or 256) // 32


def _cpu_safe_head_dim(d: int, n_k: int, block: int) -> int:
    """The head dim to hand Inductor's CPU kernel for q·kᵀ: ``d``, or ``d + 1`` where ``d``
    would take the micro-GEMM branch that reads past the last key block (see
    :data:`_TILE_KEYS`). Zero columns added to q and k leave every score unchanged."""
    vlen = _cpu_vector_floats()
    split = min(block, n_k)
    tail = ((n_k - 1) % split + 1) % _TILE_KEYS  # keys in the last, partial tile of a block
    faulty = tail % vlen == 0 and tail > 0 and d % vlen == 0 and d < _TILE_HEAD_DIM_LIMIT
    return d + 1 if faulty else d


def _bucket(x: int) -> int:
    """Table size: the next power of two, at least 64 (1 MB at block 128). The compiled kernel
    is specialised to the table's shape, so bucketing keeps recompiles rare."""
    return 1 << max(6, math.ceil(math.log2(max(1, x))))


def graph_block_mask(
    graph: AttentionGraph,
    batch: int = 1,
    heads: int = 1,
    block: int = FLEX_BLOCK,
    key_valid: Tensor | None = None,
    device: torch.device | str = "cpu",
):
    """A FlexAttention ``BlockMask`` (batch, heads, n_q, n_k) for ``graph`` (whose batch_shape
    broadcasts to (batch, heads); a size of 1 broadcasts over q's), built from its block layout
    in O(E). ``key_valid``: optional (batch, n_k) bool, True for real keys (then every block is
    partial). Its ``mask_mod`` is the pattern's element-wise predicate where the graph has one
    (``graph.predicate``), else a look-up in a table of the partial blocks' masks.
    """
    return _block_mask(graph, batch, heads, block, key_valid, device)[0]


def _block_mask(graph, batch, heads, block, key_valid, device):
    """(BlockMask, whether its mask_mod is element-wise, without look-ups: then one
    length-generic kernel computes it) — see :func:`graph_block_mask`."""
    from torch.nn.attention.flex_attention import BlockMask

    shape = graph.batch_shape
    if len(shape) > 2 or tuple(torch.broadcast_shapes(shape, (batch, heads))) != (batch, heads):
        raise ValueError(f"graph batch_shape {shape} does not broadcast to {(batch, heads)}")
    n_graphs = max(1, math.prod(shape))
    gdev = graph.device  # built where the graph lives, then moved to ``device`` once
    graph_of = (
        torch.arange(n_graphs, device=gdev)
        .view((1,) * (2 - len(shape)) + shape)
        .expand(batch, heads)
    )
    n_q, n_k = graph.n_q, graph.n_k
    nbq, nbk = -(-n_q // block), -(-n_k // block)
    dev = torch.device(device)
    predicate = graph.predicate(dev) if graph.predicate is not None else None
    pairs = block_pairs(graph, block, partial=predicate is None)
    pair_keys = pairs.keys
    rb, kb = pair_keys // nbk, pair_keys % nbk  # rb = g·nbq + i
    full = pairs.full
    if key_valid is not None:  # full blocks skip mask_mod: the padding needs it
        full = torch.zeros_like(full)
    element_wise = predicate is not None
    if predicate is None:
        predicate = _table_mask_mod(
            _block_table(pairs, full, n_graphs, nbq, nbk, block, graph_of, dev), block
        )

    def lists(select: Tensor) -> tuple[Tensor, Tensor]:
        """Per (b, h, row block): how many key blocks, and which (padded with 0)."""
        sel_rb = rb[select]
        num = torch.bincount(sel_rb, minlength=n_graphs * nbq)
        pos = torch.arange(sel_rb.numel(), device=gdev) - (torch.cumsum(num, 0) - num)[sel_rb]
        idx = torch.zeros(n_graphs * nbq, nbk, dtype=torch.int32, device=gdev)
        idx[sel_rb, pos] = kb[select].to(torch.int32)
        num = num.to(torch.int32).view(n_graphs, nbq)[graph_of]
        return num, idx.view(n_graphs, nbq, nbk)[graph_of]

    kv_num, kv_idx = lists(~full)
    full_num, full_idx = lists(full)
    mask_mod = predicate
    if key_valid is not None:
        key_ok = key_valid.to(dev).expand(batch, n_k)
        mask_mod = _padded(predicate, key_ok)
    lists_on = (t.to(dev) for t in (kv_num, kv_idx, full_num, full_idx))
    block_mask = BlockMask.from_kv_blocks(
        *lists_on, BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(n_q, n_k)
    )
    return block_mask, element_wise and key_valid is None


def _block_table(pairs, full, n_graphs, nbq, nbk, block, graph_of, dev):
    """The element masks of a block layout as look-up tables on ``dev``: (pair_index
    (G', H', nbq, nbk) int32, table (T, b, b) bool) — pair_index names each block pair's
    slot in ``table``: 0 no edge, 1 all edges, then one slot per partial pair."""
    gdev = graph_of.device
    partial = (~full).nonzero().squeeze(1)
    table = torch.zeros(_bucket(partial.numel() + 2), block, block, dtype=torch.bool, device=gdev)
    table[1] = True
    slot = torch.ones_like(pairs.keys)
    slot[partial] = torch.arange(partial.numel(), device=gdev) + 2
    table[slot[pairs.e_pair], pairs.e_q, pairs.e_k] = True
    table[slot[pairs.full]] = True  # whole pairs treated as partial (key padding): all edges
    pair_index = torch.zeros(n_graphs * nbq * nbk, dtype=torch.int32, device=gdev)
    pair_index[pairs.keys] = slot.to(torch.int32)
    return pair_index.view(n_graphs, nbq, nbk)[graph_of].to(dev), table.to(dev)


def cached_block_mask(graph: AttentionGraph, block: int, device: torch.device):
    """The BlockMask of ``graph`` (its own leading shape, no key padding) on ``device``, built
    once per (block, device) and cached on the graph: later calls copy nothing to the device."""
    return _cached_block_mask(graph, block, device)[0]


def _cached_block_mask(graph: AttentionGraph, block: int, device: torch.device):
    """(BlockMask, element-wise) of :func:`_block_mask`, cached on the graph."""
    g_batch, g_heads = (1, 1, *graph.batch_shape)[-2:]
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # the key of q.device: cuda:<index>
        device = torch.device("cuda", torch.cuda.current_device())
    return graph.cached(
        ("flex_mask", block, device),
        lambda: _block_mask(graph, g_batch, g_heads, block, None, device),
    )


def _padded_block_mask(graph: AttentionGraph, block_mask, key_ok: Tensor):
    """The graph's cached BlockMask with every key block partial (full blocks skip mask_mod)
    and a mask_mod that also reads ``key_ok`` (B, n_k), True for real keys; the merged block
    lists are cached on the graph (no host sync per call)."""
    from torch.nn.attention.flex_attention import BlockMask

    def merge() -> tuple[Tensor, Tensor]:
        num, idx = block_mask.kv_num_blocks, block_mask.kv_indices
        if block_mask.full_kv_num_blocks is None:
            return num, idx
        full_num, full_idx = block_mask.full_kv_num_blocks, block_mask.full_kv_indices
        slot = torch.arange(idx.shape[-1], device=idx.device)
        after = (slot - num.unsqueeze(-1)).clamp(0, idx.shape[-1] - 1).long()
        merged = torch.where(slot < num.unsqueeze(-1), idx, full_idx.gather(-1, after))
        return num + full_num, merged

    num, idx = graph.cached(
        ("flex_all_partial", block_mask.BLOCK_SIZE, block_mask.kv_indices.device), merge
    )
    return BlockMask.from_kv_blocks(
        num,
        idx,
        BLOCK_SIZE=block_mask.BLOCK_SIZE,
        mask_mod=_padded(block_mask.mask_mod, key_ok),
        seq_lengths=block_mask.seq_lengths,
    )


def _table_mask_mod(tables: tuple[Tensor, Tensor], block: int):
    """mask_mod(b, h, q, kv): the element mask of the (q, kv) block, looked up in ``table``
    through ``pair_index`` (B, H, n_q blocks, n_k blocks), whose size-1 batch or head dim
    broadcasts; the block size a 0-d tensor (no recompile per value)."""
    pair_index, table = tables
    one_batch, one_head = pair_index.shape[0] == 1, pair_index.shape[1] == 1
    b_t = torch.full((), block, dtype=torch.int32, device=table.device)

    def mask_mod(b, h, q_idx, kv_idx):
        b = 0 if one_batch else b
        pid = pair_index[b, 0 if one_head else h, q_idx // b_t, kv_idx // b_t]
        return table[pid, q_idx % b_t, kv_idx % b_t]

    return mask_mod


def _padded(mask_mod, key_ok: Tensor):
    """``mask_mod`` restricted to real keys: key_ok (B, n_k) bool, True for real keys; a
    size-1 batch broadcasts."""
    one_batch = key_ok.shape[0] == 1

    def padded(b, h, q_idx, kv_idx):
        return mask_mod(b, h, q_idx, kv_idx) & key_ok[0 if one_batch else b, kv_idx]

    return padded


def _flex(q, k, v, score_mod, block_mask, scale, enable_gqa):
    """``flex_attention`` in a code object of the engine's own, which is what gets compiled:
    dynamo counts recompiles per code object and, past its limit, runs that code uncompiled
    (unfused: n × n scores) for every caller — a user's own compiled ``flex_attention`` and
    the engine thus do not spend each other's recompiles."""
    return _FLEX[0](
        q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa
    )


def _flex_generic(q, k, v, score_mod, block_mask, scale, enable_gqa):
    """:func:`_flex` under a code object of its own for the length-generic kernel: dynamo
    tries a code object's cached kernels most recent first, so sharing one would let the
    generic kernel answer the shapes that have a specialised one."""
    return _flex(q, k, v, score_mod, block_mask, scale, enable_gqa)


_FLEX: list = []

#: On a GPU, how many distinct input shapes of element-wise masks get a kernel specialised to
#: them (the fastest; the length-generic one cost 1.26-1.41× at n = 8192 on an H200) before
#: one length-generic kernel serves every later shape: at most this + 1 compiles.
STATIC_SHAPES = 8
_STATIC_SEEN: set = set()
_STATIC_LOCK = threading.Lock()  # threads serving one model share the budget


def _dynamic(q: Tensor, k: Tensor, v: Tensor, generic: bool) -> bool | None:
    """The ``dynamic`` of the kernel for this call: per shape (``False``) where the mask_mod
    looks up a tensor (torch 2.13's length-generic CPU kernel then indexes out of bounds);
    element-wise masks on a GPU per shape for the first :data:`STATIC_SHAPES` shapes, then
    length-generic (``True``); on CPU torch's default (``None``)."""
    if not generic:
        return False
    if q.device.type == "cpu":
        return None
    key = tuple((t.shape, t.stride(), t.dtype, t.device) for t in (q, k, v))
    with _STATIC_LOCK:
        if key in _STATIC_SEEN:
            return False
        if len(_STATIC_SEEN) < STATIC_SHAPES:
            _STATIC_SEEN.add(key)
            return False
        return True


def forget_shapes() -> None:
    """Forget which shapes got a specialised kernel (:data:`STATIC_SHAPES`); call it with
    ``torch._dynamo.reset()``, which drops the kernels themselves."""
    with _STATIC_LOCK:
        _STATIC_SEEN.clear()


#: The recompiles the engine's compiled call may make before torch falls back to running it
#: uncompiled (an unfused O(n²) FlexAttention): tables compile one kernel per (shape, table
#: bucket), more than dynamo's default of 8.
RECOMPILE_LIMIT = 64
#: Whether ``torch.compile`` takes a per-call ``recompile_limit`` (torch 2.13 does).
_COMPILE_HAS_LIMIT = "recompile_limit" in inspect.signature(torch.compile).parameters


@functools.cache
def _compiled(dynamic: bool | None):
    """Compiled :func:`_flex` (:func:`_flex_generic` for ``dynamic=True``; see
    :func:`_dynamic`), allowed :data:`RECOMPILE_LIMIT` recompiles: by ``torch.compile``'s own
    ``recompile_limit`` where it has one, else with dynamo's global limit raised around each
    call."""
    if not _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX.append(flex_attention)
    fn = _flex_generic if dynamic else _flex
    options = {"cpp.simdlen": _cpu_vector_bits()}
    if _COMPILE_HAS_LIMIT:
        return torch.compile(fn, dynamic=dynamic, options=options, recompile_limit=RECOMPILE_LIMIT)
    compiled = torch.compile(fn, dynamic=dynamic, options=options)
    limit = torch._dynamo.config.patch(
        recompile_limit=max(RECOMPILE_LIMIT, torch._dynamo.config.recompile_limit)
    )

    def call(*args):
        with limit:
            return compiled(*args)

    return call


def flex_engine(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    graph: AttentionGraph,
    prob_map: ProbabilityMap,
    scale: float,
    key_valid: Tensor | None = None,
    dropout_p: float = 0.0,
    block: int = FLEX_BLOCK,
    score_mod: Callable | None = None,
) -> Tensor:
    """Softmax attention on the graph with compiled FlexAttention (same contract as
    ``dense_attention``): the engine table's entry (``flex_attention_engine`` checks requests).
    The BlockMask, of the graph's leading shape, is cached on the graph per (block, device)
    without key padding; k and v may have fewer heads than q. On CPU, k is read whole first
    (NonFiniteScoresError for NaN or inf: the CPU kernel would give such rows zeros), and head
    dims that would take the faulty tail branch (:data:`_TILE_KEYS`) get a zero column.
    """
    run = bind_flex(q, k, v, graph, prob_map, scale, key_valid, dropout_p, block, score_mod)
    return run(q, k, v)


def bind_flex(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    graph: AttentionGraph,
    prob_map: ProbabilityMap,
    scale: float,
    key_valid: Tensor | None = None,
    dropout_p: float = 0.0,
    block: int = FLEX_BLOCK,
    score_mod: Callable | None = None,
) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """:func:`flex_engine` with all it decides from the inputs' metadata decided now: a call
    ``run(q, k, v)`` for inputs of these shapes, dtype and device that holds the BlockMask,
    the compiled function and its arguments, and no tensor of this call but ``key_valid``.
    ``sparse_attention`` keeps it per call signature: a repeated call is then a look-up and
    the compiled call (on CPU also the read of k). The kernel's ``dynamic`` is decided here,
    once per kept call (:func:`_dynamic`)."""
    block_mask, generic = _cached_block_mask(graph, block, q.device)
    if key_valid is not None:
        block_mask, generic = _padded_block_mask(graph, block_mask, key_valid), False
    cpu, gqa = q.device.type == "cpu", k.shape[1] != q.shape[1]
    pad = _cpu_safe_head_dim(q.shape[-1], k.shape[-2], block) - q.shape[-1] if cpu else 0
    # a score_mod's Python constants (softcap's c) fail as dynamic floats: one kernel per
    # shape there
    compiled = _compiled(_dynamic(q, k, v, generic and score_mod is None))

    def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if cpu and not all_finite(k):  # the kernel returns zeros for the rows that read it
            raise NonFiniteScoresError("k holds NaN or inf, which FlexAttention would hide")
        if pad:  # the padded columns add 0 to every score
            q, k = (torch.nn.functional.pad(t, (0, pad)) for t in (q, k))
        out = compiled(q, k, v, score_mod, block_mask, scale, gqa)
        # rows whose keys are all padding: zeros (maps' rule)
        return out if key_valid is None else out.nan_to_num(0.0)

    return run
