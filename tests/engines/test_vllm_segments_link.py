"""Segment fusion inside the real vLLM (its CPU build) with the segments in Redis behind a real shaped link
(kvcodec/tools/netlab.py, root only), kept as ``cachegen`` and ``raw`` (issue 34, item 4, over the store's load
rules of issue 33).

One engine.  A system text and three real documents are stored as segments at full speed; a prompt of them in
another order, and a question, is first computed (the reference), then fused:

- over the unshaped link every segment loads, the documents raw (about 6 MB each, a few milliseconds on the link;
  cachegen's decode takes longer; the engine's first load measures the link with the small variant);
- at 20 Mbit/s the segments load as cachegen (0.54 MB a segment, about 0.2 s on the link and 0.15 s to decode,
  against 0.34 s for vLLM CPU to compute its 140 tokens at about 400 tokens/s), or are computed: no raw comes in.
  (Before the store's rule reached segment loads, a fusion over 100 Mbit/s loaded every segment raw whatever the
  cost: 15 s for 176 MB in bench/segment_reuse.py);
- recomputing every token (share 1), nothing stored is worth loading once the engine's prefill speed is known: every
  segment is computed while none loads, and the reply is the reference's.
"""

from __future__ import annotations

import re

import pytest

from kvcodec.tools.harness import wait_until
from kvcodec.tools.harness.vllm_server import Engine, connector_config
from kvcodec.tools.netlab import ShapedLink, unavailable
from kvcodec.tools.redis_server import started_redis

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

FAST, SLOW = 100_000, 20
DOC_TOKENS = 140
FUSED = re.compile(r"segments (\d+) hit, (\d+) missed, (?:(\d+) computed while the rest loaded, )?([\d.e+-]+) MB "
                   r"loaded(?: \((.*) from redis\))?;")


def _fused(engine: Engine) -> tuple[int, int, float, set[str], str]:
    """Hits, segments computed by choice, MB loaded and the variants loaded of the last fusion, and its log line."""
    line = next(l for l in reversed(engine.grep("kvcodec connector: request")) if FUSED.search(l))  # saves log too
    hit = FUSED.search(line)
    variants = {v.split(" x")[0] for v in (hit.group(5) or "").split(", ") if v}
    return int(hit.group(1)), int(hit.group(3) or 0), float(hit.group(4)), variants, line


def test_the_variant_a_segment_loads_in_follows_the_link(smollm2_hf, tokenizer, texts, tmp_path):
    tok = lambda s: tokenizer(s, add_special_tokens=False).input_ids  # noqa: E731
    bos = tokenizer.bos_token_id
    system = tok("You are a helpful assistant. Answer the question using the documents below.\n\n")
    docs = [texts[name][:DOC_TOKENS] for name in ("GPL-3", "MPL-2.0", "Apache-2.0")]
    order = [system, docs[2], docs[0], docs[1]]
    prompt = [bos] + [t for s in order for t in s] + tok("\n\nQuestion: which license is the shortest? Answer:")
    segments = [len(s) for s in order]
    with ShapedLink(FAST) as link:
        redis = started_redis(tmp_path, link)
        try:
            extra = {"codec": ["cachegen", "raw"], "tiers": [f"{redis.url}?timeout=60"]}
            with Engine(smollm2_hf, connector_config(**extra)) as engine:
                for seg in [system] + docs:
                    engine.generate([bos] + seg, 1, kv_transfer_params={"kvcodec": {"store_segment": True}})
                engine.generate(texts["GPL-3"][:600], 1)  # the worker times a prefill: its recompute speed
                reference = engine.generate(prompt, 8, cache_salt="reference")  # a miss: computed
                # both misses are saved behind their replies; a load beside a save shares the link with it (and took
                # cachegen for a document once), so the loads below start once the saves are done
                wait_until("the misses saved", lambda: len(engine.grep("new chunk(s) of tokens")) >= 2)

                engine.generate(prompt, 1, kv_transfer_params={"kvcodec": {"segments": segments}})
                hits, computed, mb, variants, line = _fused(engine)
                # (the 16-token system text may be computed rather than loaded; the engine's first load may take one
                # document as cachegen, measuring the link with it: at least two of the three 6.4 MB documents raw)
                assert hits >= 3 and hits + computed == 4 and mb > 12 and "raw" in variants, line

                link.set_rate(SLOW)
                engine.generate(prompt, 1, kv_transfer_params={"kvcodec": {"segments": segments}}, timeout_s=300)
                _, _, mb, variants, line = _fused(engine)
                assert variants <= {"cachegen"} and mb < 3, line

                whole = engine.generate(prompt, 8, kv_transfer_params={"kvcodec": {"segments": segments,
                                                                                  "share": 1.0}}, timeout_s=300)
                hits, computed, mb, _, line = _fused(engine)
                assert (hits, computed, mb) == (0, 4, 0), line
                assert whole["token_ids"][:4] == reference["token_ids"][:4], (whole, reference)
        finally:
            redis.stop()
