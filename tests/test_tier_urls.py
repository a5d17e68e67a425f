"""The tier URL grammar (kvcodec.store.tiers.urls) in both engine hooks: old forms, bounded defaults, Redis AUTH and TLS
against a real redis-server, passwords kept out of logs, reprs and errors, and kvcodec's own Redis key names."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import stat
import subprocess
import time

import pytest
import torch

import kvcodec.engines.lmcache_plugin as lp
from kvcodec.engines.vllm_connector.setup import connector_store
from kvcodec.errors import InvalidInputError, LimitExceededError
from kvcodec.store import CacheIdentity, DiskTier, GPUTier, MemoryTier, RedisTier
from kvcodec.store.tiers import default_disk_folder
from kvcodec.store.tiers import parse_size, redact, tier_from_url

from kvcodec.tools.redis_server import free_port

PASSWORD = "s3cret-Pw/@x"  # needs escaping in a URL: %2F, %40
IN_URL = "s3cret-Pw%2F%40x"
L, T, H, D = 2, 16, 2, 8


def _pool_kwargs(tier: RedisTier) -> dict:
    return tier.client.connection_pool.connection_kwargs


# --- the grammar -------------------------------------------------------------------------------------

def make_tier(spec: str, *, redis_timeout_s: float = 0.5, disk_folder: str | None = None):
    return tier_from_url(spec, timeout_s=redis_timeout_s, disk_folder=disk_folder)


def test_old_forms_still_work(tmp_path):
    assert isinstance(make_tier("cpu"), MemoryTier) and make_tier("cpu").capacity_bytes == 1 << 30
    assert make_tier("cpu:1000").capacity_bytes == 1000
    disk = make_tier(f"disk:{tmp_path / 'kv'}")
    assert isinstance(disk, DiskTier) and disk.path == str(tmp_path / "kv")
    r = make_tier("redis://10.0.0.1:6380/2", redis_timeout_s=0.7)
    assert (_pool_kwargs(r)["host"], _pool_kwargs(r)["port"], _pool_kwargs(r)["db"]) == ("10.0.0.1", 6380, 2)
    assert _pool_kwargs(r)["socket_timeout"] == 0.7 and _pool_kwargs(r)["password"] is None
    assert _pool_kwargs(make_tier("redis://cache.internal"))["port"] == 6379


def test_new_forms(tmp_path):
    assert tier_from_url("memory://?capacity=1GiB").capacity_bytes == 1 << 30
    assert tier_from_url("memory:64k").capacity_bytes == 64_000
    gpu = tier_from_url("gpu://?capacity=2MiB&device=cpu")
    assert isinstance(gpu, GPUTier) and gpu.capacity_bytes == 2 << 20 and gpu.device.type == "cpu"
    d = tier_from_url(f"file://{tmp_path}/a%20b?capacity=5GiB&shared=true&max_value=1MiB")
    assert d.path == f"{tmp_path}/a b" and d.capacity_bytes == 5 << 30 and d.shared and d.max_value_bytes == 1 << 20
    d = tier_from_url(f"disk:{tmp_path}/c?capacity=3GB")
    assert d.path == f"{tmp_path}/c" and d.capacity_bytes == 3 * 10**9 and not d.shared
    r = tier_from_url(f"redis://alice:{IN_URL}@[::1]:7000/3?ttl=600&timeout=2&prefix=team-a:&max_value=64MiB")
    kw = _pool_kwargs(r)
    assert (kw["host"], kw["port"], kw["db"], kw["username"], kw["password"]) == ("::1", 7000, 3, "alice", PASSWORD)
    assert r.ttl_s == 600 and kw["socket_timeout"] == 2.0 and r.prefix == "team-a:" and r.max_value_bytes == 64 << 20
    assert _pool_kwargs(tier_from_url(f"redis://:{IN_URL}@h"))["username"] is None
    assert parse_size("10GiB") == 10 << 30 and parse_size("1.5k") == 1500 and parse_size(42) == 42


def test_rediss_builds_a_tls_client(tmp_path):
    import redis

    r = tier_from_url(f"rediss://:{IN_URL}@h:6380?ssl_ca_certs={tmp_path}/ca.pem&ssl_cert_reqs=optional"
                      "&ssl_check_hostname=false")
    pool = r.client.connection_pool
    assert pool.connection_class is redis.SSLConnection
    kw = pool.connection_kwargs
    assert kw["ssl_ca_certs"] == f"{tmp_path}/ca.pem" and kw["ssl_cert_reqs"] == "optional"
    assert kw["ssl_check_hostname"] is False and kw["password"] == PASSWORD
    assert make_tier("rediss://h").client.connection_pool.connection_class is redis.SSLConnection
    assert make_tier("redis://h").client.connection_pool.connection_class is not redis.SSLConnection


@pytest.mark.parametrize("spec", ["tape", "ftp://x", "cpu:lots", f"redis://:{IN_URL}@h:99999",
                                  f"redis://:{IN_URL}@h/zero", f"redis://:{IN_URL}@h?ttl=0",
                                  f"redis://:{IN_URL}@h?ssl_ca_certs=/ca.pem", f"redis://:{IN_URL}@h?colour=red",
                                  f"rediss://:{IN_URL}@h?ssl_cert_reqs=maybe", "disk:/x?shared=perhaps",
                                  "file://otherhost/x", f"redis://:{IN_URL}@"])
def test_bad_specs_are_refused_without_showing_the_password(spec):
    with pytest.raises(InvalidInputError) as e:
        tier_from_url(spec)
    assert "s3cret" not in str(e.value)
    assert isinstance(e.value, ValueError)  # what vLLM's config checks catch


def test_redact():
    assert redact(f"redis://alice:{IN_URL}@h:1/2?ttl=3") == "redis://alice:***@h:1/2?ttl=3"
    assert redact(f"rediss://:{PASSWORD}@h") == "rediss://:***@h"  # even unescaped
    assert redact("redis://h:1") == "redis://h:1" and redact("disk:/a@b") == "disk:/a@b"


def test_engine_config_tiers_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    store = connector_store({"codec": "raw"}, "m", CacheIdentity())  # the default tiers
    cpu, disk = store.tiers
    assert cpu.capacity_bytes == 1 << 30
    assert disk.path == str(tmp_path / "cache" / "kvcodec" / "vllm") and disk.capacity_bytes == 10 << 30
    assert stat.S_IMODE(os.stat(disk.path).st_mode) == 0o700 and not disk.shared
    assert make_tier("disk", disk_folder=default_disk_folder("vllm")).path == disk.path
    assert make_tier(f"disk:{tmp_path}/kv?capacity=1MiB").capacity_bytes == 1 << 20
    conn = lp.connector_from_url(f"kvcodec://local/?backend=memory&codec=raw&num_heads={H}")
    assert conn.tier.capacity_bytes == 1 << 30  # was unbounded
    conn = lp.connector_from_url(f"kvcodec://local/?backend=memory&capacity=2MiB&codec=raw&num_heads={H}")
    assert conn.tier.capacity_bytes == 2 << 20 and conn.store.codec.codec_id == "raw"
    conn = lp.connector_from_url(f"kvcodec://{tmp_path}/lm?backend=disk&capacity=3MiB&codec=raw&num_heads={H}")
    assert conn.tier.capacity_bytes == 3 << 20 and conn.tier.path == f"{tmp_path}/lm"
    conn = lp.connector_from_url(f"kvcodec://127.0.0.1:6390/?backend=redis&ttl=60&timeout=0.3&codec=raw&num_heads={H}")
    assert conn.tier.ttl_s == 60 and _pool_kwargs(conn.tier)["socket_timeout"] == 0.3
    assert _pool_kwargs(conn.tier)["port"] == 6390


# --- a real redis-server with a password --------------------------------------------------------------

@pytest.fixture()
def redis_with_password(redis_server):
    """The suite's loopback redis-server, then AUTH required (requirepass) and an ACL user alice."""
    import redis

    admin = redis.Redis(port=redis_server.port)
    admin.execute_command("ACL", "SETUSER", "alice", "on", f">{PASSWORD}", "~*", "+@all")
    admin.config_set("requirepass", PASSWORD)
    admin.close()
    yield redis_server


class Key:
    def __init__(self, s):
        self.s = s

    def to_string(self):
        return self.s


def _chunk() -> torch.Tensor:
    return torch.randn(2, L, T, H * D, generator=torch.Generator().manual_seed(1)).half()


def test_redis_auth_in_both_hooks(redis_with_password, caplog):
    port = redis_with_password.port
    caplog.set_level(logging.DEBUG)
    for url in (f"redis://:{IN_URL}@127.0.0.1:{port}", f"redis://alice:{IN_URL}@127.0.0.1:{port}/1?timeout=2"):
        tier = make_tier(url)
        assert tier.put("k", b"value") and tier.get("k") == b"value" and tier.keys() == ["k"]
        assert "s3cret" not in repr(tier)
    anonymous = make_tier(f"redis://127.0.0.1:{port}")
    assert not anonymous.put("k2", b"v") and anonymous.get("k") is None and anonymous.failures >= 1  # NOAUTH: a miss
    wrong = make_tier(f"redis://:nope@127.0.0.1:{port}", redis_timeout_s=2)
    assert wrong.get("k") is None and wrong.failures == 1

    # the LMCache plugin used to drop the credentials of its URL (every operation answered NOAUTH and missed); a
    # password now comes from the environment or a file the URL names, never from the URL, which LMCache logs
    chunk = _chunk()
    with pytest.raises(InvalidInputError, match="password"):
        lp.connector_from_url(f"kvcodec://:{IN_URL}@127.0.0.1:{port}/?backend=redis&codec=raw&num_heads={H}")
    os.environ["KVCODEC_TEST_REDIS_PW"] = PASSWORD
    try:
        conn = lp.connector_from_url(f"kvcodec://127.0.0.1:{port}/?backend=redis&password_env=KVCODEC_TEST_REDIS_PW"
                                     f"&codec=raw&num_heads={H}")
        assert conn.put_sync(Key("c"), chunk) and torch.equal(conn.get_sync(Key("c")).tensor, chunk)
        assert conn.tier.failures == 0 and "s3cret" not in repr(conn)
        conn = lp.connector_from_url(f"kvcodec://alice@127.0.0.1:{port}/0?backend=redis&password_env=KVCODEC_TEST_REDIS_PW"
                                     f"&codec=raw&num_heads={H}")
        assert torch.equal(conn.get_sync(Key("c")).tensor, chunk)
    finally:
        del os.environ["KVCODEC_TEST_REDIS_PW"]
    conn = lp.connector_from_url(f"kvcodec://127.0.0.1:{port}/?backend=redis&codec=raw&num_heads={H}")
    assert conn.get_sync(Key("c")) is None and not conn.put_sync(Key("d"), chunk)
    assert "NOAUTH" in caplog.text or "Authentication" in caplog.text  # the miss says why ...
    assert "s3cret" not in caplog.text  # ... and never shows the password


# --- TLS -------------------------------------------------------------------------------------------------

def _tls_files(folder) -> dict:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl to make a test CA (rediss:// client settings are checked by test_rediss_builds_a_tls_client)")

    def run(*args):
        subprocess.run([openssl, *args], cwd=folder, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
        "-subj", "/CN=kvcodec test CA")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (folder / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
        "server.pem", "-days", "1", "-extfile", "ext.cnf")
    return {k: str(folder / f) for k, f in (("ca", "ca.pem"), ("cert", "server.pem"), ("key", "server.key"))}


@pytest.fixture()
def tls_redis(tmp_path):
    """A redis-server speaking only TLS (and requiring a password) on a loopback port; skipped when this
    redis-server was built without TLS."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not on PATH (Debian: apt-get install -y redis-server)")
    files = _tls_files(tmp_path)
    port = free_port()
    proc = subprocess.Popen([exe, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--tls-cert-file",
                             files["cert"], "--tls-key-file", files["key"], "--tls-ca-cert-file", files["ca"],
                             "--tls-auth-clients", "no", "--requirepass", PASSWORD, "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while True:
            if proc.poll() is not None:
                out = proc.stdout.read().decode(errors="replace")
                if "tls" in out.lower():
                    pytest.skip(f"this redis-server was built without TLS: {out.strip()[-200:]}")
                pytest.fail(f"redis-server with TLS did not start: {out[-500:]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "redis-server with TLS did not listen within 10 s"
                time.sleep(0.05)
        yield port, files["ca"]
    finally:
        proc.kill()
        proc.wait()


def tls_redis_password_file(beside: str) -> str:
    path = os.path.join(os.path.dirname(beside), "redis-password")
    with open(path, "w") as f:
        f.write(PASSWORD)
    return path


def test_rediss_against_a_tls_server(tls_redis, caplog):
    port, ca = tls_redis
    url = f"rediss://:{IN_URL}@127.0.0.1:{port}?ssl_ca_certs={ca}&timeout=5"
    tier = make_tier(url)
    assert tier.put("k", b"over tls") and tier.get("k") == b"over tls"
    chunk = _chunk()
    password = tls_redis_password_file(ca)
    conn = lp.connector_from_url(f"kvcodec://127.0.0.1:{port}/?backend=rediss&ssl_ca_certs={ca}&timeout=5"
                                 f"&password_file={password}&codec=raw&num_heads={H}")
    assert conn.put_sync(Key("c"), chunk) and torch.equal(conn.get_sync(Key("c")).tensor, chunk)
    # the server's certificate is checked: without the CA that signed it, no connection, a miss
    assert make_tier(f"rediss://:{IN_URL}@127.0.0.1:{port}?timeout=5").get("k") is None
    assert make_tier(f"redis://:{IN_URL}@127.0.0.1:{port}?timeout=1").get("k") is None  # plain text to a TLS port
    assert "s3cret" not in caplog.text


# --- kvcodec's own Redis names, and the size check before the payload is sent ----------------------------

def test_redis_values_do_not_meet_lmcaches_own(redis_server):
    import redis

    raw = redis.Redis(port=redis_server.port)
    key = "vllm@m@1@0@abc@float16"
    # what LMCache's own Redis connector writes: "<key>kv_bytes" and a 28-byte "<key>metadata" of its own format
    raw.mset({key + "kv_bytes": b"L" * 100, key + "metadata": b"\x01" * 28})
    tier = RedisTier(port=redis_server.port, timeout_s=2)
    assert tier.get(key) is None and not tier.contains(key) and tier.keys() == []
    assert tier.put(key, b"kvcodec container")
    assert raw.get(key + "kv_bytes") == b"L" * 100 and raw.get(key + "metadata") == b"\x01" * 28  # untouched
    assert sorted(raw.keys(f"*{key}*")) == sorted([(key + s).encode() for s in ("kv_bytes", "metadata")] +
                                                  [f"kvcodec:{key}{s}".encode() for s in (":data", ":meta")])
    assert tier.get(key) == b"kvcodec container" and tier.keys() == [key]
    # a prefix with glob characters lists only its own keys
    other = RedisTier(port=redis_server.port, timeout_s=2, prefix="t[1]*:")
    assert other.put("x", b"1") and other.keys() == ["x"] and tier.keys() == [key]


def test_redis_reads_are_bounded_by_max_value_bytes(redis_server, caplog):
    import redis

    big = os.urandom(4 << 20)
    writer = RedisTier(port=redis_server.port, timeout_s=5)
    assert writer.put("big", big) and writer.put("small", b"s" * 100)
    reader = RedisTier(port=redis_server.port, timeout_s=5, max_value_bytes=1 << 20)
    assert not reader.put("big2", big)  # nor stored
    assert reader.get("small") == b"s" * 100  # warms the connection and loads the script
    raw = redis.Redis(port=redis_server.port)
    sent = raw.info("stats")["total_net_output_bytes"]
    with pytest.raises(LimitExceededError, match="more than the 1048576"):
        reader.get("big")
    assert raw.info("stats")["total_net_output_bytes"] - sent < (1 << 20) + (64 << 10)  # not the 4 MiB payload
    assert writer.get("big") == big  # a reader with a larger limit gets it

    # one round trip per read (MULTI, STRLEN, GETRANGE, GET, EXEC written at once)
    sends = []
    conn = reader.client.connection_pool.get_connection()
    real_send = type(conn).send_packed_command

    def counting(self, command, *a, **kw):
        sends.append(command)
        return real_send(self, command, *a, **kw)

    reader.client.connection_pool.release(conn)
    type(conn).send_packed_command = counting
    try:
        for _ in range(5):
            assert reader.get("small") == b"s" * 100
    finally:
        type(conn).send_packed_command = real_send
    assert len(sends) == 5


@pytest.mark.parametrize("password", ["p#ss", "p?ss", "p/ss", "p@ss", "p:ss", "a#b?c/d@e:f", "%23%3F%2F%40%3A"])
def test_redact_hides_passwords_holding_url_delimiters(password):
    """``#`` and ``?`` ended the user information early, so such a password was shown; escaped or not, it is not."""
    for user, host in (("", "cache.internal:6379/0?ttl=5"), ("admin", "10.0.0.7"), ("u", "[::1]:6379#frag")):
        assert redact(f"redis://{user}:{password}@{host}") == f"redis://{user}:***@{host}"


def test_a_redis_password_comes_from_a_file_or_the_environment(tmp_path, monkeypatch):
    """A password written into a tier URL is logged with the engine's configuration; password_file= and
    password_env= keep it out of it."""
    secret_file = tmp_path / "redis.pw"
    secret_file.write_text("from-file\n")
    tier = tier_from_url(f"redis://kv@127.0.0.1:6390/0?password_file={secret_file}")
    assert tier.client.connection_pool.connection_kwargs["password"] == "from-file"
    assert tier.client.connection_pool.connection_kwargs["username"] == "kv"
    monkeypatch.setenv("KVC_TEST_REDIS_PW", "from-env")
    tier = tier_from_url("rediss://127.0.0.1?password_env=KVC_TEST_REDIS_PW")
    assert tier.client.connection_pool.connection_kwargs["password"] == "from-env"
    with pytest.raises(InvalidInputError, match="give one") as err:
        tier_from_url("redis://:inline@127.0.0.1?password_env=KVC_TEST_REDIS_PW")
    assert "inline" not in str(err.value)
    with pytest.raises(InvalidInputError, match="not set"):
        tier_from_url("redis://127.0.0.1?password_env=KVC_TEST_UNSET_PW")
    with pytest.raises(InvalidInputError, match="cannot read password_file"):
        tier_from_url(f"redis://127.0.0.1?password_file={tmp_path / 'missing'}")
