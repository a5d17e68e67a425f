"""Why kvtc grades a sliding window's steps by age, and by how much: measured on a model with windowed layers.

    python bench/studies/kvtc_window_grading.py [--model gemma3-270m] [--spec kvtc:bits=1.0] [--octaves 0,1,2,3]

First, where the loss of an ungraded encode comes from: the decoded cache with some tokens put back exact (the
windowed layers' oldest or newest half, their newest 64; the full layers' oldest 1024 or newest 512 but the sink).
Then the same rate with each ``window_octaves``.  KL divergence of the next-token distributions, greedy
agreement and perplexity change against the float16 cache, as ``kvcodec eval`` reports them, mean over the
evaluation texts.  Writes bench/studies/results/kvtc_window_grading.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from kvcodec.api import decode, encode
from kvcodec.cache import KVCache
from kvcodec.cli import parse_codec
from kvcodec.tools.evaluate import prepare, quality
from kvcodec.codecs.kvtc.fit import ensure_calibration
from kvcodec.models import load_model
from kvcodec.texts import DEFAULT_EVAL_TEXTS

RESULTS = Path(__file__).resolve().parent / "results"


def exact_sets(kv: KVCache) -> dict[str, dict[int, range]]:
    """Named sets of (layer: tokens of its own axis) to put back exact."""
    n = kv.num_tokens
    windowed = [i for i, l in enumerate(kv.layers) if l.keys.shape[1] < n]
    full = [i for i, l in enumerate(kv.layers) if l.keys.shape[1] == n]
    w = kv.layers[windowed[0]].keys.shape[1] if windowed else 0
    return {"none (all decoded)": {},
            "windowed layers' oldest half": {i: range(w // 2) for i in windowed},
            "windowed layers' newest half": {i: range(w // 2, w) for i in windowed},
            "windowed layers' newest 64": {i: range(w - 64, w) for i in windowed},
            "windowed layers, all": {i: range(w) for i in windowed},
            "full layers' oldest 1024 (but the sink)": {i: range(1, 1024) for i in full},
            "full layers' newest 512": {i: range(n - 512, n) for i in full}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--spec", default="kvtc:bits=1.0", help="the kvtc setting graded (default: kvtc:bits=1.0)")
    p.add_argument("--octaves", default="0,1,2,3", help="window_octaves to compare (default: 0,1,2,3)")
    args = p.parse_args()
    t0 = time.time()
    model = load_model(args.model, progress=False)
    cal = ensure_calibration(model)
    octaves = [float(o) for o in args.octaves.split(",")]
    codecs = {o: parse_codec(f"{args.spec},window_octaves={o:g}", [f"calibration={cal.digest}"]) for o in octaves}
    hybrids: dict[str, list[float]] = {}
    graded: dict[float, list[float]] = {}
    bits: dict[float, float] = {}
    texts = DEFAULT_EVAL_TEXTS
    for text in texts:
        case = prepare(model, text, 1536, 512)
        for o, codec in codecs.items():
            blob = encode(case.kv, codec)
            out = decode(blob)
            bits[o] = bits.get(o, 0) + 8 * len(blob) / case.kv.num_elements / len(texts)
            graded[o] = [a + b / len(texts) for a, b in zip(graded.get(o, [0, 0, 0]), quality(model, case, out))]
            if o == 0:
                for name, exact in exact_sets(case.kv).items():
                    layers = []
                    for i, (ref, got) in enumerate(zip(case.kv.layers, out.layers)):
                        k, v = got.keys.clone(), got.values.clone()
                        if i in exact:
                            idx = torch.tensor(list(exact[i]))
                            k[:, idx], v[:, idx] = ref.keys[:, idx], ref.values[:, idx]
                        layers.append((k, v))
                    mixed = KVCache(layers, model=case.kv.model, token_ids=case.kv.token_ids, rope=case.kv.rope)
                    hybrids[name] = [a + b / len(texts) for a, b in zip(hybrids.get(name, [0, 0, 0]),
                                                                         quality(model, case, mixed))]
        print(f"{text} done", flush=True)
    lines = [f"# kvtc window grading on {model.model_id}", "",
             f"`{args.spec}`, calibration {cal.digest[:16]}; texts {', '.join(texts)}; 1536-token float16 prefix, the "
             "next 512 tokens scored; KL (nats per token), greedy agreement and perplexity change against the "
             "float16 cache, mean over the texts.", "",
             "## Where an ungraded encode's loss is: its decoded cache with some tokens put back exact", "",
             "| put back exact | KL | agreement | perplexity change |", "|---|---|---|---|"]
    # the sums run in Quality's order: perplexity change, agreement, KL
    lines += [f"| {name} | {k:.4f} | {100 * a:.2f}% | {100 * c:+.2f}% |" for name, (c, a, k) in hybrids.items()]
    lines += ["", "## The same rate with the window graded", "",
              "| window_octaves | bits/element | KL | agreement | perplexity change |", "|---|---|---|---|---|"]
    lines += [f"| {o:g} | {bits[o]:.3f} | {k:.4f} | {100 * a:.2f}% | {100 * c:+.2f}% |"
              for o, (c, a, k) in graded.items()]
    lines += ["", f"Made by `python bench/studies/kvtc_window_grading.py --model {args.model} --spec {args.spec} --octaves "
              f"{args.octaves}` in {time.time() - t0:.0f} s on a 2-core CPU."]
    RESULTS.mkdir(exist_ok=True)
    out_path = RESULTS / "kvtc_window_grading.md"
    out_path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
