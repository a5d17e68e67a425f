"""What a prompt's KV depends on besides its token ids, so that caches which differ in any of it never share a key.

Three parts, each covered by a key (:mod:`kvcodec.store.keys`):

- the model: :func:`model_identity` hashes its configuration *and the bytes of its weight files* (weights replaced
  in place, or a fine-tune served under the base model's name and config, get another identity), computed once per
  file and cached by the file's inode, size and change times;
- how an engine keeps KV: :class:`CacheIdentity` (the model identity, KV dtype, parallel rank, namespace);
- what one request adds: :func:`request_salt` folds every non-token input (prompt embeddings, multimodal content
  hashes, a LoRA adapter's identity) into the request's salt beside vLLM's ``cache_salt``.

A hook that meets an input it cannot cover must neither save nor load that request.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import re
import tempfile
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch

from kvcodec.errors import InvalidInputError

log = logging.getLogger(__name__)

# Files whose bytes make a model's weights (a folder's tokenizer and config files are not weights: the config is
# hashed as data, and tokenization is the token ids' business).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".ckpt", ".msgpack", ".h5", ".npz")
# The digests of files already hashed, by real path, with the stat fields that must still match.
DIGEST_CACHE_ENV = "KVCODEC_DIGEST_CACHE"
_HUB_BLOB = re.compile(r"[0-9a-f]{64}")
_READ_BYTES = 8 << 20


@dataclass(frozen=True)
class CacheIdentity:
    """What, besides the model's name and the tokens, decides a prompt's KV; caches differing in any field never
    share a key.

    ``model_digest``: :func:`model_identity` of the served model (configuration and weights); ``kv_dtype``: the
    dtype the engine keeps KV in; ``tp_rank``/``tp_size`` and ``pp_rank``/``pp_size``: a tensor-parallel rank holds
    only its own heads, a pipeline stage only its own layers; ``namespace``: a deployment or tenant whose caches are
    kept apart (it also leads every key, so a tier can be listed or flushed per namespace).
    """

    model_digest: str = ""
    kv_dtype: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    namespace: str = ""

    def __post_init__(self) -> None:
        for rank, size in (("tp_rank", "tp_size"), ("pp_rank", "pp_size")):
            r, n = getattr(self, rank), getattr(self, size)
            if not (isinstance(r, int) and isinstance(n, int) and n >= 1 and 0 <= r < n):
                raise InvalidInputError(f"{rank} must be in 0..{size}-1 and {size} >= 1, not {rank}={r!r}, {size}={n!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --- the model ---------------------------------------------------------------------------------------

def model_digest(config: Any = None, revision: str | None = None, weights: str = "") -> str:
    """A 32-hex hash of a model's configuration (a dict, or an object with ``to_dict()`` such as a HuggingFace
    config), its revision and its ``weights`` digest (:func:`weights_digest`)."""
    if config is not None and not isinstance(config, dict):
        config = config.to_dict() if hasattr(config, "to_dict") else vars(config)
    parts: list[Any] = [config, revision]
    if weights:  # (absent, the digest is the one made before weights were covered)
        parts.append(weights)
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def model_identity(model: str, *, hf_config: Any = None, revision: str | None = None) -> str:
    """The digest that names ``model``'s caches, calibrations and profiles everywhere.

    ``model`` is a folder (its ``config.json`` and weight files), a weight file (a GGUF or safetensors file, which
    holds its configuration) or a hub name whose snapshot is in the local HuggingFace cache.  What is on disk is
    all that counts there, so a command given the path and an engine given the path, its parsed config and a
    revision agree.  Otherwise only ``hf_config`` and ``revision`` are covered, with a warning: two checkpoints
    served under that name would share caches."""
    path = _local_path(model, revision)
    if path is None:
        log.warning("kvcodec: no local files found for model %r; its caches are keyed by its configuration and "
                    "revision only, so serve a folder or file to have its weights covered", model)
        return model_digest(hf_config, revision)
    config = None
    config_file = os.path.join(path, "config.json")
    if os.path.isfile(config_file):
        with open(config_file, "rb") as f:
            config = json.loads(f.read(1 << 20))
    weights = weights_digest(path)
    if not weights:
        log.warning("kvcodec: %r holds no weight files (%s); its caches are keyed by its configuration only",
                    model, ", ".join(WEIGHT_SUFFIXES))
    return model_digest(config, None, weights)


def _local_path(model: str, revision: str | None) -> str | None:
    """``model`` as a local folder or file: itself, or its snapshot in the HuggingFace cache (never downloaded)."""
    if os.path.exists(model):
        return model
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        return snapshot_download(model, revision=revision, local_files_only=True)
    except Exception:  # noqa: BLE001 - not a hub name, or not in the cache
        return None


def weight_files(path: str) -> list[str]:
    """The weight files of a model folder (searched to any depth, symlinks followed), or ``[path]`` for a file."""
    if os.path.isfile(path):
        return [path]
    found = []
    for root, dirs, files in os.walk(path, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [os.path.join(root, f) for f in sorted(files) if f.endswith(WEIGHT_SUFFIXES)]
    return found


def weights_digest(path: str) -> str:
    """A hash over the SHA-256 of every weight file under ``path`` (with its name relative to ``path``); "" when
    there are none.  A file in a HuggingFace cache snapshot is a link to a blob named by its SHA-256, which is used
    as it is; any other file is hashed once and its digest cached (:func:`file_digest`)."""
    files = weight_files(path)
    if not files:
        return ""
    base = path if os.path.isdir(path) else os.path.dirname(path)
    parts = [[os.path.relpath(f, base), file_digest(f)] for f in files]
    return hashlib.sha256(json.dumps(parts, separators=(",", ":")).encode()).hexdigest()


def file_digest(path: str) -> str:
    """The SHA-256 of a file's bytes.  SHA-256 because it is what the HuggingFace hub records for weight files, so
    a recorded digest (a hub blob's name) and a computed one agree.  Cached by real path with the file's device,
    inode, size, modification and change times: rewriting the file in place changes its change time, which no
    user can set back, so a stale digest is never reused."""
    real = os.path.realpath(path)
    name = os.path.basename(real)
    if _HUB_BLOB.fullmatch(name) and os.path.basename(os.path.dirname(real)) == "blobs":
        return name
    st = os.stat(real)
    stamp = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    with _digest_cache() as cache:
        hit = cache.get(real)
        if hit is not None and hit[0] == stamp:
            return hit[1]
    h = hashlib.sha256()
    with open(real, "rb") as f:
        while chunk := f.read(_READ_BYTES):
            h.update(chunk)
    digest = h.hexdigest()
    with _digest_cache(write=True) as cache:
        cache[real] = [stamp, digest]
    return digest


def _cache_path() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get(DIGEST_CACHE_ENV) or os.path.join(base, "kvcodec", "weight-digests.json")


@contextlib.contextmanager
def _digest_cache(write: bool = False) -> Iterator[dict[str, Any]]:
    """The digest cache, under a lock shared by every process of the machine; written back (atomically) when
    ``write``.  An unreadable or damaged cache is empty: the digests are computed again."""
    path = _cache_path()
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        lock = open(path + ".lock", "a")
    except OSError:
        yield {}
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            with open(path, "rb") as f:
                cache = json.loads(f.read())
            if not isinstance(cache, dict):
                cache = {}
        except (OSError, ValueError):
            cache = {}
        yield cache
        if write:
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".weight-digests-")
            with os.fdopen(fd, "w") as f:
                json.dump(cache, f)
            os.replace(tmp, path)


# --- one request -------------------------------------------------------------------------------------

def request_salt(cache_salt: str | None = None, inputs: Mapping[str, Any] | None = None) -> str | None:
    """The salt that keys one request's chunks: its ``cache_salt`` and a digest of every non-token input in
    ``inputs`` (name to a tensor, bytes, a string, a number or a list of those; None entries are left out).  A
    request with neither has no salt, so plain prompts keep the keys they always had."""
    present = {k: v for k, v in (inputs or {}).items() if v is not None}
    if not present:
        return cache_salt or None
    h = hashlib.sha256(b"kvcodec-request-inputs/1\0")
    for name in sorted(present):
        h.update(name.encode() + b"\0")
        _feed(h, present[name])
    return f"{cache_salt or ''}|inputs:{h.hexdigest()}"


def _feed(h: Any, value: Any) -> None:
    """Hash ``value`` unambiguously: its kind, shape and bytes."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        h.update(b"b%d:" % len(raw) + raw)
    elif isinstance(value, str):
        _feed(h, value.encode())
    elif isinstance(value, bool) or isinstance(value, (int, float)):
        h.update(f"n{value!r};".encode())
    elif isinstance(value, (list, tuple)):
        h.update(b"l%d:" % len(value))
        for item in value:
            _feed(h, item)
    elif isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"t{t.dtype}{tuple(t.shape)}:".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    else:
        raise InvalidInputError(f"a request input of type {type(value).__name__} cannot be hashed into its key")
