"""Authenticated stored values: who wrote a chunk, checked before anything of it is decoded.

A container's checksums are computed by whoever wrote it, so they catch damage, not forgery: anyone who can
write a tier (the Redis database, the disk folder) could store valid KV of their choosing under any key.  A store
given a secret (one per deployment, shared by every process that writes or reads its tiers) appends to each value
``HMAC-SHA-256(secret, "kvcodec-store-auth/1" | key | container)`` and refuses a value whose tag does not match,
so a value is only served under the key it was written for, by someone holding the secret.  Without a secret,
the tiers' writers must be trusted as much as the model weights are (see docs/store.md's trust model).
"""

from __future__ import annotations

import hashlib
import hmac
import os

from kvcodec.errors import CorruptDataError, InvalidInputError

TAG_BYTES = 32
_CONTEXT = b"kvcodec-store-auth/1\0"
SECRET_ENV = "KVCODEC_STORE_SECRET"
MIN_SECRET_BYTES = 16


class UnauthenticatedError(CorruptDataError):
    """A stored value's authentication tag does not match: written without the secret, under another key, or
    altered since."""


def check_secret(secret: bytes | str | None) -> bytes | None:
    """``secret`` as bytes (None: no authentication); refuses one too short to resist guessing."""
    if secret is None:
        return None
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    if len(raw) < MIN_SECRET_BYTES:
        raise InvalidInputError(f"a store secret needs at least {MIN_SECRET_BYTES} bytes (got {len(raw)}); make one "
                                "with: python -c 'import secrets; print(secrets.token_hex(32))'")
    return raw


def secret_from_env() -> bytes | None:
    """The deployment's secret from ``$KVCODEC_STORE_SECRET`` (engine hooks read it there, so it never appears
    in an engine's logged configuration)."""
    return check_secret(os.environ.get(SECRET_ENV) or None)


def _tag(secret: bytes, key: str, container: bytes) -> bytes:
    mac = hmac.new(secret, _CONTEXT, hashlib.sha256)
    mac.update(key.encode() + b"\0")
    mac.update(container)
    return mac.digest()


def seal(secret: bytes | None, key: str, container: bytes) -> bytes:
    """The value to store under ``key``: the container, followed by its tag when there is a secret."""
    return container if secret is None else container + _tag(secret, key, container)


def unseal(secret: bytes | None, key: str, value: bytes) -> bytes:
    """The container of a value stored under ``key``; raises :class:`UnauthenticatedError` when its tag is wrong."""
    if secret is None:
        return value
    value = bytes(value)
    if len(value) < TAG_BYTES:
        raise UnauthenticatedError(f"value of {key} is too short to carry an authentication tag")
    container, tag = value[:-TAG_BYTES], value[-TAG_BYTES:]
    if not hmac.compare_digest(tag, _tag(secret, key, container)):
        raise UnauthenticatedError(f"value of {key} fails authentication: not written by a holder of this "
                                   "deployment's secret for this key")
    return container
