"""Loading a sparsified model saved with ``save_pretrained``: :func:`from_pretrained` (the
configuration's form: :mod:`sparseattn.hf.persist`; docs/persistence.md)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

from ..serialize import pattern_from_config, prob_map_from_config
from .persist import saved_config
from .registry import sparsify

__all__ = ["apply_config", "from_pretrained"]


def _saved_tensors(path: str | os.PathLike, keys: set[str]) -> dict[str, torch.Tensor]:
    """The tensors ``keys`` of the checkpoint in folder ``path`` (safetensors, one file or
    sharded, or ``pytorch_model.bin``), read directly: transformers drops them on loading, as
    keys the fresh model does not have yet."""
    from safetensors import safe_open

    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    files: dict[str, list[str]] = {}
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        for key in keys & weight_map.keys():
            files.setdefault(os.path.join(path, weight_map[key]), []).append(key)
    elif os.path.isfile(single):
        files[single] = sorted(keys)
    out: dict[str, torch.Tensor] = {}
    for file, wanted in files.items():
        with safe_open(file, framework="pt") as f:
            out.update({key: f.get_tensor(key) for key in wanted if key in f.keys()})  # noqa: SIM118
    legacy = os.path.join(path, "pytorch_model.bin")
    if len(out) < len(keys) and os.path.isfile(legacy):
        state = torch.load(legacy, map_location="cpu", weights_only=True)
        out.update({key: state[key] for key in keys - out.keys() if key in state})
    missing = sorted(keys - out.keys())
    if missing:
        raise ValueError(
            f"the sparse configuration refers to learned tensors {missing[:4]} that the "
            f"checkpoint in {str(path)!r} does not hold"
        )
    return out


def _tensor_refs(value: Any) -> set[str]:
    if isinstance(value, dict):
        if set(value) == {"tensor"}:
            return {value["tensor"]}
        return set().union(*(_tensor_refs(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(_tensor_refs(v) for v in value))
    return set()


def apply_config(
    model: nn.Module, config: dict, path: str | os.PathLike | None = None
) -> nn.Module:
    """Sparsify ``model`` as ``config`` (a saved sparse configuration) says, layer by layer;
    learned tensors (mask logits, α) are read from the checkpoint in folder ``path``."""
    refs = _tensor_refs(config["layers"])
    if refs and path is None:
        raise ValueError("this sparse configuration holds learned tensors: pass the folder")
    tensors = _saved_tensors(path, refs) if refs else {}
    load = tensors.__getitem__
    for layer, entry in sorted(config["layers"].items(), key=lambda item: int(item[0])):
        if "unsaved" in entry:
            raise ValueError(
                f"layer {layer}'s sparse configuration was not saved ({entry['unsaved']}): "
                "sparsify the loaded model yourself, with the same arguments"
            )
        sparsify(
            model,
            None if entry["pattern"] is None else pattern_from_config(entry["pattern"], load),
            prob_map=prob_map_from_config(entry["prob_map"], load),
            engine=entry["engine"],
            layers=[int(layer)],
        )
    return model


def from_pretrained(path: str | os.PathLike, model_class: Any = None, **kwargs) -> nn.Module:
    """Load a model saved with ``save_pretrained`` after :func:`~sparseattn.hf.sparsify`, with
    its sparse attention: ``model_class.from_pretrained(path, **kwargs)`` (default
    ``transformers.AutoModel``; any task class, e.g. ``AutoModelForMaskedLM``), then every
    saved layer configured as it was. A folder without a sparse configuration loads as it is.

    Raises:
        ValueError: for a configuration written by a newer sparseattn (format), or a layer
            whose configuration could not be saved (a method hook, a learned mask or α).
    """
    if model_class is None:
        from transformers import AutoModel as model_class
    config = saved_config(path)
    if config is None:
        return model_class.from_pretrained(path, **kwargs)
    kwargs.setdefault("attn_implementation", config["original"])
    return apply_config(model_class.from_pretrained(path, **kwargs), config, path)
