"""Segment reuse with selective recompute inside the real vLLM (its CPU build, 0.32.0), on SmolLM2 (issue 34,
item 4): two engine starts.

1. vLLM without the connector: the reference, a full prefill of the prompt (BOS, a system text, three real
   documents, a question), its greedy tokens, then the prompt with those tokens appended, teacher-forced, for the
   log-probabilities of every position vLLM computes.
2. The connector with ``raw`` on a disk folder: each document stored as a segment by a request of its own
   (``store_segment``), then the prompt, with the documents in another order than stored, fused at shares 1, 0
   and the default: share 1 gives the full prefill's log-probabilities (vLLM's own layers recompute every token),
   the default comes far closer to them than reusing the segments as they are; a segment not stored is computed;
   bad parameters are warned about and the request is served as without them.
"""

from __future__ import annotations

import math

import pytest

from kvcodec.tools.harness import wait_until
from kvcodec.tools.harness.vllm_server import Engine, connector_config

BLOCK = 128  # vLLM CPU's block size: a fusion's hit is whole blocks where prompt log-probabilities are asked for
DOC_TOKENS = 140
CONTINUATION = 12
TOP = 20  # log-probabilities per position compared


@pytest.fixture(scope="module")
def parts(tokenizer, texts) -> dict:
    tok = lambda s: tokenizer(s, add_special_tokens=False).input_ids  # noqa: E731
    bos = tokenizer.bos_token_id
    system = tok("You are a helpful assistant. Answer the question using the documents below.\n\n")
    docs = [texts[name][:DOC_TOKENS] for name in ("GPL-3", "MPL-2.0", "Apache-2.0")]
    question = tok("\n\nQuestion: which of these licenses lets you keep your changes private? Answer:")
    order = [system, docs[2], docs[0], docs[1]]  # not the order they are stored in
    return {"bos": bos, "stored": [system] + docs, "order": order, "question": question,
            "context": [bos] + [t for s in order for t in s]}


@pytest.fixture(scope="module")
def reference(smollm2_hf, parts) -> dict:
    """The full prefill's greedy continuation, and its teacher-forced log-probabilities."""
    prompt = parts["context"] + parts["question"]
    with Engine(smollm2_hf) as engine:
        greedy = engine.generate(prompt, CONTINUATION)
        forced = engine.generate(prompt + greedy["token_ids"], 1, prompt_logprobs=TOP)
    return {"greedy": greedy, "prompt": prompt + greedy["token_ids"], "logprobs": forced["prompt_logprobs"]}


@pytest.fixture(scope="module")
def engine(smollm2_hf, tmp_path_factory, parts):
    extra = {"codec": "raw", "tiers": [f"disk:{tmp_path_factory.mktemp('kv-segments')}"]}
    with Engine(smollm2_hf, connector_config(**extra)) as engine:
        for seg in parts["stored"]:
            engine.generate([parts["bos"]] + seg, 1, kv_transfer_params={"kvcodec": {"store_segment": True}})
        yield engine


def _as_dicts(logprobs: list) -> list:
    return [None if p is None else {int(t): x for t, x in p.items()} for p in logprobs]


def _divergence(got: list, want: list, prompt: list[int], start: int) -> tuple[float, float]:
    """Two teacher-forced runs from position ``start`` on: the mean KL divergence of ``got``'s next-token
    distribution from ``want``'s over ``want``'s top tokens (the rest of the vocabulary left out), and the largest
    difference of the actual tokens' log-probabilities."""
    kl, gap = [], []
    for i in range(start, len(prompt)):
        g, w = got[i], want[i]
        kl.append(sum(math.exp(w[t]) * (w[t] - g[t]) for t in w if t in g))
        gap.append(abs(g[prompt[i]] - w[prompt[i]]))
    return sum(kl) / len(kl), max(gap)


def _fused(engine: Engine, reference: dict, parts: dict, **ours) -> tuple[float, float]:
    lengths = [len(s) for s in parts["order"]]
    got = engine.generate(reference["prompt"], 1, prompt_logprobs=TOP,
                          kv_transfer_params={"kvcodec": {"segments": lengths, **ours}})
    assert got["num_cached_tokens"] == len(parts["context"]) // BLOCK * BLOCK, engine.tail()
    # vLLM computed the positions from the hit on: the question's and the continuation's are compared
    return _divergence(_as_dicts(got["prompt_logprobs"]), _as_dicts(reference["logprobs"]), reference["prompt"],
                       len(parts["context"]))


def test_documents_are_stored_as_segments(engine, parts):
    # each logged by the connector's saves, which run behind the replies
    wait_until("the segments saved", lambda: len(engine.grep("as a segment")) >= len(parts["stored"]))
    assert len(engine.grep("as a segment")) == len(parts["stored"]), engine.tail()


def test_recomputing_every_token_gives_the_full_prefill(engine, reference, parts):
    kl, gap = _fused(engine, reference, parts, share=1.0)
    assert engine.grep("fused 4 segments"), engine.tail()
    # vLLM's own layers over every token; only the attention kernel differs (SDPA against vLLM's CPU kernel)
    assert gap < 2e-3 and abs(kl) < 1e-4, (kl, gap)


def test_without_prompt_log_probabilities_the_hit_is_to_the_token_and_still_the_full_prefill(engine, reference,
                                                                                             parts):
    """A request that asks for no prompt log-probabilities gets every token of the segments from the connector, not
    whole blocks (vLLM computes only the question), and at share 1 the same greedy tokens and log-probabilities
    as vLLM's full prefill."""
    got = engine.generate(parts["context"] + parts["question"], CONTINUATION, kv_transfer_params={
        "kvcodec": {"segments": [len(s) for s in parts["order"]], "share": 1.0}})
    assert got["num_cached_tokens"] == len(parts["context"]) > len(parts["context"]) // BLOCK * BLOCK
    assert got["token_ids"] == reference["greedy"]["token_ids"]
    assert max(abs(a - b) for a, b in zip(got["logprobs"], reference["greedy"]["logprobs"])) < 2e-3


def test_the_default_share_nears_the_full_prefill_and_beats_reuse_as_is(engine, reference, parts):
    """Measured when written: KL 0.052 as is, 0.018 at 15%, 0.0076 at the default (30%), 0.0058 at 50%."""
    as_is, _ = _fused(engine, reference, parts, share=0.0)
    default, _ = _fused(engine, reference, parts)  # the loading controller's share: from disk, the floor
    assert default < 0.3 * as_is and default < 0.015, (default, as_is)


def test_a_segment_not_stored_is_computed(engine, reference, parts, tokenizer):
    other = tokenizer("A document no request stored, about nothing in particular, written for this test.",
                      add_special_tokens=False).input_ids
    order = parts["order"][:2] + [other] + parts["order"][2:]
    prompt = [parts["bos"]] + [t for s in order for t in s] + parts["question"]
    got = engine.generate(prompt, 4, kv_transfer_params={"kvcodec": {"segments": [len(s) for s in order],
                                                                     "share": 1.0}})
    assert got["num_cached_tokens"] == len(prompt) - len(parts["question"])
    # recomputed in full, the stored ones are computed too rather than loaded (the engine's speed is known)
    assert len(engine.grep("0 hit, 1 missed, 4 computed while the rest loaded")) == 1, engine.tail()


@pytest.mark.parametrize("params, why", [
    ({"segments": [5, -1]}, "positive integers"),
    ({"segments": [10], "share": 2}, "0..1"),
    ({"segments": [100000]}, "no token of the prompt"),
    ({"frobnicate": 1}, "a dict of"),
])
def test_bad_segment_parameters_are_warned_about_and_served_without(engine, reference, parts, params, why):
    got = engine.generate(parts["context"] + parts["question"], CONTINUATION, kv_transfer_params={"kvcodec": params})
    assert got["token_ids"] == reference["greedy"]["token_ids"]
    assert all(math.isfinite(x) for x in got["logprobs"])
    assert engine.grep(why), engine.tail()
