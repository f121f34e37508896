"""SparseBERT's differentiable attention mask (DAM), its extraction, and attention without the
diagonal — against brute-force references (explicit loops over (i, j), hand-masked ρ)."""

from __future__ import annotations

import json
import math

import pytest
import torch

import sparseattn as sa
from sparseattn.lab.models import Encoder, EncoderConfig
from sparseattn.maps import resolve_prob_map
from sparseattn.methods.sparsebert import (
    DifferentiableAttentionMask,
    LearnedMaskPattern,
    dense_no_diagonal,
    kept_by_offset,
    no_diagonal,
)
from sparseattn.patterns import PatternCycle

pytestmark = [pytest.mark.device, pytest.mark.guard]

MAPS = ["softmax", "sparsemax", "entmax15"]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, compared on the host (graphs live there; the tests' tensors may not)."""
    return torch.equal(a.cpu(), b.cpu())


@pytest.fixture
def modules_on_device(device, monkeypatch):
    """The DAMs and encoders the test builds live on the run's device (``--device``), as the
    tensors it makes do (tests/conftest.py)."""
    if device.type == "cpu":
        return
    for cls in (DifferentiableAttentionMask, Encoder):

        def init(self, *args, _init=cls.__init__, **kwargs):
            _init(self, *args, **kwargs)
            self.to(device)

        monkeypatch.setattr(cls, "__init__", init)


def qkv(b=2, h=3, n=12, d=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=g, dtype=dtype) for _ in range(3))


def dam_attention(q, k, v, bias, rho):
    """ρ(QKᵀ/√d + bias) V on dense scores — the DAM training path, written out."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias
    return resolve_prob_map(rho)(scores) @ v


def randomised(dam: DifferentiableAttentionMask, seed: int = 1, scale: float = 2.0):
    """Spread the logits (as if trained) so that roughly half the entries are kept."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        dam.logits.copy_(torch.randn(dam.logits.shape, generator=g) * scale)
    return dam


# --------------------------------------------------------------------------- straight-through
@pytest.mark.parametrize("structured", [False, True])
def test_straight_through_gradient_reaches_the_logits(structured, modules_on_device):
    torch.manual_seed(0)
    q, k, v = qkv(dtype=torch.float32)
    dam = DifferentiableAttentionMask(12, 3, structured=structured, lam=0.0)
    dam.train()
    bias, _, mask = dam(12, generator=torch.Generator().manual_seed(0))
    assert set(mask.detach().unique().tolist()) <= {0.0, 1.0}  # forward is the hard sample
    out = dam_attention(q, k, v, dam.for_layer(bias, 0), "softmax")
    (out * torch.randn_like(out)).sum().backward()
    grad = dam.logits.grad
    assert grad is not None and torch.isfinite(grad).all()
    assert grad.abs().sum() > 0


def test_penalty_is_lambda_times_the_count_of_kept_entries(modules_on_device):
    dam = randomised(DifferentiableAttentionMask(10, 2, lam=0.3))
    dam.train()
    mask = dam.sample(7, generator=torch.Generator().manual_seed(3))
    kept = sum(int(mask[0, h, i, j] == 1) for h in range(2) for i in range(7) for j in range(7))
    assert dam.penalty(mask).item() == pytest.approx(0.3 * kept)
    dam.normalized = True
    assert dam.penalty(mask).item() == pytest.approx(0.3 * kept / (2 * 7 * 7))
    dam.penalty(mask).backward()
    assert dam.logits.grad.abs().sum() > 0  # the penalty's gradient reaches the logits too


@pytest.mark.parametrize("structured", [False, True])
def test_relaxed_mask_equals_hard_mask_as_tau_goes_to_zero(structured, modules_on_device):
    dam = randomised(DifferentiableAttentionMask(9, 2, structured=structured))
    errors = []
    for tau in (1.0, 1e-2, 1e-4, 1e-7):
        dam.tau = tau
        soft, hard, z = dam.relaxed(9, noise=True, generator=torch.Generator().manual_seed(5))
        away = z.detach().abs() > 1e-3  # entries not sitting on the threshold itself
        assert away.float().mean() > 0.99
        errors.append(float((soft.detach() - hard.to(soft.dtype))[away].abs().max()))
    assert errors == sorted(errors, reverse=True) and errors[0] > 0.1
    assert errors[-1] == 0.0  # σ(z/τ) is exactly 1[z > 0] at τ = 1e-7


# --------------------------------------------------------------------------- extraction
def _with_empty_rows(dam):
    """Logits with a few rows left without any positive entry (the empty-row rule applies)."""
    randomised(dam)
    with torch.no_grad():
        if dam.structured:
            dam.logits[0, 0] = -torch.arange(1.0, dam.max_len + 1)  # head 0 drops every offset
        else:
            dam.logits[0, 0, 3, :] = -1.0 - torch.rand(dam.max_len)
            dam.logits[0, 0, :, 3] = dam.logits[0, 0, 3, :]  # symmetric case: mirror
    return dam


@pytest.mark.parametrize("rho", MAPS)
@pytest.mark.parametrize("structured,symmetric", [(False, False), (False, True), (True, True)])
@pytest.mark.parametrize("engine", ["dense", "gather"])
def test_extracted_pattern_reproduces_the_dam_attention(
    rho, structured, symmetric, engine, modules_on_device
):
    n = 12
    dam = _with_empty_rows(
        DifferentiableAttentionMask(n, 3, structured=structured, symmetric=symmetric)
    )
    dam.eval()
    q, k, v = qkv(n=n)
    bias = dam.bias(dam.sample(n)).double()[0]
    expected = dam_attention(q, k, v, bias, rho)
    pattern = dam.extract()
    assert isinstance(pattern, LearnedMaskPattern)
    got = sa.sparse_attention(q, k, v, pattern, prob_map=rho, engine=engine)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    reference = brute_force_learned(dam, n)
    for h in range(3):
        assert same(pattern.graph(n)[h].to_dense(), reference[h])


def brute_force_learned(dam, n):
    """The documented rule, with loops: keep (i, j) iff ℓ_ij > 0; DAM_u: an empty row keeps its
    first argmax entry (and its mirror when ℓ is symmetric); DAM_s: if no offset
    d ≤ ⌈(n − 1)/2⌉ is kept, keep the best of those."""
    heads = dam.num_heads
    out = torch.zeros(heads, n, n, dtype=torch.bool)
    for h in range(heads):
        if dam.structured:
            m = dam.logits[0, h].detach()
            kept = {d for d in range(n) if m[d] > 0}
            reach = math.ceil((n - 1) / 2)
            if not any(d <= reach for d in kept):
                best = max(m[d] for d in range(reach + 1))
                kept |= {d for d in range(reach + 1) if m[d] == best}
            for i in range(n):
                for j in range(n):
                    out[h, i, j] = abs(i - j) in kept
            continue
        full = dam.full_logits(n)[0, h].detach()
        mirror = all(full[i, j] == full[j, i] for i in range(n) for j in range(n))
        for i in range(n):
            row = [j for j in range(n) if full[i, j] > 0]
            if not row:  # the first entry of the row maximum; mirrored when ℓ is symmetric
                top = full[i].max()
                j = min(j for j in range(n) if full[i, j] == top)
                out[h, i, j] = True
                if mirror:
                    out[h, j, i] = True
            out[h, i, row] = True
    return out


@pytest.mark.parametrize("rho", MAPS)
def test_dropped_entries_get_exactly_zero_weight(rho, modules_on_device):
    n = 10
    dam = randomised(DifferentiableAttentionMask(n, 2))
    dam.eval()
    q, k, _ = qkv(h=2, n=n, dtype=torch.float32)
    mask = dam.sample(n)[0]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + dam.bias(mask)
    weights = resolve_prob_map(rho)(scores)
    assert (weights[:, mask == 0] == 0).all()  # float32, bias −1e4: exact zeros


@pytest.mark.parametrize("shared", [True, False])
def test_encoder_with_extracted_pattern_equals_encoder_with_dam_bias(shared, modules_on_device):
    torch.manual_seed(0)
    n, layers = 16, 2
    model = Encoder(EncoderConfig(vocab_size=50, max_len=n, dim=16, heads=2, layers=layers))
    model.double().eval()
    dam = _with_empty_rows(
        DifferentiableAttentionMask(n, 2, symmetric=True, num_layers=None if shared else layers)
    )
    dam.eval()
    ids = torch.randint(50, (3, n))
    bias, _, _ = dam(n)
    pattern = dam.extract()
    assert isinstance(pattern, LearnedMaskPattern if shared else PatternCycle)
    with torch.no_grad():
        a = model(ids, attn_bias=bias)
        b = model(ids, pattern=pattern)
    torch.testing.assert_close(b, a, atol=1e-6, rtol=0)
    if not shared:  # and SparseAttention takes layer l's mask from the cycle
        layer = sa.SparseAttention(16, 2, pattern=pattern, layer_index=1)
        assert layer.pattern is pattern[1]


def test_learned_pattern_predicate_and_shorter_lengths(modules_on_device):
    dam = randomised(DifferentiableAttentionMask(12, 2))
    pattern = dam.extract()
    for n in (5, 12):
        graph = pattern.graph(n)
        assert graph.batch_shape == (2,)
        i, j = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
        assert same(pattern.allows(i, j, n), graph.to_dense())
        heads = torch.arange(2)[:, None, None]
        assert same(pattern.allows_head(heads, i, j, n), graph.to_dense())
        hard = dam.hard_mask(n)[0]  # the DAM at length n agrees with the pattern at length n
        assert same(hard, graph.to_dense())
    assert 0 < float(pattern.graph(12).sparsity.mean()) < 1


# --------------------------------------------------------------------------- structure
def test_structured_mask_is_toeplitz_and_symmetric(modules_on_device):
    n = 11
    dam = randomised(DifferentiableAttentionMask(16, 3, structured=True))
    dam.train()
    m = dam.logits.detach()[0]
    full = dam.full_logits(n)[0].detach()
    sample = dam.sample(n, generator=torch.Generator().manual_seed(0))[0].detach()
    for h in range(3):
        for i in range(n):
            for j in range(n):
                assert full[h, i, j] == m[h, abs(i - j)]
                assert sample[h, i, j] == sample[h, 0, abs(i - j)]  # one draw per offset
    assert same(sample, sample.transpose(-1, -2))


def test_symmetric_unstructured_mask_is_symmetric(modules_on_device):
    dam = randomised(DifferentiableAttentionMask(10, 2, symmetric=True))
    dam.train()
    for seed in range(3):
        s = dam.sample(10, generator=torch.Generator().manual_seed(seed)).detach()
        assert same(s, s.transpose(-1, -2))
    assert same(dam.hard_mask(), dam.hard_mask().transpose(-1, -2))
    free = randomised(DifferentiableAttentionMask(10, 2, symmetric=False))
    assert not same(free.hard_mask(), free.hard_mask().transpose(-1, -2))


def test_kept_by_offset_brute_force():
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(2, 3, 7, 7, generator=g) > 0.5
    got = kept_by_offset(mask)
    for d in range(7):
        cells = [
            mask[a, b, i, j]
            for a in range(2)
            for b in range(3)
            for i in range(7)
            for j in range(7)
            if abs(i - j) == d
        ]
        assert got[d].item() == pytest.approx(sum(map(float, cells)) / len(cells))


# --------------------------------------------------------------------------- validation
def test_bad_configurations_give_clear_errors(modules_on_device):
    dam = DifferentiableAttentionMask(8, 2)
    with pytest.raises(ValueError, match="exceeds max_len=8"):
        dam.sample(9)
    with pytest.raises(ValueError, match="exceeds max_len=8"):
        dam(16)
    with pytest.raises(ValueError, match="exceeds"):
        dam.extract().graph(9)
    with pytest.raises(ValueError, match="exceeds"):
        q, k, v = qkv(n=9)
        sa.sparse_attention(q, k, v, dam.extract())
    with pytest.raises(ValueError, match="lam"):
        DifferentiableAttentionMask(8, 2, lam=-1e-3)
    for tau in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="tau"):
            DifferentiableAttentionMask(8, 2, tau=tau)
    with pytest.raises(ValueError, match="tau"):
        dam.tau = 0.0
    with pytest.raises(ValueError, match="bias_value"):
        DifferentiableAttentionMask(8, 2, bias_value=1.0)
    with pytest.raises(ValueError, match="num_heads"):
        DifferentiableAttentionMask(8, 0)
    with pytest.raises(ValueError, match="heads"):  # 2 learned heads, 3 attention heads
        q, k, v = qkv(h=3, n=8)
        sa.sparse_attention(q, k, v, dam.extract())


# --------------------------------------------------------------------------- no diagonal
def brute_force(n, rule):
    return torch.tensor([[rule(i, j) for j in range(n)] for i in range(n)])


def window_rule(w):  # Yun eq. (4) A¹, 0-based
    return lambda i, j: -math.ceil(w / 2) <= j - i <= w // 2


def strided_rule(w):  # Yun eq. (4) A¹ ∪ A²
    return lambda i, j: window_rule(w)(i, j) or (j - i) % w == 0


def longformer_rule(w, g):
    return lambda i, j: window_rule(w)(i, j) or i < g or j < g


@pytest.mark.parametrize("n", [2, 3, 8, 17])
@pytest.mark.parametrize(
    "pattern,rule",
    [
        (sa.dense(), lambda i, j: True),
        (sa.window(4), window_rule(4)),
        (sa.strided(3), strided_rule(3)),
        (sa.longformer(2, 1), longformer_rule(2, 1)),
    ],
    ids=["dense", "window", "strided", "longformer"],
)
def test_no_diagonal_edges_equal_brute_force_minus_diagonal(n, pattern, rule):
    expected = brute_force(n, lambda i, j: rule(i, j) and i != j)
    nd = no_diagonal(pattern)
    assert same(nd.graph(n).to_dense(), expected)
    i, j = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    assert same(nd.allows(i, j, n), expected)


def test_no_diagonal_of_per_head_and_data_dependent_patterns(modules_on_device):
    dam = randomised(DifferentiableAttentionMask(10, 2))
    learned = dam.extract()
    nd = no_diagonal(learned)
    hard = dam.hard_mask()[0]
    expected = hard & ~torch.eye(10, dtype=torch.bool)
    if (expected.sum(-1) > 0).all():
        assert same(nd.graph(10).to_dense(), expected)
    q, k, v = qkv(h=2, n=10)
    topk = no_diagonal(sa.topk(4))
    graph = topk.build(q, k)
    scores = q @ k.transpose(-1, -2)
    top = scores.topk(4, dim=-1).indices
    ref = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top, True)
    assert same(graph.to_dense(), ref & ~torch.eye(10, dtype=torch.bool))


def test_no_diagonal_empty_rows_are_an_error_at_use():
    with pytest.raises(ValueError, match="without its diagonal"):
        no_diagonal(sa.window(1)).graph(
            6
        )  # row 0's only key was itself... and window(1) = {k−1, k}
    with pytest.raises(ValueError, match="without its diagonal"):
        dense_no_diagonal().graph(1)
    q, k, v = qkv(n=6)
    with pytest.raises(ValueError, match="no allowed key|without its diagonal"):
        sa.sparse_attention(q, k, v, dense_no_diagonal().causal())  # query 0: no key < 0
    with pytest.raises(TypeError, match="Pattern"):
        no_diagonal("dense")


@pytest.mark.parametrize("rho", MAPS)
def test_dense_no_diagonal_attention_against_hand_masked_scores(rho):
    q, k, v = qkv(n=9)
    scores = q @ k.transpose(-1, -2) / math.sqrt(8)
    valid = ~torch.eye(9, dtype=torch.bool)
    expected = resolve_prob_map(rho)(scores, valid) @ v
    for engine in ("dense", "gather"):
        got = sa.sparse_attention(q, k, v, dense_no_diagonal(), prob_map=rho, engine=engine)
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=0)
    assert dense_no_diagonal().graph(9).sparsity == pytest.approx(1 / 9)


# --------------------------------------------------------------------------- experiment
def test_tiny_run_writes_json_and_resumes(tmp_path):
    from sparseattn.lab.experiments.dam import DamConfig, run

    config = DamConfig(
        seq_len=16,
        dim=16,
        heads=2,
        layers=1,
        batch_size=2,
        warm_steps=2,
        dam_steps=3,
        finetune_steps=2,
        warmup=1,
        lambdas=(1e-2,),
        variants=("structured",),
        baselines=("dense", "dense_no_diagonal"),
        eval_draws=1,
        log_every=1,
        out_dir=str(tmp_path),
        progress=False,
    )
    first = run(config)
    folder = tmp_path / config.run_name()
    cells = sorted(p.name for p in (folder / "cells").glob("*.json"))
    assert cells == ["dam_s-lam0.01.json", "pattern-dense.json", "pattern-dense_no_diagonal.json"]
    assert len(first["trained_now"]) == 3
    metrics = json.loads((folder / "metrics.json").read_text())
    rows = {r["cell"]: r for r in metrics["summary"]["rows"]}
    assert rows["pattern-dense"]["sparsity"] == 0.0
    assert rows["pattern-dense_no_diagonal"]["sparsity"] == pytest.approx(1 / 16)
    assert rows["dam_s-lam0.01"]["extract_max_abs_diff"] <= 1e-5  # float32 kernels
    assert math.isfinite(rows["dam_s-lam0.01"]["retrained_loss"])
    assert (folder / "warm.pt").exists() and (folder / "warm.json").exists()
    for row in rows.values():
        assert math.isfinite(row["val_loss"]) and 0 <= row["val_acc"] <= 1
    for fig in ("sparsity_quality.png", "masks.png", "offsets.png"):
        assert (folder / fig).stat().st_size > 0
    stamps = {p: p.stat().st_mtime_ns for p in (folder / "cells").glob("*.json")}
    second = run(config)
    assert second["trained_now"] == [] and len(second["skipped"]) == 3
    assert {p: p.stat().st_mtime_ns for p in (folder / "cells").glob("*.json")} == stamps
    with pytest.raises(ValueError, match="different config"):
        run(DamConfig(**{**config.__dict__, "dam_steps": 4, "run": config.run_name()}))
