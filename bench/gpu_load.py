"""The store's load path into a GPU engine's paged memory: correctness first, then speed.

``PrefixLoad`` (fetch overlapping decode, ``Codec.decode_layer_paged``: cachegen's Triton kernel) into vLLM's GPU
paged layouts (``gpu``: ``(num_blocks, H, block_size, 2*D)`` split; ``flash``: ``(2, num_blocks, block_size, H,
D)``) through a shuffled block table, from a memory tier; each layer read back must equal the store's dense CPU
decode of the same chunks bit for bit (cachegen's device and CPU decodes agree exactly; raw is a copy), with a load
starting inside the first chunk leaving the tokens before it untouched.  Then the load's GB/s of KV against the
dense decode plus a scatter.  ``--device cpu`` runs the same checks on the CPU (no kernel), as a smoke test.

    bash scripts/gpu_check.sh load          (carry .whl and .cache/bench-kv; scripts/gpu_wheels.sh makes them)
    python bench/gpu_load.py --device cpu --tokens 512
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from kvcodec.cache import KVCache
from kvcodec.layouts.paged import empty_shape, read_paged, slot_mapping
from kvcodec.store import KVStore, MemoryTier, PagedSink

OUT = Path(__file__).parent / "results" / "gpu_load.md"
BLOCK = 16


def synthetic(layers: int, heads: int, dim: int, tokens: int) -> KVCache:
    """Channel-biased float16 KV, as real keys are (cachegen's steps follow the channels)."""
    g = torch.Generator().manual_seed(0)
    scale = torch.rand(1, 1, dim, generator=g) * 4 + 0.1
    return KVCache([((torch.randn(heads, tokens, dim, generator=g) * scale).half(),
                     torch.randn(heads, tokens, dim, generator=g).half()) for _ in range(layers)], model="bench",
                   rope="post")


def check_and_time(codec: str, kv: KVCache, layout: str, device: str, reps: int) -> dict:
    store = KVStore([MemoryTier(None)], model="bench", codec=codec)
    ids = list(range(kv.num_tokens))
    store.put(ids, kv)
    want = store.get(ids)  # the dense CPU decode
    shape = kv.shapes[0]
    blocks = -(-kv.num_tokens // BLOCK) + 4
    table = torch.randperm(blocks, generator=torch.Generator().manual_seed(1))[: -(-kv.num_tokens // BLOCK)]

    def fresh() -> list[torch.Tensor]:
        return [torch.full(empty_shape(layout, blocks, BLOCK, shape.heads, shape.key_dim), 7.0, dtype=kv.dtype,
                           device=device) for _ in range(kv.num_layers)]

    start = BLOCK  # inside the first chunk: its first block must stay as it was
    layers = fresh()
    result = store.prefix_load(ids, PagedSink(layers, table.tolist(), BLOCK, layout), start=start).start().finish()
    assert result.complete, [c.status for c in result.chunks]
    slots = slot_mapping(table.to(device), 0, kv.num_tokens, BLOCK)
    for i, (paged, layer) in enumerate(zip(layers, want.layers)):
        k, v = read_paged(paged, slots, layout)
        assert torch.equal(k[:, start:].cpu(), layer.keys[:, start:]), (codec, layout, i, "keys")
        assert torch.equal(v[:, start:].cpu(), layer.values[:, start:]), (codec, layout, i, "values")
        assert bool((k[:, :start] == 7).all()), (codec, layout, i, "tokens before the load were written")
    seconds = []
    for _ in range(reps):
        layers = fresh()
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        store.prefix_load(ids, PagedSink(layers, table.tolist(), BLOCK, layout)).start().finish()
        if device == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    nbytes = sum(l.keys.numel() + l.values.numel() for l in kv.layers) * kv.dtype.itemsize
    best = min(seconds)
    return {"codec": codec, "layout": layout, "exact": True, "seconds": best, "gbps": nbytes / best / 1e9,
            "stored": sum(c.nbytes for c in result.chunks)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--shape", default="32,8,128", help="layers,heads,head_dim (default: Llama-3-8B's KV)")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    layers, heads, dim = (int(x) for x in args.shape.split(","))
    if args.device == "cpu":
        layers, heads, dim = min(layers, 4), min(heads, 2), min(dim, 32)
    kv = synthetic(layers, heads, dim, args.tokens)
    rows = []
    for codec in ("raw", "cachegen"):
        for layout in (("gpu", "flash") if args.device != "cpu" else ("cpu", "flash")):
            r = check_and_time(codec, kv, layout, args.device, args.reps)
            rows.append(r)
            print(f"gpu_load: {codec} into {layout}: bit-exact against the CPU decode; {r['seconds']:.3f} s, "
                  f"{r['gbps']:.2f} GB/s of KV", flush=True)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (smoke)"
    lines = [f"# Store loads into paged memory on {name}", "",
             f"`python bench/gpu_load.py --device {args.device} --tokens {args.tokens} --shape {layers},{heads},{dim}`"
             f" on {time.strftime('%Y-%m-%d')}: synthetic float16 KV, 256-token chunks in a memory tier, block size "
             f"{BLOCK}, shuffled block table; every layer bit-exact against the store's dense CPU decode.", "",
             "| codec | layout | stored MB | load s | GB/s of KV |", "|---|---|---|---|---|"]
    lines += [f"| {r['codec']} | {r['layout']} | {r['stored'] / 1e6:.1f} | {r['seconds']:.3f} | {r['gbps']:.2f} |"
              for r in rows]
    out = OUT.with_name("gpu_load-smoke.md") if args.device == "cpu" else OUT
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
