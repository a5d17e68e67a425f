"""safetensors KV dumps: ``layers.{i}.keys``, ``layers.{i}.values`` and string metadata."""

from __future__ import annotations

import json
import os
import re
from typing import Any, Sequence

from safetensors import SafetensorError, safe_open
from safetensors.torch import save

import torch

from kvcodec.errors import CorruptDataError
from kvcodec.files import write_atomically
from kvcodec.formats.v1 import MAGIC

FORMAT_TAG = "kvcodec-kv-dump"
_NAME = re.compile(r"layers\.(\d+)\.(keys|values)")
_JSON_FIELDS = ("token_ids", "positions")
# What a reader of a foreign file needs to know to make a dump (said in every error about the tensors)
LAYOUT = ("a KV dump holds tensors layers.{i}.keys and layers.{i}.values for i = 0..L-1, each [heads, tokens, "
          "head_dim], float16, bfloat16 or float32")


def save_safetensors(layers: Sequence[tuple[torch.Tensor, torch.Tensor]], meta: dict[str, Any],
                     path: str | os.PathLike[str]) -> None:
    """Write ``(keys, values)`` per layer and a cache's ``meta`` to ``path`` atomically (tensors made contiguous;
    metadata as strings, lists as JSON)."""
    tensors = {}
    for i, (keys, values) in enumerate(layers):
        tensors[f"layers.{i}.keys"] = keys.contiguous().cpu()
        tensors[f"layers.{i}.values"] = values.contiguous().cpu()
    out = {"format": FORMAT_TAG}
    for k, v in meta.items():
        out[k] = json.dumps(v) if k in _JSON_FIELDS else str(v)
    write_atomically(path, save(tensors, metadata=out))


def read_safetensors(path: str | os.PathLike[str]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], dict[str, Any]]:
    """Read a dump as ``(keys, values)`` per layer and the cache's metadata; the layer numbering must be complete
    (0..L-1, keys and values)."""
    try:
        with safe_open(os.fspath(path), framework="pt") as f:
            meta = f.metadata() or {}
            names = list(f.keys())
            found: dict[int, dict[str, Any]] = {}
            for name in names:
                m = _NAME.fullmatch(name)
                if m is None:
                    raise CorruptDataError(f"{path}: unexpected tensor {name!r}: {LAYOUT}")
                found.setdefault(int(m.group(1)), {})[m.group(2)] = f.get_tensor(name)
    except SafetensorError as e:
        with open(path, "rb") as f:
            if f.read(len(MAGIC)) == MAGIC:
                raise CorruptDataError(f"{path} is a kvcodec container, not a KV dump; use kvcodec decode or info") from None
        raise CorruptDataError(f"{path}: not a readable safetensors file: {e}") from None
    if sorted(found) != list(range(len(found))) or any(len(v) != 2 for v in found.values()):
        raise CorruptDataError(f"{path}: layers must be numbered 0..L-1, each with keys and values: {LAYOUT}")
    kwargs: dict[str, Any] = {}
    for k in ("model", "rope", *_JSON_FIELDS):
        if k in meta:
            try:
                kwargs[k] = json.loads(meta[k]) if k in _JSON_FIELDS else meta[k]
            except ValueError:
                raise CorruptDataError(f"{path}: metadata {k!r} is not valid JSON") from None
    return [(found[i]["keys"], found[i]["values"]) for i in range(len(found))], kwargs
