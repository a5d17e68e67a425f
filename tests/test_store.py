"""The tiered KV store: chained keys, tiers (CPU LRU, disk, real redis-server, GPU), faults and concurrency."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import kvcodec
from kvcodec.errors import CorruptDataError
from kvcodec.store import DiskTier, GPUTier, KVStore, MemoryTier, PlacementPolicy, RedisTier, chunk_hashes, namespace

from kvcodec.tools.redis_server import free_port as _free_port

REPO = Path(__file__).resolve().parent.parent
MODEL = "SmolLM2-135M-Instruct"


def _small_kv(tokens: int, layers: int = 2, seed: int = 0) -> kvcodec.KVCache:
    g = torch.Generator().manual_seed(seed)
    return kvcodec.KVCache([(torch.randn(2, tokens, 8, generator=g).half(), torch.randn(2, tokens, 8, generator=g).half())
                            for _ in range(layers)], model=MODEL)


# --- keys -----------------------------------------------------------------------------------------

def test_chained_keys():
    seed = namespace(MODEL, "raw", {}, 4)
    a = chunk_hashes(list(range(10)), 4, seed)
    assert len(a) == 3  # 4 + 4 + a partial chunk of 2
    assert a == chunk_hashes(list(range(10)), 4, seed)
    b = chunk_hashes([99] + list(range(1, 10)), 4, seed)  # a different first chunk changes every later key
    assert all(x != y for x, y in zip(a, b))
    c = chunk_hashes(list(range(8)) + [7, 7], 4, seed)  # same first chunks, different last one
    assert c[:2] == a[:2] and c[2] != a[2]
    # model, codec config and chunk size are part of every key
    for other in (namespace("other", "raw", {}, 4), namespace(MODEL, "kivi", {"bits": 4}, 4),
                  namespace(MODEL, "raw", {}, 5)):
        assert chunk_hashes(list(range(10)), 4, other)[0] != a[0]
    x = chunk_hashes(list(range(10)), 4, namespace(MODEL, "raw", {}, 4, "xxh3-128"), "xxh3-128")
    assert len(x[0]) == 16 and len(a[0]) == 32
    store = KVStore([MemoryTier()], model=MODEL, codec="raw", chunk_tokens=4)
    keys = [k for k, _, _ in store.keys_for(list(range(10)))]
    assert len(set(keys)) == 3 and all(k.startswith(f"kvc@{MODEL}@") for k in keys)
    assert KVStore([MemoryTier()], model=MODEL, codec="kivi", chunk_tokens=4).keys_for(list(range(10)))[0][0] != keys[0]


# --- prefix lookup and decode on real KV -----------------------------------------------------------

def test_prefix_lookup_real_kv(real_kv):
    ids = real_kv.token_ids
    store = KVStore([MemoryTier(None)], model=real_kv.model, codec="raw")
    assert store.lookup(ids) == (0, [], 0)
    assert store.get(ids) is None
    assert store.put(ids, real_kv) == 2
    assert store.put(ids, real_kv) == 0  # already stored: nothing encoded again
    assert store.lookup(ids) == (512, ["cpu", "cpu"], 512)
    assert store.lookup(ids[:300]).num_tokens == 256  # the partial chunk 256..300 was never stored
    assert store.lookup(ids + [1, 2, 3]).num_tokens == 512
    assert store.lookup(ids[:256] + [0] + ids[257:]).num_tokens == 256  # differs inside the second chunk
    assert store.lookup([0] + ids[1:]).num_tokens == 0  # differs in the first chunk: nothing reusable
    got = store.get(ids + [5, 6])
    assert got.equal(real_kv) and got.token_ids == ids and got.model == real_kv.model and got.rope == real_kv.rope
    half = store.get(ids[:256] + [1] * 256)
    assert half.num_tokens == 256
    assert half.equal(kvcodec.KVCache([(l.keys[:, :256], l.values[:, :256]) for l in real_kv.layers]))


def test_partial_last_chunk(real_kv):
    ids = real_kv.token_ids[:300]
    kv = kvcodec.KVCache([(l.keys[:, :300], l.values[:, :300]) for l in real_kv.layers], model=real_kv.model,
                         token_ids=ids, rope="post")
    store = KVStore([MemoryTier(None)], model=real_kv.model, codec="raw")
    assert store.put(ids, kv) == 2
    assert store.lookup(ids) == (300, ["cpu", "cpu"], 300)
    assert store.lookup(real_kv.token_ids).num_tokens == 256  # the longer request's second chunk is a full one
    assert store.get(ids).equal(kv)


def test_chunks_an_engine_names_itself(real_kv):
    """put_chunk/load_chunk under engine_key (LMCache's and SGLang's hooks): one chunk per key, its length read from
    the chunk, other engines' names and other codecs kept apart, and a chunk under another name never served."""
    kv = kvcodec.KVCache([(l.keys[:, :100], l.values[:, :100]) for l in real_kv.layers], model=real_kv.model)
    tier = MemoryTier(None)
    store = KVStore([tier], model=real_kv.model, codec="raw")
    key = store.engine_key("page-1", b"engine/1\0")
    assert key != store.engine_key("page-1", b"other/1\0") and key != store.engine_key("page-2", b"engine/1\0")
    assert key != KVStore([tier], model=real_kv.model, codec="kivi").engine_key("page-1", b"engine/1\0")
    size = store.put_chunk(key, kv)
    assert size == len(tier.get(key)) and store.put_chunk(key, kv) == 0  # already there: nothing written
    assert store.load_chunk(key).equal(kv) and store.load_chunk(key, 100).equal(kv)
    assert store.source.holders([key, "nope"]) == ["cpu", None]
    assert store.held_prefix([key, "nope", key]) == 1 and store.held_prefix([key]) == 1 and store.held_prefix([]) == 0
    assert store.load_chunk(key, 256) is None and store.stats["corrupt"] == 1 and not tier.contains(key)
    store.put_chunk(key, kv)
    other = store.engine_key("page-2", b"engine/1\0")
    tier.put(other, tier.get(key))  # a valid chunk, written for another name
    assert store.load_chunk(other) is None and not tier.contains(other)
    with pytest.raises(kvcodec.InvalidInputError, match="1 to 256 tokens"):
        store.put_chunk(key, real_kv)


def test_default_codec_is_cachegen(real_kv):
    ids = real_kv.token_ids[:256]
    kv = kvcodec.KVCache([(l.keys[:, :256], l.values[:, :256]) for l in real_kv.layers], model=real_kv.model,
                         token_ids=ids, rope="post")
    tier = MemoryTier(None)
    store = KVStore([tier], model=real_kv.model)
    assert store.codec.codec_id == "cachegen"
    store.put(ids, kv)
    (key,) = tier.keys()
    info = kvcodec.open(tier.get(key)).info
    assert info.codec == "cachegen" and info.num_chunks == 1 and info.bits_per_element < 4
    # exactly what decoding a cachegen container of the chunk gives
    assert store.get(ids).equal(kvcodec.decode(kvcodec.encode(kv, "cachegen", chunk_tokens=256)))


# --- CPU tier --------------------------------------------------------------------------------------

def test_cpu_lru_budget():
    tier = MemoryTier(capacity_bytes=30)
    evicted = []
    tier.on_evict = lambda k, v: evicted.append((k, v))
    assert tier.put("a", b"x" * 10) and tier.put("b", b"y" * 10) and tier.put("c", b"z" * 10)
    assert tier.size() == 30 and evicted == []
    assert tier.get("a") == b"x" * 10  # a is now the most recently used
    tier.put("d", b"w" * 10)
    assert evicted == [("b", b"y" * 10)] and not tier.contains("b")
    assert tier.keys() == ["c", "a", "d"] and tier.size() == 30
    tier.put("e", b"v" * 25)  # needs the room of three values
    assert [k for k, _ in evicted] == ["b", "c", "a", "d"] and tier.keys() == ["e"] and tier.size() == 25
    assert not tier.put("big", b"q" * 31) and not tier.contains("big")  # larger than the whole budget
    assert tier.put("e", b"v" * 5) and tier.size() == 5  # replacing a value recounts it
    assert tier.delete("e") and not tier.delete("e") and tier.size() == 0


def test_gpu_tier_logic_on_cpu_device():
    tier = GPUTier(capacity_bytes=20, device="cpu")
    tier.put("a", b"0123456789")
    tier.put("b", b"abcdefghij")
    assert tier.get("a") == b"0123456789" and tier.size() == 20
    tier.put("c", b"!!!!!!!!!!")
    assert tier.keys() == ["a", "c"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_tier_on_cuda(real_kv):
    tier = GPUTier(capacity_bytes=1 << 30)
    store = KVStore([tier, MemoryTier(None)], model=real_kv.model, codec="raw")
    store.put(real_kv.token_ids, real_kv)
    assert store.lookup(real_kv.token_ids) == (512, ["gpu", "gpu"], 512)
    assert store.get(real_kv.token_ids).equal(real_kv)


def test_demote_and_promote():
    kv = _small_kv(12)
    ids = list(range(12))
    probe = MemoryTier(None)
    KVStore([probe], model=MODEL, codec="raw", chunk_tokens=4).put(ids, kv)
    one = max(len(probe.get(k)) for k in probe.keys())  # a stored chunk's bytes
    cpu, disk = MemoryTier(capacity_bytes=one + 10), MemoryTier(None, name="disk")
    store = KVStore([cpu, disk], model=MODEL, codec="raw", chunk_tokens=4)
    store.put(ids, kv)  # writes to the fastest tier; two of the three chunks are demoted as the budget overflows
    assert store.lookup(ids) == (12, ["disk", "disk", "cpu"], 12) and store.stats["demoted"] == 2
    assert store.get(ids[:4]).equal(kvcodec.KVCache([(l.keys[:, :4], l.values[:, :4]) for l in kv.layers]))
    assert store.lookup(ids).where[0] == "cpu" and store.stats["promoted"] == 1  # the hit was promoted
    assert store.lookup(ids).where[2] == "disk"  # and the coldest chunk went down
    assert store.evict(ids, tiers=["cpu"]) == 1
    assert store.lookup(ids) == (12, ["disk", "disk", "disk"], 12)
    assert store.promote(ids[:4], to="cpu") == 1 and store.lookup(ids).where == ["cpu", "disk", "disk"]
    assert store.evict(ids) == 4 and store.lookup(ids) == (0, [], 0)


# --- disk tier -------------------------------------------------------------------------------------

def test_disk_tier_basics(tmp_path):
    tier = DiskTier(tmp_path / "kv")
    assert tier.put("kvc@m@ab/cd", b"hello") and tier.get("kvc@m@ab/cd") == b"hello"
    assert tier.keys() == ["kvc@m@ab/cd"] and tier.size() == 5 and tier.contains("kvc@m@ab/cd")
    assert DiskTier(tmp_path / "kv").get("kvc@m@ab/cd") == b"hello"  # survives reopening
    assert tier.delete("kvc@m@ab/cd") and tier.get("kvc@m@ab/cd") is None and tier.keys() == []
    small = DiskTier(tmp_path / "small", capacity_bytes=10)
    gone = []
    small.on_evict = lambda k, v: gone.append((k, v))
    small.put("a", b"12345")
    small.put("b", b"67890")
    small.get("a")
    small.put("c", b"abcde")
    assert gone == [("b", b"67890")] and sorted(small.keys()) == ["a", "c"]


def test_disk_kill_mid_write_leaves_nothing_corrupt(tmp_path):
    folder = tmp_path / "kv"
    tier = DiskTier(folder)
    tier.put("k", b"old value")
    # a writer that is killed after writing half its bytes into the temporary file
    child = textwrap.dedent(f"""
        import os, sys, time
        from kvcodec.store import DiskTier
        real_fsync = os.fsync
        def stall(fd):
            sys.stdout.write("writing\\n"); sys.stdout.flush(); time.sleep(60)
        os.fsync = stall
        DiskTier({str(folder)!r}).put("k", b"new value " * 100000)
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, cwd=REPO)
    assert proc.stdout.readline() == b"writing\n"
    proc.kill()
    proc.wait()
    tmps = [p for p in folder.iterdir() if p.name.startswith(".tmp-")]
    assert tmps, "the killed writer should have left its temporary file"
    for reader in (tier, DiskTier(folder)):
        assert reader.keys() == ["k"] and reader.get("k") == b"old value"
    # a partial temporary file for a key that was never stored is never served either
    (folder / ".tmp-partial").write_bytes(b"garbage")
    assert DiskTier(folder).keys() == ["k"] and not DiskTier(folder).contains(".tmp-partial")
    DiskTier(folder, stale_tmp_s=0)  # reopening cleans up stale temporary files
    assert [p.name for p in folder.iterdir()] == ["k.kvc"]


# --- corruption ------------------------------------------------------------------------------------

def test_corrupt_chunk_is_evicted_and_recomputed(tmp_path, real_kv):
    ids = real_kv.token_ids
    disk = DiskTier(tmp_path / "kv")
    store = KVStore([disk], model=real_kv.model, codec="raw")
    store.put(ids, real_kv)
    second = store.keys_for(ids)[1][0]
    path = Path(disk.path) / disk._file(second)
    data = bytearray(Path(path).read_bytes())
    data[len(data) // 2] ^= 0x40  # one flipped bit in the middle of the tensor bytes
    Path(path).write_bytes(bytes(data))
    assert store.lookup(ids).num_tokens == 512  # lookup does not read payloads
    got = store.get(ids)
    assert got.num_tokens == 256 and store.stats["corrupt"] == 1  # the damaged chunk is a miss ...
    assert not disk.contains(second) and store.lookup(ids) == (256, ["disk"], 256)  # ... and evicted
    assert store.put(ids, real_kv) == 1  # the caller recomputes and stores it again
    assert store.get(ids).equal(real_kv)


def test_corrupt_in_fast_tier_served_from_slower(real_kv):
    ids = real_kv.token_ids[:256]
    kv = kvcodec.KVCache([(l.keys[:, :256], l.values[:, :256]) for l in real_kv.layers], model=real_kv.model,
                         token_ids=ids, rope="post")
    cpu, slow = MemoryTier(None), MemoryTier(None, name="slow")
    store = KVStore([cpu, slow], model=real_kv.model, codec="raw", policy=PlacementPolicy(put_tiers=["cpu", "slow"]))
    store.put(ids, kv)
    (key,) = cpu.keys()
    blob = bytearray(cpu.get(key))
    blob[-100] ^= 1
    cpu.put(key, bytes(blob))
    assert store.get(ids).equal(kv) and store.stats["corrupt"] == 1
    assert store.fetch(ids)[0].tier == "cpu"  # promoted back, intact
    truncated = slow.get(key)[:1000]
    slow.put(key, truncated)
    cpu.delete(key)
    assert store.get(ids) is None and not slow.contains(key)  # a truncated chunk is a miss too


# --- concurrency -----------------------------------------------------------------------------------

def _race(tier, key: str, values: list[bytes], rounds: int = 5) -> None:
    errors = []
    seen = set()

    def write(v: bytes) -> None:
        try:
            for _ in range(rounds):
                assert tier.put(key, v)
                got = tier.get(key)
                assert got in values, "a reader saw a value nobody wrote"
                seen.add(got)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=write, args=(v,)) for v in values]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert tier.get(key) in values and tier.keys() == [key]


def test_concurrent_writers_same_key(tmp_path, redis_server):
    values = [bytes([i]) * (200_000 + i) for i in range(8)]
    _race(MemoryTier(None), "k", values)
    _race(DiskTier(tmp_path / "kv", fsync=False), "k", values)
    assert not [p for p in (tmp_path / "kv").iterdir() if p.name.startswith(".tmp-")]
    _race(RedisTier(port=redis_server.port, timeout_s=2.0), "k", values)


def test_concurrent_store_puts(tmp_path, real_kv, redis_server):
    ids = real_kv.token_ids
    stores = [KVStore([MemoryTier(None), DiskTier(tmp_path / "kv"), RedisTier(port=redis_server.port, timeout_s=5.0)],
                      model=real_kv.model, codec="raw", policy=PlacementPolicy(put_tiers=["cpu", "disk", "redis"]))
              for _ in range(4)]
    threads = [threading.Thread(target=s.put, args=(ids, real_kv)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    fresh = KVStore([DiskTier(tmp_path / "kv")], model=real_kv.model, codec="raw")
    assert fresh.get(ids).equal(real_kv)
    shared = KVStore([RedisTier(port=redis_server.port, timeout_s=5.0)], model=real_kv.model, codec="raw")
    assert shared.get(ids).equal(real_kv)


# --- Redis -----------------------------------------------------------------------------------------

def test_redis_tier_layout(redis_server):
    import redis

    tier = RedisTier(port=redis_server.port)
    assert tier.put("kvc@m@01", b"payload") and tier.contains("kvc@m@01")
    assert tier.get("kvc@m@01") == b"payload" and tier.keys() == ["kvc@m@01"] and tier.size() == 7
    assert tier.value_sizes(["kvc@m@01", "kvc@m@02"]) == [7, None]
    assert tier.get_range("kvc@m@01", 2, 3) == b"ylo" and tier.get_range("kvc@m@01", 5, 10) == b"ad"
    assert tier.get_range("kvc@m@02", 0, 3) is None
    raw = redis.Redis(port=redis_server.port)
    assert raw.get("kvcodec:kvc@m@01:data") == b"payload" and len(raw.get("kvcodec:kvc@m@01:meta")) == 28
    raw.set("kvcodec:kvc@m@01:data", b"payloaX")  # a payload that does not match its metadata is bad
    with pytest.raises(CorruptDataError, match="does not match its metadata"):
        tier.get("kvc@m@01")
    raw.delete("kvcodec:kvc@m@01:meta")
    assert not tier.contains("kvc@m@01") and tier.get("kvc@m@01") is None
    assert tier.delete("kvc@m@01") and tier.keys() == []


def test_redis_down_slow_and_restarted(redis_server, real_kv):
    ids = real_kv.token_ids
    tier = RedisTier(port=redis_server.port, timeout_s=0.2, down_for_s=0.5)
    store = KVStore([tier], model=real_kv.model, codec="raw")
    assert store.put(ids, real_kv) == 2 and store.lookup(ids) == (512, ["redis", "redis"], 512)

    redis_server.kill()  # dead: connection refused
    for _ in range(3):
        t = time.monotonic()
        assert store.lookup(ids) == (0, [], 0)
        assert store.get(ids) is None
        assert store.put(ids, real_kv) == 0
        assert tier.keys() == [] and tier.size() == 0 and not tier.delete("x")
        assert time.monotonic() - t < 1.0
    assert tier.failures >= 1

    redis_server.start()  # restarted on the same port, empty (no persistence)
    time.sleep(0.6)  # the tier retries after down_for_s
    assert store.lookup(ids) == (0, [], 0)
    assert store.put(ids, real_kv) == 2 and store.get(ids).equal(real_kv)

    redis_server.pause()  # hung: every call would wait; the socket timeout bounds it
    try:
        t = time.monotonic()
        assert store.lookup(ids) == (0, [], 0)
        first = time.monotonic() - t
        t = time.monotonic()
        assert store.lookup(ids) == (0, [], 0) and store.get(ids) is None
        again = time.monotonic() - t
        assert first < 0.2 * 3 and again < 0.05, (first, again)  # then no network at all while marked down
    finally:
        redis_server.resume()
    time.sleep(0.6)
    assert store.lookup(ids) == (512, ["redis", "redis"], 512)


def test_redis_behind_memory(redis_server, real_kv):
    """Two machines sharing one Redis: the second finds what the first stored, and caches it locally."""
    ids = real_kv.token_ids
    a = KVStore([MemoryTier(None), RedisTier(port=redis_server.port)], model=real_kv.model, codec="raw")
    b = KVStore([MemoryTier(None), RedisTier(port=redis_server.port)], model=real_kv.model, codec="raw")
    a.put(ids, real_kv)
    assert a.lookup(ids) == (512, ["cpu", "cpu"], 512)
    assert b.lookup(ids) == (512, ["redis", "redis"], 512)
    assert b.get(ids).equal(real_kv)
    assert b.lookup(ids) == (512, ["cpu", "cpu"], 512)
    redis_server.kill()
    assert b.get(ids).equal(real_kv)  # the local copy still serves


def test_lookup_asks_each_tier_once_for_the_whole_prompt(redis_server):
    """A prefix lookup is one batch per tier (for the chunks no faster tier holds), not one round trip per chunk."""
    class Counting(RedisTier):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.batches, self.single = 0, 0

        def contains_many(self, keys):
            self.batches += 1
            return super().contains_many(keys)

        def contains(self, key):
            self.single += 1
            return super().contains(key)

    ids, kv = list(range(40)), _small_kv(40)
    cpu, redis = MemoryTier(None), Counting(port=redis_server.port, prefix="batch:")
    store = KVStore([cpu, redis], model=MODEL, codec="raw", chunk_tokens=4)
    store.put(ids, kv)
    for key, _, _ in store.keys_for(ids)[::2]:  # even chunks only in Redis, odd ones in both tiers
        cpu.delete(key)
    redis.batches = redis.single = 0
    assert store.lookup(ids) == (40, ["redis", "cpu"] * 5, 40)
    assert (redis.batches, redis.single) == (1, 0)
    assert redis.contains_many([k for k, _, _ in store.keys_for(ids)] + ["missing"]) == [True] * 10 + [False]
    assert redis.contains_many([]) == []
    redis_server.kill()
    assert store.lookup(ids) == (0, [], 0)  # Redis gone: the even chunks are missing, the prefix ends at once


def test_a_tier_that_raises_is_a_miss():
    class Broken(MemoryTier):
        name = "broken"

        def contains(self, key):
            raise OSError("backend gone")

        def get(self, key, max_bytes=None):
            raise OSError("backend gone")

        def put(self, key, value):
            raise OSError("backend gone")

    kv = _small_kv(8)
    store = KVStore([Broken(None)], model=MODEL, codec="raw", chunk_tokens=4)
    assert store.put(list(range(8)), kv) == 0
    assert store.lookup(list(range(8))) == (0, [], 0) and store.get(list(range(8))) is None
    assert store.evict(list(range(8))) == 0 and store.promote(list(range(8))) == 0


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is valid and free too."""
    for _ in range(1000):
        port = _free_port()
        if port + 10000 > 65535:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    pytest.fail("no free port pair for a Redis cluster node")


@pytest.fixture()
def redis_cluster(tmp_path):
    """Three redis-server masters in cluster mode on loopback, joined with redis-cli --cluster create."""
    exe, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if exe is None or cli is None:
        pytest.fail("redis-server and redis-cli are not on PATH: install Debian's redis-server package")
    procs, ports = [], []
    try:
        for i in range(3):
            port, folder = _cluster_port(), tmp_path / f"node{i}"
            folder.mkdir()
            procs.append(subprocess.Popen(
                [exe, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes", "--cluster-config-file",
                 str(folder / "nodes.conf"), "--save", "", "--appendonly", "no", "--dir", str(folder)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            ports.append(port)
        for port in ports:
            for _ in range(200):
                if subprocess.run([cli, "-p", str(port), "ping"], capture_output=True, text=True).stdout.strip() == "PONG":
                    break
                time.sleep(0.05)
        made = subprocess.run([cli, "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports], "--cluster-replicas",
                               "0", "--cluster-yes"], capture_output=True, text=True, timeout=60)
        assert made.returncode == 0, made.stdout + made.stderr
        for _ in range(200):
            info = subprocess.run([cli, "-p", str(ports[0]), "cluster", "info"], capture_output=True, text=True).stdout
            if "cluster_state:ok" in info:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the loopback Redis cluster did not reach cluster_state:ok")
        yield ports
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_redis_cluster(redis_cluster, real_kv):
    from redis.cluster import RedisCluster

    client = RedisCluster(host="127.0.0.1", port=redis_cluster[0], socket_timeout=2.0)
    tier = RedisTier(client=client)
    assert tier.hash_tag
    store = KVStore([tier], model=real_kv.model, codec="raw", chunk_tokens=64)  # 8 chunks spread over the slots
    assert store.put(real_kv.token_ids, real_kv) == 8
    assert store.lookup(real_kv.token_ids) == (512, ["redis"] * 8, 512)
    assert store.get(real_kv.token_ids).equal(real_kv)
    assert sorted(tier.keys()) == sorted(k for k, _, _ in store.keys_for(real_kv.token_ids))
    slots = {client.keyslot(tier._k(k)[0]) for k in tier.keys()}
    assert len(slots) == 8 and all(client.keyslot(tier._k(k)[1]) == client.keyslot(tier._k(k)[0]) for k in tier.keys())
    assert len({client.get_node_from_key(tier._k(k)[0]).port for k in tier.keys()}) > 1  # more than one node holds chunks


def test_put_without_replication_leaves_stored_chunks(tmp_path):
    """A chunk any tier holds is not encoded again (what an engine that just loaded it wants)."""
    kv, ids = _small_kv(60), list(range(60))
    disk, mem = DiskTier(tmp_path / "kv"), MemoryTier(None)
    store = KVStore([mem, disk], model=MODEL, codec="raw", chunk_tokens=20, policy=PlacementPolicy(shared=["disk"]))
    head = kvcodec.KVCache([(l.keys[:, :40], l.values[:, :40]) for l in kv.layers], model=MODEL)
    assert store.put(ids[:40], head, replicate=False) == 2
    store.evict(ids[:40], tiers=["cpu"])
    assert store.put(ids, kv, replicate=False) == 1  # only the third chunk: the first two are on disk
    assert store.lookup(ids).where == ["disk", "disk", "cpu"]
    assert store.put(ids, kv) == 2  # replicating: the first two go to the memory tier too
