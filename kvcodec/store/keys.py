"""Chunk keys: a chained hash over token chunks, seeded by everything that changes the KV besides the tokens.

``seed = H("kvcodec-store/2" | model | identity | codec id | canonical codec config | chunk_tokens)``;
a request's own salt (vLLM's ``cache_salt``) gives it a seed of its own, ``H(seed | salt)``; a segment (a document
stored apart from any prefix, :class:`SegmentDomain`) one of ``H(seed | "segment:" | anchor token ids)``;
``h[i] = H(h[i-1] | token ids of chunk i as little-endian int64)`` with ``h[-1]`` the seed.

Chunk ``i``'s key therefore depends on every token before it (a different earlier chunk changes every later
key), on the model and its :class:`CacheIdentity` (weights, KV dtype, parallel rank, tenant), and on the codec,
so caches that differ in any of them never share a key.  ``H`` is SHA-256, or HMAC-SHA-256 under the store's
secret (then nobody without the secret can tell which prompt a key belongs to, or craft one); ``xxh3-128`` is a
fast, non-cryptographic alternative for a store whose writers and readers all trust each other.  A key reads
``kvc@<namespace>@<model>@<hex digest>`` (``@`` in the names becomes ``_``), like LMCache's
``model@world_size@worker_id@<chunk hash>@<dtype>``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import xxhash

from kvcodec.errors import InvalidInputError
from kvcodec.store.identity import CacheIdentity

HASHES: dict[str, Callable[[bytes], bytes]] = {
    "sha256": lambda b: hashlib.sha256(b).digest(),
    "xxh3-128": lambda b: xxhash.xxh3_128_digest(b),
}

KEY_VERSION = "kvcodec-store/2"


def hasher(hash_name: str = "sha256", secret: bytes | None = None) -> Callable[[bytes], bytes]:
    """The ``H`` of the key chain: ``hash_name``, keyed by ``secret`` when there is one."""
    if hash_name not in HASHES:
        raise InvalidInputError(f"hash must be one of {sorted(HASHES)}, not {hash_name!r}")
    if secret is None:
        return HASHES[hash_name]
    if hash_name != "sha256":
        raise InvalidInputError(f"a store with a secret keys its chunks with HMAC-SHA-256; hash {hash_name!r} is not "
                                "keyed: use hash='sha256'")
    return lambda b: hmac.new(secret, b, hashlib.sha256).digest()


def namespace(model: str, codec_id: str, codec_config: dict[str, Any], chunk_tokens: int, hash_name: str = "sha256",
              identity: CacheIdentity | None = None, secret: bytes | None = None) -> bytes:
    """The hash that seeds the chain: everything that must match for a stored chunk to be reusable."""
    text = json.dumps([KEY_VERSION, model, (identity or CacheIdentity()).to_dict(), codec_id, codec_config,
                       int(chunk_tokens)], sort_keys=True, separators=(",", ":"), default=str)
    return hasher(hash_name, secret)(text.encode())


@dataclass(frozen=True)
class SegmentDomain:
    """The keys of segments: token runs (documents) whose KV was computed after ``anchor`` (token ids, the
    same for every segment of a store) rather than after the prompt's own prefix, so that they can be reused
    wherever they sit in a prompt (:mod:`kvcodec.blend.segments`).  Given as a store's ``salt``, it seeds a chain
    of its own that no request's salt can reach (``"segment:"`` against ``"salt:"``), covering the anchor (and so
    the positions the segment was computed at) beside everything the store's seed covers."""

    anchor: tuple[int, ...] = ()


def salted(seed: bytes, salt: str | bytes | SegmentDomain | None, hash_name: str = "sha256",
           secret: bytes | None = None) -> bytes:
    """The seed of a request carrying its own ``salt`` (vLLM's ``cache_salt``): requests share chunks only with
    requests of the same salt; a :class:`SegmentDomain`'s is the seed of segments after its anchor.  No salt:
    ``seed`` itself."""
    if isinstance(salt, SegmentDomain):
        return hasher(hash_name, secret)(seed + b"segment:" + np.asarray(salt.anchor, dtype="<i8").tobytes())
    if salt is None or salt == "" or salt == b"":
        return seed
    raw = salt.encode() if isinstance(salt, str) else bytes(salt)
    return hasher(hash_name, secret)(seed + b"salt:" + raw)


def chunk_bounds(num_tokens: int, chunk_tokens: int, partial: bool = True) -> list[tuple[int, int]]:
    """``(start, end)`` of each chunk of a ``num_tokens`` sequence; the last may be partial."""
    out = [(s, min(s + chunk_tokens, num_tokens)) for s in range(0, num_tokens, chunk_tokens)]
    if not partial and out and out[-1][1] - out[-1][0] < chunk_tokens:
        out.pop()
    return out


def chunk_hashes(token_ids: Sequence[int], chunk_tokens: int, seed: bytes, hash_name: str = "sha256",
                 partial: bool = True, secret: bytes | None = None) -> list[bytes]:
    """The chained digest of every chunk of ``token_ids``."""
    h = hasher(hash_name, secret)
    ids = np.asarray(list(token_ids), dtype="<i8")
    prev, out = seed, []
    for s, e in chunk_bounds(len(ids), chunk_tokens, partial):
        prev = h(prev + ids[s:e].tobytes())
        out.append(prev)
    return out


def format_key(model: str, digest: bytes, namespace: str = "") -> str:
    name = model.replace("@", "_")
    return f"kvc@{namespace.replace('@', '_')}@{name}@{digest.hex()}" if namespace else f"kvc@{name}@{digest.hex()}"
