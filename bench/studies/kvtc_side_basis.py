"""Would a basis that adapts to the text close kvtc's KL gap to cachegen level 2 (issue 36)?

    python bench/studies/kvtc_side_basis.py --calibration FILE [--texts SPEC,SPEC,...]

SmolLM2 (one layer group: every layer holds every token), each text's first 1536 tokens as float16 KV, the
calibration named.  What level 2's components leave out of a text's weighted features (the first token aside) is
the residual; most of kvtc's KL on unfamiliar text comes from it (bench/studies/kvtc_ood_error.py).  If it were of
low rank, a few directions fitted to the prompt (sent once) or to each chunk (sent with it) would hold most of it.
Per tensor: the residual's share of the energy, the share of the residual its leading r singular directions hold
(over the whole prompt; per 256-token chunk, the chunks' mean), and what sending those directions alone costs at
8 bits per entry, in bits per element of the whole cache: a lower bound, as their coefficients cost more.
Writes bench/studies/results/kvtc_side_basis-smollm2.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from kvcodec.cache import KVCache
from kvcodec.codecs.kvtc import KVTC
from kvcodec.codecs.kvtc.calibration import Calibration, register_calibration
from kvcodec.models import load_model
from kvcodec.texts import load_text

RESULTS = Path(__file__).resolve().parent / "results"
# kvtc_ood_error.py's texts (the three furthest over cachegen's KL, one under) and an evaluation text
TEXTS = ("stdlib:html/entities.py", "stdlib:heapq.py", "license:MPL-2.0", "license:GPL-3", "pydoc-topics")
PROMPT_RANKS = (8, 32, 128)
CHUNK_RANKS = (2, 8, 32)
CHUNK = 256
ENTRY_BITS = 8


def weighted_features(cal: Calibration, kv: KVCache, side: int) -> torch.Tensor:
    """The group's weighted features ``[T - 1, F]`` of keys (rotary undone) or values, without the first token."""
    rows = []
    for layer in cal.groups[0]:
        info, pair = cal.layers[layer], kv.layers[layer]
        x = (pair.keys, pair.values)[side][:, 1:].float()
        if side == 0 and info.rotary is not None:
            x = info.rotary.rotate(x, torch.arange(1, kv.num_tokens), inverse=True)
        rows.append(x.permute(1, 0, 2).reshape(kv.num_tokens - 1, -1))
    gb = (cal.keys, cal.values)[side][0]
    return (torch.cat(rows, 1) - gb.mean) * gb.weight


def held(residual: torch.Tensor, ranks: tuple[int, ...]) -> list[float]:
    """The share of ``residual``'s energy its leading singular directions hold, per rank."""
    energy = torch.linalg.svdvals(residual.double()) ** 2
    cum = energy.cumsum(0) / energy.sum()
    return [float(cum[min(r, len(cum)) - 1]) for r in ranks]


def rows_for(cal: Calibration, kv: KVCache) -> list[str]:
    """Per tensor: the residual's share of the energy, then the prompt's and the chunks' directions' shares of it."""
    out = []
    for side, (name, kept) in enumerate(zip(("keys", "values"), KVTC(calibration=cal).coded_components()[0])):
        rows = (cal.keys, cal.values)[side][0].rows32[:kept]
        w = weighted_features(cal, kv, side)
        residual = w - (w @ rows.T) @ rows
        left = float((residual ** 2).sum() / (w ** 2).sum())
        chunks = np.mean([held(residual[a:a + CHUNK], CHUNK_RANKS) for a in range(0, len(residual), CHUNK)], 0)
        out.append(f"{name} | {100 * left:.1f}% | " + " / ".join(f"{100 * s:.0f}%" for s in held(residual, PROMPT_RANKS))
                   + " | " + " / ".join(f"{100 * s:.0f}%" for s in chunks))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calibration", required=True, help="SmolLM2's kvtc calibration file to measure")
    p.add_argument("--texts", default=",".join(TEXTS))
    p.add_argument("--tokens", type=int, default=1536)
    a = p.parse_args()
    t0 = time.time()
    cal = register_calibration(a.calibration)
    if len(cal.groups) != 1:
        raise SystemExit("this study reads a calibration of one layer group (SmolLM2's)")
    model = load_model("smollm2", progress=False)
    lines = []
    for text in a.texts.split(","):
        kv = model.prefill(model.tokenize(load_text(text))[:a.tokens], dtype=torch.float16)
        lines += [f"| `{text}` | {row} |" for row in rows_for(cal, kv)]
        print(lines[-2], lines[-1], sep="\n", flush=True)
    # one tensor's r directions of F entries, over the cache's T x 2F elements
    prompt_cost = " / ".join(f"{ENTRY_BITS * r / (2 * a.tokens):.3f}" for r in PROMPT_RANKS)
    chunk_cost = " / ".join(f"{ENTRY_BITS * r / (2 * CHUNK):.3f}" for r in CHUNK_RANKS)
    text = [f"# Would a basis that adapts to the text close kvtc's KL gap? ({model.model_id})", "",
            f"`python bench/studies/kvtc_side_basis.py --calibration FILE` with calibration {cal.digest[:12]} "
            f"({cal.settings.get('tokens', '?')} tokens of {', '.join(cal.settings.get('texts', []))}). Each "
            f"text's first {a.tokens} tokens, float16 KV.", "",
            "What level 2's components leave out of the weighted features (the residual's share of their energy), "
            "and the share of the residual its leading r singular directions hold: fitted to the whole prompt (r = "
            f"{', '.join(map(str, PROMPT_RANKS))}) and to each {CHUNK}-token chunk (r = "
            f"{', '.join(map(str, CHUNK_RANKS))}; the chunks' mean).", "",
            "| text | tensor | left out | prompt's r directions | each chunk's r directions |",
            "|---|---|---|---|---|", *lines, "",
            f"Sending one tensor's directions at {ENTRY_BITS} bits per entry costs, per element of the cache: "
            f"{prompt_cost} bits (the prompt's, over {a.tokens} tokens) and {chunk_cost} bits (each chunk's), "
            "before their coefficients.", "", f"Made in {time.time() - t0:.0f} s on a 2-core CPU."]
    out = RESULTS / "kvtc_side_basis-smollm2.md"
    out.write_text("\n".join(text) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
