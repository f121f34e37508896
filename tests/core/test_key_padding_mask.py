"""One meaning per name (issue 41): a parameter named ``key_padding_mask`` is True for keys to
ignore (padding), as in ``nn.MultiheadAttention`` and PyTorch's transformer layers, everywhere
in the package; the engines' mask is ``key_valid`` (True for real keys) and the old internal
name ``kpm`` is gone. Each public function taking ``key_padding_mask`` is checked by behaviour:
changing the values at the masked keys must not change the output — read the other way, the
real keys would be dropped and the output would change."""

from __future__ import annotations

import ast
import pathlib
import re

import torch

import sparseattn as sa
from sparseattn.lab.models.encoder import Encoder, EncoderConfig
from sparseattn.methods.mca import mca_attention
from sparseattn.methods.sparsefinder.pattern import PredictedPattern

PACKAGE = pathlib.Path(sa.__file__).parent

#: Every function of the package with a ``key_padding_mask`` parameter, and where it is
#: checked below (a new one must be added here and checked).
TAKES_IT = {
    ("attention.py", "sparse_attention"),
    ("attention.py", "attention_weights"),
    ("attention.py", "_key_validity"),  # the check and conversion every entry point uses
    ("module.py", "forward"),  # SparseAttention
    ("attention.py", "_sharded"),  # hands it to parallel's (test_parallel checks it)
    ("lab/models/encoder.py", "attend"),
    ("lab/models/encoder.py", "forward"),
    ("methods/mca/montecarlo.py", "mca_attention"),
    ("methods/mca/montecarlo.py", "__call__"),  # MCAMethod: hands it to mca_attention
    ("parallel/attention.py", "sparse_attention"),
    ("parallel/attention.py", "check"),
    ("methods/sparsefinder/pattern.py", "graph"),
    ("methods/sparsefinder/pattern.py", "build"),
    ("methods/sparsefinder/pattern.py", "_valid"),
}


def _functions_taking(name: str) -> set[tuple[str, str]]:
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.args + node.args.kwonlyargs + node.args.posonlyargs
                if name in {a.arg for a in args}:
                    found.add((path.relative_to(PACKAGE).as_posix(), node.name))
    return found


def test_every_key_padding_mask_parameter_is_listed_and_engines_take_key_valid():
    assert _functions_taking("key_padding_mask") <= TAKES_IT
    engines = {(p, f) for p, f in _functions_taking("key_padding_mask") if p.startswith("engines")}
    assert not engines  # the engines take key_valid (True = real key)
    assert _functions_taking("key_valid")  # ... which exists
    for path in PACKAGE.rglob("*.py"):
        assert not re.search(r"\bkpm\b|\bKPM\b", path.read_text()), path


def _padded(n=12, pad=3):
    mask = torch.zeros(2, n, dtype=torch.bool)
    mask[1, n - pad :] = True  # item 1: its last keys are padding
    return mask


def _perturbed(x, mask, value=50.0):
    """``x`` (B, H, n, d) with the masked keys' entries replaced."""
    return torch.where(mask[:, None, :, None], torch.full_like(x, value), x)


def test_sparse_attention_and_weights_ignore_the_masked_keys():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 2, 12, 8, dtype=torch.float64)
    mask = _padded()
    for prob_map in ("softmax", "entmax15"):
        call = dict(prob_map=prob_map, key_padding_mask=mask)
        out = sa.sparse_attention(q, k, v, sa.window(6), **call)
        moved = sa.sparse_attention(
            q, _perturbed(k, mask), _perturbed(v, mask), sa.window(6), **call
        )
        assert torch.equal(out, moved)
        w = sa.attention_weights(q, k, sa.window(6), **call)
        assert torch.equal(w, sa.attention_weights(q, _perturbed(k, mask), sa.window(6), **call))
        assert float(w[1, ..., -3:].abs().max()) == 0.0


def test_the_module_the_mca_function_and_the_encoder_ignore_the_masked_keys():
    torch.manual_seed(0)
    mask = _padded()
    layer = sa.SparseAttention(16, 2, pattern=sa.window(6)).double().eval()
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    x_moved = torch.where(mask[..., None], torch.full_like(x, 50.0), x)
    with torch.no_grad():
        real = ~mask[..., None]
        a, b = layer(x, key_padding_mask=mask), layer(x_moved, key_padding_mask=mask)
        assert torch.equal(a * real, b * real)

    q, k = torch.randn(2, 2, 2, 12, 8, dtype=torch.float64)
    w = torch.randn(2, 16, 8, dtype=torch.float64)  # (H, d_in, d_head)

    def mca(x, k):
        g = torch.Generator().manual_seed(1)
        return mca_attention(
            x, q, k, w, None, 0.5, sa.window(6), key_padding_mask=mask, generator=g
        )

    assert torch.equal(mca(x, k).out, mca(x_moved, _perturbed(k, mask)).out)

    model = Encoder(EncoderConfig(vocab_size=20, max_len=12, dim=16, heads=2, dropout=0.0)).eval()
    ids = torch.randint(0, 20, (2, 12))
    ids_moved = torch.where(mask, (ids + 7) % 20, ids)
    with torch.no_grad():
        a = model(ids, sa.window(6), key_padding_mask=mask)
        b = model(ids_moved, sa.window(6), key_padding_mask=mask)
    assert torch.allclose(a * ~mask[..., None], b * ~mask[..., None], atol=1e-6)


def test_the_predicted_pattern_reads_true_as_padding():
    mask = _padded()
    assert torch.equal(PredictedPattern._valid(mask, 2, 12), ~mask)
