"""Where kvtc's perplexity change comes from: keys or values, and which layer group.

    python bench/studies/kvtc_breakdown.py [--model gemma3-270m] [--level 4] [--texts 1]

Encodes each cache with kvtc at ``--level`` (the calibration installed for the model), decodes it, then lets the
model continue from hybrids that take only some of the decoded tensors (the rest from the float16 cache itself):
keys only, values only, and each layer group alone.  Perplexity change of the next tokens against the float16
cache, as in bench/rate_distortion.py, mean over the first ``--texts`` evaluation texts.  Writes
bench/studies/results/kvtc_breakdown-<model>.md.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from kvcodec.api import decode, encode
from kvcodec.cache import KVCache
from kvcodec.codecs.kvtc import KVTC
from kvcodec.codecs.kvtc.fit import ensure_calibration
from kvcodec.tools.evaluate import prepare, quality
from kvcodec.models import load_model
from kvcodec.texts import DEFAULT_EVAL_TEXTS

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--level", type=int, default=4)
    p.add_argument("--texts", type=int, default=1)
    p.add_argument("--tokens", type=int, default=1536)
    p.add_argument("--continuation", type=int, default=512)
    args = p.parse_args()
    model = load_model(args.model, progress=False)
    cal = ensure_calibration(model)
    codec = KVTC(level=args.level, calibration=cal)
    variants = {"all decoded": (True, True, None), "keys decoded, values exact": (True, False, None),
                "values decoded, keys exact": (False, True, None)}
    variants |= {f"group {g} only ({len(m)} layers: {m[0]}..{m[-1]})": (True, True, set(m))
                 for g, m in enumerate(cal.groups)}
    change = dict.fromkeys(variants, 0.0)
    texts = DEFAULT_EVAL_TEXTS[:args.texts]
    for text in texts:
        case = prepare(model, text, args.tokens, args.continuation)
        decoded = decode(encode(case.kv, codec))
        for name, (keys, values, layers) in variants.items():
            mixed = [(d.keys if keys and (layers is None or i in layers) else o.keys,
                      d.values if values and (layers is None or i in layers) else o.values)
                     for i, (o, d) in enumerate(zip(case.kv.layers, decoded.layers))]
            kv = KVCache(mixed, model=case.kv.model, token_ids=case.kv.token_ids, rope=case.kv.rope)
            q = quality(model, case, kv)
            change[name] += q.ppl_change / len(texts)
            print(f"{text} {name}: {100 * q.ppl_change:+.2f}%", flush=True)
    lines = [f"# kvtc level {args.level} on {model.model_id}: where the perplexity change comes from", "",
             f"Texts {', '.join(texts)}; {args.tokens}-token float16 prefix, perplexity of the next "
             f"{args.continuation} tokens. Calibration {cal.digest[:16]}: groups {cal.groups}.", "",
             "| decoded tensors used (the rest exact) | perplexity change |", "|---|---|"]
    lines += [f"| {name} | {100 * c:+.2f}% |" for name, c in change.items()]
    lines += ["", f"Made by `python bench/studies/kvtc_breakdown.py --model {args.model} --level {args.level} --texts "
              f"{args.texts}` (load average {os.getloadavg()[0]:.1f})."]
    (RESULTS / f"kvtc_breakdown-{args.model}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
