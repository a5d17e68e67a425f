"""LMCache's three ways of configuring kvcodec (the remote connector's ``kvcodec://`` URL, the serializer's
``"serde"`` settings, the L2 adapter's ``adapter_params``) translated into the one :class:`StoreConfig`, and the
store every LMCache hook opens from it (:func:`open_lmcache_store`).

Engines log their configuration, so a password written into a ``kvcodec://`` URL is refused as in a tier URL:
Redis takes ``password_file=PATH`` or ``password_env=NAME`` instead.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Mapping, Sequence
from urllib.parse import parse_qs, urlencode, urlsplit

from kvcodec.engines.auto_calibration import load_served_model
from kvcodec.engines.store_setup import open_store
from kvcodec.errors import InvalidInputError
from kvcodec.store import ChunkShape, KVStore
from kvcodec.store.config import StoreConfig
from kvcodec.store.identity import CacheIdentity, model_identity
from kvcodec.store.tiers import OPTIONS as TIER_OPTIONS
from kvcodec.store.tiers import redact

log = logging.getLogger(__name__)

UNNAMED_MODEL = "unnamed"  # the store's model name when LMCache gives none
# what StoreConfig.parse reads (the secret only to refuse it, naming where it belongs)
STORE_KEYS = frozenset(f.name for f in dataclasses.fields(StoreConfig)) | {"secret"}
CALIBRATE_PREFIX = "calibrate."  # calibrate.max_tokens=4096 in a URL is calibration_options["max_tokens"]


def _parse_value(v: str) -> Any:
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(v.lower(), v)


def _split(settings: Mapping[str, Any], hook_keys: Sequence[str], *, parse: bool) -> dict[str, Any]:
    """``settings`` as :meth:`StoreConfig.parse` takes them: ``calibrate.X`` into ``calibration_options`` and
    whatever is neither a store field nor one of ``hook_keys`` into ``codec_options`` (the codec refuses what it
    does not take).  ``parse``: values are URL text (``level=2`` is a number)."""
    out: dict[str, Any] = {}
    codec_options = dict(settings.get("codec_options") or {})
    calibration = dict(settings.get("calibration_options") or {})
    for k, v in settings.items():
        if k in ("codec_options", "calibration_options"):
            continue
        if k.startswith(CALIBRATE_PREFIX):
            calibration[k[len(CALIBRATE_PREFIX):]] = _parse_value(v) if parse else v
        elif k in STORE_KEYS or k in hook_keys:
            out[k] = int(v) if parse and k == "chunk_tokens" else v
        else:
            codec_options[k] = _parse_value(v) if parse else v
    if codec_options:
        out["codec_options"] = codec_options
    if calibration:
        out["calibration_options"] = calibration
    return out


URL_KEYS = ("backend", "num_heads", "workers")


def url_config(url: str, codec_options: Mapping[str, Any] | None = None) -> tuple[StoreConfig, dict[str, Any]]:
    """The configuration in a remote connector's URL, and its own settings (``backend``, ``num_heads``,
    ``workers``).  ``kvcodec://[USER@]HOST:PORT[/DB]?backend=redis`` (``rediss``: TLS),
    ``kvcodec:///FOLDER?backend=disk`` or ``kvcodec://local/?backend=memory``: the tier's own query options
    (:mod:`kvcodec.store.tiers.urls`) go to its tier URL, ``calibrate.X`` to ``calibration_options``, the store's
    fields (``codec``, ``chunk_tokens``, ``namespace``, ``secret_file``, ``calibrate``, ...) to the store, and
    the rest, after ``codec_options`` (LMCache's ``remote_storage_plugin.<name>.codec_options``), are codec
    settings."""
    parsed = urlsplit(url)
    if parsed.scheme != "kvcodec":
        raise InvalidInputError(f"not a kvcodec:// url: {redact(url)!r}")
    # codec given more than once (codec=cachegen&codec=raw): variants, smallest first (a spec's options hold commas)
    raw: dict[str, Any] = {k: v if k == "codec" and len(v) > 1 else v[-1] for k, v in parse_qs(parsed.query).items()}
    try:
        port = parsed.port
    except ValueError:
        raise InvalidInputError(f"{redact(url)!r}: the port is not a number from 1 to 65535") from None
    backend = raw.get("backend", "redis" if port else "disk" if parsed.path not in ("", "/") else "memory")
    if backend not in ("redis", "rediss", "disk", "memory"):
        raise InvalidInputError(f"backend must be redis, rediss, disk or memory, not {backend!r}")
    tier_query = urlencode({k: raw.pop(k) for k in list(raw) if k in TIER_OPTIONS[backend]})
    if backend in ("redis", "rediss"):
        tier = f"{backend}://{parsed.netloc or '127.0.0.1'}{parsed.path}?{tier_query}"
    elif backend == "disk":
        if parsed.path in ("", "/"):
            raise InvalidInputError("backend=disk needs a folder: kvcodec:///path/to/folder?backend=disk")
        tier = f"file://{parsed.path}?{tier_query}"
    else:
        tier = f"memory://?{tier_query}"
    if "tiers" in raw:
        raise InvalidInputError("a kvcodec:// URL names its one tier itself; 'tiers' is not one of its settings")
    settings = _split(raw, URL_KEYS, parse=True)
    settings["codec_options"] = {**(codec_options or {}), **settings.get("codec_options", {})}
    return StoreConfig.parse({**settings, "tiers": [tier]}, hook_keys=URL_KEYS, where="the kvcodec:// URL")


SERDE_KEYS = ("type", "num_heads", "max_workers")


def serde_config(settings: Mapping[str, Any] | None) -> tuple[StoreConfig, dict[str, Any]]:
    """The configuration in the serializer's ``"serde"`` settings, and its own (``num_heads``, ``max_workers``).
    The serializer stores nothing itself, so ``tiers`` is not one of them; the store's fields are, and the rest
    are codec settings."""
    settings = dict(settings or {})
    if "tiers" in settings:
        raise InvalidInputError("the kvcodec serde stores nothing itself (its L2 adapter does): 'tiers' is not one "
                                "of its settings")
    config, own = StoreConfig.parse(_split(settings, SERDE_KEYS, parse=False), hook_keys=SERDE_KEYS,
                                    where="the kvcodec serde settings")
    own.pop("type", None)
    return config, own


ADAPTER_KEYS = ("url", "workers")


def adapter_tier_config(params: Mapping[str, Any] | None) -> tuple[StoreConfig, dict[str, Any]]:
    """The tier of ``KVCodecTierL2Adapter``'s ``adapter_params`` (``url``: a tier URL) as a configuration, and its
    own ``workers`` (threads doing the tier's calls, default 2)."""
    params = dict(params or {})
    url = params.pop("url", None)
    if not isinstance(url, str) or not url:
        raise InvalidInputError('KVCodecTierL2Adapter needs adapter_params {"url": "<tier url>"} '
                                '(mooncake://, redis://, file://, memory://)')
    unknown = sorted(set(params) - set(ADAPTER_KEYS))
    if unknown:
        raise InvalidInputError(f"KVCodecTierL2Adapter: unknown adapter_params {unknown} (known: url, workers)")
    workers = params.get("workers", 2)
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise InvalidInputError(f"workers must be a whole number >= 1, not {workers!r}")
    config, _ = StoreConfig.parse({"tiers": [url]}, where="KVCodecTierL2Adapter's adapter_params")
    return config, {"workers": workers}


def served_model_identity(name: str) -> str:
    """The model identity of LMCache's ``model_name``: :func:`model_identity` (configuration and weights) when it
    is a local folder or file, else the name itself (LMCache knows nothing more of it)."""
    return model_identity(name) if os.path.exists(name) else name


def open_lmcache_store(config: StoreConfig, *, model_name: str | None, shape: ChunkShape | None,
                       chunk_tokens: int | None = None, kv_dtype: str = "", tp_rank: int = 0,
                       tp_size: int = 1) -> KVStore:
    """The store of an LMCache hook (:func:`open_store`) for the engine's ``model_name`` (``config.model``
    overrides it): keyed by its model identity, ``kv_dtype`` and rank, checked against ``shape``; a kvtc
    calibration, when one is needed, is made from that model (a folder, a GGUF file or ``smollm2``)."""
    model = config.model or model_name or UNNAMED_MODEL
    identity = CacheIdentity(model_digest=served_model_identity(model), kv_dtype=kv_dtype, tp_rank=tp_rank,
                             tp_size=tp_size)
    return open_store(config, model=model_name or UNNAMED_MODEL, identity=identity, log=log.info,
                      load_model=lambda: load_served_model(model, log.info), shape=shape,
                      engine_chunk_tokens=chunk_tokens, model_path=model)
