"""engines/store_setup: how every hook opens its store, and finds the served model's channel profile one way."""

from __future__ import annotations

import json

import pytest
import torch

from kvcodec.engines.store_setup import open_store, use_model_profile
from kvcodec.profiles import find_profile
from kvcodec.store import CacheIdentity
from kvcodec.store.config import StoreConfig

SHIPPED = "SmolLM2-135M-Instruct"


def _same(a, b) -> bool:
    return a is not None and all(torch.equal(x, y) for x, y in zip(a.key_weight + a.value_weight,
                                                                   b.key_weight + b.value_weight))


@pytest.fixture()
def served_folder(tmp_path):
    """A folder named unlike any shipped profile, whose config.json has SmolLM2's signature."""
    folder = tmp_path / "served" / "checkpoint-1200"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(find_profile(SHIPPED).signature))
    return folder


def test_a_served_folder_finds_its_profile_under_the_engines_name(served_folder):
    lines = []
    store = open_store(StoreConfig(), model=str(served_folder), identity=CacheIdentity(), log=lines.append,
                       model_path=str(served_folder))
    assert _same(find_profile(store.model), find_profile(SHIPPED))
    assert any(f"uses the channel profile of {SHIPPED}" in line for line in lines)


def test_an_engines_parsed_config_finds_it_too(served_folder):
    config = json.loads((served_folder / "config.json").read_text())
    store = StoreConfig().store(model="served-under-another-name")
    assert use_model_profile(store, hf_config=config, log=lambda line: None) == SHIPPED
    assert _same(find_profile("served-under-another-name"), find_profile(SHIPPED))


def test_another_models_signature_finds_none_and_says_so(served_folder):
    config = json.loads((served_folder / "config.json").read_text()) | {"num_hidden_layers": 31}
    lines = []
    store = StoreConfig(codec="cachegen").store(model="/some/other/model")
    assert use_model_profile(store, hf_config=config, log=lines.append) is None
    assert find_profile("/some/other/model") is None
    assert any("take their steps from the data" in line for line in lines)


def test_codecs_without_a_profile_hear_nothing():
    lines = []
    assert use_model_profile(StoreConfig(codec="raw").store(model="m"), log=lines.append) is None
    assert lines == []


def test_a_hooks_store_of_variants_times_their_decodes_before_the_first_load():
    """Every hook opens its store here, so every hook's first load plans on this machine's decode rates
    (:meth:`KVStore.measure_decodes`), not on an unmeasured variant decoding for free."""
    from kvcodec.store import ChunkShape

    lines = []
    shape = ChunkShape(layers=2, heads=2, key_dim=16, value_dim=16, dtype="float16")
    store = open_store(StoreConfig(codec=("cachegen", "raw"), telemetry="off"), model="m", identity=CacheIdentity(),
                       log=lines.append, shape=shape)
    assert all(store.telemetry.decode_rate(c).samples for c in store.variants)
    assert any(line.startswith("kvcodec: decode rates timed at start (tokens/s): cachegen ") for line in lines), lines
    one = open_store(StoreConfig(telemetry="off"), model="m", identity=CacheIdentity(), log=lines.append, shape=shape)
    assert not one.telemetry.decode_rate(one.codec).samples  # one variant: nothing to choose, nothing timed
