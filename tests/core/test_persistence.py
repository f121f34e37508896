"""Saving and loading (docs/persistence.md): every map, pattern, learned α and learned mask
survives ``torch.save`` / ``torch.load`` and ``copy.deepcopy`` without its caches; a learned
mask is in the state dict; a sparsified Hugging Face model saved with ``save_pretrained`` comes
back configured through ``hf.from_pretrained`` and never silently dense. Round trips are
checked in a fresh process (what a user who saves and later loads does), against the outputs
computed before saving: equal, not close.
"""

from __future__ import annotations

import copy
import io
import json

import pytest
import torch
from fresh import fresh

import sparseattn as sa
from sparseattn import serialize
from sparseattn.methods.sparsebert import DifferentiableAttentionMask
from sparseattn.patterns import NAMED

MAPS = {
    "softmax": "softmax",
    "entmax15": "entmax15",
    "sparsemax": "sparsemax",
    "alpha13": sa.entmax(1.3),
    "sparselin": sa.sparselin_gen(0.3),
    "hardmax": "hardmax",
}


def _layers() -> dict[str, sa.SparseAttention]:
    torch.manual_seed(0)
    layers = {
        name: sa.SparseAttention(32, 2, pattern=sa.bigbird(4, 1, 1, 4), prob_map=rho)
        for name, rho in MAPS.items()
    }
    layers["learn_alpha"] = sa.SparseAttention(
        32, 2, pattern=sa.window(4), prob_map="entmax15", learn_alpha=True
    )
    with torch.no_grad():
        layers["learn_alpha"].alpha_logit.copy_(torch.tensor([-1.0, 0.7]))
    mask = DifferentiableAttentionMask(24, 2, seed=3).extract()
    layers["learned_mask"] = sa.SparseAttention(32, 2, pattern=mask, prob_map="sparsemax")
    return layers


def test_layers_round_trip_through_torch_save_in_a_fresh_process(tmp_path):
    x = torch.randn(2, 24, 32, generator=torch.Generator().manual_seed(1))
    torch.save(x, tmp_path / "x.pt")
    for name, layer in _layers().items():
        layer.eval()
        for n in (8, 16, 24):  # caches at several lengths: not in the file
            layer(x[:, :n])
        with torch.no_grad():
            torch.save(layer(x), tmp_path / f"{name}.out.pt")
        torch.save(layer, tmp_path / f"{name}.pt")
    got = fresh(
        f"""
        import json, torch
        d = {str(tmp_path)!r}
        x = torch.load(d + "/x.pt")
        out = {{}}
        for name in {sorted(_layers())!r}:
            layer = torch.load(d + f"/{{name}}.pt", weights_only=False)
            with torch.no_grad():
                out[name] = float((layer(x) - torch.load(d + f"/{{name}}.out.pt")).abs().max())
        print(json.dumps(out))
        """
    )
    assert got == dict.fromkeys(sorted(_layers()), 0.0)


@pytest.mark.parametrize("name", sorted(NAMED))
def test_patterns_pickle_and_copy_without_their_caches(name):
    factory, kwargs = NAMED[name]
    pattern = factory(**kwargs)
    fresh = len(pickle_bytes(pattern))
    q = torch.randn(1, 1, 64, 8)
    for n in (16, 32, 64):  # graphs, drawn tables, device copies
        pattern.build(q[:, :, :n], q[:, :, :n])
        if not pattern.data_dependent:
            pattern.allows(torch.arange(4), torch.arange(4), n)
    assert len(pickle_bytes(pattern)) == fresh
    for other in (
        copy.deepcopy(pattern),
        torch.load(io.BytesIO(pickle_bytes(pattern)), weights_only=False),
    ):
        assert repr(other) == repr(pattern)
        got, want = other.build(q, q).to_dense(), pattern.build(q, q).to_dense()
        assert torch.equal(got, want)


def pickle_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.mark.parametrize("name", sorted(MAPS))
def test_maps_copy_and_pickle(name):
    rho = sa.maps.resolve_prob_map(MAPS[name])
    s = torch.randn(3, 7, dtype=torch.float64)
    for other in (
        copy.deepcopy(rho),
        torch.load(io.BytesIO(pickle_bytes(rho)), weights_only=False),
    ):
        assert repr(other) == repr(rho)
        assert torch.equal(other(s), rho(s))


def test_a_tensor_alpha_pickles_with_its_tensor():
    alpha = torch.tensor([[1.2], [1.7], [2.5]], dtype=torch.float64)
    rho = sa.entmax(alpha)
    s = torch.randn(3, 7, dtype=torch.float64)
    assert torch.equal(copy.deepcopy(rho)(s), rho(s))


def test_a_learned_mask_is_in_the_state_dict():
    """Loading the weights of a layer into one built with another mask gives the first
    layer's outputs (before: "All keys matched" and outputs 0.044 apart)."""
    torch.manual_seed(0)
    a = sa.SparseAttention(32, 2, pattern=DifferentiableAttentionMask(16, 2, seed=1).extract())
    b = sa.SparseAttention(32, 2, pattern=DifferentiableAttentionMask(16, 2, seed=2).extract())
    assert "pattern_logits" in a.state_dict()
    x = torch.randn(2, 16, 32)
    with torch.no_grad():
        assert not torch.equal(a(x), b(x))
        b.load_state_dict(a.state_dict())
        assert torch.equal(a(x), b(x))
    plain = sa.SparseAttention(32, 2, pattern=sa.window(4))
    with pytest.raises(RuntimeError, match="pattern_logits"):  # not silently dropped
        plain.load_state_dict(a.state_dict())


@pytest.mark.parametrize("name", sorted(NAMED))
def test_pattern_configs_are_json_and_give_the_same_graph(name):
    factory, kwargs = NAMED[name]
    pattern = factory(**kwargs)
    config = json.loads(json.dumps(serialize.pattern_config(pattern)))
    other = serialize.pattern_from_config(config)
    assert repr(other) == repr(pattern)
    q = torch.randn(1, 2, 48, 8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(other.build(q, q).to_dense(), pattern.build(q, q).to_dense())


def test_configs_refuse_state_and_foreign_classes():
    mask = DifferentiableAttentionMask(8, 2, seed=0).extract()
    with pytest.raises(TypeError, match="tensor"):
        serialize.pattern_config(mask)
    with pytest.raises(TypeError, match="tensor"):
        serialize.prob_map_config(sa.entmax(torch.full((2, 1, 1), 1.5)))
    with pytest.raises(ValueError, match="sparseattn's classes only"):
        serialize.pattern_from_config({"pattern": "os.system", "fields": {}})
    with pytest.raises(ValueError, match="no pattern class"):
        serialize.pattern_from_config({"pattern": "sparseattn.patterns.fixed.Nope", "fields": {}})
