"""``kvcodec segments``: store documents' KV as segments, and fuse a prompt of them (issue 34; :mod:`kvcodec.blend`)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Sequence

HELP = "store documents' KV as segments, reused wherever they sit in a prompt, and fuse a prompt of them"
DESCRIPTION = """\
Store the KV of documents (texts) as segments: keyed by their own tokens and the model, not by what precedes
them, so that a later prompt that holds them in any order reuses them. Then fuse a prompt of a system text,
documents and a question: the documents' KV is loaded and moved to its positions, a share of its tokens (those
whose KV deviates most once the documents see each other) is recomputed layer by layer, and the question is
computed over the result. The report says what was reused, recomputed and missed (docs/segments.md).

  kvcodec segments store --text license:BSD --text stdlib:textwrap.py --text pydoc:json
  kvcodec segments fuse --text license:BSD --text pydoc:json --question "Which license is this?"

The segments live in the tiers given (default a private folder in the user's cache); a document named in fuse
that is not stored is computed in full (and reported as missed). Both actions must name the same model,
codec(s), --tokens and --system for the segments to be found."""


def default_tier() -> str:
    """Where segments are kept unless ``--tier`` says: a private folder in the user's cache."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return f"disk:{os.path.join(cache, 'kvcodec', 'segments')}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments, for :func:`run`."""
    from kvcodec.blend.fusion import SHARE_FLOOR

    parser.add_argument("action", choices=["store", "fuse"],
                        help="store: compute and store each --text's KV; fuse: the prompt [--system] + texts + "
                             "--question, from the stored segments")
    parser.add_argument("--model", default="smollm2", help="the model: smollm2 or a HuggingFace folder of a Llama-"
                                                          "architecture model (default: smollm2)")
    parser.add_argument("--text", action="append", required=True, metavar="SPEC",
                        help="a document, in prompt order (repeatable): a file, pydoc-topics, pydoc:MODULE, "
                             "license:NAME, stdlib:PATH or package:PACKAGE/PATH")
    parser.add_argument("--tokens", type=int, default=512,
                        help="at most this many tokens of each text (default: 512)")
    parser.add_argument("--system", default=None,
                        help="a system text, the first segment of every prompt (default: none)")
    parser.add_argument("--question", help="fuse: the prompt's last part, computed over the fused documents")
    parser.add_argument("--share", type=float, default=None,
                        help="fuse: the share of the documents' tokens recomputed at each layer, 0 to 1 (0 reuses "
                             "them as they are, 1 recomputes all: a full prefill; default: the loading "
                             "controller's, as much as hides under loading them on these tiers, at least "
                             f"{SHARE_FLOOR})")
    parser.add_argument("--new-tokens", type=int, default=32,
                        help="fuse: greedy tokens to generate after the question (default: 32)")
    parser.add_argument("--tier", action="append", metavar="URL",
                        help="a tier URL, fastest first (repeatable; docs/store.md#tier-urls; default: "
                             f"{default_tier()})")
    parser.add_argument("--codec", action="append", metavar="SPEC",
                        help="the codec segments are stored in (repeatable: variants, smallest first; default: "
                             "cachegen)")


def run(args: argparse.Namespace, emit: Callable[[argparse.Namespace, dict[str, Any], Sequence[str]], None]) -> int:
    """Do ``args.action``; ``emit(args, obj, lines)`` prints the result (a JSON object with ``--json``)."""
    import torch

    from kvcodec.engines.transformers_hook import TransformersKVHook
    from kvcodec.errors import InvalidInputError
    from kvcodec.models import load_model, model_path
    from kvcodec.texts import load_text

    if args.action == "fuse" and not args.question:
        args.parser.error("fuse needs --question")
    if args.tokens < 1 or args.new_tokens < 1 or not (args.share is None or 0 <= args.share <= 1):
        args.parser.error("--tokens and --new-tokens are positive, --share is in 0..1")
    try:
        texts = [load_text(spec) for spec in args.text]
    except InvalidInputError as e:
        args.parser.error(f"--text: {e}")
    tiers = args.tier or [default_tier()]
    codec = args.codec if args.codec and len(args.codec) > 1 else (args.codec or ["cachegen"])[0]
    lm = load_model(args.model, progress=not (args.quiet or args.json))
    hook = TransformersKVHook.with_store(lm, tiers, model_path=model_path(args.model), codec=codec, save=False)
    docs = [lm.tokenize(t)[:args.tokens] for t in texts]
    segments = ([lm.tokenize(args.system)] if args.system else []) + docs
    if args.action == "store":
        written, bar = 0, _bar(args, len(segments))
        for seg in segments:
            written += hook.put_segments([seg])
            bar(1)
        bar(0, close=True)
        obj = {"ok": True, "segments": len(segments), "tokens": sum(map(len, segments)), "chunks_written": written,
               "tiers": tiers}
        emit(args, obj, [f"{len(segments)} segments ({obj['tokens']} tokens) stored: {written} chunks written "
                         f"to {', '.join(tiers)}"])
        return 0
    fused = hook.fuse(segments, lm.tokenize(args.question), share=args.share)
    out = [int(fused.logits[-1].argmax())]
    with torch.no_grad():
        while len(out) < args.new_tokens:
            step = hook.model(torch.tensor([[out[-1]]]), cache=fused.cache, use_cache=True)
            out.append(int(step.logits[0, -1].argmax()))
    r = fused.report
    answer = lm.tokenizer.decode(out)
    obj = {"ok": True, "answer": answer, "prompt_tokens": r.prompt_tokens, "reused_tokens": r.reused_tokens,
           "forced_tokens": r.forced_tokens, "share": r.share, "share_reason": r.share_reason,
           "recomputed_per_layer": r.recomputed,
           "segments": [{"start": s.start, "tokens": s.tokens, "loaded": s.loaded, "tiers": s.tiers}
                        for s in r.segments],
           "hits": r.hits, "misses": r.misses, "bytes_loaded": r.nbytes, "load_s": r.load_s,
           "recompute_s": r.recompute_s, "suffix_s": r.suffix_s, "first_token_s": r.first_token_s}
    emit(args, obj, [r.summary(), f"recomputed per layer: {' '.join(map(str, r.recomputed))}", "answer: " + answer])
    return 0


def _bar(args: argparse.Namespace, total: int) -> Callable[..., None]:
    """A progress bar's update function (a no-op with --quiet or --json)."""
    if args.quiet or args.json:
        return lambda n, close=False: None
    from tqdm import tqdm

    bar = tqdm(total=total, desc="segments", unit="segment", leave=False, file=sys.stderr)
    return lambda n, close=False: bar.close() if close else bar.update(n)
