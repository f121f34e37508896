"""Score modifiers (sparseattn.score_mods) on every engine and map, against references
written out here: the scaled scores modified by hand (s + bias, s − m_h·|i − j|,
c·tanh(s / c)), masked to the pattern and normalised by the map, in float64; outputs and the
gradients of q, k, v and a learned bias."""

from __future__ import annotations

import math

import pytest
import torch

import sparseattn as sa
from sparseattn import score_mods as sm
from sparseattn.engines import unsupported

pytestmark = [pytest.mark.device, pytest.mark.guard, pytest.mark.avx2]

B, H, N, D = 2, 4, 72, 16


def _inputs(n: int = N, dtype=torch.float64, kv_heads: int = H):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, n, D, generator=g, dtype=dtype)
    k, v = (torch.randn(B, kv_heads, n, D, generator=g, dtype=dtype) for _ in range(2))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_()


def _slopes(heads: int) -> torch.Tensor:
    """ALiBi's slopes for a power-of-two head count, written out: 2^(−8/H), 2^(−16/H), …"""
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)])


def _modified(kind: str | None, s: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    n_q, n_k = s.shape[-2:]
    if kind is None:
        return s
    if kind == "bias":
        return s + bias
    if kind == "alibi":
        i, j = torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
        return s - _slopes(s.shape[1]).view(-1, 1, 1).double() * (i - j).abs()
    if kind == "softcap":
        return 1.5 * torch.tanh(s / 1.5)
    if kind == "chain":  # soft-cap, then the bias
        return 2.0 * torch.tanh(s / 2.0) + bias
    raise AssertionError(kind)


def _mod(kind: str, bias: torch.Tensor):
    return {
        "bias": lambda: sm.bias(bias),
        "alibi": lambda: sm.alibi(H),
        "softcap": lambda: sm.softcap(1.5),
        "chain": lambda: sm.chain(sm.softcap(2.0), sm.bias(bias)),
    }[kind]()


def _reference(q, k, v, pattern, rho, kind, bias, key_padding_mask=None):
    """ρ(mod(s)) on the pattern's edges, float64, autograd (the maps' own tests check ρ)."""
    q, k, v = (t.double() for t in (q, k, v))
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (k, v))
    mask = pattern.build(q, k).to_dense().to(q.device)
    mask = mask.expand(q.shape[0], q.shape[1], -1, -1)
    if key_padding_mask is not None:
        mask = mask & ~key_padding_mask[:, None, None, :]
    s = _modified(kind, q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), bias.double())
    return sa.maps.resolve_prob_map(rho)(s, mask) @ v


PATTERNS = {
    "window": sa.window(8),
    "longformer": sa.longformer(8, 2),
    "random": sa.random(6, seed=1),
    "topk": sa.topk(9),  # data-dependent: one graph per (batch, head)
    "split": sa.split_heads(sa.window(4), sa.strided(8)),  # one graph per head
    "causal": sa.sliding_window(16, 2),
    "dense": sa.dense(),
}


def _check(engine, pattern, rho, kind, padded=False, tol=1e-9):
    q, k, v = _inputs()
    bias = torch.randn(1, H, N, N, dtype=torch.float64, requires_grad=True)
    kpm = None
    if padded:
        kpm = torch.zeros(B, N, dtype=torch.bool)
        kpm[1, -7:] = True
    out = sa.sparse_attention(
        q,
        k,
        v,
        pattern,
        prob_map=rho,
        engine=engine,
        score_mod=_mod(kind, bias),
        key_padding_mask=kpm,
    )
    ref = _reference(q, k, v, pattern, rho, kind, bias, kpm)
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    go = torch.randn_like(ref)
    inputs = (q, k, v, bias) if kind in ("bias", "chain") else (q, k, v)
    got = torch.autograd.grad(out, inputs, go)
    want = torch.autograd.grad(ref, inputs, go)
    for name, a, b in zip("qkvb", got, want, strict=False):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=f"gradient of {name}")


@pytest.mark.parametrize("engine", ["dense", "rows", "block", "gather", "auto"])
@pytest.mark.parametrize("kind", ["bias", "alibi", "softcap", "chain"])
@pytest.mark.parametrize("rho", ["softmax", "entmax15"])
def test_engines_against_reference(engine, kind, rho):
    for name in ("longformer", "topk", "split"):
        _check(engine, PATTERNS[name], rho, kind)


@pytest.mark.parametrize("engine", ["rows", "block", "gather"])
@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_patterns_with_padding_and_sparsemax(engine, name):
    _check(engine, PATTERNS[name], "sparsemax", "chain", padded=True)
    _check(engine, PATTERNS[name], "softmax", "bias", padded=True)


def test_dense_pattern_leaves_sdpa():
    """The dense pattern under ``auto`` goes to SDPA for softmax, except with a score_mod
    (the rows engine applies it); causal too."""
    _check("auto", sa.dense(), "softmax", "chain")
    _check("auto", sa.dense().causal(), "softmax", "alibi")


def test_a_plain_function_and_its_captured_tensor():
    """FlexAttention's convention: any function of (score, b, h, q_idx, kv_idx); a tensor in
    its closure gets its gradient."""
    q, k, v = _inputs()
    scale = torch.ones(H, dtype=torch.float64, requires_grad=True)

    def per_head(score, b, h, q_idx, kv_idx):
        return score * scale[h] + (b + 1).to(score.dtype) * 0.1

    for engine in ("dense", "block", "gather", "rows"):
        out = sa.sparse_attention(q, k, v, sa.window(8), engine=engine, score_mod=per_head)
        mask = sa.window(8).build(q, k).to_dense().to(q.device)
        s = q @ k.transpose(-1, -2) / 4.0 * scale.view(1, -1, 1, 1)
        s = s + torch.tensor([0.1, 0.2], dtype=torch.float64).view(-1, 1, 1, 1)
        ref = torch.softmax(s.masked_fill(~mask, -math.inf), -1) @ v
        torch.testing.assert_close(out, ref)
        (g,) = torch.autograd.grad(out.sum(), scale)
        (g_ref,) = torch.autograd.grad(ref.sum(), scale)
        torch.testing.assert_close(g, g_ref, msg=engine)


def test_gqa_and_half_precision():
    """h is the query head under grouped-query attention; bf16 inputs are computed in
    float32 and stay close to the float64 reference."""
    q, k, v = _inputs(kv_heads=2)
    bias = torch.randn(1, H, N, N, dtype=torch.float64)
    out = sa.sparse_attention(
        q, k, v, sa.window(8), score_mod=sm.alibi(H), enable_gqa=True, engine="block"
    )
    ref = _reference(q, k, v, sa.window(8), "softmax", "alibi", bias)
    torch.testing.assert_close(out, ref)
    qh, kh, vh = (t.detach().bfloat16() for t in (q, k, v))
    out = sa.sparse_attention(
        qh, kh, vh, sa.longformer(8, 2), score_mod=sm.softcap(1.5), enable_gqa=True
    )
    assert out.dtype == torch.bfloat16
    ref = _reference(qh, kh, vh, sa.longformer(8, 2), "softmax", "softcap", bias)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def _bait(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """k as a view into a longer buffer whose keys past n score 1000·|q_last|² with the last
    query: a kernel that reads keys past n and lets them reach the result goes wrong for sure
    (whatever memory holds), not from run to run."""
    past = 1e3 * q[:, :, -1:].expand(-1, -1, 16, -1)
    return torch.cat([k, past], dim=2)[:, :, : k.shape[2]]


@pytest.mark.parametrize("n", [72, 128])
@pytest.mark.parametrize("kind", [None, "bias", "alibi", "softcap", "chain"])
def test_flex_forward_equals_float64(kind, n):
    """The flex engine hands the modifier to FlexAttention (CPU: forward, compiled) and equals
    the float64 reference at lengths that are (128) and are not (72) multiples of its block, on
    inputs drawn in float64 and rounded, with keys past n that would show any read of them. On
    AVX2 (``ATEN_CPU_CAPABILITY=avx2``) torch's own kernel reads such keys at n = 72 with
    d = 16 (docs/engines.md, "Results that depend on the CPU's vector width")."""
    if unsupported("flex", *(torch.zeros(1, 1, 1, 16),) * 3, sa.softmax(), 0.0, True):
        pytest.skip("FlexAttention cannot run here")
    q, k, v = (t.detach().float() for t in _inputs(n))
    k = _bait(q, k)
    bias = torch.randn(1, H, n, n, generator=torch.Generator().manual_seed(1))
    pattern = sa.longformer(8, 2)
    with torch.no_grad():
        mod = None if kind is None else _mod(kind, bias)
        out = sa.sparse_attention(q, k, v, pattern, engine="flex", score_mod=mod)
    ref = _reference(q, k, v, pattern, "softmax", kind, bias.double())
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_alibi_slopes_follow_the_paper():
    # a host tensor (ALiBi with a head count computes its slopes on the device from h)
    torch.testing.assert_close(sm.alibi_slopes(8), _slopes(8).cpu())
    # 12 heads: the 8 of H = 8, then every other slope of H = 16
    want = torch.cat([_slopes(8), _slopes(16)[0::2][:4]])
    torch.testing.assert_close(sm.alibi_slopes(12), want.cpu())


def test_bad_score_mods_are_refused():
    q, k, v = _inputs()
    with pytest.raises(TypeError, match="score_mod must be callable"):
        sa.sparse_attention(q, k, v, sa.window(4), score_mod=3)
    with pytest.raises(ValueError, match="does not broadcast"):
        sa.sparse_attention(q, k, v, sa.window(4), score_mod=sm.bias(torch.zeros(1, 3, N, N)))
    with pytest.raises(ValueError, match="cap must be a positive"):
        sm.softcap(0.0)
    with pytest.raises(TypeError, match="slopes"):
        sm.alibi(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="at least one"):
        sm.chain()
    with pytest.raises(TypeError, match="bias must be a floating-point"):
        sm.bias(torch.zeros(3, dtype=torch.long))


def test_engines_declare_score_mods():
    """Every engine applies modifiers; the Triton kernels only the library's, which they
    take as a description (``Request.mod_kinds``, from ``score_mods.steps``): declared, so
    ``auto`` never picks them for another callable and ``engine="triton"`` says why."""
    import dataclasses

    from sparseattn.engines import SPECS, Request

    req = Request("cuda", torch.float32, sa.entmax(1.5), score_mod=True)  # kinds not known
    assert "score modifiers only" in " ".join(SPECS["triton"].not_supported_reasons(req))
    known = dataclasses.replace(req, mod_kinds=("softcap", "bias"))
    assert not any("modif" in r for r in SPECS["triton"].not_supported_reasons(known))
    twice = dataclasses.replace(req, mod_kinds=("bias", "softcap", "bias"))
    assert "2 × bias" in " ".join(SPECS["triton"].not_supported_reasons(twice))
    for name in ("dense", "rows", "block", "gather", "flex"):
        assert SPECS[name].score_mod and SPECS[name].mod_kinds is None, name
    q = k = v = torch.zeros(1, H, 8, D)
    bias = torch.zeros(1, H, 8, 8)
    assert Request.of(q, k, v, sa.entmax(1.5), 0.0, None).score_mod is False
    chained = Request.of(q, k, v, sa.entmax(1.5), 0.0, sm.chain(sm.softcap(2.0), sm.bias(bias)))
    assert chained.score_mod and chained.mod_kinds == ("softcap", "bias")
    plain = Request.of(q, k, v, sa.entmax(1.5), 0.0, lambda s, b, h, i, j: s)
    assert plain.score_mod and plain.mod_kinds is None
    assert sm.steps(sm.chain(sm.alibi(H), sm.chain(sm.softcap(1.0), sm.bias(bias))))
    assert sm.steps(sm.chain(sm.alibi(H), lambda s, b, h, i, j: s)) is None


def test_alibi_from_the_head_count_matches_its_slopes():
    """``alibi(H)`` computes the slopes from h (no tensor to move between devices); it equals
    ALiBi with the slopes given, also for a head count that is not a power of two."""
    s = torch.randn(1, 12, 5, 7, dtype=torch.float64)
    idx = (torch.zeros(1, 1, 1, 1, dtype=torch.long), torch.arange(12).view(1, -1, 1, 1))
    idx += (torch.arange(5).view(-1, 1), torch.arange(7))
    want = sm.alibi(sm.alibi_slopes(12).double().to(s.device))(s, *idx)
    torch.testing.assert_close(sm.alibi(12)(s, *idx), want)


def test_module_score_mod_trains_with_the_layer(device):
    """An nn.Module modifier (learned per-head slopes) is a submodule of SparseAttention and
    gets its gradient through the engines that recompute scores."""

    class LearnedSlopes(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.slopes = torch.nn.Parameter(torch.full((4,), 0.5))

        def forward(self, score, b, h, q_idx, kv_idx):
            return score - self.slopes[h] * (q_idx - kv_idx).abs().to(score.dtype)

    layer = sa.SparseAttention(32, 4, pattern=sa.longformer(6, 2), score_mod=LearnedSlopes())
    layer = layer.to(device)
    assert any(n.startswith("score_mod.") for n, _ in layer.named_parameters())
    x = torch.randn(2, 70, 32)
    grads = {}
    for engine in ("dense", "block", "gather"):
        layer.engine = engine
        layer.zero_grad()
        layer(x).square().sum().backward()
        grads[engine] = layer.score_mod.slopes.grad.clone()
    assert grads["dense"].abs().min() > 0
    for engine in ("block", "gather"):
        torch.testing.assert_close(grads[engine], grads["dense"], atol=1e-5, rtol=1e-4)


def test_attention_weights_take_the_modifier():
    q, k, _ = _inputs()
    bias = torch.randn(1, H, N, N, dtype=torch.float64)
    w = sa.attention_weights(q, k, sa.window(8), prob_map="sparsemax", score_mod=sm.bias(bias))
    mask = sa.window(8).build(q, k).to_dense().to(q.device).expand(B, H, -1, -1)
    s = _modified("bias", q @ k.transpose(-1, -2) / math.sqrt(D), bias)
    torch.testing.assert_close(w, sa.maps.resolve_prob_map("sparsemax")(s, mask))
    layer = sa.SparseAttention(32, 4, pattern=sa.window(8), score_mod=sm.softcap(30.0))
    assert "score_mod=softcap(30.0)" in repr(layer)
