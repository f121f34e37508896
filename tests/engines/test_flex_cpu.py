"""torch's CPU FlexAttention kernel, and what the flex engine does about it.

Inductor emits the CPU kernel with the vector width of the CPU it runs on (8 floats with AVX2,
16 with AVX-512), and torch 2.13 has two faults that only show at one width or across two
(docs/engines.md, "Results that depend on the CPU's vector width"):

* the micro-GEMM that scores a tail of keys reads and writes a whole tile of 16 keys when the
  tail and the head dim are multiples of the vector width (AVX2: a tail of 8 keys, d = 8 or 16);
* the on-disk cache is not keyed by the vector width: code made for one is served to the other.

`make test` runs these tests, the score-modifier tests and the flex interop tests a second time
under ``ATEN_CPU_CAPABILITY=avx2``, so that an AVX-512 machine checks the AVX2 code too.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._inductor.cpu_vec_isa import pick_vec_isa

import sparseattn as sa
from sparseattn.engines import unsupported

pytestmark = [
    pytest.mark.avx2,
    pytest.mark.skipif(
        unsupported("flex", *(torch.zeros(1, 1, 1, 16),) * 3, sa.softmax(), 0.0, False) is not None,
        reason="FlexAttention cannot be compiled here",
    ),
]

VECTOR_FLOATS = pick_vec_isa().nelements(torch.float) if pick_vec_isa() else 8


def _inputs(n: int, d: int, heads: int = 2):
    """q, k, v drawn in float64 and rounded to float32; k is a view into a longer buffer
    whose keys past n give the last query a score of 1000·|q|²: a kernel that reads them
    and lets them reach the result is wrong for sure, not from run to run."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, n, d, generator=g, dtype=torch.float64).float() for _ in "qkv")
    past = 1e3 * q[:, :, -1:].expand(-1, -1, 16, -1)
    return q, torch.cat([k, past], dim=2)[:, :, :n], v


def _reference(q, k, v):
    s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(s, -1) @ v.double()


def _by_hand(q, k, v):
    """torch's compiled ``flex_attention`` with every key allowed (no sparseattn); compiled
    with the vector width as ``cpp.simdlen``, as the engine does, so that Inductor's cache
    does not serve it the other width's code."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    n = q.shape[-2]
    mask = create_block_mask(lambda b, h, i, j: j >= 0, None, None, n, n, device="cpu")
    bits = pick_vec_isa().bit_width() if pick_vec_isa() else None
    compiled = torch.compile(flex_attention, options={"cpp.simdlen": bits})
    with torch.no_grad():
        return compiled(q, k, v, block_mask=mask).double()


@pytest.mark.parametrize(("n", "d"), [(72, 16), (8, 8)])
def test_torch_kernel_reads_keys_past_the_tail_on_avx2_only(n, d):
    """The fault the engine works around, shown on torch's own call: wrong with 8 floats a
    vector, right with 16. When a torch release fixes it this test fails; then the head-dim
    padding in ``engines/flex.py`` (``_cpu_safe_head_dim``) can go."""
    q, k, v = _inputs(n, d)
    err = float((_by_hand(q, k, v) - _reference(q, k, v)).abs().max())
    if VECTOR_FLOATS == 8:
        assert err > 0.1, f"torch's kernel is right here now ({err:.2e}): drop the workaround"
    else:
        assert err < 1e-5


@pytest.mark.parametrize(
    ("n", "d"), [(8, 8), (72, 8), (136, 8), (8, 16), (72, 16), (136, 16), (128, 16), (72, 32)]
)
def test_engine_equals_float64_at_every_tail(n, d):
    """The flex engine on the same inputs, with tails of 8 keys (n = 8, 72, 136) and none
    (128), head dims that take the faulty branch on AVX2 (8, 16) and one that does not (32)."""
    q, k, v = _inputs(n, d)
    with torch.no_grad():
        out = sa.sparse_attention(q, k, v, sa.dense(), engine="flex").double()
    torch.testing.assert_close(out, _reference(q, k, v), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n", [8, 16, 72])
def test_a_nan_key_is_named_not_dropped(n):
    """torch's CPU kernel gives the rows that read a NaN key zeros (seen on AVX2 and AVX-512):
    the result alone cannot show it, so the engine reads k whole before the call (docs/engines.md,
    "Checks that read values")."""
    q, k, v = (t.contiguous() for t in _inputs(n, 4))
    for key in (0, n - 1):
        bad = k.clone()
        bad[0, 0, key, 0] = math.nan
        with pytest.raises(ValueError, match="^k contains NaN or inf"):
            sa.sparse_attention(q, bad, v, sa.window(2), engine="flex")


@pytest.mark.skipif(VECTOR_FLOATS != 16, reason="needs a CPU with AVX-512 to compare two widths")
def test_inductor_cache_keeps_the_two_widths_apart(tmp_path):
    """Two processes on one cache directory, the first emitting AVX2 code, the second AVX-512:
    without the engine's ``cpp.simdlen`` option the second is served the first's code and is
    wrong (seen at n = 64: 2.06 off)."""
    script = textwrap.dedent(
        """
        import torch, sparseattn as sa
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, 4, 64, 16, generator=g) for _ in "qkv")
        with torch.no_grad():
            out = sa.sparse_attention(q, k, v, sa.longformer(8, 2), engine="flex")
            ref = sa.sparse_attention(q, k, v, sa.longformer(8, 2), engine="dense")
        print(float((out - ref).abs().max()))
        """
    )
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    for capability in ("avx2", "avx512"):
        env["ATEN_CPU_CAPABILITY"] = capability
        run = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
        )
        assert run.returncode == 0, run.stderr[-2000:]
        assert float(run.stdout.split()[-1]) < 1e-5, (capability, run.stdout)
