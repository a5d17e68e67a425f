"""Prompt embeddings through kvcodec's connector inside the real vLLM (its CPU build, 0.32.0), on SmolLM2.

vLLM's mixed prompts carry embedding rows at positions whose token ids are placeholders, so two prompts with
different embeddings can have the same ids.  One engine start, ``enable_prompt_embeds`` on, the connector with
``raw`` on a disk folder and vLLM's prefix cache off (every hit is the connector's).  The embeddings are SmolLM2's
own embedding table applied to real text, so a prompt given as embeddings must generate what its text's token ids do.
"""

from __future__ import annotations

import pytest
import torch

from kvcodec.tools.harness.vllm_server import Engine, connector_config

PROMPT = 300  # tokens: one whole 256-token chunk (two 128-token vLLM blocks), then a partial chunk
HIT = 256
MAX_TOKENS = 16
PLACEHOLDER = 0  # the id at every embedded position (vLLM reads the embedding row there, not the id)


@pytest.fixture(scope="module")
def embed(smollm2_hf):
    """Token ids -> their rows of SmolLM2's input embedding table (float32, as the engine runs)."""
    from transformers import AutoModelForCausalLM

    table = AutoModelForCausalLM.from_pretrained(smollm2_hf, torch_dtype=torch.float32).get_input_embeddings()

    def rows(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return table(torch.tensor(ids)).clone()

    return rows


@pytest.fixture(scope="module")
def engine(smollm2_hf, tmp_path_factory):
    folder = tmp_path_factory.mktemp("kv-disk")
    with Engine(smollm2_hf, connector_config(codec="raw", tiers=[f"disk:{folder}"]),
                enable_prompt_embeds=True) as engine:
        yield engine


def _as_embeds(engine: Engine, rows: torch.Tensor) -> dict:
    return engine.generate([PLACEHOLDER] * len(rows), MAX_TOKENS, prompt_embeds=rows,
                           prompt_is_token_ids=[False] * len(rows))


def test_same_placeholder_ids_with_other_prompt_embeds_do_not_share_kv(engine, embed, texts):
    a, b = texts["GPL-3"][:PROMPT], texts["MPL-2.0"][:PROMPT]
    # the references: each text as token ids (first requests, so computed; they save under their own ids)
    ref_a, ref_b = engine.generate(a, MAX_TOKENS), engine.generate(b, MAX_TOKENS)
    assert ref_a["num_cached_tokens"] == ref_b["num_cached_tokens"] == 0
    assert ref_a["token_ids"] != ref_b["token_ids"]

    e1 = _as_embeds(engine, embed(a))  # computed, and saved under the placeholder ids with its embeddings' salt
    assert e1["num_cached_tokens"] == 0
    assert e1["token_ids"] == ref_a["token_ids"]
    assert e1["logprobs"] == ref_a["logprobs"]  # the same inputs as the ids give, so the same logits, bit for bit

    e2 = _as_embeds(engine, embed(b))  # the same ids as e1, other embeddings: e1's KV must not serve it
    assert e2["num_cached_tokens"] == 0, engine.tail()
    assert e2["token_ids"] == ref_b["token_ids"]
    assert e2["logprobs"] == ref_b["logprobs"]  # e1's KV in its first 256 positions would move them (not the tokens)

    loads_before = len(engine.grep("loaded tokens"))
    again = _as_embeds(engine, embed(a))  # the same embeddings again: the connector loads e1's KV
    assert again["num_cached_tokens"] == HIT
    assert len(engine.grep("loaded tokens")) == loads_before + 1, engine.tail()
    assert again["token_ids"] == ref_a["token_ids"]
    assert again["logprobs"] == e1["logprobs"]  # bit-exact KV gives bit-exact logits
