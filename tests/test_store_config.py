"""StoreConfig: one parser of every hook's store settings, strict about what it takes."""

from __future__ import annotations

import pytest

from kvcodec.errors import InvalidInputError
from kvcodec.store import CacheIdentity, ChunkShape, DiskTier, MemoryTier
from kvcodec.store.config import StoreConfig

SECRET = "0123456789abcdef0123456789abcdef"


def test_defaults_make_a_working_store():
    store = StoreConfig().store(model="m")
    assert store.codec.codec_id == "cachegen" and [type(t) for t in store.tiers] == [MemoryTier]
    assert store.chunk_tokens == 256


def test_parse_returns_the_hooks_own_keys():
    config, own = StoreConfig.parse({"codec": "raw", "num_heads": 3, "tiers": ["cpu:1MiB"]}, hook_keys=["num_heads"])
    assert config.codec == "raw" and config.tiers == ("cpu:1MiB",) and own == {"num_heads": 3}


def test_an_unknown_key_names_the_known_ones():
    with pytest.raises(InvalidInputError, match="unknown setting.*'tier'.*known"):
        StoreConfig.parse({"tier": ["cpu"]}, where="kv_connector_extra_config")


def test_the_secret_itself_is_refused():
    with pytest.raises(InvalidInputError, match="KVCODEC_STORE_SECRET"):
        StoreConfig.parse({"secret": SECRET})


@pytest.mark.parametrize("url", ["redis://:hunter2@127.0.0.1:6379/0", "redis://user:p%23w@host/0",
                                 "rediss://u:a#b?c@host:6380", "mooncake://x:y@host", "redis://u:s3cret/x@host:6379/0"])
def test_a_password_in_a_tier_url_is_refused_without_showing_it(url):
    with pytest.raises(InvalidInputError) as err:
        StoreConfig(tiers=["cpu", url])
    assert "password_file" in str(err.value)
    for secret in ("hunter2", "p%23w", "a#b?c", "s3cret"):
        assert secret not in str(err.value)


def test_a_user_name_alone_is_not_a_password():
    StoreConfig(tiers=["redis://reader@127.0.0.1:6379/0?password_env=REDIS_PW"])


def test_the_secret_comes_from_a_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("KVCODEC_STORE_SECRET", raising=False)
    assert StoreConfig().secret() is None
    monkeypatch.setenv("KVCODEC_STORE_SECRET", SECRET)
    assert StoreConfig().secret() == SECRET.encode()
    path = tmp_path / "secret"
    path.write_text("f" * 40 + "\n")
    assert StoreConfig(secret_file=str(path)).secret() == b"f" * 40
    with pytest.raises(InvalidInputError, match="cannot be read"):
        StoreConfig(secret_file=str(tmp_path / "missing")).secret()


@pytest.mark.parametrize("settings, match", [
    ({"codec": ""}, "codec"), ({"codec": ["kvtc", 3]}, "codec"), ({"tiers": []}, "tiers"),
    ({"chunk_tokens": 0}, "chunk_tokens"), ({"hash": "md5"}, "hash"), ({"calibrate": "later"}, "calibrate"),
    ({"codec": ["raw", "cachegen"], "codec_options": {"level": 2}}, "variants"),
    ({"codec_options": [1]}, "codec_options")])
def test_bad_settings_are_clear_errors(settings, match):
    with pytest.raises(InvalidInputError, match=match):
        StoreConfig(**settings)


def test_the_store_carries_identity_namespace_shape_and_placement(tmp_path):
    shape = ChunkShape(2, 3, 8, 8, "float16")
    config = StoreConfig(codec=["cachegen", "raw"], tiers=("cpu", f"disk:{tmp_path}/t"), namespace="tenant",
                         model="served-as")
    store = config.store(model="engine-name", identity=CacheIdentity(model_digest="abc", kv_dtype="float16"),
                         shape=shape, engine_chunk_tokens=64)
    assert store.model == "served-as" and store.chunk_tokens == 64 and store.shape == shape
    assert store.identity == CacheIdentity(model_digest="abc", kv_dtype="float16", namespace="tenant")
    assert [v.codec_id for v in store.variants] == ["cachegen", "raw"]
    assert isinstance(store.tiers[1], DiskTier) and list(store.policy.shared) == [store.tiers[1].name]


def test_chunk_tokens_overrides_the_engines_unit():
    assert StoreConfig(chunk_tokens=128).store(model="m", engine_chunk_tokens=64).chunk_tokens == 128


def test_regression_a_single_codec_spec_with_options_was_an_unknown_codec():
    """``"codec": "cachegen:level=2"`` named no codec (the spec was looked up whole), though a variant list's specs
    and the docs' ``"kivi:bits=4"`` parse: found writing bench/vllm_segments.py."""
    store = StoreConfig(codec="cachegen:level=4").store(model="m")
    assert store.codec.codec_id == "cachegen" and store.codec.get_config()["level"] == 4
    assert StoreConfig(codec="cachegen", codec_options={"level": 4}).store(model="m").codec.get_config()["level"] == 4
    with pytest.raises(InvalidInputError, match="not both"):
        StoreConfig(codec="cachegen:level=4", codec_options={"level": 2}).store(model="m")
