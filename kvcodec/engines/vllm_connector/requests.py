"""What keys one vLLM request's chunks besides its token ids: :func:`request_key_salt`.

vLLM 0.32 lets a request's KV depend on more than its token ids: prompt embeddings (whose positions carry
placeholder ids), a LoRA adapter and multimodal items.  Each is folded into the request's salt with its
``cache_salt`` (:func:`kvcodec.store.identity.request_salt`), so requests that differ in any of them never share a
chunk; a plain request keeps the salt, and so the keys, it always had.  An input that cannot be covered makes the
request unkeyable: it is neither loaded nor saved.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from kvcodec.errors import UnsupportedError
from kvcodec.store.identity import model_identity, request_salt, weight_files

# attributes of older vLLM requests that carried multimodal inputs (0.32 has ``mm_features``)
_OLD_MULTIMODAL = ("mm_hashes", "mm_positions", "mm_inputs")


def request_key_salt(request: Any) -> str | None:
    """The salt that keys ``request``'s chunks (None: a plain request without ``cache_salt``).  Raises
    :class:`~kvcodec.errors.UnsupportedError`, whose message names the kind of input (the same for every request of
    that kind), when the request carries something that changes its KV and cannot be covered."""
    inputs: dict[str, Any] = {}
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is not None:
        if not isinstance(embeds, torch.Tensor):
            raise UnsupportedError("prompt embeddings that are not a tensor")
        inputs["prompt_embeds"] = embeds
        mask = getattr(request, "prompt_is_token_ids", None)  # mixed prompts: which positions are real tokens
        inputs["prompt_is_token_ids"] = None if mask is None else bytes(bool(m) for m in mask)
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        inputs["lora"] = _lora(lora)
    features = getattr(request, "mm_features", None)
    if features:
        inputs["multimodal"] = [_multimodal(f) for f in features]
    if any(getattr(request, name, None) for name in _OLD_MULTIMODAL):
        raise UnsupportedError("multimodal inputs of a vLLM older than 0.32")
    return request_salt(getattr(request, "cache_salt", None), inputs)


def _lora(lora: Any) -> list[Any]:
    """A LoRA adapter's name, id and identity (its weight files' bytes and its ``adapter_config.json``)."""
    path = str(getattr(lora, "lora_path", "") or "")
    if not path or not os.path.exists(path) or not weight_files(path):
        raise UnsupportedError("a LoRA adapter whose weight files are not on this machine")
    config = b""
    config_file = os.path.join(path, "adapter_config.json")  # rank, alpha, target modules: they change the KV too
    if os.path.isfile(config_file):
        with open(config_file, "rb") as f:
            config = json.dumps(json.loads(f.read(1 << 20)), sort_keys=True).encode()
    return [str(lora.lora_name), int(lora.lora_int_id), model_identity(path), config]


def _multimodal(feature: Any) -> list[Any]:
    """One multimodal item: its modality, content hash (vLLM's ``identifier``) and where it sits in the prompt."""
    identifier, position = getattr(feature, "identifier", None), getattr(feature, "mm_position", None)
    if not (isinstance(identifier, str) and identifier) or position is None:
        raise UnsupportedError("multimodal items without a content hash or a position")
    item: list[Any] = [str(getattr(feature, "modality", "")), identifier, int(position.offset), int(position.length)]
    mask = getattr(position, "is_embed", None)  # which placeholder positions take the item's embeddings
    return item if mask is None else item + [mask.to(torch.bool)]
