"""Fixtures for the tests that run kvcodec inside the real engines: vLLM's CPU build and LMCache.

These tests run in ``.venv-engines`` (``scripts/setup_engines.sh``; ``scripts/test.sh`` runs them).  The model is
SmolLM2-135M-Instruct as a HuggingFace folder made by kvcodec itself (:func:`kvcodec.tools.models.export_hf_folder`),
cached in ``.cache/models/`` (``KVCODEC_MODEL_CACHE`` overrides) like the KV dumps in ``.cache/test-kv/``.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

ENGINES = Path(__file__).resolve().parent
REPO = ENGINES.parent.parent
MODEL_CACHE = Path(os.environ.get("KVCODEC_MODEL_CACHE", REPO / ".cache" / "models"))

for _package in ("vllm", "lmcache"):
    if importlib.util.find_spec(_package) is None:
        raise pytest.UsageError(f"tests/engines/ needs {_package}: run them in .venv-engines "
                                "(bash scripts/setup_engines.sh; scripts/test.sh does both)")


@pytest.fixture()
def mooncake_master(tmp_path):
    """A started ``mooncake_master`` (:class:`kvcodec.tools.harness.mooncake.Master`), killed after the test; without
    Mooncake a skip, and under CI (whose set-up installs it) a failure."""
    from kvcodec.tools.harness.mooncake import Master, unavailable

    why = unavailable()
    if why:
        if os.environ.get("CI"):
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
    master = Master(tmp_path)
    master.start()
    yield master
    master.kill()


@pytest.fixture(scope="session")
def smollm2_hf() -> Path:
    """SmolLM2-135M-Instruct as a bfloat16 HuggingFace folder that vLLM loads (made once, then cached)."""
    from kvcodec.tools.models import export_hf_folder

    return Path(export_hf_folder("smollm2", MODEL_CACHE / "SmolLM2-135M-Instruct"))


@pytest.fixture(scope="session")
def tokenizer(smollm2_hf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_hf)


@pytest.fixture(scope="session")
def texts(tokenizer) -> dict[str, list[int]]:
    """Token ids of real texts (Debian's license files), long enough for any prompt here."""
    from kvcodec.texts import load_text

    return {name: tokenizer(load_text(f"license:{name}")).input_ids for name in ("GPL-3", "MPL-2.0", "Apache-2.0")}
