"""The Mooncake Store tier over a real shaped link: a ``mooncake_master`` and a segment holder (the process whose
memory keeps the values) in a network namespace of the test's own, the store's client here, reaching them over a
veth pair shaped with tbf (kvcodec/tools/netlab.py).  Values cross at the rate set, and a load from a store keeping
``cachegen`` and ``raw`` variants follows the link as it does over Redis.  Skipped where a link cannot be made
(not root); under CI a missing Mooncake fails (the set-up installs it)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvcodec.store import DenseSink, KVStore
from kvcodec.store.tiers.mooncake import MooncakeTier

from kvcodec.tools.harness.mooncake import master_exe
from kvcodec.tools.harness.mooncake import unavailable as mooncake_unavailable
from kvcodec.tools.redis_server import free_port
from kvcodec.tools.netlab import ShapedLink, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=unavailable() or "")

HOLDER = """
import sys
from kvcodec.store.tiers.mooncake import MooncakeTier
tier = MooncakeTier(sys.argv[1], local_hostname=sys.argv[2], segment_bytes=256 << 20, buffer_bytes=1 << 20,
                    timeout_s=5, name="holder")
assert tier.available, "the segment holder could not set up with the master"
print("ready", flush=True)
sys.stdin.read()
tier.close()
"""


@pytest.fixture
def mooncake_behind_link(tmp_path):
    """A master and a segment holder behind a 50 Mbit/s link, and a tier whose client mounts no memory of its own."""
    why = mooncake_unavailable()
    if why:
        if os.environ.get("CI"):
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
    with ShapedLink(50) as link:
        port = free_port()
        log = open(tmp_path / "master.log", "wb")
        master = subprocess.Popen(link.command(master_exe(), f"--rpc_port={port}", f"--rpc_address={link.peer}",
                                               f"--metrics_port={free_port()}", f"--metrics_host={link.peer}"),
                                  stdout=log, stderr=subprocess.STDOUT)
        holder = None
        try:
            address = f"{link.peer}:{port}"
            deadline = time.monotonic() + 15
            while subprocess.run(link.command("bash", "-c", f"exec 3<>/dev/tcp/{link.peer}/{port}"),
                                 capture_output=True).returncode != 0:
                assert time.monotonic() < deadline and master.poll() is None, (tmp_path / "master.log").read_text()
                time.sleep(0.1)
            holder = subprocess.Popen(link.command(sys.executable, "-c", HOLDER, address, link.peer),
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                      cwd=Path(__file__).resolve().parent.parent)
            assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
            tier = MooncakeTier(address, local_hostname=link.host, segment_bytes=0, buffer_bytes=64 << 20,
                                timeout_s=60, name="mooncake")
            assert tier.available
            yield link, tier
            tier.close()
        finally:
            if holder is not None:
                assert holder.stdin is not None
                holder.stdin.close()
                holder.wait(30)
            master.kill()
            master.wait()
            log.close()


def test_values_cross_the_link_at_its_rate_and_loads_follow_it(mooncake_behind_link, real_kv):
    link, tier = mooncake_behind_link
    value = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8).numpy().tobytes()  # incompressible, 4 MiB
    assert tier.put("k", value)  # into the holder's segment: across the link
    t0 = time.perf_counter()
    assert tier.get("k") == value
    mbit = len(value) * 8 / (time.perf_counter() - t0) / 1e6
    assert 0.6 * 50 < mbit < 1.15 * 50, mbit

    ids = list(real_kv.token_ids)  # 512 tokens: two chunks
    store = KVStore([tier], model=real_kv.model, codec=["cachegen", "raw"])
    link.set_rate(10_000)
    store.put(ids, real_kv)

    def variants(rate: float) -> list[int]:
        link.set_rate(rate)
        store.prefix_load(ids, DenseSink()).start().finish()  # what the store learns of the link at this rate
        result = store.prefix_load(ids, DenseSink()).start().finish()
        assert result.complete
        return [c.variant for c in result.chunks]

    # raw from the front (a few ms a chunk, less than decoding cachegen) while the decoder may work back from the
    # last chunk's cachegen
    assert variants(10_000)[0] == 1
    assert variants(20) == [0, 0]  # cachegen only: 5.9 MB of raw is 2.4 s a chunk at 20 Mbit/s
