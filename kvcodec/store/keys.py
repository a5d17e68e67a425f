"""Chunk keys: a chained hash over token chunks, namespaced by model and codec config.

``namespace = H("kvcodec-store/1" | model | codec id | canonical codec config JSON | chunk_tokens)``
``h[-1] = namespace``; ``h[i] = H(h[i-1] | token ids of chunk i as little-endian int64)``.

Chunk ``i``'s key therefore depends on every token before it (a different earlier chunk
changes every later key) and on the model and codec, so caches of different models or
codec settings never collide.  ``H`` is SHA-256 by default (a store shared between
tenants should not let anyone craft colliding prefixes); ``xxh3-128`` is the fast
alternative.  A key reads ``kvc@<model>@<hex digest>`` (``@`` in the model id becomes ``_``),
like LMCache's ``model@world_size@worker_id@<chunk hash>@<dtype>``.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Callable, Sequence

import numpy as np
import xxhash

from kvcodec.errors import InvalidInputError

HASHES: dict[str, Callable[[bytes], bytes]] = {
    "sha256": lambda b: hashlib.sha256(b).digest(),
    "xxh3-128": lambda b: xxhash.xxh3_128_digest(b),
}


def namespace(model: str, codec_id: str, codec_config: dict[str, Any], chunk_tokens: int, hash_name: str = "sha256") -> bytes:
    """The hash that seeds the chain: everything that must match for a stored chunk to be reusable."""
    if hash_name not in HASHES:
        raise InvalidInputError(f"hash must be one of {sorted(HASHES)}, not {hash_name!r}")
    text = json.dumps(["kvcodec-store/1", model, codec_id, codec_config, int(chunk_tokens)], sort_keys=True,
                      separators=(",", ":"), default=str)
    return HASHES[hash_name](text.encode())


def chunk_bounds(num_tokens: int, chunk_tokens: int, partial: bool = True) -> list[tuple[int, int]]:
    """``(start, end)`` of each chunk of a ``num_tokens`` sequence; the last may be partial."""
    out = [(s, min(s + chunk_tokens, num_tokens)) for s in range(0, num_tokens, chunk_tokens)]
    if not partial and out and out[-1][1] - out[-1][0] < chunk_tokens:
        out.pop()
    return out


def chunk_hashes(token_ids: Sequence[int], chunk_tokens: int, seed: bytes, hash_name: str = "sha256",
                 partial: bool = True) -> list[bytes]:
    """The chained digest of every chunk of ``token_ids``."""
    h = HASHES[hash_name]
    ids = np.asarray(list(token_ids), dtype="<i8")
    prev, out = seed, []
    for s, e in chunk_bounds(len(ids), chunk_tokens, partial):
        prev = h(prev + ids[s:e].tobytes())
        out.append(prev)
    return out


def format_key(model: str, digest: bytes) -> str:
    return f"kvc@{model.replace('@', '_')}@{digest.hex()}"
