"""Time to first token from the KV store against recomputing the prefix (SmolLM2, CPU).

One run: a 2048-token prefix of ``license:GPL-3`` plus a 16-token continuation.  The baseline
prefills all 2064 tokens.  For every codec (raw, cachegen) and tier (memory, disk, a real
redis-server on a free loopback port) the prefix's KV is stored, then
:class:`kvcodec.engines.transformers_hook.TransformersKVHook` answers the request: fetch, decode layer
by layer while the model reads the 16 new tokens, first token.  Median of ``--reps`` runs each.
Also: cachegen's (and raw's) greedy token agreement over 64 generated tokens against never
leaving memory, and the perplexity of the next 256 tokens continuing from the stored prefix
against the original float32 KV.  Writes ``bench/results/store_ttft.md``.

    python bench/store_ttft.py [--reps 3] [--prefix 2048]
"""

from __future__ import annotations

import argparse
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvcodec.engines.transformers_hook import TransformersKVHook
from kvcodec.models import load_model
from kvcodec.store import KVStore
from kvcodec.store.tiers import DiskTier, MemoryTier, RedisTier
from kvcodec.texts import load_text

OUT = Path(__file__).parent / "results" / "store_ttft.md"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(folder: str) -> tuple[subprocess.Popen, int]:
    exe = shutil.which("redis-server")
    if exe is None:
        sys.exit("redis-server is not on PATH (apt-get install -y redis-server)")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", folder, "--protected-mode", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc, port
        except OSError:
            time.sleep(0.05)
    proc.kill()
    sys.exit("redis-server did not start")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--new", type=int, default=16, help="tokens of the request after the stored prefix")
    ap.add_argument("--codecs", default="raw,cachegen")
    args = ap.parse_args()

    lm = load_model("smollm2")
    ids = lm.tokenize(load_text("license:GPL-3"))
    prefix = ids[: args.prefix]
    request = ids[: args.prefix + args.new]
    ppl_cont = ids[args.prefix: args.prefix + 257]
    torch.set_num_threads(torch.get_num_threads())

    tmp = tempfile.mkdtemp(prefix="kvcodec-ttft-")
    redis_proc, port = start_redis(tmp)
    try:
        # baseline: recompute the whole request
        plain = TransformersKVHook(lm, KVStore([MemoryTier(None, name="none")], model=lm.model_id, codec="raw"), save=False)
        recompute = []
        for _ in range(args.reps):
            recompute.append(plain.generate(request, max_new_tokens=1).first_token_s)
        ref64 = plain.generate(request, max_new_tokens=64).tokens
        kv = lm.prefill(prefix)  # float32, keys after RoPE
        ref_nll, ref_pred = nll(lm, kv, ppl_cont)

        rows, quality = [], []
        for codec in args.codecs.split(","):
            tiers = {
                "memory": lambda: MemoryTier(None),
                "disk": lambda: DiskTier(Path(tmp) / f"disk-{codec}"),
                "redis": lambda: RedisTier(port=port, timeout_s=10.0, prefix=f"{codec}:"),
            }
            for tier_name, make in tiers.items():
                store = KVStore([make()], model=lm.model_id, codec=codec)
                t = time.perf_counter()
                store.put(prefix, kv)
                put_s = time.perf_counter() - t
                nbytes = store.tiers[0].size()
                hook = TransformersKVHook(lm, store, save=False)
                times, loaded, where = [], 0, []
                for _ in range(args.reps):
                    g = hook.generate(request, max_new_tokens=1)
                    times.append(g.first_token_s)
                    loaded, where = g.loaded_tokens, g.where
                rows.append((codec, tier_name, statistics.median(times), loaded, nbytes, put_s, sorted(set(where))))
                print(f"{codec:9s} {tier_name:7s} TTFT {statistics.median(times):.3f} s  loaded {loaded}  "
                      f"{nbytes / 1e6:.2f} MB  put {put_s:.2f} s", flush=True)
                if tier_name == "memory":
                    out64 = hook.generate(request, max_new_tokens=64).tokens
                    agree = sum(a == b for a, b in zip(out64, ref64)) / len(ref64)
                    first_div = next((i for i, (a, b) in enumerate(zip(out64, ref64)) if a != b), None)
                    got = store.get(prefix)
                    q_nll, q_pred = nll(lm, got, ppl_cont)
                    dppl = float(torch.exp(q_nll.mean()) / torch.exp(ref_nll.mean()) - 1)
                    forced = float((q_pred == ref_pred).float().mean())
                    quality.append((codec, agree, first_div, dppl, forced))
                    print(f"{codec:9s} agreement {agree:.3f} over 64 tokens (first divergence {first_div}), "
                          f"teacher-forced {forced:.3f}, ppl change {100 * dppl:+.3f}%", flush=True)
                store.close()
    finally:
        redis_proc.kill()
        redis_proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)

    rec = statistics.median(recompute)
    lines = [
        "# Time to first token from the store vs recomputing the prefix",
        "",
        f"SmolLM2-135M-Instruct (float32, CPU, {torch.get_num_threads()} threads), `license:GPL-3`: a {args.prefix}-token "
        f"stored prefix plus {args.new} new tokens. Recompute = prefill all {args.prefix + args.new} tokens. From the store = "
        "fetch the prefix's chunks from one tier, decode them layer by layer while the model reads the new tokens "
        f"(`TransformersKVHook`), first token. Median of {args.reps} runs. KV stored from float32. Produced by "
        "`python bench/store_ttft.py`.",
        "",
        f"Recompute: **{rec:.3f} s**",
        "",
        "| codec | tier | TTFT (s) | speed-up vs recompute | prefix tokens loaded | stored MB | put (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for codec, tier, t, loaded, nbytes, put_s, _ in rows:
        lines.append(f"| {codec} | {tier} | {t:.3f} | {rec / t:.2f}× | {loaded} | {nbytes / 1e6:.2f} | {put_s:.2f} |")
    lines += ["", "Side by side (TTFT seconds):", "", "| tier | " + " | ".join(args.codecs.split(",")) + " | recompute |",
              "|---|" + "---|" * (len(args.codecs.split(",")) + 1)]
    for tier in ("memory", "disk", "redis"):
        cells = [f"{t:.3f}" for c in args.codecs.split(",") for (c2, tr, t, *_rest) in rows if c2 == c and tr == tier]
        lines.append(f"| {tier} | " + " | ".join(cells) + f" | {rec:.3f} |")
    lines += ["", "Quality through the store (memory tier), greedy, against the run that never left memory:", "",
              "| codec | token agreement over 64 generated tokens | first divergence (token index) "
              "| teacher-forced top-1 agreement, next 256 tokens | perplexity change, next 256 tokens |",
              "|---|---|---|---|---|"]
    for codec, agree, first_div, dppl, forced in quality:
        lines.append(f"| {codec} | {agree:.3f} | {'none' if first_div is None else first_div} | {forced:.3f} "
                     f"| {100 * dppl:+.3f}% |")
    lines += ["", "Token agreement over 64 generated tokens is position by position: once greedy decoding takes "
              "another token the two continuations are different texts and rarely line up again, so the first "
              "divergence and the teacher-forced agreement (same reference tokens fed to both) say more."]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


@torch.no_grad()
def nll(lm, kv, cont: list[int]) -> torch.Tensor:
    logits = lm.continue_from(kv, cont[:-1])
    return torch.nn.functional.cross_entropy(logits, torch.tensor(cont[1:]), reduction="none"), logits.argmax(-1)


if __name__ == "__main__":
    main()
