"""safetensors KV dumps: ``layers.{i}.keys``, ``layers.{i}.values`` and string metadata."""

from __future__ import annotations

import json
import os
import re
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError, safe_open
from safetensors.torch import save

import torch

from kvcodec.errors import CorruptDataError
from kvcodec.files import write_atomically

if TYPE_CHECKING:
    from kvcodec.cache import KVCache

FORMAT_TAG = "kvcodec-kv-dump"
_NAME = re.compile(r"layers\.(\d+)\.(keys|values)")
_JSON_FIELDS = ("token_ids", "positions")


def save_safetensors(kv: KVCache, path: str | os.PathLike[str]) -> None:
    """Write ``kv`` to ``path`` atomically (tensors made contiguous; metadata as strings, lists as JSON)."""
    tensors = {}
    for i, layer in enumerate(kv.layers):
        tensors[f"layers.{i}.keys"] = layer.keys.contiguous().cpu()
        tensors[f"layers.{i}.values"] = layer.values.contiguous().cpu()
    meta = {"format": FORMAT_TAG}
    for k, v in kv.meta.items():
        meta[k] = json.dumps(v) if k in _JSON_FIELDS else str(v)
    write_atomically(path, save(tensors, metadata=meta))


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
                    raise CorruptDataError(f"{path}: unexpected tensor {name!r} in a KV dump")
                found.setdefault(int(m.group(1)), {})[m.group(2)] = f.get_tensor(name)
    except SafetensorError as e:
        raise CorruptDataError(f"{path}: not a readable safetensors file: {e}") from None
    if sorted(found) != list(range(len(found))) or any(len(v) != 2 for v in found.values()):
        raise CorruptDataError(f"{path}: layers must be numbered 0..L-1, each with keys and values")
    kwargs: dict[str, Any] = {}
    for k in ("model", "rope", *_JSON_FIELDS):
        if k in meta:
            try:
                kwargs[k] = json.loads(meta[k]) if k in _JSON_FIELDS else meta[k]
            except ValueError:
                raise CorruptDataError(f"{path}: metadata {k!r} is not valid JSON") from None
    return [(found[i]["keys"], found[i]["values"]) for i in range(len(found))], kwargs
