"""kvtc through kvcodec's connector inside the real vLLM (its CPU build, 0.32.0), on SmolLM2: one engine start.

No calibration is installed (a fresh cache folder), so the connector calibrates the served model on first use and
says so (one of vLLM's two processes calibrates, the other waits for it and finds it installed); the first request
saves kvtc chunks (joint sections: all layers of a chunk in one section), the same prompt then loads them.
A small calibration (256 tokens, one basis per layer: about a second) keeps the test short; the default is larger.
"""

from __future__ import annotations

import pytest
import torch

import kvcodec
from kvcodec.store.identity import model_identity
from kvcodec.tools.harness.vllm_server import Engine, connector_config, connector_store

PROMPT, HIT, MAX_TOKENS = 599, 512, 16
SMALL_CALIBRATION = {"max_tokens": 256, "segment_tokens": 128, "group_layers": 1}


@pytest.fixture(scope="module")
def kvtc_engine(smollm2_hf, tmp_path_factory):
    cache = tmp_path_factory.mktemp("xdg-cache")  # where calibrations are installed: empty
    extra = {"codec": "kvtc", "tiers": [f"disk:{tmp_path_factory.mktemp('kv-kvtc')}"],
             "calibration_options": SMALL_CALIBRATION, "calibrate": "now"}
    with Engine(smollm2_hf, connector_config(**extra), env={"XDG_CACHE_HOME": str(cache)}) as engine:
        yield engine, extra, cache


def test_kvtc_calibrates_on_first_use_saves_and_loads(kvtc_engine, texts, smollm2_hf, monkeypatch):
    engine, extra, cache = kvtc_engine
    calibrated = engine.grep("calibrating it now")
    identity = model_identity(str(smollm2_hf))  # the served folder's: what `kvcodec calibrate --install` names it by
    assert len(calibrated) == 1 and identity in calibrated[0], engine.tail()
    assert engine.grep("loading ") and engine.grep("using the installed calibration"), engine.tail()
    installed = list((cache / "kvcodec" / "calibrations").glob("*.kvtc"))
    assert len(installed) == 1

    prompt = texts["GPL-3"][:PROMPT]
    first = engine.generate(prompt, MAX_TOKENS)
    assert first["num_cached_tokens"] == 0
    again = engine.generate(prompt, MAX_TOKENS)
    # generated on the loaded kvtc KV (a 256-token calibration's tokens soon part from the exact ones)
    assert again["num_cached_tokens"] == HIT and len(again["token_ids"]) == MAX_TOKENS

    # the stored chunks decode to the model's KV within kvtc's error
    from kvcodec.models import load_model

    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    store = connector_store(extra, smollm2_hf)  # finds the calibration the engine installed
    assert store.codec.calibration == installed[0].stem
    stored = [store.load_chunk(key, end - start) for key, start, end in store.keys_for(prompt[:HIT])]
    assert len(stored) == 2 and None not in stored
    # vLLM's float32 KV and transformers' differ in the last bits; kvtc's error on transformers' KV is the yardstick
    exact = load_model(str(smollm2_hf), progress=False).prefill(prompt[:HIT])
    own = kvcodec.decode(kvcodec.encode(exact, store.codec, chunk_tokens=256))
    for i, (b, c) in enumerate(zip(exact.layers, own.layers)):
        for kind in ("keys", "values"):
            got = torch.cat([getattr(kv.layers[i], kind).float() for kv in stored], 1)
            want, codec_error = getattr(b, kind), float((getattr(c, kind) - getattr(b, kind)).pow(2).mean().sqrt())
            error = float((got - want).pow(2).mean().sqrt())
            assert error <= 1.1 * codec_error + 1e-3, (i, kind, error, codec_error)
