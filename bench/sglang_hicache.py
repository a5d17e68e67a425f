"""SGLang HiCache storage: kvcodec's backend (``raw``, ``cachegen``, ``kivi`` on a disk tier) beside SGLang's own
``file`` backend (``HiCacheFile``: each page's raw bytes in a file), both made by SGLang's ``StorageBackendFactory``
and called with SGLang's flat pages (``batch_set``/``batch_get``, the calls of its cache controller's generic path).

Runs in ``.venv-sglang`` (``bash scripts/setup_sglang.sh``)::

    .venv-sglang/bin/python bench/sglang_hicache.py [--tokens 1024] [--reps 3]

The KV is real: SmolLM2's float16 cache over the first ``--tokens`` tokens of ``license:GPL-3`` (``kvcodec dump``),
put in an SGLang host pool (``MHATokenToKVPoolHost``, ``page_first``, 64-token pages).  Bytes are the files on disk
(headers included); ms are per page, medians of ``--reps`` rounds, each into an empty folder.  Every page read back
is checked: bit-exact for ``raw`` and SGLang's backend, kvcodec's own decode for the lossy codecs.
Writes ``bench/results/sglang_hicache.md``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from real_kv import gpl3_kv  # bench/ is on sys.path when this runs as a script
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

import kvcodec
from kvcodec.store import concat
from kvcodec.tools.harness.sglang_pools import PAGE, make_host_pool, read_tokens, write_tokens

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "results" / "sglang_hicache.md"
MODEL = "SmolLM2-135M-Instruct"  # the name of the cachegen profile kvcodec ships


def backend(pool, folder: str, codec: str | None):
    """SGLang's file backend (codec None) or kvcodec's with ``codec`` on a disk tier in ``folder``."""
    extra = ({"file_storage_path": folder} if codec is None else
             {"backend_name": "kvcodec", "module_path": "kvcodec.engines.sglang_hicache",
              "class_name": "KVCodecHiCacheStorage", "codec": codec, "tiers": [f"disk:{folder}"]})
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                               model_name=MODEL, extra_config=extra)
    made = StorageBackendFactory.create_backend("file" if codec is None else "dynamic", cfg, pool)
    made.register_mem_pool_host(pool)
    return made


def expected(kv: kvcodec.KVCache, codec: str | None) -> kvcodec.KVCache:
    if codec in (None, "raw"):
        return kv
    pages = [kvcodec.decode(kvcodec.encode(kvcodec.KVCache([(l.keys[:, s:s + PAGE], l.values[:, s:s + PAGE])
                                                            for l in kv.layers], model=MODEL), codec, chunk_tokens=PAGE))
             for s in range(0, kv.num_tokens, PAGE)]
    return concat(pages)


def one_round(kv: kvcodec.KVCache, codec: str | None) -> tuple[float, float, int]:
    pool = make_host_pool("page_first")
    n = kv.num_tokens
    saved, loaded = torch.arange(PAGE, PAGE + n), torch.arange(PAGE + n, PAGE + 2 * n)
    write_tokens(pool, saved, kv)
    keys = [f"{i:064x}" for i in range(n // PAGE)]
    with tempfile.TemporaryDirectory() as folder:
        store = backend(pool, folder, codec)
        pages = [pool.get_data_page(int(s)) for s in saved[::PAGE]]
        start = time.perf_counter()
        assert store.batch_set(keys, pages)
        set_s = time.perf_counter() - start
        on_disk = sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
        targets = [pool.get_dummy_flat_data_page() for _ in keys]
        start = time.perf_counter()
        got = store.batch_get(keys, targets)
        get_s = time.perf_counter() - start
    for s, page in zip(loaded[::PAGE], got):
        pool.set_from_flat_data_page(int(s), page)
    want, back = expected(kv, codec), read_tokens(pool, loaded)
    assert all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) for a, b in zip(back.layers, want.layers))
    return set_s / len(keys), get_s / len(keys), on_disk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    full = gpl3_kv(args.tokens)
    n = args.tokens // PAGE * PAGE
    kv = kvcodec.KVCache([(l.keys[:, :n].contiguous(), l.values[:, :n].contiguous()) for l in full.layers])
    raw_bytes = kv.nbytes
    rows = []
    for name, codec in (("SGLang file backend (baseline)", None), ("kvcodec raw", "raw"),
                        ("kvcodec cachegen", "cachegen"), ("kvcodec kivi", "kivi")):
        runs = [one_round(kv, codec) for _ in range(args.reps)]
        set_ms, get_ms = (statistics.median(r[i] for r in runs) * 1e3 for i in (0, 1))
        on_disk = runs[-1][2]
        rows.append(f"| {name} | {on_disk / (n // PAGE):,.0f} | {raw_bytes / on_disk:.2f}x | {set_ms:.1f} | {get_ms:.1f} |")
        print(rows[-1], flush=True)
    table = "\n".join(["| backend | bytes on disk per page | vs raw KV | batch_set ms/page | batch_get ms/page |",
                       "|---|---|---|---|---|", *rows])
    text = (f"# SGLang HiCache storage: kvcodec's backend beside SGLang's file backend\n\n"
            f"`python bench/sglang_hicache.py --tokens {args.tokens} --reps {args.reps}` in `.venv-sglang` (SGLang "
            f"0.5.23, torch {torch.__version__}, {torch.get_num_threads()} threads), on this project's 2-core CPU machine "
            f"shared with other work. Real SmolLM2-135M float16 KV: {n} tokens in {n // PAGE} pages of {PAGE} tokens "
            f"(30 layers x 3 KV heads x 64: {raw_bytes // (n // PAGE):,} bytes of KV per page), from an SGLang "
            f"`page_first` host pool through SGLang's flat pages; every page read back checked (bit-exact for the "
            f"file backend and `raw`, kvcodec's own decode for the lossy codecs). Medians of {args.reps} rounds.\n\n"
            f"{table}\n")
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(REPO)}")


if __name__ == "__main__":
    main()
