"""What one vLLM request asks of the store besides its token ids: what keys its chunks (:func:`request_key_salt`)
and what it asks of segments (:func:`segment_request`).

vLLM 0.32 lets a request's KV depend on more than its token ids: prompt embeddings (whose positions carry
placeholder ids), a LoRA adapter and multimodal items.  Each is folded into the request's salt with its
``cache_salt`` (:func:`kvcodec.store.identity.request_salt`), so requests that differ in any of them never share a
chunk; a plain request keeps the salt, and so the keys, it always had.  An input that cannot be covered makes the
request unkeyable: it is neither loaded nor saved.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from kvcodec.errors import InvalidInputError, UnsupportedError
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


# the key of kvcodec's part of a request's ``kv_transfer_params``
PARAMS_KEY = "kvcodec"


@dataclass(frozen=True)
class SegmentRequest:
    """What a request's ``kv_transfer_params["kvcodec"]`` asks of segments (docs/segments.md, "vLLM").  Either
    ``segments``: the token counts of the stored segments that follow the model's anchor (its BOS) in the prompt,
    in prompt order, to fuse with recompute ``share`` (None: the loading controller's); the rest of the prompt (at
    least one token, the question) is computed by vLLM.  Or ``store_segment``: the prompt after the anchor is a
    document, saved as a segment once its prefill is done."""

    segments: tuple[int, ...] = ()
    share: float | None = None
    store_segment: bool = False


def segment_spans(start: int, lengths: tuple[int, ...]) -> list[tuple[int, int]]:
    """The prompt positions (start, end) of segments of ``lengths`` tokens that follow ``start`` tokens (the
    anchor)."""
    spans = []
    for n in lengths:
        spans.append((start, start + n))
        start += n
    return spans


def segment_request(request: Any) -> SegmentRequest | None:
    """``request``'s segment parameters, or None where it has none.  Raises
    :class:`~kvcodec.errors.InvalidInputError` for parameters that are not as :class:`SegmentRequest` says."""
    params = getattr(request, "kv_transfer_params", None)
    ours = params.get(PARAMS_KEY) if isinstance(params, dict) else None
    if ours is None:
        return None
    if not isinstance(ours, dict) or set(ours) - {"segments", "share", "store_segment"}:
        raise InvalidInputError(f"kv_transfer_params[{PARAMS_KEY!r}] is a dict of 'segments', 'share' and "
                                f"'store_segment', not {ours!r}")
    segments, share, store = ours.get("segments") or (), ours.get("share"), ours.get("store_segment", False)
    if not isinstance(segments, (list, tuple)) or not all(type(n) is int and n > 0 for n in segments):
        raise InvalidInputError(f"'segments' lists each segment's token count (positive integers), not {segments!r}")
    if share is not None and not (type(share) in (int, float) and math.isfinite(share) and 0 <= share <= 1):
        raise InvalidInputError(f"'share' is a recompute share in 0..1, not {share!r}")
    if type(store) is not bool or (store and segments):
        raise InvalidInputError("'store_segment' is true or false, and a request either stores a segment or fuses "
                                "segments, not both")
    if not store and not segments:
        raise InvalidInputError(f"kv_transfer_params[{PARAMS_KEY!r}] names neither 'segments' nor 'store_segment'")
    return SegmentRequest(tuple(segments), None if share is None else float(share), store)
