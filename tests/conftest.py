"""Shared fixtures: real KV caches from SmolLM2, made with kvcodec's own ``dump`` and cached on disk."""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# Without a GPU, Triton kernels run in its interpreter (numpy on the CPU).  It is chosen when a kernel is
# defined, so this must happen before anything imports kvcodec.kernels.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
CACHE_DIR = Path(os.environ.get("KVCODEC_TEST_CACHE", REPO / ".cache" / "test-kv"))
# Engine hooks keep their stores' estimates from one process to the next (kvcodec.store.telemetry_file): a test run
# keeps its own, so that no test plans its loads on what an earlier run measured.
if "KVCODEC_TELEMETRY_DIR" not in os.environ:
    os.environ["KVCODEC_TELEMETRY_DIR"] = tempfile.mkdtemp(prefix="kvcodec-test-telemetry-")
    atexit.register(shutil.rmtree, os.environ["KVCODEC_TELEMETRY_DIR"], True)
# tests/engines/ runs against the real vLLM (CPU build) and LMCache, which live in their own virtual environment
# (.venv-engines, made by scripts/setup_engines.sh): scripts/test.sh runs them there with that environment's python.
collect_ignore = [] if importlib.util.find_spec("vllm") and importlib.util.find_spec("lmcache") else ["engines"]
# tests/sglang_hicache/ runs against SGLang's own classes in .venv-sglang (scripts/setup_sglang.sh).
if importlib.util.find_spec("sglang") is None:
    collect_ignore.append("sglang_hicache")


def _dump_version() -> str:
    import transformers

    import kvcodec
    return f"kvcodec{kvcodec.__version__}-tf{transformers.__version__}"


@pytest.fixture(scope="session")
def real_dump():
    """``real_dump(text, tokens, dtype="float16") -> Path`` of a safetensors KV dump of SmolLM2
    over the first ``tokens`` tokens of ``text``, made with ``kvcodec dump`` once and reused."""
    from kvcodec.cli import main

    def get(text: str, tokens: int, dtype: str = "float16") -> Path:
        name = f"{text.replace(':', '-').replace('/', '_')}-{tokens}-{dtype}-{_dump_version()}.safetensors"
        path = CACHE_DIR / name
        if not path.exists():
            CACHE_DIR.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp.safetensors")
            code = main(["dump", "--model", "smollm2", "--text", text, "--tokens", str(tokens), "--dtype", dtype,
                         "-o", str(tmp), "--quiet"])
            assert code == 0, f"kvcodec dump failed with exit code {code}"
            tmp.rename(path)
        return path

    return get


@pytest.fixture(scope="session")
def real_kv(real_dump):
    """A real 512-token float16 SmolLM2 cache over the GPL-3 text."""
    import kvcodec
    return kvcodec.KVCache.load_safetensors(real_dump("license:GPL-3", 512))


@pytest.fixture()
def redis_server(tmp_path):
    """A real redis-server on a loopback port (:class:`~kvcodec.tools.redis_server.RedisServer`), stopped after it."""
    from kvcodec.tools.redis_server import started_redis

    server = started_redis(tmp_path)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def smollm2():
    from kvcodec.models import load_model
    return load_model("smollm2")


@pytest.fixture(scope="session")
def kvcodec_script() -> str:
    """The installed ``kvcodec`` console script, found beside this interpreter (so whether or not its environment
    is activated)."""
    return shutil.which("kvcodec", path=str(Path(sys.executable).parent)) \
        or pytest.fail("the kvcodec console script is not installed")
