"""Importance profiles: how much each key and value channel of a model matters to attention.

A key channel's quantization error reaches the attention logits multiplied by
the queries that read it, so channels that queries barely use can take much
coarser steps (the logit error is sum_d q_d * err_d).  A value channel's error
reaches the output through the output projection's columns.  A profile holds,
per layer, the RMS of the queries on each key channel (summed over the query
heads that share the KV head, with rotary pairs averaged since RoPE rotates
energy within a pair) and the norm of the output-projection columns of each
value channel.  Profiles are computed once per model from a calibration text
(``kvcodec profile``), shipped for known models, and used only by encoders:
decoders read the chosen steps from the data.

Encoders find a profile by the cache's ``model`` metadata (:func:`find_profile`).  A serving engine knows its model
by a path or a served name, which need not match any file name, so a profile also records the *signature* of the
model it was measured on (:func:`model_signature`: the architecture and shape fields of its HuggingFace config), and
:func:`find_profile_for_config` finds a profile from an engine's config.  Fine-tunes of one base model share a
signature, and so a profile; their query statistics are close, and the steps stay what the data needs.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from importlib.resources import as_file, files
from typing import Any

import torch

from kvcodec.errors import CorruptDataError, InvalidInputError
from kvcodec.formats.v1 import LayerShape

_registered: dict[str, "Profile"] = {}


@dataclass
class Profile:
    """Per-layer channel weights of one model: ``key_weight[i]`` is ``[H, Dk]``, ``value_weight[i]`` ``[H, Dv]``."""

    model: str
    key_weight: list[torch.Tensor]
    value_weight: list[torch.Tensor]
    signature: dict[str, Any] = field(default_factory=dict)  # model_signature() of the model it was measured on

    def layer_weights(self, layer: int, shape: LayerShape) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer ``layer``'s float32 key and value weights, or None past the profile's last layer; a profile
        whose weights do not fit ``shape`` (heads, key and value dims) is a caller error."""
        if not 0 <= layer < len(self.key_weight):
            return None
        kw, vw = self.key_weight[layer], self.value_weight[layer]
        if tuple(kw.shape) != (shape.heads, shape.key_dim) or tuple(vw.shape) != (shape.heads, shape.value_dim):
            raise InvalidInputError(f"profile {self.model!r} does not match layer {layer}'s shape")
        return kw.float(), vw.float()

    def save(self, path: str | os.PathLike[str]) -> None:
        from safetensors.torch import save_file

        tensors = {f"layers.{i}.key_weight": k.float().contiguous() for i, k in enumerate(self.key_weight)}
        tensors |= {f"layers.{i}.value_weight": v.float().contiguous() for i, v in enumerate(self.value_weight)}
        meta = {"format": "kvcodec-profile", "model": self.model}
        if self.signature:
            meta["signature"] = json.dumps(self.signature, sort_keys=True)
        save_file(tensors, os.fspath(path), metadata=meta)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Profile:
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(os.fspath(path), framework="pt") as f:
                meta = f.metadata() or {}
                n = len([k for k in f.keys() if k.endswith(".key_weight")])
                keys = [f.get_tensor(f"layers.{i}.key_weight") for i in range(n)]
                values = [f.get_tensor(f"layers.{i}.value_weight") for i in range(n)]
        except (SafetensorError, KeyError) as e:
            raise CorruptDataError(f"{path}: not a kvcodec profile: {e}") from None
        if meta.get("format") != "kvcodec-profile" or not n:
            raise CorruptDataError(f"{path}: not a kvcodec profile")
        try:
            signature = json.loads(meta.get("signature", "{}"))
        except ValueError:
            raise CorruptDataError(f"{path}: the profile's model signature is not JSON") from None
        return cls(meta.get("model", ""), keys, values, signature if isinstance(signature, dict) else {})


def register_profile(profile: Profile) -> None:
    """Make ``profile`` the one used for caches whose ``model`` metadata equals ``profile.model``."""
    _registered[profile.model] = profile


def find_profile(model: str | None) -> Profile | None:
    """The registered or shipped profile of ``model``, if there is one."""
    if not model:
        return None
    if model not in _registered:
        shipped = files("kvcodec.profiles") / f"{model}.safetensors"
        if not shipped.is_file():
            return None
        with as_file(shipped) as path:
            _registered[model] = Profile.load(path)
    return _registered[model]


SIGNATURE_FIELDS = ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "vocab_size")


def model_signature(config: Any) -> dict[str, Any]:
    """What identifies a model's architecture and shape: :data:`SIGNATURE_FIELDS` of its HuggingFace config (an
    object such as vLLM's ``model_config.hf_config``, or a ``config.json`` dict)."""
    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
    sig = {k: get(k) for k in SIGNATURE_FIELDS}
    if sig["head_dim"] is None and sig["hidden_size"] and sig["num_attention_heads"]:
        sig["head_dim"] = sig["hidden_size"] // sig["num_attention_heads"]
    if sig["num_key_value_heads"] is None:
        sig["num_key_value_heads"] = sig["num_attention_heads"]
    return {k: v for k, v in sig.items() if v is not None}


def find_profile_for_config(config: Any) -> Profile | None:
    """The registered or shipped profile measured on a model of ``config``'s signature (:func:`model_signature`)."""
    want = model_signature(config)
    if not want:
        return None
    for entry in files("kvcodec.profiles").iterdir():
        if entry.name.endswith(".safetensors"):
            find_profile(entry.name[: -len(".safetensors")])
    return next((p for p in _registered.values() if p.signature == want), None)
