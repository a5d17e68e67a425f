"""Which tokens kvtc codes at finer steps, and how much of the attention they draw (issue 21).

    python bench/studies/kvtc_fine_tokens.py [--model M] [--texts SPEC,...] [--fine-tokens N]

For each text (default: the three evaluation texts and the three held-out kinds), the model reads 1536 tokens of
prefix and 512 of continuation with its attention weights out; a token's share is the attention the continuation's
queries give it, summed over layers and heads, as a fraction of what all prefix tokens but the first (a sink
kvtc always stores exactly) receive.  Per 256-token chunk (kvtc's default grid), each rule picks ``--fine-tokens``
rows: kvtc's own (``KVTC.fine_rows``: smallest key and value against the chunk's median ones, in some layer and
head), the smallest mean key norm, and an oracle that knows the shares.  Writes bench/studies/results/kvtc_fine_tokens-<model>.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from kvcodec.codecs.kvtc import KVTC
from kvcodec.models import load_model
from kvcodec.texts import DEFAULT_EVAL_TEXTS, HELDOUT_TEXTS, load_text

RESULTS = Path(__file__).resolve().parent / "results"
PREFIX, CONTINUATION, CHUNK = 1536, 512, 256


@torch.no_grad()
def shares_and_kv(model, text: str) -> tuple[np.ndarray, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Attention received per prefix token ``[PREFIX]`` and each full layer's keys and values ``[H, PREFIX, D]``."""
    ids = model.tokenize(load_text(text))[:PREFIX + CONTINUATION]
    model.model.set_attn_implementation("eager")  # the only implementation that returns the weights
    out = model.model(torch.tensor([ids]), output_attentions=True, use_cache=True)
    share = sum(a[0, :, PREFIX:, :PREFIX].float().sum((0, 1)) for a in out.attentions).numpy()
    # the layers that keep every token (a sliding-window layer's cache holds only the last ones, and kvtc groups
    # it apart): one group's keys, as kvtc's rule sees them
    return share, [(layer.keys[0, :, :PREFIX].float(), layer.values[0, :, :PREFIX].float())
                   for layer in out.past_key_values.layers if layer.keys.shape[2] == len(ids)]


def pick(rule: str, codec: KVTC, share: np.ndarray, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
    """The tokens ``rule`` codes finer, over the prefix's chunks (token 0, the sink, never)."""
    out = []
    dims = (layers[0][0].shape[-1], layers[0][1].shape[-1])
    for t0 in range(0, PREFIX, CHUNK):
        lo = max(t0, 1)
        keys, values = (torch.cat([x[side][:, lo:t0 + CHUNK].permute(1, 0, 2).reshape(t0 + CHUNK - lo, -1)
                                   for x in layers], 1) for side in (0, 1))
        if rule == "kvtc":
            chosen = codec.fine_rows(keys, values, dims)[0]
        elif rule == "mean key norm":
            norms = keys.reshape(keys.shape[0], -1, dims[0]).norm(dim=2).mean(1).numpy()
            chosen = np.argsort(norms, kind="stable")[:codec.fine_tokens]
        else:
            chosen = np.argsort(-share[lo:t0 + CHUNK], kind="stable")[:codec.fine_tokens]
        out += [lo + int(r) for r in chosen]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--texts", default=",".join(list(DEFAULT_EVAL_TEXTS) + list(HELDOUT_TEXTS)))
    p.add_argument("--fine-tokens", type=int, default=2, help="rows per 256-token chunk (kvtc's fine_tokens)")
    a = p.parse_args()
    model = load_model(a.model, progress=False)
    codec = KVTC(calibration="auto", fine_tokens=a.fine_tokens)
    rules = ("kvtc", "mean key norm", "oracle")
    rows = []
    for text in a.texts.split(","):
        share, layers = shares_and_kv(model, text)
        total = share[1:].sum()
        rows.append([text] + [float(share[pick(r, codec, share, layers)].sum() / total) for r in rules])
        print(" | ".join([rows[-1][0]] + [f"{x:.1%}" for x in rows[-1][1:]]), flush=True)
    lines = [f"# kvtc's fine rows on {a.model}: the continuation's attention they draw",
             "", f"`python bench/studies/kvtc_fine_tokens.py --model {a.model} --fine-tokens {a.fine_tokens}`: "
             f"{a.fine_tokens} rows per {CHUNK}-token chunk of a {PREFIX}-token prefix, the attention the next "
             f"{CONTINUATION} tokens' queries give them (all layers and heads) as a share of what every prefix "
             "token but the first receives.", "",
             "| text | " + " | ".join(rules) + " |", "|---|" + "---:|" * len(rules)]
    lines += ["| " + r[0] + " | " + " | ".join(f"{x:.1%}" for x in r[1:]) + " |" for r in rows]
    mean = np.mean([r[1:] for r in rows], 0)
    lines += ["| **mean** | " + " | ".join(f"**{x:.1%}**" for x in mean) + " |", ""]
    out = RESULTS / f"kvtc_fine_tokens-{a.model}.md"
    out.write_text("\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
