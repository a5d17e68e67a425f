"""Where kvtc's KL divergence comes from on texts where it leaves more than cachegen level 2 (issue 36).

    python bench/studies/kvtc_ood_error.py --calibration FILE [--model smollm2] [--texts SPEC,SPEC,...]

Each text alone, with the protocol of bench/rate_distortion.py (1536-token float16 prefix, the next 512 tokens
scored; KL against the float16 cache's next-token distributions).  Rows, all with the calibration named (never
one found installed: the measurement must say which basis it measured):

* the default level, with and without its fine rows;
* the default level's components, quantized 10x finer: what leaving the other components out costs alone
  (the basis's truncation), and of that, keys alone and values alone (the other tensor exact);
* every component the calibration file holds, quantized 100x finer: what the file's basis cannot hold;
* the default level coding every component of the file (``min_std=0``);
* the default level with the components chosen per chunk: also those whose std *in this chunk* is at least
  ``min_std`` steps (those of a text unlike the calibration's), the others left out as before;
* level 3 (finer steps, the same kind of bytes for less KL);
* cachegen level 2;

and the energy the default level's components leave out of the cache, and how it spreads over tokens and
feature channels.  The finer steps are measured as extra levels of this process only (the format's levels are
fixed), as bench/studies/kvtc_heldout_levers.py ``--steps`` does.
Writes bench/studies/results/kvtc_ood_error-<model>.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from kvcodec.api import decode, encode
from kvcodec.cache import KVCache
from kvcodec.codecs.cachegen import CacheGen
from kvcodec.codecs.entropy.tables import step_code
from kvcodec.codecs.kvtc import KVTC, levels
from kvcodec.codecs.kvtc.calibration import register_calibration
from kvcodec.codecs.kvtc.quantize import quantize
from kvcodec.codecs.registry import register_codec
from kvcodec.models import load_model
from kvcodec.tools.evaluate import prepare, quality

RESULTS = Path(__file__).resolve().parent / "results"
# the three texts where kvtc's KL is furthest over cachegen's, and one where it is under
TEXTS = ("stdlib:html/entities.py", "stdlib:heapq.py", "license:MPL-2.0", "license:GPL-3")
FINER, FINEST = 90, 91  # this process's extra levels: the default's steps 10x and 100x finer


@register_codec
class ChosenPerChunk(KVTC):
    """kvtc at a level, coding besides the calibration's components those whose std in the chunk is at least
    ``min_std`` steps.  Its parts carry a table byte for every component of the file (a dead one costs that
    byte), so its decoder reads that many: a study codec under an id of its own, not a format."""

    codec_id = "kvtc-chosen-per-chunk"

    added: list[int]  # per part coded, the components it added to the calibration's (main sets it per text)

    def _coded(self, gb, step):  # type: ignore[no-untyped-def]
        return gb.components

    def _level_part(self, x, gb, step):  # type: ignore[no-untyped-def]
        coeff = self._project((x - gb.mean) * gb.weight, gb, 0, gb.components)
        calibrated = (gb.variance.sqrt() >= self.min_std * step).numpy()
        keep = calibrated | (np.sqrt((coeff ** 2).mean(1)) >= self.min_std * step)
        coeff[~keep] = 0
        self.added.append(int((keep & ~calibrated).sum()))
        codes, q = quantize(coeff, np.full(gb.components, step_code(step), np.int64))
        return self._part_bytes(q, codes, b"", codes[0], codes[0])


def left_out(cal, kv: KVCache, chunk_tokens: int = 256) -> list[str]:  # type: ignore[no-untyped-def]
    """Per tensor (keys, values): the share of the weighted features' energy that the default level's components
    leave out of a cache's chunks (after the first, exact token), and the shares of that left-out energy on the 5%
    of tokens and the 5% of feature channels that hold most of it (a sparse remainder could be coded apart).  For
    a calibration of one layer group (every layer holding every token, as SmolLM2's); "-" for others."""
    if len(cal.groups) != 1:
        return ["-", "-"]
    out = []
    counts = KVTC(calibration=cal).coded_components()[0]
    members = cal.groups[0]
    for name, bases, kept in zip(("keys", "values"), (cal.keys, cal.values), counts):
        gb = bases[0]
        by_token, by_channel, left, total = [], 0.0, 0.0, 0.0
        for start in range(0, kv.num_tokens, chunk_tokens):
            stop = min(start + chunk_tokens, kv.num_tokens)
            rows = []
            for layer in members:
                info, (k, v) = cal.layers[layer], kv.layers[layer]
                x = (k if name == "keys" else v)[:, start:stop].float()
                if name == "keys" and info.rotary is not None:
                    x = info.rotary.rotate(x, torch.arange(start, stop), inverse=True)
                rows.append(x.permute(1, 0, 2).reshape(stop - start, -1))
            w = ((torch.cat(rows, 1) - gb.mean) * gb.weight)[1 if start == 0 else 0:]
            coeff = w @ gb.rows32[:kept].T
            energy = (w - coeff @ gb.rows32[:kept]) ** 2
            by_token.append(energy.sum(1))
            by_channel = by_channel + energy.sum(0)
            left += float(energy.sum())
            total += float(energy.sum() + (coeff ** 2).sum())
        tokens, channels = torch.cat(by_token).sort(descending=True).values, by_channel.sort(descending=True).values
        top = [float(x[:len(x) // 20].sum() / x.sum()) for x in (tokens, channels)]
        out.append(f"{100 * left / total:.1f}% ({100 * top[0]:.0f}%, {100 * top[1]:.0f}%)")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--calibration", required=True, help="the kvtc calibration file to measure")
    p.add_argument("--texts", default=",".join(TEXTS))
    p.add_argument("--tokens", type=int, default=1536)
    p.add_argument("--continuation", type=int, default=512)
    a = p.parse_args()
    t0 = time.time()
    key, value = levels.LEVELS[levels.DEFAULT_LEVEL]
    levels.LEVELS[FINER] = (key / 10, value / 10)
    levels.LEVELS[FINEST] = (key / 100, value / 100)
    cal = register_calibration(a.calibration)
    model = load_model(a.model, progress=False)
    finer_codec = KVTC(level=FINER, calibration=cal, min_std=2.3, fine_tokens=0)
    chosen = ChosenPerChunk(calibration=cal)
    # a row's codec, or (None, the tensor) for a hybrid of the finer decode and the exact cache
    rows: dict[str, tuple[object, str | None]] = {
        "kvtc level 2": (KVTC(calibration=cal), None),
        "kvtc level 2 without fine rows": (KVTC(calibration=cal, fine_tokens=0), None),
        "level 2's components, 10x finer steps": (finer_codec, None),
        "... keys decoded, values exact": (None, "keys"),
        "... values decoded, keys exact": (None, "values"),
        "every component of the file, 100x finer steps": (KVTC(level=FINEST, calibration=cal, min_std=0.0,
                                                               fine_tokens=0), None),
        "kvtc level 2, every component coded (min_std=0)": (KVTC(calibration=cal, min_std=0.0), None),
        "kvtc level 2, components chosen per chunk too": (chosen, None),
        "kvtc level 3": (KVTC(level=3, calibration=cal), None),
        "cachegen level 2": (CacheGen(level=2), None),
    }
    texts = a.texts.split(",")
    cells: dict[str, list[str]] = {name: [] for name in rows}
    added, spread = [], []
    for text in texts:
        chosen.added = []
        case = prepare(model, text, a.tokens, a.continuation)
        spread.append(f"| `{text}` | " + " | ".join(left_out(cal, case.kv)) + " |")
        finer = None
        for name, (codec, part) in rows.items():
            if part is None:
                blob = encode(case.kv, codec)
                kv = decode(blob)
                bits = f"{8 * len(blob) / case.kv.num_elements:.3f}, "
                if codec is finer_codec:
                    finer = kv
            else:
                assert finer is not None
                kv = KVCache([(d.keys if part == "keys" else o.keys, d.values if part == "values" else o.values)
                              for o, d in zip(case.kv.layers, finer.layers)],
                             model=case.kv.model, token_ids=case.kv.token_ids, rope=case.kv.rope)
                bits = ""
            q = quality(model, case, kv)
            cells[name].append(f"{bits}{100 * q.ppl_change:+.2f}%, {100 * q.agreement:.1f}%, {q.kl:.4f}")
            print(f"{text} | {name} | {cells[name][-1]}", flush=True)
        added.append(f"`{text}` {np.mean(chosen.added):.0f}")
    lines = [f"# Where kvtc's KL comes from on texts unlike its calibration ({model.model_id})", "",
             f"`python bench/studies/kvtc_ood_error.py --model {a.model} --calibration FILE` with calibration "
             f"{cal.digest[:12]} ({cal.settings.get('tokens', '?')} tokens of "
             f"{', '.join(cal.settings.get('texts', []))}). Each text alone: {a.tokens}-token float16 prefix, the "
             f"next {a.continuation} tokens scored. Cells: bits/element (where the row encodes), perplexity change, "
             "greedy agreement, KL (nats per token).", "",
             "| row | " + " | ".join(f"`{t}`" for t in texts) + " |", "|---|" + "---|" * len(texts)]
    lines += [f"| {name} | " + " | ".join(c) + " |" for name, c in cells.items()]
    lines += ["", "Components chosen per chunk besides the calibration's, on average per part (a chunk's keys or "
              "values; the file holds " + ", ".join(f"{k.components} and {v.components}" for k, v in
                                                     zip(cal.keys, cal.values)) + "): " + ", ".join(added) + ".",
              "", "The energy of the weighted features (the first token's aside) that level 2's components leave "
              "out, and in brackets the shares of it on the 5% of tokens and the 5% of feature channels that hold "
              "most:", "", "| text | keys | values |", "|---|---|---|", *spread,
              "", f"Made in {time.time() - t0:.0f} s on a 2-core CPU."]
    out = RESULTS / f"kvtc_ood_error-{a.model}.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
