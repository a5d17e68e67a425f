"""One configuration for every engine hook's store: :class:`StoreConfig`, parsed and checked in one place.

Each hook reads it from its engine's own configuration (vLLM's ``kv_connector_extra_config``, LMCache's plugin URL
or serde settings, SGLang's ``--hicache-storage-backend-extra-config``, or keyword arguments for transformers) and
builds its store with :meth:`StoreConfig.store`; ``docs/engines.md`` documents the keys once.  Engines log their
configuration, so nothing secret may be in it: the secret comes from ``$KVCODEC_STORE_SECRET`` or a file
(``secret_file``), and a tier's password from a file or an environment variable the tier URL names
(``password_file=``, ``password_env=``); a password written into a tier URL is refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from kvcodec.errors import InvalidInputError
from kvcodec.store.auth import SECRET_ENV, check_secret, secret_from_env
from kvcodec.store.chunks import ChunkShape
from kvcodec.store.identity import CacheIdentity
from kvcodec.store.keys import HASHES
from kvcodec.store.store import DEFAULT_STORE_CHUNK_TOKENS, KVStore, PlacementPolicy
from kvcodec.store.telemetry_file import default_path as default_telemetry_path
from kvcodec.store.tiers import MemoryTier, StorageTier, has_password, redact, tier_from_url

CALIBRATE_WHEN = ("background", "now")


@dataclass(frozen=True)
class StoreConfig:
    """What a hook's store is made of.  Every field has a default, so ``StoreConfig()`` is a working store of
    cachegen chunks in process memory.

    ``codec``: a codec spec (``"cachegen"``, ``"kivi:bits=4"``), with ``codec_options`` its settings; or a list of
    variant specs, smallest first (``["kvtc", "cachegen", "raw"]``), each chunk saved in every one and each load
    choosing per chunk.  ``tiers``: tier URLs fastest first (:mod:`kvcodec.store.tiers.urls`).  ``chunk_tokens``:
    tokens per stored chunk (None: the engine's own unit, else 256).  ``hash``: ``sha256`` or ``xxh3-128``.
    ``model``: the model's name in keys (None: the engine's).  ``namespace``: a deployment or tenant kept apart.
    ``secret_file``: a file holding the secret that authenticates values (None: ``$KVCODEC_STORE_SECRET``).
    ``calibrate``: when a codec made from the model (kvtc) has no calibration of it installed, ``"background"``
    serves with ``fallback_codec`` until one is made, ``"now"`` makes it before the engine starts;
    ``calibration_options``: the calibration's settings.  ``telemetry``: where the store keeps its estimates of
    links and decode rates for the next process (:mod:`kvcodec.store.telemetry_file`): ``"auto"``, a file per
    namespace and model in the per-user cache folder; ``"off"``; or a file's path.
    """

    codec: str | tuple[str, ...] = "cachegen"
    codec_options: Mapping[str, Any] = field(default_factory=dict)
    tiers: tuple[str, ...] = ("cpu",)
    chunk_tokens: int | None = None
    hash: str = "sha256"
    model: str | None = None
    namespace: str = ""
    secret_file: str | None = None
    calibrate: str = "background"
    calibration_options: Mapping[str, Any] = field(default_factory=dict)
    fallback_codec: str = "cachegen"
    telemetry: str = "auto"

    def __post_init__(self) -> None:
        codec = self.codec
        if isinstance(codec, list):
            object.__setattr__(self, "codec", codec := tuple(codec))
        if not (isinstance(codec, str) and codec) and not (isinstance(codec, tuple) and codec and
                                                           all(isinstance(c, str) and c for c in codec)):
            raise InvalidInputError(f"'codec' is a codec spec or a list of them, smallest first, not {codec!r}")
        if isinstance(codec, tuple) and self.codec_options:
            raise InvalidInputError("a list of codec variants takes each one's settings in its spec "
                                    "(\"kvtc:level=0\"), not in 'codec_options'")
        tiers = (self.tiers,) if isinstance(self.tiers, str) else tuple(self.tiers) if isinstance(self.tiers, (list, tuple)) else None
        if not tiers or not all(isinstance(t, str) and t for t in tiers):
            raise InvalidInputError(f"'tiers' is a list of tier URLs, fastest first (e.g. [\"cpu\", "
                                    f"\"disk:/var/cache/kvcodec\"]), not {self.tiers!r}")
        object.__setattr__(self, "tiers", tiers)
        for url in tiers:
            if has_password(url):
                raise InvalidInputError(f"tier {redact(url)!r} carries a password, and engines log their "
                                        "configuration: name a file holding it (?password_file=PATH) or an "
                                        "environment variable (?password_env=NAME) instead")
        for name in ("codec_options", "calibration_options"):
            value = getattr(self, name)
            if not isinstance(value, Mapping):
                raise InvalidInputError(f"'{name}' is a mapping of settings, not {value!r}")
            object.__setattr__(self, name, dict(value))
        if self.chunk_tokens is not None and not (isinstance(self.chunk_tokens, int) and self.chunk_tokens > 0):
            raise InvalidInputError(f"'chunk_tokens' is a positive whole number, not {self.chunk_tokens!r}")
        if self.hash not in HASHES:
            raise InvalidInputError(f"'hash' is one of {sorted(HASHES)}, not {self.hash!r}")
        if self.calibrate not in CALIBRATE_WHEN:
            raise InvalidInputError(f"'calibrate' is \"background\" or \"now\", not {self.calibrate!r}")
        for name in ("model", "secret_file"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise InvalidInputError(f"'{name}' is a non-empty string, not {value!r}")
        if not isinstance(self.namespace, str) or not isinstance(self.fallback_codec, str):
            raise InvalidInputError("'namespace' and 'fallback_codec' are strings")
        if not (isinstance(self.telemetry, str) and self.telemetry):
            raise InvalidInputError(f"'telemetry' is \"auto\", \"off\" or a file's path, not {self.telemetry!r}")

    # -- parsing -----------------------------------------------------------------------------------------
    @classmethod
    def parse(cls, settings: Mapping[str, Any] | None, *, hook_keys: Sequence[str] = (),
              where: str = "the store settings") -> tuple[StoreConfig, dict[str, Any]]:
        """The configuration in ``settings`` (a hook's mapping of its engine's configuration), and the settings
        named in ``hook_keys`` (the hook's own, e.g. LMCache's ``num_heads``).  An unknown key, or the secret
        itself, is an error that names ``where`` and the known keys."""
        settings = dict(settings or {})
        if "secret" in settings:
            raise InvalidInputError(f"put the store secret in ${SECRET_ENV} or a file named by \"secret_file\", not "
                                    f"in {where}, which the engine writes to its log")
        own = {k: settings.pop(k) for k in list(settings) if k in hook_keys}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise InvalidInputError(f"{where}: unknown setting(s) {unknown}; known: {sorted(known | set(hook_keys))}")
        return cls(**settings), own

    # -- what it makes ---------------------------------------------------------------------------------
    def secret(self) -> bytes | None:
        """The deployment's secret: the contents of ``secret_file`` (surrounding whitespace removed), else ``$KVCODEC_STORE_SECRET`` (None: no
        authentication)."""
        if self.secret_file is None:
            return secret_from_env()
        try:
            with open(self.secret_file, "rb") as f:
                return check_secret(f.read(4096).strip())
        except OSError as e:
            raise InvalidInputError(f"secret_file {self.secret_file!r} cannot be read: {e}") from None

    def make_tiers(self, *, disk_folder: str | None = None) -> list[StorageTier]:
        """The tiers, built from their URLs (a bare ``disk`` is ``disk_folder``)."""
        return [tier_from_url(url, disk_folder=disk_folder) for url in self.tiers]

    def store(self, *, model: str, identity: CacheIdentity | None = None, shape: ChunkShape | None = None,
              engine_chunk_tokens: int | None = None, codec: str | Sequence[str] | None = None,
              codec_options: Mapping[str, Any] | None = None, disk_folder: str | None = None,
              tiers: Sequence[StorageTier] | None = None) -> KVStore:
        """The hook's store.  ``model``: the engine's name for the model (``model`` here overrides it);
        ``identity``: what the engine's caches depend on (its namespace is this configuration's); ``shape``: what
        the engine holds per token; ``engine_chunk_tokens``: the engine's own unit (a page, LMCache's chunk),
        used unless ``chunk_tokens`` is set; ``codec``/``codec_options``: what to serve with instead of
        ``codec`` (a hook serving a fallback while a calibration is made).  Chunks go to the fastest tier and
        to every tier that is not process memory (those are shared with other processes and machines)."""
        made = list(tiers) if tiers is not None else self.make_tiers(disk_folder=disk_folder)
        shared = [t.name for t in made if not isinstance(t, MemoryTier)]
        chunk_tokens = self.chunk_tokens or engine_chunk_tokens or DEFAULT_STORE_CHUNK_TOKENS
        identity = dataclasses.replace(identity or CacheIdentity(), namespace=self.namespace)
        serving = self.codec if codec is None else codec
        options = (self.codec_options if codec is None else codec_options) or None
        telemetry = {"off": None, "auto": default_telemetry_path(self.model or model, self.namespace)}.get(
            self.telemetry, self.telemetry)
        return KVStore(made, model=self.model or model, codec=list(serving) if isinstance(serving, tuple) else serving,
                       codec_options=options, chunk_tokens=chunk_tokens, hash=self.hash,
                       policy=PlacementPolicy(shared=shared), identity=identity, secret=self.secret(), shape=shape,
                       telemetry_file=telemetry)

