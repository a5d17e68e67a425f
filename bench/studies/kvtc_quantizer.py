"""kvtc's quantizer against two textbook refinements, measured by what the model does with the decoded cache.

    python bench/studies/kvtc_quantizer.py --calibration FILE [--spec kvtc:level=2 ...] [--variant NAME ...]

Variants (``--variant``, repeatable; default: all):

* ``midpoint``: kvtc as it is: symbols are the coefficients rounded to the nearest step, decoded at the step's
  multiple.
* ``rdo:L``: the encoder moves a symbol one toward zero where the squared error that adds (in steps squared) is
  under ``L`` times the bits it saves under the component's table: an entropy-constrained quantizer's thresholds
  (``L`` = 0.12 is the high-rate slope, 2 ln 2 / 12).  The decoder is unchanged.
* ``centroid``: the decoder puts a nonzero symbol at its bin's centroid under the Gaussian of the component's
  table (the table names the component's spread in the chunk), the mean-squared-error optimum, not the midpoint.
* ``offset:D``: the decoder puts nonzero symbols ``D`` steps nearer zero (negative: farther).

Both refinements lower the weighted squared error per bit, which is what the calibration's weights and the
uniform steps minimize; the question is whether the model's next-token distributions follow.  Each variant is
measured on the three evaluation texts and the three held-out kinds (1536-token float16 prefix, the next 512
tokens scored): bits/element, perplexity change, greedy agreement and the KL divergence from the float16 cache's
distributions (:func:`kvcodec.tools.evaluate.kl`).  Writes bench/studies/results/kvtc_quantizer.{md,jsonl}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from kvcodec.cli import parse_codec
from kvcodec.codecs.entropy.tables import RADIX, STEPS, choose_tables, code_lengths_fixed, table_scale
from kvcodec.codecs.kvtc import codec as kvtc_codec
from kvcodec.codecs.kvtc.calibration import Calibration, register_calibration
from kvcodec.codecs.kvtc.quantize import CODE_LENGTH_UNIT
from kvcodec.formats.cachegen import NUM_TABLES
from kvcodec.tools.evaluate import evaluate, prepare
from kvcodec.models import load_model
from kvcodec.texts import DEFAULT_EVAL_TEXTS, HELDOUT_TEXTS

RESULTS = Path(__file__).resolve().parent / "results"
GROUPS = {"evaluation texts": list(DEFAULT_EVAL_TEXTS), "held-out kinds": list(HELDOUT_TEXTS)}
DEFAULT_VARIANTS = ["midpoint", "rdo:0.06", "rdo:0.12", "centroid", "offset:0.1", "offset:-0.1"]


def rd_round(u: np.ndarray, q: np.ndarray, lam: float) -> np.ndarray:
    """``q = rint(u)`` moved one toward zero where the added squared error is under ``lam`` times the bits saved
    under each row's cheapest table."""
    m = np.abs(q)
    per_row = (code_lengths_fixed() / CODE_LENGTH_UNIT)[:, choose_tables(q)].T  # [rows, RADIX + 1] bits
    r = np.arange(q.shape[0])[:, None]
    saved = per_row[r, m] - per_row[r, np.maximum(m - 1, 0)]
    return np.where((m > 0) & (2 * (np.abs(u) - m) + 1 < lam * saved), q - np.sign(q), q)


def gaussian_centroids() -> np.ndarray:
    """``[NUM_TABLES, RADIX + 1]``: the mean magnitude, in steps, of the values that round to each magnitude
    under the Gaussian each codebook table was made from."""
    phi = lambda x: math.exp(-x * x / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    cdf = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
    out = np.tile(np.arange(RADIX + 1, dtype=np.float64), (NUM_TABLES, 1))
    for j in range(NUM_TABLES):
        s = table_scale(j)
        for m in range(1, RADIX + 1):
            a, b = (m - 0.5) / s, (m + 0.5) / s
            if cdf(b) - cdf(a) > 1e-12:
                out[j, m] = s * (phi(a) - phi(b)) / (cdf(b) - cdf(a))
    return out


@contextlib.contextmanager
def variant(name: str) -> Iterator[None]:
    """kvtc's encoder or decoder changed as ``name`` says, for the duration."""
    kind, _, arg = name.partition(":")
    quantize, coefficients = kvtc_codec.quantize, kvtc_codec.KVTC.coefficients
    if kind == "rdo":
        def rdo_quantize(coeff: np.ndarray, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            used, q = quantize(coeff, codes)
            return used, rd_round(coeff / STEPS[used][:, None].astype(np.float64), q, float(arg))
        kvtc_codec.quantize = rdo_quantize
    elif kind in ("centroid", "offset"):
        points = gaussian_centroids() if kind == "centroid" else np.maximum(np.arange(RADIX + 1) - float(arg), 0)
        points = torch.from_numpy(np.array(np.broadcast_to(points, (NUM_TABLES, RADIX + 1))))

        def moved(self: kvtc_codec.KVTC, part: kvtc_codec.CodedPart) -> torch.Tensor:
            c = coefficients(self, part).double()
            n = part.span
            step = torch.from_numpy(STEPS[part.codes[:n]].astype(np.float64))
            q = torch.round(c / step)
            table = torch.from_numpy(np.where(part.table[:n] == kvtc_codec.DEAD, 0, part.table[:n]).astype(np.int64))
            mag = q.abs().long()
            return (q.sign() * points[table.expand_as(mag), mag] * step).float()
        kvtc_codec.KVTC.coefficients = moved
    elif kind != "midpoint":
        raise SystemExit(f"unknown variant {name!r}")
    try:
        yield
    finally:
        kvtc_codec.quantize, kvtc_codec.KVTC.coefficients = quantize, coefficients


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calibration", required=True, help="a SmolLM2 kvtc calibration file")
    p.add_argument("--spec", action="append", default=[], help="kvtc specs (default: kvtc:level=2)")
    p.add_argument("--variant", action="append", default=[],
                   help="variants (default: " + ", ".join(DEFAULT_VARIANTS) + ")")
    a = p.parse_args()
    t0 = time.time()
    model = load_model("smollm2", progress=False)
    cal = register_calibration(Calibration.load(a.calibration))
    cases = {t: prepare(model, t, 1536, 512) for texts in GROUPS.values() for t in texts}
    log = RESULTS / "kvtc_quantizer.jsonl"
    for spec in a.spec or ["kvtc:level=2"]:
        codec = parse_codec(spec, [f"calibration={a.calibration}"])
        for name in a.variant or DEFAULT_VARIANTS:
            with variant(name):
                rows = {t: evaluate(model, [case], [codec])[0] for t, case in cases.items()}
            rec = {"spec": spec, "variant": name, "calibration": cal.digest,
                   "calibration_texts": cal.settings.get("texts"), "calibration_tokens": cal.settings.get("tokens")}
            for g, texts in GROUPS.items():
                rec[g] = [float(np.mean([getattr(rows[t], k) for t in texts]))
                          for k in ("bits_per_element", "ppl_change", "agreement", "kl")]
            print(f"{spec} {name}: " + " | ".join(f"{g} {v[0]:.3f} bits {100 * v[1]:+.2f}% {100 * v[2]:.2f}% KL "
                                                  f"{v[3]:.4f}" for g, v in rec.items() if g in GROUPS), flush=True)
            with open(log, "a") as f:
                f.write(json.dumps(rec) + "\n")
    render(log)
    print(f"{time.time() - t0:.0f} s")


def render(log: Path) -> None:
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    cell = lambda v: f"{v[0]:.3f}, {100 * v[1]:+.2f}%, {100 * v[2]:.1f}%, {v[3]:.4f}"  # noqa: E731
    lines = ["# kvtc's quantizer: rounding to the nearest step against an RD-optimized encoder and centroid "
             "decoding (SmolLM2)", "",
             "`python bench/studies/kvtc_quantizer.py --calibration FILE --spec SPEC`. Each text alone: 1536-token float16 "
             "prefix, the next 512 tokens scored; means over the three texts of a set. Cells: bits/element, "
             "perplexity change, greedy agreement, KL divergence from the float16 cache's next-token distributions "
             "(nats per token).", "",
             "| spec | variant | " + " | ".join(GROUPS) + " | calibration |", "|---|---|---|---|---|"]
    lines += [f"| `{r['spec']}` | {r['variant']} | " + " | ".join(cell(r[g]) for g in GROUPS)
              + f" | {r['calibration'][:12]} ({r['calibration_tokens']:,} tokens) |" for r in rows]
    (RESULTS / "kvtc_quantizer.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
