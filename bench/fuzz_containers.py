"""Hostile containers: structure-aware fuzzing of every codec through all three read paths.

    python bench/fuzz_containers.py --minutes 30 [--dump PATH] [--seed 1] [--max-bytes 67108864]

Seeds are real containers of every codec (and a multi-level one) made from a slice of a real SmolLM2 cache.
Each case mutates one seed (header JSON, frame heads, section tables, the index, codec section internals; see
kvcodec.tools.fuzz.mutate), re-seals it with every checksum recomputed, and decodes it through
``kvcodec.decode(bytes)``, ``kvcodec.open(...).read_chunk(i)`` and the streaming decode of byte pieces, in a
child process under an address-space limit with a 10 s limit per decode and ``max_bytes`` as an untrusted-input
caller would pass.  Prints and writes (bench/results/fuzz_containers.md) the outcomes per seed and path, the
slowest decode, and the peak memory ratio: a decode's peak resident memory over the declared output it may
produce plus its input, on the full real cache decoded whole (no mutation) and over the fuzz cases.
Failing inputs are saved to out/fuzz-failures/.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import kvcodec
from kvcodec.tools.fuzz.runner import FIXED_BYTES, HEADER_FACTOR, INPUT_FACTOR, OUTPUT_FACTOR, Worker, fuzz
from kvcodec.tools.fuzz.seeds import CHUNK_LAYERS, SEED_CODECS, fuzz_kv, hevc_donors, make_seeds, seed_codecs
from kvcodec.tools.fuzz.worker import PATHS
from real_kv import gpl3_dump  # bench/ is on sys.path when this runs as a script

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def real_cache_ratios(kv: kvcodec.KVCache, seeds_data: list[bytes]) -> list[tuple[str, str, int, int, float]]:
    """(codec, path, declared output bytes, peak bytes, peak / declared) of the whole real cache, unmutated."""
    files = {name: kvcodec.encode(kv, seed_codecs(name, kv), chunk_layers=CHUNK_LAYERS) for name in SEED_CODECS}
    worker = Worker(seeds_data + [files["kvtc"]], 4 << 30)  # the child gets the kvtc file's calibration, too
    rows = []
    try:
        for name, data in files.items():
            for path in PATHS:
                r = worker.run((path, data, 0, None), 120)
                assert r["outcome"] == "decoded", r["detail"]
                rows.append((name, path, r["declared"], r["peak"], r["peak"] / r["declared"]))
    finally:
        worker.stop()
    return rows


def section_ratios(kv: kvcodec.KVCache, seeds_data: list[bytes], tokens: int = 4096) -> list[tuple[str, int, int, float]]:
    """(codec, declared output, peak, peak / output) of one layer in one section of ``tokens`` tokens (the real
    cache's layer 5 repeated along tokens), read with ``read_chunk``: the per-section factor of SPEC.md §9.1."""
    layer = kv.layers[5]
    reps = -(-tokens // layer.keys.shape[1])
    one = kvcodec.KVCache([(torch.cat([layer.keys] * reps, 1)[:, :tokens], torch.cat([layer.values] * reps, 1)[:, :tokens])],
                          model=kv.model)
    files = {name: kvcodec.encode(one, seed_codecs(name, one)[-1], chunk_tokens=tokens) for name in SEED_CODECS}
    worker = Worker(seeds_data + [files["kvtc"]], 4 << 30)
    rows = []
    try:
        for name, data in files.items():
            r = worker.run(("open", data, 0, None), 300)
            assert r["outcome"] == "decoded", r["detail"]
            rows.append((name, r["declared"], r["peak"], r["peak"] / r["declared"]))
    finally:
        worker.stop()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--dump", type=Path, default=None, help="a safetensors KV dump (default: 512 tokens of real_kv.gpl3_kv)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-bytes", type=int, default=64 << 20)
    p.add_argument("--out", type=Path, default=RESULTS / "fuzz_containers.md")
    args = p.parse_args()
    kv = kvcodec.KVCache.load_safetensors(args.dump or gpl3_dump(512))
    seeds = make_seeds(fuzz_kv(kv))
    donors = hevc_donors()
    print(f"{len(seeds)} seeds ({', '.join(s.name for s in seeds)}), {len(donors)} HEVC donor streams", flush=True)

    ratios = real_cache_ratios(kv, [s.data for s in seeds])
    sections = section_ratios(kv, [s.data for s in seeds])
    started = time.monotonic()
    last = [started]

    def progress(tally) -> None:
        if time.monotonic() - last[0] > 60:
            last[0] = time.monotonic()
            print(f"{(last[0] - started) / 60:5.1f} min: {tally.cases} files, {len(tally.bugs)} bugs", flush=True)

    tally = fuzz(seeds, donors, seconds=60 * args.minutes, rng_seed=args.seed, max_bytes=args.max_bytes,
                 progress=progress)
    minutes = (time.monotonic() - started) / 60

    failures = ROOT / "out" / "fuzz-failures"
    for k, bug in enumerate(tally.bugs):
        failures.mkdir(parents=True, exist_ok=True)
        (failures / f"{k:04d}-{bug['seed']}-{bug['path']}-{bug['outcome']}.kvc").write_bytes(bug["data"])
    worst_real = max(r[4] for r in ratios)
    lines = [
        "# Hostile containers: structure-aware fuzzing",
        "",
        f"`python bench/fuzz_containers.py --minutes {args.minutes:g} --seed {args.seed}`: {tally.cases} mutated "
        f"files in {minutes:.1f} min, each decoded through all three paths ({3 * tally.cases} decodes), "
        f"`max_bytes={args.max_bytes}`, 10 s per decode, address space limited to 2 GiB over the warmed-up child's.",
        "Seeds: real SmolLM2 KV (3 layers, 72 tokens, the last layer a 40-token window; chunks of 32 tokens x 2 layers).",
        "",
        tally.table(),
        "",
        "`in codec`: the KVCodecErrors a codec's own section checks raised (their message names the codec, or HEVC); "
        "`memory` also counts a decode whose peak exceeded the SPEC.md §9.1 bound.",
        "",
        f"Bugs (other exception, timeout, memory, crash): **{len(tally.bugs)}**. "
        f"Slowest decode: {tally.slowest:.2f} s. Largest peak over a case's starting memory: "
        f"{tally.worst_peak / 2**20:.1f} MiB; largest peak / (declared output within max_bytes + input) over cases "
        f"with at least 1 MiB of either: {tally.worst_ratio:.2f}.",
        "",
        "## Peak memory on the whole real cache (512 tokens, 30 layers, unmutated)",
        "",
        "Peak resident memory a decode adds, over the bytes of the output the header declares (the open path "
        "decodes chunk by chunk and drops each, so its peak is one chunk's). SPEC.md §9.1 bounds it by "
        f"{OUTPUT_FACTOR} x output + {INPUT_FACTOR} x input + {HEADER_FACTOR} x header JSON + {FIXED_BYTES >> 20} MiB.",
        "",
        "| codec | path | declared output (MB) | peak (MB) | peak / output |",
        "|---|---|---:|---:|---:|",
        *(f"| {c} | {p} | {d / 1e6:.1f} | {k / 1e6:.1f} | {r:.2f} |" for c, p, d, k, r in ratios),
        "",
        f"Largest ratio: **{worst_real:.2f}**.",
        "",
        "## Peak memory of one large section (layer 5 repeated to 4096 tokens, one chunk, `read_chunk`)",
        "",
        "| codec | output (MB) | peak (MB) | peak / output |",
        "|---|---:|---:|---:|",
        *(f"| {c} | {d / 1e6:.2f} | {k / 1e6:.2f} | {r:.2f} |" for c, d, k, r in sections),
        "",
        f"Largest ratio: **{max(r[3] for r in sections):.2f}** (the multi-level row decodes its best codec alone).",
    ]
    if tally.bugs:
        lines += ["", "## Bugs", ""] + [f"- {b['seed']} / {b['path']} / {b['mutation']}: {b['outcome']}: "
                                        f"`{b['detail'][-300:]!r}`" for b in tally.bugs[:50]]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.write_text(text)
    sys.exit(1 if tally.bugs else 0)


if __name__ == "__main__":
    main()
