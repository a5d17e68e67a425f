"""The model identity covers the weights' bytes, and a request's salt covers its non-token inputs."""

from __future__ import annotations

import json
import os

import pytest
import torch

from kvcodec.errors import InvalidInputError
from kvcodec.store.identity import file_digest, model_identity, request_salt, weights_digest


@pytest.fixture(autouse=True)
def _own_digest_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCODEC_DIGEST_CACHE", str(tmp_path / "digests.json"))


def _model(folder, weights: bytes, config: dict | None = None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or {"hidden_size": 8, "num_hidden_layers": 2}))
    (folder / "model.safetensors").write_bytes(weights)
    return str(folder)


def test_weights_replaced_in_place_change_the_identity(tmp_path):
    folder = _model(tmp_path / "m", b"\x01" * 4096)
    before = model_identity(folder)
    with open(os.path.join(folder, "model.safetensors"), "r+b") as f:  # same size, same name, new bytes
        f.seek(100)
        f.write(b"\x02")
    assert model_identity(folder) != before


def test_a_fine_tune_with_the_base_config_is_another_model(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 576}
    base = _model(tmp_path / "base", b"base weights" * 100, config)
    tuned = _model(tmp_path / "tuned", b"tuned weights" * 100, config)
    assert model_identity(base) != model_identity(tuned)
    assert model_identity(base) == model_identity(_model(tmp_path / "copy", b"base weights" * 100, config))


def test_a_config_change_changes_the_identity(tmp_path):
    a = _model(tmp_path / "a", b"w" * 64, {"rope_theta": 10000})
    b = _model(tmp_path / "b", b"w" * 64, {"rope_theta": 500000})
    assert model_identity(a) != model_identity(b)


def test_a_weight_file_alone_is_a_model(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 100)
    first = model_identity(str(gguf))
    gguf.write_bytes(b"GGUF" + b"\1" * 100)
    assert model_identity(str(gguf)) != first


def test_a_local_model_is_known_by_its_files_alone(tmp_path):
    """A command given a path and an engine given the path, its parsed config and a revision name one model."""
    folder = _model(tmp_path / "m", b"w" * 64)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 64)
    for path in (folder, str(gguf)):
        assert model_identity(path) == model_identity(path, hf_config={"parsed": True}, revision="main")


def test_a_digest_is_computed_once_and_reused(tmp_path, monkeypatch):
    path = tmp_path / "w.bin"
    path.write_bytes(os.urandom(1 << 16))
    first = file_digest(str(path))
    reads = []
    real_open = open

    def counting_open(file, *args, **kwargs):
        if str(file) == str(path):
            reads.append(file)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", counting_open)
    assert file_digest(str(path)) == first
    assert reads == []


def test_a_hub_snapshot_uses_the_recorded_digest(tmp_path):
    blobs = tmp_path / "models--org--m" / "blobs"
    blobs.mkdir(parents=True)
    name = "a" * 64
    (blobs / name).write_bytes(b"whatever the bytes")
    snap = tmp_path / "models--org--m" / "snapshots" / "rev"
    snap.mkdir(parents=True)
    os.symlink(blobs / name, snap / "model.safetensors")
    assert file_digest(str(snap / "model.safetensors")) == name


def test_a_folder_without_weights_has_no_weights_digest(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert weights_digest(str(tmp_path)) == ""


def test_plain_requests_keep_their_salt():
    assert request_salt(None) is None
    assert request_salt("tenant") == "tenant"
    assert request_salt("tenant", {"prompt_embeds": None}) == "tenant"


def test_prompt_embeddings_key_the_request():
    a, b = torch.zeros(4, 8), torch.zeros(4, 8)
    b[2, 3] = 1e-3
    assert request_salt(None, {"prompt_embeds": a}) == request_salt(None, {"prompt_embeds": a.clone()})
    assert request_salt(None, {"prompt_embeds": a}) != request_salt(None, {"prompt_embeds": b})
    assert request_salt(None, {"prompt_embeds": a}) != request_salt(None, {"prompt_embeds": a.to(torch.bfloat16)})
    assert request_salt("s", {"prompt_embeds": a}) != request_salt("t", {"prompt_embeds": a})


def test_inputs_are_told_apart_by_name_and_kind():
    assert request_salt(None, {"mm": ["ab", "c"]}) != request_salt(None, {"mm": ["a", "bc"]})
    assert request_salt(None, {"mm": ["x"]}) != request_salt(None, {"lora": ["x"]})
    with pytest.raises(InvalidInputError):
        request_salt(None, {"odd": object()})
