"""A sparsified Hugging Face model as an artifact (docs/persistence.md): ``save_pretrained``
writes its sparse configuration into config.json, ``hf.from_pretrained`` gives back a model
whose outputs equal the saved one's (in a fresh process), the plain ``AutoModel`` path raises
instead of running dense, and a model saved whole with ``torch.save`` runs after
``import sparseattn.hf``. Random-weight models built from configs; nothing is downloaded."""

from __future__ import annotations

import json
import os

import pytest
import torch
from fresh import fresh
from tiny_models import tiny_bert, tiny_llama

import sparseattn as sa
from sparseattn import hf
from sparseattn.serialize import FORMAT

IDS = torch.randint(1, 99, (2, 20), generator=torch.Generator().manual_seed(0))
MASK = torch.ones(2, 20, dtype=torch.long)
MASK[1, 15:] = 0  # padding: the mask function must reach the kernel after loading


def _save(model, path, **inputs):
    with torch.no_grad():
        out = model(**inputs)
    model.save_pretrained(path)
    logits = getattr(out, "logits", None)
    torch.save(out.last_hidden_state if logits is None else logits, os.path.join(path, "ref.pt"))


CASES = {
    "softmax": dict(pattern=sa.window(4)),
    "entmax15": dict(pattern=sa.cycle(sa.window(4), sa.longformer(4, 1)), prob_map="entmax15"),
    "sparsemax": dict(pattern=sa.bigbird(4, 1, 1, 4), prob_map="sparsemax", engine="block"),
    "alpha13": dict(pattern=sa.split_heads(sa.window(2), sa.strided(4)), prob_map=sa.entmax(1.3)),
}


def test_save_pretrained_round_trips_in_a_fresh_process(tmp_path):
    for name, kwargs in CASES.items():
        _save(
            hf.sparsify(tiny_bert(), **kwargs), tmp_path / name, input_ids=IDS, attention_mask=MASK
        )
    one_layer = hf.sparsify(tiny_bert("BertForMaskedLM"), sa.window(2), layers=[1])
    _save(one_layer, tmp_path / "masked_lm", input_ids=IDS, attention_mask=MASK)
    decoder = hf.sparsify(tiny_llama(), sa.sliding_window(6, 1), prob_map="entmax15")
    _save(decoder, tmp_path / "llama", input_ids=IDS, attention_mask=MASK)
    saved = json.loads((tmp_path / "softmax" / "config.json").read_text())
    assert saved["attn_implementation"] == "sparseattn"
    assert saved["sparseattn"]["format"] == FORMAT
    got = fresh(
        f"""
        import json, torch, transformers
        import sparseattn.hf as hf
        d, ids, mask = {str(tmp_path)!r}, {IDS.tolist()!r}, {MASK.tolist()!r}
        ids, mask = torch.tensor(ids), torch.tensor(mask)
        classes = {{"masked_lm": transformers.AutoModelForMaskedLM,
                    "llama": transformers.AutoModelForCausalLM}}
        out = {{}}
        for name in {[*CASES, "masked_lm", "llama"]!r}:
            model = hf.from_pretrained(f"{{d}}/{{name}}", model_class=classes.get(name))
            with torch.no_grad():
                res = model(input_ids=ids, attention_mask=mask)
            res = getattr(res, "logits", None) if name in classes else res.last_hidden_state
            out[name] = float((res - torch.load(f"{{d}}/{{name}}/ref.pt")).abs().max())
        plain = transformers.AutoModel.from_pretrained(f"{{d}}/softmax")
        try:
            plain(input_ids=ids)
            out["plain"] = "ran"
        except hf.NotConfiguredError as err:
            out["plain"] = str(err)
        print(json.dumps(out))
        """
    )
    plain = got.pop("plain")
    assert got == dict.fromkeys([*CASES, "masked_lm", "llama"], 0.0)
    assert "hf.from_pretrained" in plain


def test_without_sparseattn_transformers_refuses_the_saved_model(tmp_path):
    hf.sparsify(tiny_bert(), sa.window(4)).save_pretrained(tmp_path)
    got = fresh(
        f"""
        import json, transformers
        try:
            transformers.AutoModel.from_pretrained({str(tmp_path)!r})
            print(json.dumps("loaded"))
        except ValueError as err:
            print(json.dumps(str(err)))
        """
    )
    assert "sparseattn" in got and "not supported" in got


def test_a_model_saved_whole_runs_after_import(tmp_path):
    model = hf.sparsify(tiny_bert(), sa.longformer(4, 1), prob_map="entmax15")
    with torch.no_grad():
        torch.save(model(input_ids=IDS).last_hidden_state, tmp_path / "ref.pt")
    torch.save(model, tmp_path / "model.pt")
    got = fresh(
        f"""
        import json, torch
        import sparseattn.hf
        d = {str(tmp_path)!r}
        model = torch.load(d + "/model.pt", weights_only=False)
        with torch.no_grad():
            out = model(input_ids=torch.tensor({IDS.tolist()!r})).last_hidden_state
        print(json.dumps(float((out - torch.load(d + "/ref.pt")).abs().max())))
        """
    )
    assert got == 0.0


def test_restore_forgets_the_configuration(tmp_path):
    model = hf.restore(hf.sparsify(tiny_bert(), sa.window(4)))
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "sparseattn" not in saved and saved.get("attn_implementation") != "sparseattn"


def test_a_newer_format_and_an_unsaved_layer_are_named(tmp_path):
    hf.sparsify(tiny_bert(), sa.window(4)).save_pretrained(tmp_path / "new")
    path = tmp_path / "new" / "config.json"
    config = json.loads(path.read_text())
    config["sparseattn"]["format"] = FORMAT + 1
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"format {FORMAT + 1}.*upgrade sparseattn"):
        hf.from_pretrained(tmp_path / "new")
    hf.sparsify(tiny_bert(), sa.window(4), method="mca", alpha=0.2).save_pretrained(
        tmp_path / "mca"
    )
    with pytest.raises(ValueError, match="layer 0's sparse configuration was not saved"):
        hf.from_pretrained(tmp_path / "mca")


def test_longformer_and_led_round_trip_in_a_fresh_process(tmp_path):
    """Longformer-style models (their own attention classes, not AttentionInterface): the
    configuration is saved and loaded the same way, entmax with a per-layer window and global
    tokens; the plain path raises at the layer instead of running transformers' attention."""
    import transformers

    ids = IDS[:, :18]
    glob = torch.zeros_like(ids)
    glob[0, 0], glob[1, [0, 5]] = 1, 1
    mask = MASK[:, :18]
    small = dict(vocab_size=99, num_attention_heads=4, attention_window=[4, 8])
    longformer = transformers.LongformerForMaskedLM(
        transformers.LongformerConfig(
            hidden_size=32,
            num_hidden_layers=2,
            intermediate_size=37,
            max_position_embeddings=80,
            **small,
        )
    ).eval()
    led = transformers.LEDModel(
        transformers.LEDConfig(
            d_model=32,
            encoder_layers=2,
            decoder_layers=1,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=37,
            decoder_ffn_dim=37,
            max_encoder_position_embeddings=64,
            max_decoder_position_embeddings=64,
            **small,
        )
    ).eval()
    hf.sparsify(longformer, prob_map="entmax15")  # its own windows, entmax
    hf.sparsify(led, sa.window(2), layers=[1])
    inputs = dict(input_ids=ids, attention_mask=mask, global_attention_mask=glob)
    _save(longformer, tmp_path / "longformer", **inputs)
    _save(led, tmp_path / "led", **inputs, decoder_input_ids=ids[:, :5])
    got = fresh(
        f"""
        import json, torch, transformers
        import sparseattn.hf as hf
        d = {str(tmp_path)!r}
        data = {[ids.tolist(), mask.tolist(), glob.tolist()]!r}
        ids, mask, glob = (torch.tensor(x) for x in data)
        inputs = dict(input_ids=ids, attention_mask=mask, global_attention_mask=glob)
        out = {{}}
        cases = (("longformer", transformers.AutoModelForMaskedLM, {{}}),
                 ("led", transformers.AutoModel, {{"decoder_input_ids": ids[:, :5]}}))
        for name, cls, extra in cases:
            model = hf.from_pretrained(f"{{d}}/{{name}}", model_class=cls)
            with torch.no_grad():
                res = model(**inputs, **extra)
            res = getattr(res, "logits", None) if name == "longformer" else res.last_hidden_state
            out[name] = float((res - torch.load(f"{{d}}/{{name}}/ref.pt")).abs().max())
            out[name + "_layers"] = sorted(hf.layer_specs(model))
            plain = cls.from_pretrained(f"{{d}}/{{name}}")
            try:
                plain(**inputs, **extra)
                out[name + "_plain"] = "ran"
            except hf.NotConfiguredError as err:
                out[name + "_plain"] = str(err)
        print(json.dumps(out))
        """
    )
    assert got["longformer"] == 0.0 and got["led"] == 0.0
    assert got["longformer_layers"] == [0, 1] and got["led_layers"] == [1]
    assert "layer 0" in got["longformer_plain"] and "hf.from_pretrained" in got["led_plain"]
    assert "layer 1" in got["led_plain"]
    hf.restore(led)
    assert not hasattr(led.config, "sparseattn")


def test_learned_masks_and_alpha_round_trip_through_save_pretrained(tmp_path):
    """SparseBERT's learned masks (one per layer) and a learned α (one per head, shared by
    the layers, a Parameter of the model) are buffers/parameters of the attention modules, so
    save_pretrained writes them; hf.from_pretrained reads them back in a fresh process."""
    from sparseattn.methods.sparsebert import DifferentiableAttentionMask

    model = tiny_bert()
    heads = model.config.num_attention_heads
    masks = DifferentiableAttentionMask(20, heads, num_layers=2, seed=3).extract()
    alpha = torch.nn.Parameter(torch.linspace(1.2, 1.9, heads).view(heads, 1, 1))
    hf.sparsify(model, masks, prob_map=sa.entmax(alpha))
    held = model.state_dict()
    names = hf.layer_names(model)
    assert f"{names[0]}.sparseattn_logits" in held and f"{names[1]}.sparseattn_logits" in held
    assert f"{names[0]}.sparseattn_alpha" in held  # held once, by layer 0
    assert f"{names[1]}.sparseattn_alpha" not in held
    assert any(p is alpha for p in model.parameters())  # trainable where it is
    _save(model, tmp_path / "learned", input_ids=IDS, attention_mask=MASK)
    got = fresh(
        f"""
        import json, torch
        import sparseattn.hf as hf
        d, ids, mask = {str(tmp_path / "learned")!r}, {IDS.tolist()!r}, {MASK.tolist()!r}
        model = hf.from_pretrained(d)
        with torch.no_grad():
            res = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask))
        diff = float((res.last_hidden_state - torch.load(f"{{d}}/ref.pt")).abs().max())
        print(json.dumps({{"diff": diff, "alpha": hf.layer_specs(model)[1].prob_map.recipe[1][0]
                          .flatten().tolist()}}))
        """
    )
    assert got["diff"] == 0.0
    assert got["alpha"] == pytest.approx(alpha.detach().flatten().tolist())
    hf.restore(model)
    assert not any("sparseattn_" in key for key in model.state_dict())


def test_bigbird_round_trips_in_a_fresh_process(tmp_path):
    """BigBird and BigBirdPegasus on their own configuration (block layout, eval quirk,
    1.5-entmax) and on a given pattern: saved, loaded in a fresh process with outputs equal;
    the plain path raises at the sparsified layer."""
    from test_hf_bigbird import tiny_bigbird, tiny_pegasus

    ids = torch.randint(1, 99, (2, 48), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 40:] = 0
    own = hf.sparsify(tiny_bigbird("BigBirdForMaskedLM"), prob_map="entmax15")
    _save(own, tmp_path / "bigbird", input_ids=ids, attention_mask=mask)
    given = hf.sparsify(tiny_pegasus(), sa.window(8), layers=[1])
    _save(
        given,
        tmp_path / "pegasus",
        input_ids=ids,
        attention_mask=mask,
        decoder_input_ids=ids[:, :6],
    )
    saved = json.loads((tmp_path / "bigbird" / "config.json").read_text())["sparseattn"]
    assert saved["layers"]["0"]["pattern"] is None  # the model's own layout
    got = fresh(
        f"""
        import json, torch, transformers
        import sparseattn.hf as hf
        d = {str(tmp_path)!r}
        ids, mask = torch.tensor({ids.tolist()!r}), torch.tensor({mask.tolist()!r})
        cases = (("bigbird", transformers.AutoModelForMaskedLM, {{}}),
                 ("pegasus", transformers.AutoModelForSeq2SeqLM,
                  {{"decoder_input_ids": ids[:, :6]}}))
        out = {{}}
        for name, cls, extra in cases:
            model = hf.from_pretrained(f"{{d}}/{{name}}", model_class=cls).eval()
            with torch.no_grad():
                res = model(input_ids=ids, attention_mask=mask, **extra).logits
            out[name] = float((res - torch.load(f"{{d}}/{{name}}/ref.pt")).abs().max())
            plain = cls.from_pretrained(f"{{d}}/{{name}}").eval()
            try:
                plain(input_ids=ids, attention_mask=mask, **extra)
                out[name + "_plain"] = "ran"
            except hf.NotConfiguredError as err:
                out[name + "_plain"] = str(err)
        print(json.dumps(out))
        """
    )
    assert got["bigbird"] == 0.0 and got["pegasus"] == 0.0
    assert "hf.from_pretrained" in got["bigbird_plain"] and "layer 1" in got["pegasus_plain"]
