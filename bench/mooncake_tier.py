"""Store and load throughput of kvcodec containers through the Mooncake tier, beside the Redis tier and beside
Mooncake's own put/get of the same bytes, against a real ``mooncake_master`` and a real ``redis-server`` on loopback.

    .venv/bin/python bench/mooncake_tier.py [--reps 20]

The chunks are real: SmolLM2's float16 cache over 512 tokens of ``license:GPL-3`` (``kvcodec dump``), made by a
``KVStore`` into 256-token single-chunk containers with ``raw``, ``cachegen`` and ``kvtc`` (SmolLM2's calibration
from 4096 tokens, computed once into ``.cache/bench-kvtc``).  A writer Mooncake tier (lending a 256 MiB segment) puts each
container ``--reps`` times under fresh keys and a reader tier in a second client (lending none) gets them back;
"Mooncake" is ``put``/``get`` of the same bytes on two bare Mooncake clients (lending none), without kvcodec's
header, checksum, size check and worker thread; "Redis" is kvcodec's Redis tier (one client) on the same bytes.
All clients live in this process and talk over loopback TCP.  Medians of the reps.  MB/s of KV are the container's
MB/s times its compression ratio (the float16 KV it stands for); "with the codec" adds the codec's own encode (store)
or decode (load) time on this CPU, median of 3, to the tier's put or get.  Writes ``bench/results/mooncake_tier.md``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from real_kv import gpl3_kv  # bench/ is on sys.path when this runs as a script

from kvcodec.store import KVStore, MemoryTier, MooncakeTier, tier_from_url
from kvcodec.tools.harness.mooncake import Master
from kvcodec.tools.redis_server import RedisServer

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "results" / "mooncake_tier.md"
CODECS = ("raw", "cachegen", "kvtc")


# kvtc's calibration of SmolLM2 for the benches: from 4096 calibration tokens (the default, every calibration text,
# takes over 15 minutes on this shared machine), installed in a folder of the benches' own so it never stands in
# for the full one elsewhere.
BENCH_CALIBRATIONS = REPO / ".cache" / "bench-kvtc"
CALIBRATION_TOKENS = 4096


def ensure_kvtc_calibration() -> str:
    """SmolLM2's model name, its bench calibration installed (computed first when missing) and
    ``XDG_CACHE_HOME`` pointing at it, for this process and the ones it starts."""
    os.environ["XDG_CACHE_HOME"] = str(BENCH_CALIBRATIONS)
    from kvcodec.codecs.kvtc.fit import ensure_calibration
    from kvcodec.models import load_model

    loaded = load_model("smollm2", progress=False)
    ensure_calibration(loaded, log=lambda line: print(line, file=sys.stderr), max_tokens=CALIBRATION_TOKENS)
    return loaded.model_id


def timed(fn) -> float:
    start = time.perf_counter()
    ok = fn()
    took = time.perf_counter() - start
    assert ok, "an operation failed"
    return took


def median_s(fn, reps: int) -> float:
    return statistics.median(timed(fn) for _ in range(reps))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    ensure_kvtc_calibration()
    kv = gpl3_kv(512)
    ids = list(kv.token_ids)
    kv_bytes = sum(l.keys.numel() * l.keys.element_size() * 2 for l in kv.layers) // len(ids) * 256
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        master = Master(Path(folder))
        master.start()
        redis = RedisServer(shutil.which("redis-server"), Path(folder))
        redis.start()
        writer = MooncakeTier(master.address, segment_bytes=256 << 20, buffer_bytes=64 << 20, name="writer")
        reader = MooncakeTier(master.address, segment_bytes=0, buffer_bytes=64 << 20, name="reader")
        mc_writer, mc_reader = bare_client(master.address), bare_client(master.address)
        rtier = tier_from_url(f"{redis.url}?timeout=5")
        try:
            for codec in CODECS:
                mem = MemoryTier(None)
                store = KVStore([mem], model=kv.model, codec=codec)
                store.put(ids, kv)
                key = store.keys_for(ids)[0][0]  # the first 256-token chunk
                value = mem.get(key)
                n = len(value)
                # the codec's own time per chunk: a KVStore put of the 512-token cache (two chunks) into memory,
                # and decode_chunk of the first
                encode_s = median_s(lambda: KVStore([MemoryTier(None)], model=kv.model, codec=codec).put(ids, kv)
                                    or True, 3) / 2
                fetched = store.fetch(ids[:256])[0]
                decode_s = median_s(lambda: store.decode_chunk(fetched) is not None, 3)
                times: dict[str, list[float]] = {k: [] for k in ("mc-tier put", "mc-tier get", "mc put", "mc get",
                                                                 "redis put", "redis get")}
                for r in range(args.reps):
                    tk, mk = f"bench-{codec}-{r}", f"bench-raw-{codec}-{r}"
                    times["mc-tier put"].append(timed(lambda: writer.put(tk, value)))
                    times["mc-tier get"].append(timed(lambda: reader.get(tk) == value))
                    times["mc put"].append(timed(lambda: mc_writer.put(mk, value) == 0))
                    times["mc get"].append(timed(lambda: len(mc_reader.get(mk)) == n))
                    times["redis put"].append(timed(lambda: rtier.put(tk, value)))
                    times["redis get"].append(timed(lambda: rtier.get(tk) == value))
                    # forced, not the tier's delete (which leaves a value read within its lease): keeps the
                    # segment from filling up
                    mc_writer.remove(writer.prefix + tk, force=True)
                    mc_writer.remove(mk, force=True)
                    rtier.delete(tk)
                med = {k: statistics.median(v) for k, v in times.items()}
                rows.append((codec, n, kv_bytes / n, med, encode_s, decode_s))
                print(codec, n, {k: round(n / v / 1e6) for k, v in med.items()}, flush=True)
        finally:
            for client in (mc_writer, mc_reader):
                client.close()
            writer.close()
            reader.close()
            rtier.close()
            redis.stop()
            master.kill()
    OUT.write_text(report(rows, kv_bytes, args.reps))
    print(OUT.read_text())


def bare_client(master: str):
    """A Mooncake Store client of its own, lending no segment (values land in the writer tier's), for Mooncake's
    own put/get of the same bytes."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    rc = client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", master)
    if rc != 0:
        raise SystemExit(f"a bare Mooncake client could not set up with the master at {master}: {rc}")
    return client


def report(rows, kv_bytes: int, reps: int) -> str:
    lines = ["# Mooncake tier throughput", "",
             f"`python bench/mooncake_tier.py --reps {reps}` (mooncake-transfer-engine-non-cuda 0.3.13.post1 and "
             "redis-server, TCP over loopback, all clients in one process on a shared 2-core machine). One 256-token "
             f"chunk of SmolLM2-135M's real float16 KV ({kv_bytes / 1e6:.2f} MB) per operation, medians of {reps}. "
             "Container MB/s are of the bytes stored; MB/s of KV are those times the compression ratio; 'with the "
             "codec' adds the codec's encode (store) or decode (load) time per chunk on this CPU. 'Mooncake' is the "
             "client's own put/get of the same bytes (no kvcodec header, checksum or worker thread).", "",
             "| codec | container bytes | ratio | path | store MB/s | load MB/s | store / load, MB/s of KV "
             "| with the codec, MB/s of KV |",
             "|---|---|---|---|---|---|---|---|"]
    for codec, n, ratio, m, enc, dec in rows:
        for path, put, get in (("Mooncake tier", "mc-tier put", "mc-tier get"), ("Mooncake put/get", "mc put", "mc get"),
                               ("Redis tier", "redis put", "redis get")):
            coded = (f"{kv_bytes / (m[put] + enc) / 1e6:.0f} / {kv_bytes / (m[get] + dec) / 1e6:.0f}"
                     if path != "Mooncake put/get" else "")
            lines.append(f"| {codec} | {n:,} | {ratio:.1f}x | {path} | {n / m[put] / 1e6:.0f} | {n / m[get] / 1e6:.0f} "
                         f"| {kv_bytes / m[put] / 1e6:.0f} / {kv_bytes / m[get] / 1e6:.0f} | {coded} |")
    lines += ["", "Codec time per 256-token chunk on this CPU: " +
              ", ".join(f"{codec} encode {enc * 1e3:.0f} ms / decode {dec * 1e3:.0f} ms"
                        for codec, _, _, _, enc, dec in rows) + "."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
