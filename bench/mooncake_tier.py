"""Put and get throughput of kvcodec containers through the Mooncake tier, beside Mooncake's own put/get of the same
bytes, against a real ``mooncake_master`` on loopback.

    .venv/bin/python bench/mooncake_tier.py [--reps 20]

The chunks are real: SmolLM2's float16 cache over 512 tokens of ``license:GPL-3`` (``kvcodec dump``), stored by a
``KVStore`` as 256-token single-chunk containers with ``raw`` and ``cachegen``.  A writer tier (lending a 256 MiB
segment) puts each container ``--reps`` times under fresh keys, and a reader tier in a second client (lending
none) gets them back; "Mooncake" is ``put``/``get`` of the same bytes on the same two clients, without kvcodec's
header, checksum, size check and worker thread.  Both clients live in this process and talk over loopback TCP.
MB/s are of container bytes (and, in the last column, of the float16 KV they hold); medians of the reps.  Writes ``bench/results/mooncake_tier.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import kvcodec  # noqa: E402
from kvcodec.cli import main as kvcodec_main  # noqa: E402
from kvcodec.store import KVStore, MemoryTier, MooncakeTier  # noqa: E402
from test_mooncake_tier import Master  # noqa: E402

OUT = REPO / "bench" / "results" / "mooncake_tier.md"


def real_kv(tokens: int) -> kvcodec.KVCache:
    path = REPO / ".cache" / "test-kv" / f"bench-mooncake-GPL-3-{tokens}-float16.safetensors"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        assert kvcodec_main(["dump", "--model", "smollm2", "--text", "license:GPL-3", "--tokens", str(tokens),
                             "--dtype", "float16", "-o", str(path), "--quiet"]) == 0
    return kvcodec.KVCache.load_safetensors(path)


def timed(fn) -> float:
    start = time.perf_counter()
    ok = fn()
    took = time.perf_counter() - start
    assert ok, "an operation failed"
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    kv = real_kv(512)
    ids = list(kv.token_ids)
    kv_bytes = sum(l.keys.numel() * l.keys.element_size() * 2 for l in kv.layers) // len(ids) * 256
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        master = Master(Path(folder))
        master.start()
        writer = MooncakeTier(master.address, segment_bytes=256 << 20, buffer_bytes=64 << 20, name="writer")
        reader = MooncakeTier(master.address, segment_bytes=0, buffer_bytes=64 << 20, name="reader")
        try:
            for codec in ("raw", "cachegen"):
                mem = MemoryTier(None)
                store = KVStore([mem], model=kv.model, codec=codec)
                store.put(ids, kv)
                value = mem.get(store.keys_for(ids)[0][0])  # the first 256-token chunk
                n = len(value)
                times: dict[str, list[float]] = {k: [] for k in ("tier put", "tier get", "mc put", "mc get")}
                for r in range(args.reps):
                    tk, mk = f"bench-{codec}-{r}", f"bench-raw-{codec}-{r}"
                    times["tier put"].append(timed(lambda: writer.put(tk, value)))
                    times["tier get"].append(timed(lambda: reader.get(tk) == value))
                    times["mc put"].append(timed(lambda: writer._client.put(mk, value) == 0))
                    times["mc get"].append(timed(lambda: len(reader._client.get(mk)) == n))
                    writer._client.remove(writer.prefix + tk, force=True)  # keeps the segment from filling up
                    writer._client.remove(mk, force=True)
                mbs = {k: n / statistics.median(v) / 1e6 for k, v in times.items()}
                rows.append((codec, n, kv_bytes / n, mbs))
                print(codec, n, {k: round(v) for k, v in mbs.items()}, flush=True)
        finally:
            writer.close()
            reader.close()
            master.kill()
    lines = ["# Mooncake tier throughput", "",
             f"`python bench/mooncake_tier.py --reps {args.reps}` (mooncake-transfer-engine-non-cuda 0.3.13.post1, "
             "TCP over loopback, two clients in one process on a shared 2-core machine). One 256-token chunk of "
             f"SmolLM2-135M's real float16 KV ({kv_bytes / 1e6:.2f} MB) per operation; MB/s of container bytes, "
             "medians. 'Mooncake' is the client's own put/get of the same bytes.", "",
             "| codec | container bytes | ratio | tier put MB/s | Mooncake put MB/s | tier get MB/s | Mooncake get MB/s "
             "| tier put / get, MB/s of KV |",
             "|---|---|---|---|---|---|---|---|"]
    for codec, n, ratio, m in rows:
        lines.append(f"| {codec} | {n:,} | {ratio:.1f}x | {m['tier put']:.0f} | {m['mc put']:.0f} | "
                     f"{m['tier get']:.0f} | {m['mc get']:.0f} | {m['tier put'] * ratio:.0f} / "
                     f"{m['tier get'] * ratio:.0f} |")
    OUT.write_text("\n".join(lines) + "\n")
    print(OUT.read_text())


if __name__ == "__main__":
    main()
