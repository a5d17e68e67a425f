"""kvcodec's connector inside the real vLLM, its store Redis behind a real shaped link (kvcodec/tools/netlab.py, root
only), keeping each chunk as ``cachegen`` and ``raw``: the variant loaded follows the link, and follows it when
the link drops in the middle of a request.

One engine; a 2048-token prompt (eight chunks of 12 MB raw, about 1 MB cachegen) saved once at full speed.  A
load reads every chunk's cachegen variant first and decodes them from the last chunk backwards while the link
brings raw from the front.  Over the unshaped link (tbf at 100 Gbit/s) raw chunks load sooner than cachegen ones
decode, so the link carries some of them (most, where decoding does not slow the fetch); at 20 Mbit/s raw takes
about 5 s a chunk and cachegen well under one, or recomputing the rest is sooner still.  Then the link runs at 1 Gbit/s (raw about 0.1 s a chunk) and drops to 20
Mbit/s 0.25 s into a request: what the link had not brought by then is cachegen; and it rises from 20 Mbit/s to
the unshaped link 0.3 s into a request: the front chunks come raw.  Last, a fresh engine (a restart) on the slow
link: its first request plans on the estimates the first engine left in the store's telemetry file, so it reads no
raw on the 1 Gbit/s prior.  Every reply's first tokens must equal those of the first, computed, request.
"""

from __future__ import annotations

import re
import threading

import pytest

from kvcodec.tools.harness.vllm_server import Engine, connector_config
from kvcodec.tools.netlab import ShapedLink, unavailable
from kvcodec.tools.redis_server import started_redis

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

PROMPT = 2048
FAST, SLOW, BEFORE_DROP = 100_000, 20, 1000
LOADED = re.compile(r"loaded tokens (\d+)-(\d+) of \d+-\d+ in [\d.]+ s, (\d+) bytes, variants \[(.*)\], (\d+) bytes wasted")


def _variants(engine: Engine) -> list[str]:
    """The variants the connector loaded for the last request (its log line), chunk by chunk."""
    line = next(l for l in reversed(engine.grep("kvcodec connector: request")) if LOADED.search(l))
    return [v.strip(" '") for v in LOADED.search(line).group(4).split(",") if v.strip()]


def _wasted(engine: Engine) -> tuple[int, int]:
    """Bytes used and wasted by the last request's load."""
    line = next(l for l in reversed(engine.grep("kvcodec connector: request")) if LOADED.search(l))
    hit = LOADED.search(line)
    return int(hit.group(3)), int(hit.group(5))


@pytest.fixture(scope="module")
def link():
    with ShapedLink(FAST) as shaped:
        yield shaped


def test_the_variant_loaded_follows_the_link(smollm2_hf, texts, link, tmp_path):
    prompt = texts["GPL-3"][:PROMPT]
    other = texts["MPL-2.0"][:300]
    redis = started_redis(tmp_path, link)
    try:
        extra = {"codec": ["cachegen", "raw"], "tiers": [f"{redis.url}?timeout=60"],
                 "telemetry": str(tmp_path / "telemetry.json")}
        with Engine(smollm2_hf, connector_config(**extra)) as engine:
            engine.generate(other, 1)  # the worker times a prefill
            first = engine.generate(prompt, 8)  # a miss: computed, saved in both variants
            for _ in range(2):  # the second load plans with what the first measured
                fast = engine.generate(prompt, 8)
            assert fast["token_ids"][:4] == first["token_ids"][:4]
            on_fast = _variants(engine)
            # the link brings raw from the front; how many chunks it brings before the decoder, working back through
            # cachegen, meets it depends on how much the decoder slows the fetch on this machine's cores
            assert "raw" in on_fast, on_fast

            link.set_rate(SLOW)
            slow = engine.generate(prompt, 8, timeout_s=300)
            on_slow = _variants(engine)
            assert slow["token_ids"][:4] == first["token_ids"][:4]
            # the small variant (a raw read started on the old estimate is given up), or vLLM recomputes the rest
            assert on_slow.count("raw") <= 1 and on_slow != on_fast, (on_fast, on_slow)

            # the link drops while a request loads: the last chunks are the small variant, or vLLM recomputes them
            link.set_rate(BEFORE_DROP)
            for _ in range(2):
                engine.generate(prompt, 1)
            assert "raw" in _variants(engine)
            drop = threading.Timer(0.25, link.set_rate, (SLOW,))
            drop.start()
            dropped = engine.generate(prompt, 8, timeout_s=300)
            drop.join()
            during = _variants(engine)
            assert dropped["token_ids"][:4] == first["token_ids"][:4]
            assert len(during) < PROMPT // 256 or during[-1] == "cachegen", during

            # the link rises while a request loads: the chunks still to come when it does come raw
            with link.playing([(0, SLOW), (0.3, FAST)]):
                risen = engine.generate(prompt, 8, timeout_s=300)
            after_rise = _variants(engine)
            assert risen["token_ids"][:4] == first["token_ids"][:4]
            assert after_rise and after_rise[0] == "raw", after_rise
            link.set_rate(SLOW)
            engine.generate(prompt, 1, timeout_s=300)  # the estimates this engine leaves: the slow link's

        with Engine(smollm2_hf, connector_config(**extra)) as fresh:
            restored = fresh.grep("kvcodec: the store starts from the estimates in")
            restarted = fresh.generate(prompt, 8, timeout_s=300)
            on_restart = _variants(fresh)
            used, wasted = _wasted(fresh)
        assert restored and 0 < float(re.search(r"link \S+ ([\d.]+) Mbit/s", restored[0]).group(1)) < 100, restored
        assert restarted["token_ids"][:4] == first["token_ids"][:4]
        # the 1 Gbit/s prior would read raw from the front first (about 5 s a chunk here) and give it up
        assert on_restart.count("raw") <= 1 and wasted < 0.10 * used, (on_restart, used, wasted)
    finally:
        redis.stop()
