"""Store and retrieve throughput of a real LMCache multiprocess server (``lmcache server``, LMCache 0.5.6) through its
L2 with kvcodec's serializer beside LMCache's own serdes.

    .venv-engines/bin/python bench/lmcache_server.py [--requests 4]

One server per serde, each with one L2 adapter, kvcodec's ``KVCodecFSL2Adapter`` (LMCache's ``fs`` adapter loading
serialized objects at their real length) on a folder of this machine's disk, and a 1 GB L1.  The serdes:
``none`` (LMCache's own path, no serde: the KV bytes as they are; the MP server's counterpart of the old
``naive`` serde), LMCache's ``fp8`` (``float8_e4m3fn``), and kvcodec's with ``raw``, ``cachegen`` and ``kvtc``
(SmolLM2's calibration from 4096 tokens, ``bench/mooncake_tier.py``'s).  The KV is real: SmolLM2's float16 cache
over ``license:GPL-3``, ``--requests`` requests of 512 tokens (two 256-token chunks each, 5.9 MB of KV a chunk)
written into the paged blocks of LMCache's own bench client (``ServerBenchClient``, KV shared with the server over
POSIX SHM).  Store: STORE of every request, timed until the L2 folder holds all their objects (serializing and
writing happen after STORE returns).  Retrieve: the server's L1 cleared, then lookup (the server prefetches from
L2 and deserializes) and RETRIEVE of every request.  MB/s of KV; one run (this 2-core machine is shared, so numbers
move by tens of percent).  Writes ``bench/results/lmcache_server.md``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from mooncake_tier import ensure_kvtc_calibration  # bench/ is on sys.path when this runs as a script
from real_kv import gpl3_kv

from kvcodec.tools.harness.lmcache_server import KVClient, LMCacheServer

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "results" / "lmcache_server.md"
L, H, D = 30, 3, 64
TOKENS = 512


def real_kv(requests: int) -> list[torch.Tensor]:
    """``requests`` consecutive 512-token windows of SmolLM2's KV over GPL-3, each ``[2, L, 512, H*D]``."""
    tokens = TOKENS * requests
    kv = gpl3_kv(tokens).to_lmcache()
    return [kv[:, :, i * TOKENS:(i + 1) * TOKENS].contiguous() for i in range(requests)]


def run(name: str, serde: dict | None, kvs: list[torch.Tensor], folder: Path) -> dict:
    l2 = folder / f"l2-{name}"
    l2.mkdir()
    adapter = {"type": "plugin", "module_path": "kvcodec.engines.lmcache_server", "class_name": "KVCodecFSL2Adapter",
               "adapter_params": {"base_path": str(l2)}, **({"serde": serde} if serde else {})}
    want = 2 * len(kvs)
    with LMCacheServer(folder, adapter) as server, \
            KVClient(server, layers=L, heads=H, head_dim=D, tokens=TOKENS, blocks=32 * len(kvs) + 32) as client:
        start = time.perf_counter()
        for seq, kv in enumerate(kvs):
            client.store(seq, kv)
        while len(list(l2.glob("*.data"))) < want:
            assert time.perf_counter() - start < 600, f"{name}: the L2 store did not finish"
            time.sleep(0.005)
        store_s = time.perf_counter() - start
        time.sleep(0.5)  # the last file was renamed into place; let its task report
        server.clear_l1()
        start = time.perf_counter()
        got = [client.retrieve(seq)[0] for seq in range(len(kvs))]
        retrieve_s = time.perf_counter() - start
    sizes = [p.stat().st_size for p in l2.glob("*.data")]
    err = max(float((g.float() - k.float()).abs().max()) for g, k in zip(got, kvs))
    kv_bytes = sum(k.numel() * k.element_size() for k in kvs)
    row = {"name": name, "bytes": sum(sizes) / len(sizes), "ratio": kv_bytes / sum(sizes),
           "store": kv_bytes / store_s / 1e6, "retrieve": kv_bytes / retrieve_s / 1e6, "err": err}
    print(row, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=4)
    args = ap.parse_args()
    kvs = real_kv(args.requests)
    model = ensure_kvtc_calibration()  # the servers inherit its XDG_CACHE_HOME
    serdes = [("none (LMCache's own path)", None),
              ("fp8 (LMCache)", {"type": "fp8", "fp8_dtype": "float8_e4m3fn"}),
              ("kvcodec raw", {"type": "kvcodec", "codec": "raw", "num_heads": H}),
              ("kvcodec cachegen", {"type": "kvcodec", "codec": "cachegen", "num_heads": H}),
              ("kvcodec kvtc", {"type": "kvcodec", "codec": "kvtc", "num_heads": H, "model": model})]
    with tempfile.TemporaryDirectory() as folder:
        rows = [run(name, serde, kvs, Path(folder)) for name, serde in serdes]
    kv_chunk = kvs[0][:, :, :256].numel() * 2
    lines = ["# LMCache MP server: L2 store and retrieve throughput by serde", "",
             f"`.venv-engines/bin/python bench/lmcache_server.py --requests {args.requests}` (LMCache 0.5.6 `lmcache "
             "server`, CPU, `KVCodecFSL2Adapter` on local disk, 1 GB L1; a shared 2-core machine). "
             f"{args.requests} requests of 512 tokens of SmolLM2-135M's real float16 KV ({2 * args.requests} chunks "
             f"of {kv_chunk / 1e6:.2f} MB). Store: STORE of all requests until every object is in the L2 folder "
             "(serialization included). Retrieve: L1 cleared, then lookup (prefetch from L2, deserialization) and "
             "RETRIEVE of all requests. MB/s of KV, one run.", "",
             "| serde | bytes per chunk on disk | ratio | store MB/s of KV | retrieve MB/s of KV | max abs error |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['bytes']:,.0f} | {r['ratio']:.2f}x | {r['store']:.0f} | {r['retrieve']:.0f} "
                     f"| {r['err']:.3g} |")
    OUT.write_text("\n".join(lines) + "\n")
    print(OUT.read_text())


if __name__ == "__main__":
    main()
