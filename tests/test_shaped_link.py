"""The store's Redis tier over a real, shaped network link (kvcodec/tools/netlab.py): transfers run at the rate set,
a rate change reaches a transfer in flight, and a compressed chunk crosses the link as much sooner as it is
smaller.  Skipped with the reason where a link cannot be made (not root); CI runs as root."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import kvcodec
from kvcodec.store import KVStore, RedisTier

from kvcodec.tools.redis_server import started_redis
from kvcodec.tools.netlab import ShapedLink, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=unavailable() or "")


@pytest.fixture
def link_redis(tmp_path):
    with ShapedLink(40) as link:
        server = started_redis(tmp_path, link)
        try:
            yield link, server, RedisTier(server.host, server.port, timeout_s=5.0)
        finally:
            server.stop()


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _mbit(nbytes: int, seconds: float) -> float:
    return nbytes * 8 / seconds / 1e6


def test_transfers_run_at_the_rate_set(link_redis):
    link, _, tier = link_redis
    value = torch.randint(0, 256, (2 << 20,), dtype=torch.uint8).numpy().tobytes()  # incompressible, 2 MiB
    ok, put_s = _timed(lambda: tier.put("k", value))
    got, get_s = _timed(lambda: tier.get("k"))
    assert ok and got == value
    for seconds in (put_s, get_s):  # both directions are shaped: tbf gives a little under its rate
        assert 0.6 * 40 < _mbit(len(value), seconds) < 1.15 * 40
    link.set_rate(160)
    again, fast_s = _timed(lambda: tier.get("k"))
    assert again == value and get_s / fast_s > 2.5


def test_a_rate_change_reaches_a_transfer_in_flight(link_redis):
    link, _, tier = link_redis
    value = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8).numpy().tobytes()
    link.set_rate(400)
    assert tier.put("k", value)
    link.set_rate(80)  # 4 MiB take 0.42 s at 80 Mbit/s
    done: dict = {}

    def fetch() -> None:
        done["value"], done["seconds"] = _timed(lambda: tier.get("k"))

    reader = threading.Thread(target=fetch)
    reader.start()
    time.sleep(0.12)
    link.set_rate(8)  # the rest, about 3 MiB, at 8 Mbit/s: about 3 s more
    reader.join(30)
    assert done["value"] == value
    assert 1.5 < done["seconds"] < 10


def test_a_compressed_chunk_crosses_the_link_sooner(link_redis, real_kv):
    """The same 256 tokens of real SmolLM2 KV fetched from Redis over a 40 Mbit/s link: raw float16 and cachegen."""
    _, _, tier = link_redis
    ids = real_kv.token_ids[:256]
    kv = kvcodec.KVCache([(l.keys[:, :256], l.values[:, :256]) for l in real_kv.layers], model=real_kv.model,
                         rope=real_kv.rope)
    seconds, sizes = {}, {}
    for codec in ("raw", "cachegen"):
        store = KVStore([tier], model=real_kv.model, codec=codec)
        assert store.put(ids, kv) == 1
        chunks, seconds[codec] = _timed(lambda: store.fetch(ids))
        assert len(chunks) == 1
        sizes[codec] = len(chunks[0].data)
        assert store.get(ids).num_tokens == 256
    ratio = sizes["raw"] / sizes["cachegen"]
    assert ratio > 4
    # the fetch time follows the bytes: at least half of the size ratio is won on the link
    assert seconds["raw"] / seconds["cachegen"] > ratio / 2, (seconds, sizes)
