"""One grammar for the storage tiers that engine hooks build from their configuration (the vLLM connector's
``tiers``, the LMCache plugin's URL): :func:`tier_from_url`.

- ``cpu[:SIZE]``, ``memory[:SIZE]`` or ``memory://?capacity=SIZE``: process memory, LRU (default 1 GiB);
- ``gpu[:SIZE]`` or ``gpu://?capacity=SIZE&device=cuda:1``: device memory, LRU (default 1 GiB);
- ``disk[:FOLDER][?OPTIONS]`` or ``file:///FOLDER[?OPTIONS]``: a folder (default: the caller's, else
  ``$XDG_CACHE_HOME/kvcodec/tiers``); ``capacity=SIZE`` (default 10 GiB, LRU), ``shared=true`` (a folder
  deliberately shared with other users: no owner/mode check, files per the umask), ``max_value=SIZE``;
- ``redis://[[USER]:PASSWORD@]HOST[:PORT][/DB][?OPTIONS]`` and ``rediss://...`` (TLS): ``ttl=SECONDS``,
  ``timeout=SECONDS`` (default 0.5), ``prefix=TEXT`` (default ``kvcodec:``), ``max_value=SIZE``,
  ``password_file=PATH`` (the password is its first line) or ``password_env=NAME`` (an environment variable),
  which keep the password out of configuration that engines log (``redis://USER@HOST?password_env=REDIS_PW``);
  with ``rediss``
  also ``ssl_ca_certs=PATH``, ``ssl_cert_reqs=none|optional|required``, ``ssl_certfile=PATH``,
  ``ssl_keyfile=PATH``, ``ssl_check_hostname=true|false``;
- ``mooncake://MASTER_HOST[:PORT][?OPTIONS]``: Mooncake Store (:mod:`kvcodec.store.tiers.mooncake`; master port
  default 50051): ``metadata=P2PHANDSHAKE`` (default) or the metadata server's URL, ``segment=SIZE`` (memory
  lent to the store, default 512 MiB), ``buffer=SIZE`` (transfer buffer, the largest value, default 128 MiB),
  ``replicas=N`` (default 1), ``timeout=SECONDS`` (default 2), ``protocol=tcp|rdma`` (default tcp),
  ``local=HOST`` (this client's address, default 127.0.0.1), ``admin=HOST:PORT`` (the master's metrics server,
  to list keys), ``max_value=SIZE``.

SIZE is a byte count, or one with a unit: ``512MiB``, ``10GiB``, ``2GB`` (K, M, G, T; ``i``: powers of 1024).
Every tier built here is bounded.  Percent-escape ``@ : / ? # %`` in a user name or password.  Passwords are never
logged, shown in a repr or put in an error message (:func:`redact`).
"""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from kvcodec.errors import InvalidInputError
from kvcodec.store.tiers.base import DEFAULT_MAX_VALUE_BYTES, StorageTier
from kvcodec.store.tiers.disk import DiskTier
from kvcodec.store.tiers.memory import GPUTier, MemoryTier
from kvcodec.store.tiers.redis import RedisTier

DEFAULT_MEMORY_CAPACITY = 1 << 30
DEFAULT_DISK_CAPACITY = 10 << 30
DEFAULT_REDIS_TIMEOUT_S = 0.5

# the query options each kind of tier takes (the LMCache plugin tells them from codec settings by these names)
OPTIONS = {
    "memory": frozenset({"capacity"}),
    "gpu": frozenset({"capacity", "device"}),
    "disk": frozenset({"capacity", "shared", "max_value"}),
    "redis": frozenset({"ttl", "timeout", "prefix", "max_value", "password_file", "password_env"}),
    "rediss": frozenset({"ttl", "timeout", "prefix", "max_value", "password_file", "password_env", "ssl_ca_certs", "ssl_cert_reqs", "ssl_certfile",
                         "ssl_keyfile", "ssl_check_hostname"}),
    "mooncake": frozenset({"metadata", "segment", "buffer", "replicas", "timeout", "protocol", "local", "admin",
                           "max_value"}),
}
FORMS = ("cpu[:SIZE], memory://?capacity=SIZE, gpu[:SIZE], disk:FOLDER[?capacity=SIZE&shared=true], "
         "file:///FOLDER[?...], redis://[[USER]:PASSWORD@]HOST[:PORT][/DB][?ttl=S&timeout=S&prefix=P], rediss://... or "
         "mooncake://MASTER_HOST[:PORT][?segment=SIZE&replicas=N&...]")

_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}


def default_disk_folder(purpose: str = "tiers") -> str:
    """A per-user folder for a disk tier: ``$XDG_CACHE_HOME/kvcodec/<purpose>`` (``~/.cache/kvcodec/<purpose>``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvcodec", purpose)


def _userinfo(spec: str) -> tuple[str, str, str] | None:
    """``(scheme, user information, the rest from its "@")`` of a URL that has user information, else None.  The
    user information ends at the last ``@`` followed by a host, so a password holding ``@ : / ? #`` unescaped is
    still all inside it (a doubtful spec gets too much counted as user information, never too little)."""
    scheme, sep, rest = spec.partition("://")
    at = max((m.start() for m in _HOST_AFTER_AT.finditer(rest)), default=-1)
    return (scheme, rest[:at], rest[at:]) if sep and at >= 0 else None


def redact(spec: str) -> str:
    """``spec`` with the password of a URL replaced by ``***`` (see :func:`_userinfo` for where it ends)."""
    parts = _userinfo(spec)
    if parts is None:
        return spec
    scheme, info, rest = parts
    user, colon, _ = info.partition(":")
    return f"{scheme}://{user}{':***' if colon else ''}{rest}"


def has_password(spec: str) -> bool:
    """Whether ``spec`` carries a (non-empty) password in its user information, escaped or not."""
    parts = _userinfo(spec)
    return parts is not None and parts[1].partition(":")[2] != ""


# an "@" followed by a host (a name, an address or a bracketed IPv6 one; empty in a malformed spec), a port and the
# end of the authority
_HOST_AFTER_AT = re.compile(r"(?=@(?:\[[\w:.%]*\]|[\w.\-%]*)(?::\d*)?(?:[/?#]|$))")


def parse_size(text: str | int, what: str = "size") -> int:
    """Bytes from ``1073741824``, ``512MiB``, ``10GiB``, ``2GB``, ``64k``."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", str(text), flags=re.I)
    if not m:
        raise InvalidInputError(f"{what} {text!r} is not a size: write bytes (1073741824) or with a unit (512MiB, "
                                "10GiB, 2GB)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def _flag(text: str, what: str) -> bool:
    value = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(text.lower())
    if value is None:
        raise InvalidInputError(f"{what}={text!r}: write true or false")
    return value


def _query(spec: str, kind: str, query: str) -> dict[str, str]:
    try:
        parsed = parse_qs(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise InvalidInputError(f"tier {redact(spec)!r}: a malformed query {query!r}") from None
    unknown = sorted(set(parsed) - OPTIONS[kind])
    if unknown:
        raise InvalidInputError(f"tier {redact(spec)!r}: unknown option(s) {unknown}; a {kind} tier takes "
                                f"{sorted(OPTIONS[kind])}")
    return {k: v[-1] for k, v in parsed.items()}


def tier_from_url(spec: str, *, timeout_s: float = DEFAULT_REDIS_TIMEOUT_S, disk_folder: str | None = None,
                  memory_capacity: int = DEFAULT_MEMORY_CAPACITY, disk_capacity: int = DEFAULT_DISK_CAPACITY) -> StorageTier:
    """The tier ``spec`` names (the module docstring has the forms).  ``timeout_s`` is a Redis tier's socket timeout
    unless the URL sets ``timeout``; ``disk_folder`` the folder of a bare ``disk``; ``memory_capacity`` and
    ``disk_capacity`` the budgets of tiers whose spec sets none.  Raises :class:`~kvcodec.errors.InvalidInputError`
    (a ``ValueError``) for a spec it cannot read, never showing a password."""
    scheme = spec.split("://", 1)[0].lower() if "://" in spec else ""
    if scheme in ("redis", "rediss"):
        return _redis(spec, scheme, timeout_s)
    if scheme == "mooncake":
        return _mooncake(spec)
    if scheme in ("memory", "cpu", "gpu", "file"):
        u = urlsplit(spec)
        if scheme == "file":
            if u.netloc not in ("", "localhost"):
                raise InvalidInputError(f"tier {spec!r}: a file:// URL names a local folder (file:///path), "
                                        f"not one on host {u.netloc!r}")
            return _disk(spec, unquote(u.path), _query(spec, "disk", u.query), disk_folder, disk_capacity)
        if u.netloc or u.path not in ("", "/"):
            raise InvalidInputError(f"tier {spec!r}: write {scheme}://?capacity=SIZE")
        kind = "gpu" if scheme == "gpu" else "memory"
        q = _query(spec, kind, u.query)
        return _memory(spec, kind, q.get("capacity"), memory_capacity, q.get("device"))
    if scheme:
        raise InvalidInputError(f"tier {redact(spec)!r}: unknown scheme {scheme!r}; use one of {FORMS}")
    kind, _, arg = spec.partition(":")
    if kind in ("cpu", "memory", "gpu"):
        return _memory(spec, "gpu" if kind == "gpu" else "memory", arg or None, memory_capacity, None)
    if kind == "disk":
        folder, _, query = arg.partition("?")
        return _disk(spec, folder, _query(spec, "disk", query), disk_folder, disk_capacity)
    raise InvalidInputError(f"unknown tier {redact(spec)!r}: use one of {FORMS}")


def _memory(spec: str, kind: str, capacity: str | None, default: int, device: str | None) -> StorageTier:
    budget = parse_size(capacity, f"tier {spec!r}: capacity") if capacity else default
    if kind == "gpu":
        return GPUTier(budget, device=device or "cuda")
    return MemoryTier(budget)


def _disk(spec: str, folder: str, q: dict[str, str], default_folder: str | None, default_capacity: int) -> DiskTier:
    folder = folder or default_folder or default_disk_folder()
    capacity = parse_size(q["capacity"], f"tier {spec!r}: capacity") if "capacity" in q else default_capacity
    limit = parse_size(q["max_value"], f"tier {spec!r}: max_value") if "max_value" in q else DEFAULT_MAX_VALUE_BYTES
    return DiskTier(folder, capacity, shared=_flag(q.get("shared", "false"), "shared"), max_value_bytes=limit)


def _redis(spec: str, scheme: str, timeout_s: float) -> RedisTier:
    shown = redact(spec)
    u = urlsplit(spec)
    try:
        host, port = u.hostname, u.port or 6379
    except ValueError:
        raise InvalidInputError(f"tier {shown!r}: the port is not a number from 1 to 65535") from None
    if not host:
        raise InvalidInputError(f"tier {shown!r}: no host; write {scheme}://[[USER]:PASSWORD@]HOST[:PORT][/DB]")
    db = u.path.strip("/") or "0"
    if not db.isdigit():
        raise InvalidInputError(f"tier {shown!r}: the database after the host is a number (/0), not {db!r}")
    q = _query(spec, scheme, u.query)
    ttl = q.get("ttl")
    if ttl is not None and not (ttl.isdigit() and int(ttl) > 0):
        raise InvalidInputError(f"tier {shown!r}: ttl is a whole number of seconds above 0, not {ttl!r}")
    try:
        timeout = float(q.get("timeout", timeout_s))
    except ValueError:
        raise InvalidInputError(f"tier {shown!r}: timeout is a number of seconds, not {q['timeout']!r}") from None
    ssl_options: dict[str, Any] = {k: v for k, v in q.items() if k.startswith("ssl_")}
    if "ssl_check_hostname" in ssl_options:
        ssl_options["ssl_check_hostname"] = _flag(ssl_options["ssl_check_hostname"], "ssl_check_hostname")
    if ssl_options.get("ssl_cert_reqs", "required") not in ("none", "optional", "required"):
        raise InvalidInputError(f"tier {shown!r}: ssl_cert_reqs is none, optional or required")
    limit = parse_size(q["max_value"], f"tier {shown!r}: max_value") if "max_value" in q else DEFAULT_MAX_VALUE_BYTES
    return RedisTier(host, port, db=int(db), username=unquote(u.username) if u.username else None,
                     password=_password(shown, u.password, q), ssl=scheme == "rediss",
                     ssl_options=ssl_options, timeout_s=timeout, ttl_s=int(ttl) if ttl else None,
                     prefix=q.get("prefix", "kvcodec:"), max_value_bytes=limit)


def _password(shown: str, in_url: str | None, q: dict[str, str]) -> str | None:
    """The password from exactly one of the URL, ``password_file`` (its first line) or ``password_env``."""
    given = [w for w, v in (("the URL", in_url), ("password_file", q.get("password_file")),
                            ("password_env", q.get("password_env"))) if v is not None]
    if len(given) > 1:
        raise InvalidInputError(f"tier {shown!r}: the password comes from {' and '.join(given)}; give one")
    if "password_file" in q:
        try:
            with open(q["password_file"], encoding="utf-8") as f:
                return f.readline().rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidInputError(f"tier {shown!r}: cannot read password_file {q['password_file']!r} "
                                    f"({type(e).__name__})") from None
    if "password_env" in q:
        if q["password_env"] not in os.environ:
            raise InvalidInputError(f"tier {shown!r}: password_env names {q['password_env']!r}, which is not set")
        return os.environ[q["password_env"]]
    return unquote(in_url) if in_url is not None else None


def _mooncake(spec: str) -> StorageTier:
    from kvcodec.store.tiers.mooncake import DEFAULT_MASTER_PORT, DEFAULT_TIMEOUT_S, MooncakeTier

    u = urlsplit(spec)
    try:
        host, port = u.hostname, u.port or DEFAULT_MASTER_PORT
    except ValueError:
        raise InvalidInputError(f"tier {spec!r}: the port is not a number from 1 to 65535") from None
    if not host or u.path not in ("", "/") or u.username or u.password:
        raise InvalidInputError(f"tier {spec!r}: write mooncake://MASTER_HOST[:PORT][?OPTIONS]")
    q = _query(spec, "mooncake", u.query)
    replicas = q.get("replicas", "1")
    if not (replicas.isdigit() and int(replicas) > 0):
        raise InvalidInputError(f"tier {spec!r}: replicas is a whole number above 0, not {replicas!r}")
    try:
        timeout = float(q.get("timeout", DEFAULT_TIMEOUT_S))
    except ValueError:
        raise InvalidInputError(f"tier {spec!r}: timeout is a number of seconds, not {q['timeout']!r}") from None
    sizes = {opt: parse_size(q[opt], f"tier {spec!r}: {opt}") for opt in ("segment", "buffer", "max_value") if opt in q}
    return MooncakeTier(f"{host}:{port}", metadata=q.get("metadata", "P2PHANDSHAKE"),
                        local_hostname=q.get("local", "127.0.0.1"), protocol=q.get("protocol", "tcp"),
                        replicas=int(replicas), timeout_s=timeout, admin=q.get("admin"),
                        **{k: v for k, v in (("segment_bytes", sizes.get("segment")),
                                             ("buffer_bytes", sizes.get("buffer")),
                                             ("max_value_bytes", sizes.get("max_value"))) if v is not None})
