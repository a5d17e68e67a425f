"""Would adapting to the text close kvtc's KL gap to cachegen level 2 (issue 36)?  A side basis, or entropy
coding that adapts to each token and to its neighbours.

    python bench/studies/kvtc_adaptation.py --calibration FILE [--texts SPEC,SPEC,...]

SmolLM2 (one layer group: every layer holds every token), each text's first 1536 tokens as float16 KV, the
calibration named.  What level 2's components leave out of a text's weighted features (the first token aside) is
the residual; most of kvtc's KL on unfamiliar text comes from it (bench/studies/kvtc_ood_error.py).  If it were of
low rank, a few directions fitted to the prompt (sent once) or to each chunk (sent with it) would hold most of it.
Per tensor: the residual's share of the energy, the share of the residual its leading r singular directions hold
(over the whole prompt; per 256-token chunk, the chunks' mean), and what sending those directions alone costs at
8 bits per entry, in bits per element of the whole cache: a lower bound, as their coefficients cost more.

The bytes saved could buy a finer step instead.  Level 2's symbols, per 256-token chunk, cost what kvtc codes
(each component's cheapest codebook table, one byte per component for its table).  Against that: tokens split
into 2 or 4 classes by their symbols' energy (each component's variance-normalized squares, the token's mean),
each class a table per component, the classes' ids sent; and the bound any context model of the neighbours
could reach: the symbols' empirical entropy per component per chunk, alone and given how many of the token's 8
previous components are nonzero (0, 1-2, 3 or more) or whether the previous token's same component is.
Writes bench/studies/results/kvtc_adaptation-smollm2.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from kvcodec.cache import KVCache
from kvcodec.codecs.kvtc import KVTC, levels
from kvcodec.codecs.kvtc.calibration import Calibration, register_calibration
from kvcodec.codecs.kvtc.quantize import symbol_bits
from kvcodec.models import load_model
from kvcodec.texts import load_text

RESULTS = Path(__file__).resolve().parent / "results"
# kvtc_ood_error.py's texts (the three furthest over cachegen's KL, one under) and an evaluation text
TEXTS = ("stdlib:html/entities.py", "stdlib:heapq.py", "license:MPL-2.0", "license:GPL-3", "pydoc-topics")
PROMPT_RANKS = (8, 32, 128)
CHUNK_RANKS = (2, 8, 32)
CHUNK = 256
ENTRY_BITS = 8
TABLE_BITS = 8  # a component's table byte in a part
CLASSES = (2, 4)


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


def coded_bits(q: np.ndarray) -> float:
    """What kvtc's part spends on symbols ``[K, T]``: each component's cheapest table, and its table byte."""
    return float(symbol_bits(q).sum()) + TABLE_BITS * len(q)


def by_token_class(q: np.ndarray, classes: int) -> float:
    """The bits with the tokens split into ``classes`` by their symbols' energy, a table per component per class,
    and each token's class id."""
    energy = np.log((q ** 2 / np.maximum((q ** 2).mean(1, keepdims=True), 1e-3)).mean(0) + 1e-3)
    token_class = np.searchsorted(np.quantile(energy, np.linspace(0, 1, classes + 1)[1:-1]), energy)
    return sum(coded_bits(q[:, token_class == c]) for c in range(classes)) + q.shape[1] * np.log2(classes)


def entropy(symbols: np.ndarray, context: np.ndarray) -> float:
    """The empirical entropy of ``symbols`` given ``context`` (bits, all of them)."""
    total = 0.0
    for c in np.unique(context):
        _, n = np.unique(symbols[context == c], return_counts=True)
        total -= float((n * np.log2(n / n.sum())).sum())
    return total


def neighbour_entropies(q: np.ndarray) -> tuple[float, float, float]:
    """Symbols ``[K, T]``: per component, their entropy alone, given the count of nonzero symbols among the token's
    8 previous components, given whether the previous token's same component is nonzero."""
    nonzero = (q != 0).astype(np.int64)
    before = np.cumsum(nonzero, 0) - nonzero
    recent = before - np.vstack([np.zeros((8, q.shape[1]), np.int64), before[:-8]])[:len(q)]
    components = np.minimum((recent + 1) // 2, 2)
    previous = np.hstack([np.zeros((len(q), 1), np.int64), nonzero[:, :-1]])
    alone = np.zeros(q.shape[1], np.int64)
    return tuple(sum(entropy(q[j], ctx[j]) for j in range(len(q)))  # type: ignore[return-value]
                 for ctx in (np.broadcast_to(alone, q.shape), components, previous))


def rows_for(cal: Calibration, kv: KVCache) -> tuple[list[str], list[str]]:
    """Per tensor: the side basis's row (the residual's share of the energy, then the prompt's and the chunks'
    directions' shares of it) and the entropy coding's row."""
    basis, coding = [], []
    for side, (name, kept) in enumerate(zip(("keys", "values"), KVTC(calibration=cal).coded_components()[0])):
        rows = (cal.keys, cal.values)[side][0].rows32[:kept]
        w = weighted_features(cal, kv, side)
        coeff = w @ rows.T
        residual = w - coeff @ rows
        left = float((residual ** 2).sum() / (w ** 2).sum())
        chunks = np.mean([held(residual[a:a + CHUNK], CHUNK_RANKS) for a in range(0, len(residual), CHUNK)], 0)
        basis.append(f"{name} | {100 * left:.1f}% | " + " / ".join(f"{100 * s:.0f}%" for s in held(residual, PROMPT_RANKS))
                     + " | " + " / ".join(f"{100 * s:.0f}%" for s in chunks))
        q = np.rint(coeff.double().numpy() / levels.LEVELS[levels.DEFAULT_LEVEL][side]).astype(np.int64).T
        parts = [q[:, a:a + CHUNK] for a in range(0, q.shape[1], CHUNK)]
        base = sum(coded_bits(p) for p in parts)
        split = [sum(by_token_class(p, k) for p in parts) for k in CLASSES]
        alone, components, previous = np.sum([neighbour_entropies(p) for p in parts], 0)
        coding.append(f"{name} | {base / w.numel():.3f} | " + " / ".join(f"{100 * (x / base - 1):+.1f}%" for x in split)
                      + f" | {alone / q.size:.3f} | {100 * (components / alone - 1):+.1f}% / "
                      f"{100 * (previous / alone - 1):+.1f}%")
    return basis, coding


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
    lines, coding = [], []
    for text in a.texts.split(","):
        kv = model.prefill(model.tokenize(load_text(text))[:a.tokens], dtype=torch.float16)
        basis_rows, coding_rows = rows_for(cal, kv)
        lines += [f"| `{text}` | {row} |" for row in basis_rows]
        coding += [f"| `{text}` | {row} |" for row in coding_rows]
        print(*lines[-2:], *coding[-2:], sep="\n", flush=True)
    # one tensor's r directions of F entries, over the cache's T x 2F elements
    prompt_cost = " / ".join(f"{ENTRY_BITS * r / (2 * a.tokens):.3f}" for r in PROMPT_RANKS)
    chunk_cost = " / ".join(f"{ENTRY_BITS * r / (2 * CHUNK):.3f}" for r in CHUNK_RANKS)
    text = [f"# Would adapting to the text close kvtc's KL gap? ({model.model_id})", "",
            f"`python bench/studies/kvtc_adaptation.py --calibration FILE` with calibration {cal.digest[:12]} "
            f"({cal.settings.get('tokens', '?')} tokens of {', '.join(cal.settings.get('texts', []))}). Each "
            f"text's first {a.tokens} tokens, float16 KV.", "", "## A side basis", "",
            "What level 2's components leave out of the weighted features (the residual's share of their energy), "
            "and the share of the residual its leading r singular directions hold: fitted to the whole prompt (r = "
            f"{', '.join(map(str, PROMPT_RANKS))}) and to each {CHUNK}-token chunk (r = "
            f"{', '.join(map(str, CHUNK_RANKS))}; the chunks' mean).", "",
            "| text | tensor | left out | prompt's r directions | each chunk's r directions |",
            "|---|---|---|---|---|", *lines, "",
            f"Sending one tensor's directions at {ENTRY_BITS} bits per entry costs, per element of the cache: "
            f"{prompt_cost} bits (the prompt's, over {a.tokens} tokens) and {chunk_cost} bits (each chunk's), "
            "before their coefficients.", "", "## Entropy coding that adapts", "",
            f"Level 2's symbols per {CHUNK}-token chunk: bits per element of the tensor as kvtc codes them (each "
            "component's cheapest table and its table byte); the change with the tokens split into "
            f"{' / '.join(map(str, CLASSES))} classes by energy (a table per component per class, the class ids "
            "sent); the symbols' empirical entropy per component (bits per symbol), and its change given the "
            "token's 8 previous components (how many are nonzero) / the previous token's same component (whether "
            "it is nonzero). Entropies measured on the chunk itself are what an ideal coder could reach, less "
            "the cost of describing the model.", "",
            "| text | tensor | bits/element coded | token classes | entropy per symbol | given neighbours |",
            "|---|---|---|---|---|---|", *coding, "", f"Made in {time.time() - t0:.0f} s on a 2-core CPU."]
    out = RESULTS / "kvtc_adaptation-smollm2.md"
    out.write_text("\n".join(text) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
